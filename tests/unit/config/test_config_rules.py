"""The rules across sections and fields (moed/config/rules.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config
from moed.config import ConfigError


def test_defaults_need_a_model_except_for_router() -> None:
    with pytest.raises(ConfigError, match="model.path is required"):
        config.load(environ={})
    cfg = config.load(environ={}, overrides={"server": {"role": "router"}})
    assert cfg.server.role == "router" and cfg.server.port == 8000


def test_structured_budget_from_env_and_its_bound_under_the_collective_timeout() -> None:
    env = {"MOED_MODEL_PATH": "/m", "MOED_STRUCTURED_COMPILE_TIMEOUT_S": "0.5",
           "MOED_STRUCTURED_MAX_ITEMS_IN_ROW": "500", "MOED_STRUCTURED_MASK_TIMEOUT_MS": "40"}
    cfg = config.load(environ=env)
    st = cfg.structured
    assert (st.compile_timeout_s, st.max_items_in_row, st.mask_timeout_ms) == (0.5, 500, 40)
    with pytest.raises(config.ConfigError, match="structured.compile_timeout_s"):
        config.load(environ={**env, "MOED_STRUCTURED_COMPILE_TIMEOUT_S": "0"})
    with pytest.raises(config.ConfigError, match="MOED_STRUCTURED_MASK_TIMEOUT"):
        config.load(environ={**env, "MOED_STRUCTURED_MASK_TIMEOUT": "40"})   # misspelt
    ep = {**env, "MOED_PARALLEL_EP_SIZE": "2", "MOED_PARALLEL_EP_INIT": "tcp://127.0.0.1:9",
          "MOED_PARALLEL_COLLECTIVE_TIMEOUT_S": "0.5", "MOED_STRUCTURED_MASK_TIMEOUT_MS": "300"}
    with pytest.raises(config.ConfigError, match="mask_timeout_ms must stay under half"):
        config.load(environ=ep)


# ---- each rule is one function, applied where the node meets it --------------------------

def _cfg(**env: str) -> config.Config:
    return config.load(environ={"MOED_MODEL_PATH": "m", **env})


def test_tiers_need_prefix_caching_at_load_and_in_the_engine_alike() -> None:
    """One rule, one message: Config applies it when built, the engine to the sections it is
    given alone (moed/engine: the KV tiers)."""
    from moed.config.rules import tiers_need_prefix_caching

    msg = "tiers: KV tiers hold prefix-cached blocks; they need engine.enable_prefix_caching"
    with pytest.raises(ConfigError) as e:
        _cfg(MOED_TIERS_HOST_BYTES="4096", MOED_ENGINE_ENABLE_PREFIX_CACHING="0")
    assert str(e.value) == msg
    off = config.EngineConfig(enable_prefix_caching=False)
    with pytest.raises(ConfigError) as e:
        tiers_need_prefix_caching(off, config.TiersConfig(disk_bytes=1, disk_dir="/x"))
    assert str(e.value) == msg
    tiers_need_prefix_caching(off, config.TiersConfig())                  # no tier: nothing
    tiers_need_prefix_caching(config.EngineConfig(), config.TiersConfig(host_bytes=1))


@pytest.mark.parametrize("env,msg", [
    ({"MOED_PARALLEL_EP_RANK": "1"}, "parallel.ep_rank: 1 is not below parallel.ep_size 1"),
    ({"MOED_PARALLEL_REDUNDANT_EXPERTS": "2"}, "parallel.redundant_experts: the expert balancer"),
    ({"MOED_PARALLEL_EPLB_INTERVAL_S": "5"}, "parallel.eplb_interval_s: the expert balancer"),
    ({"MOED_PARALLEL_EP_SIZE": "2"}, "parallel.ep_init: ep_size 2 needs rank 0's rendezvous"),
])
def test_parallel_rules_across_fields(env: dict[str, str], msg: str) -> None:
    from moed.config import rules

    cfg = _cfg(**env)                  # each field loads alone at its bounds
    with pytest.raises(ConfigError, match=msg):
        rules.parallel(cfg)
    rules.parallel(_cfg(MOED_PARALLEL_EP_SIZE="2", MOED_PARALLEL_EP_RANK="1",
                        MOED_PARALLEL_EP_INIT="tcp://127.0.0.1:9", MOED_PARALLEL_REDUNDANT_EXPERTS="1"))


def test_a_disk_tier_needs_a_directory(tmp_path: Path) -> None:
    from moed.config import rules

    with pytest.raises(ConfigError, match="tiers.disk_bytes: a disk tier needs tiers.disk_dir"):
        rules.tiers_disk(_cfg(MOED_TIERS_DISK_BYTES="8192"))
    rules.tiers_disk(_cfg(MOED_TIERS_DISK_BYTES="8192", MOED_TIERS_DISK_DIR=str(tmp_path)))
    rules.tiers_disk(_cfg())


@pytest.mark.parametrize("role,cluster,needed", [
    ("colocated", False, False), ("colocated", True, True), ("prefill", False, True),
    ("decode", False, True), ("router", False, False), ("router", True, True),
])
def test_who_needs_the_cluster_key(role: str, cluster: bool, needed: bool) -> None:
    cfg = config.load(environ={"MOED_MODEL_PATH": "m", "MOED_SERVER_ROLE": role,
                               "MOED_CLUSTER_ENABLED": str(cluster)})
    assert config.needs_cluster_key(cfg) is needed


def test_node_name_is_the_setting_else_hostname_port() -> None:
    import socket

    assert config.node_name(_cfg(MOED_SERVER_NODE_NAME="n1")) == "n1"
    assert config.node_name(_cfg(MOED_SERVER_PORT="9123")) == f"{socket.gethostname()}-9123"


def test_speculative_off_by_default_and_its_rules_name_what_is_refused() -> None:
    assert not _cfg().speculative.enabled
    on = _cfg(MOED_SPECULATIVE_METHOD="ngram", MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS="4",
              MOED_SPECULATIVE_PROMPT_LOOKUP_MIN="2", MOED_SPECULATIVE_PROMPT_LOOKUP_MAX="3")
    sp = on.speculative
    assert (sp.method, sp.num_speculative_tokens, sp.prompt_lookup_min,
            sp.prompt_lookup_max, sp.adaptive) == ("ngram", 4, 2, 3, True)
    assert not _cfg(MOED_SPECULATIVE_METHOD="ngram",
                    MOED_SPECULATIVE_ADAPTIVE="false").speculative.adaptive
    for env, says in (
            ({"MOED_SPECULATIVE_METHOD": "eagle"}, "speculative.method: 'eagle' is not one of"),
            ({"MOED_SPECULATIVE_METHOD": "ngram", "MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS": "9"},
             r"speculative.num_speculative_tokens: must be in \[1, 8\]"),
            ({"MOED_SPECULATIVE_METHOD": "ngram", "MOED_SPECULATIVE_PROMPT_LOOKUP_MIN": "4",
              "MOED_SPECULATIVE_PROMPT_LOOKUP_MAX": "3"},
             r"speculative.prompt_lookup_min \(4\) must not exceed"),
            ({"MOED_SPECULATIVE_METHOD": "mtp", "MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS": "5"},
             "num_speculative_tokens 5 with method mtp: the one MTP layer is chained for k > 1, "
             "at most 4"),
            ({"MOED_SPECULATIVE_METHOD": "ngram", "MOED_SERVER_ROLE": "prefill"},
             "speculation runs where tokens are decoded.*only method mtp is taken"),
            ({"MOED_SPECULATIVE_METHOD": "ngram", "MOED_SERVER_ROLE": "router"},
             "not on a router node"),
            ({"MOED_SPECULATIVE_METHOD": "mtp", "MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS": "1",
              "MOED_SERVER_ROLE": "router"}, "not on a router node")):
        with pytest.raises(ConfigError, match=says):
            _cfg(**env)
    # off: the draft settings are not applied, so they are not checked across fields
    assert _cfg(MOED_SPECULATIVE_PROMPT_LOOKUP_MIN="9").speculative.prompt_lookup_min == 9
    assert _cfg(MOED_SPECULATIVE_METHOD="ngram", MOED_SERVER_ROLE="decode") \
        .speculative.enabled
    # mtp on a decode node drafts after the remote prefill; on a prefill node it computes and
    # sends the MTP layer's KV (and the first draft)
    for role in ("colocated", "decode", "prefill"):
        assert _cfg(MOED_SPECULATIVE_METHOD="mtp", MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS="1",
                    MOED_SERVER_ROLE=role).speculative.method == "mtp"
    # an expert-parallel group speculates, both methods (the ranks agree the MTP exchange)
    ep = {"MOED_PARALLEL_EP_SIZE": "2", "MOED_PARALLEL_EP_INIT": "tcp://127.0.0.1:9"}
    assert _cfg(MOED_SPECULATIVE_METHOD="ngram", **ep).parallel.ep_size == 2
    assert _cfg(MOED_SPECULATIVE_METHOD="mtp", MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS="1",
                **ep).speculative.method == "mtp"
    assert _cfg(MOED_SPECULATIVE_METHOD="mtp").speculative.num_speculative_tokens == 3  # chained


def test_experts_budget_from_env_toml_and_what_it_refuses(tmp_path: Path) -> None:
    env = {"MOED_MODEL_PATH": "/m", "MOED_EXPERTS_RESIDENT_BYTES": "1000000",
           "MOED_EXPERTS_MOVE_BYTES_PER_STEP": "0"}
    x = config.load(environ=env).experts
    assert (x.resident_bytes, x.move_bytes_per_step, x.tiered) == (1000000, 0, True)
    assert not config.load(environ={"MOED_MODEL_PATH": "/m"}).experts.tiered
    assert config.load(environ={**env, "MOED_MODEL_QUANTIZATION": "int8"}).experts.tiered
    p = tmp_path / "m.toml"
    p.write_text("[experts]\nresident_bytse = 5\n")          # misspelt key
    with pytest.raises(ConfigError, match="resident_bytse"):
        config.load(p, environ={"MOED_MODEL_PATH": "/m"})
    with pytest.raises(ConfigError, match="experts.heat_half_life_steps"):
        config.load(environ={**env, "MOED_EXPERTS_HEAT_HALF_LIFE_STEPS": "0.5"})
    ep = {"MOED_PARALLEL_EP_SIZE": "2", "MOED_PARALLEL_EP_INIT": "tcp://h:1"}
    assert config.load(environ={**env, **ep, "MOED_PARALLEL_REDUNDANT_EXPERTS": "1"}).experts.tiered
    for extra, match in (({**ep, "MOED_PARALLEL_EPLB_INTERVAL_S": "60"}, "parallel.eplb_interval_s > 0"),
                         ({"MOED_SPECULATIVE_METHOD": "mtp", "MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS": "1"},
                          "speculative.method mtp"),
                         ({"MOED_MODEL_DEVICE": "cuda"}, "CPU nodes only")):
        with pytest.raises(ConfigError, match=match):
            config.load(environ={**env, **extra})
    # layer-ahead prefetch: auto (-1) everywhere, off under EP; explicit under EP refused
    from moed.engine.build import cold_settings
    assert config.load(environ=env).experts.prefetch_experts == -1
    assert cold_settings(config.load(environ=env)).prefetch_experts == -1
    assert cold_settings(config.load(environ={**env, **ep})).prefetch_experts == 0
    assert cold_settings(config.load(environ={**env, "MOED_EXPERTS_PREFETCH_EXPERTS": "0"})).prefetch_experts == 0
    with pytest.raises(ConfigError, match="experts.prefetch_experts under expert parallelism"):
        config.load(environ={**env, **ep, "MOED_EXPERTS_PREFETCH_EXPERTS": "4"})
    with pytest.raises(ConfigError, match="experts.prefetch_experts"):
        config.load(environ={**env, "MOED_EXPERTS_PREFETCH_EXPERTS": "-2"})
