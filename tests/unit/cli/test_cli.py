"""`moed check-config`, the serve flags and flag/env/TOML precedence, in-process; and
check-config refusing what a real `moed serve` refuses, in the same words."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import structlog

from moed import __version__, cli
from moed.cli import flags, serve, settings
from moed.api.auth import load_keys
from moed.config import ConfigError, load

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf" / "moed.toml"


@pytest.fixture(autouse=True)
def _own_process_state(monkeypatch):
    """check-config configures logging and --api-key writes the environment: both go back
    after each test. No MOED_* variable of the shell reaches a test."""
    handlers, level = logging.getLogger().handlers[:], logging.getLogger().level
    saved = structlog.get_config()
    for name in [n for n in os.environ if n.startswith("MOED_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(flags.API_KEYS_ENV, "")      # set, so that teardown removes it
    yield
    logging.getLogger().handlers[:] = handlers
    logging.getLogger().setLevel(level)
    structlog.configure(**saved)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _cfg(*argv: str):
    """The effective config of `moed serve ARGV`, without serving (and without preflight)."""
    return settings.load_config(cli.build_parser(["serve", *argv]).parse_args(["serve", *argv]))


def test_check_config_prints_effective_toml(capsys, tmp_path, tiny_qwen3):
    rc, out, _ = _run(capsys, "check-config", str(CONF), "--model", str(tiny_qwen3))
    assert rc == 0
    parsed = tomllib.loads(out)
    assert parsed["model"]["path"] == str(tiny_qwen3) and parsed["server"]["port"] == 8000
    # the printed config is a valid config file that loads back to the same effective config
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    assert load(printed, environ={}) == load(CONF, environ={},
                                             overrides={"model": {"path": str(tiny_qwen3)}})


def test_precedence_flag_over_env_over_toml(capsys, monkeypatch, tmp_path, tiny_qwen3):
    f = tmp_path / "m.toml"
    f.write_text(f'[server]\nport = 8100\nhost = "0.0.0.0"\n[engine]\nmax_num_seqs = 3\n'
                 f'[model]\npath = "{tiny_qwen3}"\n')
    monkeypatch.setenv("MOED_SERVER_PORT", "8200")
    monkeypatch.setenv("MOED_ENGINE_MAX_NUM_SEQS", "4")
    rc, out, _ = _run(capsys, "check-config", str(f))
    parsed = tomllib.loads(out)
    assert rc == 0 and parsed["server"]["port"] == 8200 and parsed["engine"]["max_num_seqs"] == 4
    assert parsed["server"]["host"] == "0.0.0.0"
    rc, out, _ = _run(capsys, "check-config", "--config", str(f), "--port", "8300",
                      "--max-num-seqs", "5")
    parsed = tomllib.loads(out)
    assert (parsed["server"]["port"], parsed["engine"]["max_num_seqs"]) == (8300, 5)


def test_errors_exit_2_with_a_clear_message(capsys, monkeypatch, tmp_path, tiny_qwen3):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    rc, out, err = _run(capsys, "check-config", str(bad))
    assert rc == 2 and out == "" and "unknown key server.prot" in err
    rc, _, err = _run(capsys, "check-config", str(CONF))
    assert rc == 2 and "model.path is required" in err
    rc, _, err = _run(capsys, "check-config", str(tmp_path / "none.toml"))
    assert rc == 2 and "does not exist" in err
    monkeypatch.setenv("MOED_SERVER_API_KEYS_FILE", str(tmp_path / "nokeys"))
    rc, _, err = _run(capsys, "check-config", str(CONF), "--model", str(tiny_qwen3))
    assert rc == 2 and "api_keys_file" in err


# ---- every flag sets its field ------------------------------------------------------------

FLAG_VALUES = {   # flag -> (argument, the field's value); a flag added to flags.FLAGS needs a row
    "--role": ("router", "router"), "--host": ("0.0.0.0", "0.0.0.0"),
    "--port": ("9123", 9123), "--node-name": ("n1", "n1"),
    "--served-model-name": ("my-model", "my-model"), "--max-model-len": ("1234", 1234),
    "--max-num-seqs": ("7", 7), "--max-num-batched-tokens": ("333", 333),
    "--kv-cache-memory": ("77", 77), "--kv-cache-memory-fraction": ("0.5", 0.5),
    "--block-size": ("32", 32),
    "--dtype": ("half", "float16"), "--device": ("cuda:1", "cuda:1"),
    "--quantization": ("int4", "int4"), "--quantization-lm-head": ("int8", "int8"),
    "--quantization-activations": ("int8", "int8"),
    "--attention-backend": ("torch", "torch"), "--log-format": ("console", "console"),
    "--log-level": ("debug", "debug"),
    "--ep-size": ("4", 4), "--ep-rank": ("3", 3),
    "--ep-init": ("tcp://10.0.0.1:29500", "tcp://10.0.0.1:29500"),
    "--experts-resident-bytes": ("123456789", 123456789),
    "--experts-move-bytes-per-step": ("4096", 4096), "--experts-heat-half-life": ("8.5", 8.5), "--experts-prefetch": ("4", 4),
    "--tool-call-parser": ("hermes", "qwen"),          # vLLM's name for the Qwen format
    "--vllm-metrics-path": ("/metrics/vllm", "/metrics/vllm"),
    "--kv-cache-dtype": ("fp8_e4m3", "fp8_e4m3"),
    "--priority-classes": ("interactive=0, batch=20", ("interactive=0", "batch=20")),
    "--priority-default-class": ("batch", "batch"),
}


def test_every_flag_has_a_test_row():
    assert {f.name for f in flags.FLAGS} == set(FLAG_VALUES)


@pytest.mark.parametrize("flag", flags.FLAGS, ids=[f.name for f in flags.FLAGS])
def test_each_flag_sets_its_config_field_over_env_and_toml(flag, monkeypatch, tmp_path):
    arg, expect = FLAG_VALUES[flag.name]
    section, key = flag.field.split(".")
    default = getattr(getattr(_cfg("/m"), section), key)
    assert default != expect                       # the flag, not the default, made it so
    p = tmp_path / "m.toml"
    p.write_text(f"[{section}]\n{key} = {settings.toml_value(default)}\n")
    monkeypatch.setenv(f"MOED_{section}_{key}".upper(), str(default))
    model = [] if flag.name == "--role" else ["/m"]         # a router takes no model
    cfg = _cfg(*model, "--config", str(p), flag.name, arg)
    assert getattr(getattr(cfg, section), key) == expect


def test_model_is_positional_or_a_flag_never_two_different_ones(capsys):
    assert _cfg("/models/a").model.path == "/models/a"
    assert _cfg("--model", "/models/a").model.path == "/models/a"
    assert _cfg("--api-key", "k", "/models/a", "--port", "1").model.path == "/models/a"
    assert _cfg("/models/a/", "--model", "/models/a").model.path == "/models/a/"
    with pytest.raises(ConfigError, match="MODEL /models/a and --model /models/b differ"):
        _cfg("/models/a", "--model", "/models/b")
    rc, _, err = _run(capsys, "check-config", "a.toml", "--config", "b.toml", "--role", "router")
    assert rc == 2 and "CONFIG a.toml and --config b.toml differ" in err


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"],
                                  ["check-config", "--version"]])
def test_version(capsys, argv):
    sighup = signal.getsignal(signal.SIGHUP)      # `serve` holds SIGHUP from its first line
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
    finally:
        signal.signal(signal.SIGHUP, sighup)
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"moed {__version__}"


def test_version_is_the_packaged_one():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__


def test_flags_moed_cannot_honour_are_refused_not_ignored(capsys):
    rc, out, err = _run(capsys, "check-config", "--role", "router",
                        "--gpu-memory-utilization", "0.9")
    assert rc == 2 and out == ""
    assert err.strip() == ("moed: config error: command line: --gpu-memory-utilization is not "
                           "supported: " + flags.REFUSED["--gpu-memory-utilization"])
    assert "--kv-cache-memory" in err


def test_model_and_engine_flags_are_refused_on_a_router(capsys):
    rc, out, err = _run(capsys, "check-config", "--role", "router", "--max-num-seqs", "3")
    assert rc == 2 and out == ""
    assert err.strip() == ("moed: config error: command line: --max-num-seqs: a router node "
                           "has no model or engine for it")
    with pytest.raises(ConfigError, match="--dtype: a router node"):
        _cfg("/m", "--role", "router", "--dtype", "half")
    # the router's tokenizer (prefix affinity) comes from the checkpoint: --model is applied
    assert _cfg("/m", "--role", "router").model.path == "/m"
    assert _cfg("--role", "router", "--port", "1", "--api-key", "k").server.port == 1


def test_api_key_reaches_the_key_loader_and_no_printed_config(capsys):
    cfg = _cfg("/m", "--api-key", "k1", "--api-key", " k2 ")
    assert cfg.server.api_keys_env == flags.API_KEYS_ENV
    assert load_keys(cfg.server.api_keys_file, cfg.server.api_keys_env) == (b"k1", b"k2")
    rc, out, _ = _run(capsys, "check-config", "--role", "router", "--api-key", "sk-secret")
    assert rc == 0 and "sk-secret" not in out
    assert tomllib.loads(out)["server"]["api_keys_env"] == flags.API_KEYS_ENV
    for bad in ("a,b", " "):      # the variable holds comma-separated keys
        with pytest.raises(ConfigError, match="--api-key"):
            _cfg("/m", "--api-key", bad)


def test_api_key_flag_counts_beside_a_keys_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("from-file\n")
    p = tmp_path / "m.toml"
    p.write_text(f'[server]\napi_keys_file = "{keys}"\n')
    cfg = _cfg("/m", "--config", str(p), "--api-key", "from-flag")
    assert load_keys(cfg.server.api_keys_file, cfg.server.api_keys_env) == (b"from-file",
                                                                            b"from-flag")


def test_check_config_runs_the_model_checks(capsys, tmp_path, tiny_qwen3):
    rc, _, err = _run(capsys, "check-config", "--model", str(tmp_path))
    assert rc == 2 and err.strip() == (f"moed: config error: model.path: {tmp_path}/config.json "
                                       f"not found: not a Hugging Face checkpoint directory")
    rc, _, err = _run(capsys, "check-config", "--model", str(tiny_qwen3), "--max-model-len",
                      "100000")
    assert rc == 2 and "model.max_model_len: 100000 is beyond" in err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    rc, _, err = _run(capsys, "check-config", "--model", str(tmp_path))
    assert rc == 2 and "llama" in err and "qwen3_moe" in err      # names what is served


def test_kv_transfer_nodes_get_huge_pages_unless_the_operator_chose():
    for role, expect in (("prefill", "1"), ("decode", "1"), ("colocated", None), ("router", None)):
        env: dict[str, str] = {}
        assert serve.kv_transfer_env(role, env) is (expect == "1")
        assert env.get(serve.THP_ENV) == expect
    env = {serve.THP_ENV: "0"}                       # an explicit opt-out is kept
    assert serve.kv_transfer_env("decode", env) is False and env[serve.THP_ENV] == "0"


def test_engine_nodes_get_a_bounded_openmp_spin_unless_the_operator_chose():
    for role in ("colocated", "prefill", "decode"):
        env: dict[str, str] = {}
        assert serve.omp_spin_env(role, env) == serve.SPIN_DEFAULT == env[serve.SPIN_ENV]
    env = {}
    assert serve.omp_spin_env("router", env) == "" and env == {}     # never loads torch
    env = {serve.SPIN_ENV: "300000"}                                  # the operator's count
    assert serve.omp_spin_env("colocated", env) == "300000"
    env = {"OMP_WAIT_POLICY": "ACTIVE"}             # a wait policy chooses its own count
    assert serve.omp_spin_env("colocated", env) == "" and serve.SPIN_ENV not in env


def test_kv_events_config_takes_vllm_json_and_refuses_unknown_keys(capsys, tmp_path):
    cfg = _cfg("/m", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": '
               '"zmq", "endpoint": "tcp://*:6001", "replay_endpoint": null, "topic": "kv", '
               '"buffer_steps": 7, "hwm": 9, "max_queue_size": 11}')
    k = cfg.kv_events
    assert (k.active, k.endpoint, k.replay_endpoint, k.topic, k.buffer_steps, k.hwm,
            k.max_queue_size) == (True, "tcp://*:6001", "", "kv", 7, 9, 11)
    assert not _cfg("/m").kv_events.active and _cfg("/m").kv_events.event_format == "map"
    assert _cfg("/m", "--kv-events-config", '{"event_format": "array"}').kv_events.event_format \
        == "array"
    assert not _cfg("/m", "--kv-events-config", '{"enable_kv_cache_events": true, '
                    '"publisher": "null"}').kv_events.active
    for bad, says in (('{"enable_kv_cache_events": true, "buffer_step": 3}', "'buffer_step'"),
                      ('{"publisher": "kafka"}', "kv_events.publisher"),
                      ('{"endpoint": "http://x:1"}', "kv_events.endpoint"),
                      ('{"hwm": "many"}', "kv_events.hwm"), ("[1]", "JSON object"),
                      ('{"event_format": "tuple"}', "kv_events.event_format"),
                      ("{nope", "not valid JSON")):
        assert cli.main(["check-config", "--model", "/m", "--kv-events-config", bad]) == 2, bad
        assert says in capsys.readouterr().err, bad


def test_speculative_config_takes_vllm_json_and_refuses_other_keys(capsys):
    sp = _cfg("/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 6}').speculative
    assert (sp.method, sp.num_speculative_tokens, sp.prompt_lookup_min,
            sp.prompt_lookup_max) == ("ngram", 4, 2, 6)
    # vLLM's rule: a lone prompt_lookup_min or _max stands for both
    sp = _cfg("/m", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}') \
        .speculative
    assert (sp.prompt_lookup_min, sp.prompt_lookup_max) == (3, 3)
    assert sp.adaptive      # moed's one key beyond vLLM's, on by default
    assert not _cfg("/m", "--speculative-config", '{"method": "ngram", "adaptive": false}') \
        .speculative.adaptive
    assert not _cfg("/m").speculative.enabled
    for bad, says in (('{"method": "ngram", "draft_tensor_parallel_size": 1}',
                       "draft_tensor_parallel_size is not supported"),
                      ('{"model": "x/draft"}', "model is not supported"),
                      ('{"method": "mtp", "num_speculative_tokens": 5}',
                       "the one MTP layer is chained for k > 1, at most 4"),
                      ('{"method": "ngram", "num_speculative_tokens": 0}',
                       "speculative.num_speculative_tokens"),
                      ("[1]", "JSON object"), ("{nope", "not valid JSON")):
        assert cli.main(["check-config", "--model", "/m", "--speculative-config", bad]) == 2, bad
        assert says in capsys.readouterr().err, bad


def test_mtp_on_a_checkpoint_without_an_mtp_layer_is_a_config_error(capsys, tiny_qwen3):
    rc, _, err = _run(capsys, "check-config", "--model", str(tiny_qwen3), "--speculative-config",
                      '{"method": "mtp", "num_speculative_tokens": 1}')
    assert rc == 2 and "speculative.method mtp: the checkpoint has no MTP layer" in err \
        and "num_nextn_predict_layers" in err and len(err.strip().splitlines()) == 1


def test_documented_default_file_matches_builtin_defaults():
    """conf/moed.toml documents the defaults: loading it changes nothing but what it must."""
    o = {"model": {"path": "/m"}}
    assert load(CONF, environ={}, overrides=o) == load(None, environ={}, overrides=o)


# ---- check-config refuses what serve refuses, in the same words (real processes) ----------

def _error_line(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "moed", *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=90)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("moed: ")]
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, lines[-1] if lines else r.stdout + r.stderr


def _refusals(tmp_path: Path, model: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    no_key = {"MOED_CLUSTER_KEY_FILE": "", "MOED_CLUSTER_KEY_ENV": ""}
    return {  # case -> (config and flags, environment, what the message says)
        "router-without-cluster-key": (["--config", str(ROOT / "conf" / "router.toml"),
                                        "--host", "127.0.0.1"], no_key, "no cluster key"),
        "decode-insecure-off-loopback": (["--role", "decode", "--model", str(model),
                                          "--host", "0.0.0.0"],
                                         {**no_key, "MOED_CLUSTER_INSECURE": "true"},
                                         "cluster.insecure: a decode node"),
        # a colocated node lending its KV to peers (tiers.peer_reuse) takes /internal/kv/lease
        "colocated-peer-reuse-insecure-off-loopback": (
            ["--model", str(model), "--host", "0.0.0.0"],
            {**no_key, "MOED_CLUSTER_INSECURE": "true", "MOED_CLUSTER_ENABLED": "true",
             "MOED_TIERS_PEER_REUSE": "true"}, "cluster.insecure: a colocated node"),
        # a router on loopback whose gossip socket is not: unsigned membership from anywhere
        "router-insecure-gossip-off-loopback": (
            ["--config", str(ROOT / "conf" / "router.toml"), "--host", "127.0.0.1"],
            {**no_key, "MOED_CLUSTER_INSECURE": "true", "MOED_CLUSTER_BIND_HOST": "0.0.0.0",
             "MOED_CLUSTER_ADVERTISE_HOST": "192.0.2.1"}, "cluster.bind_host 0.0.0.0"),
        "admin-token-file-missing": (["--model", str(model)],
                                     {"MOED_SERVER_ADMIN_TOKEN_FILE": str(tmp_path / "none")},
                                     "server.admin_token_file"),
        "not-a-checkpoint": (["--model", str(tmp_path)], {}, "not a Hugging Face checkpoint"),
        "misspelt-variable": (["--model", str(model)], {"MOED_SERVR_PORT": "1"},
                              "did you mean MOED_SERVER_PORT?"),
    }


@pytest.mark.timeout(240)
def test_check_config_refuses_what_serve_refuses_in_the_same_words(tmp_path, tiny_qwen3):
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    base["OMP_NUM_THREADS"] = "1"
    cases = _refusals(tmp_path, tiny_qwen3)
    # serve on a free port of loopback, in case it did not refuse; the CLI starts (mostly
    # imports) four at a time
    runs = [(cmd, case) for case in cases for cmd in ("serve", "check-config")]
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(runs, pool.map(lambda r: _error_line(
            [r[0], *cases[r[1]][0], "--port", "0"], {**base, **cases[r[1]][1]}), runs)))
    for case, (_, _, says) in cases.items():
        served, checked = got["serve", case], got["check-config", case]
        assert served == checked, case
        assert served[0] == 2 and served[1].startswith("moed: config error: ") and \
            says in served[1], (case, served)


# ---- vLLM's flags (docs/config.md, "vLLM's command-line flags") --------------------------

def test_vllm_flags_for_what_moed_does_are_accepted_with_a_log_line(capsys, tiny_qwen3):
    rc, out, err = _run(capsys, "check-config", "--model", str(tiny_qwen3),
                        "--tensor-parallel-size", "1", "-pp", "1", "-dp", "1",
                        "--load-format", "safetensors",
                        "--swap-space", "0", "--enforce-eager", "--enable-chunked-prefill",
                        "--disable-log-requests", "--enable-auto-tool-choice",
                        "--enable-prefix-caching", "--log-format", "console")
    assert rc == 0 and tomllib.loads(out)["engine"]["enable_prefix_caching"] is True
    accepted = [line for line in err.splitlines() if "vllm_flag_accepted" in line]
    assert len(accepted) == len(flags.SAME)                  # one line each, naming the flag
    for same in flags.SAME:
        assert sum(f"flag={same.name} " in line for line in accepted) == 1
    assert "moed does this anyway: one process holds each layer whole" in err
    applied = [line for line in err.splitlines() if "vllm_flag_applied" in line]
    assert len(applied) == 1 and "flag=--enable-prefix-caching" in applied[0] and \
        "field=engine.enable_prefix_caching" in applied[0]


@pytest.mark.parametrize("argv,says", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 is not supported: moed has no "
                                      "tensor parallelism"),
    (["-tp", "4"], "--tensor-parallel-size 4 is not supported"),
    (["-pp", "2"], "--pipeline-parallel-size 2 is not supported"),
    (["--data-parallel-size", "2"], "run more nodes behind a router"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2 is not supported: moed's fp8 "
                                       "KV cache is e4m3"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype int8: expected auto, fp8, "
                                   "fp8_e4m3"),
    (["--load-format", "gguf"], "safetensors checkpoints only"),
    (["--swap-space", "4"], "recomputing"),
    (["--no-enable-chunked-prefill"], "always chunks prefill"),
    (["--trust-remote-code"], "--trust-remote-code is not supported: moed never runs code"),
    (["--enable-expert-parallel"], "--ep-size N"),
    (["-ep"], "--enable-expert-parallel is not supported"),
    (["--seed", "0"], "a request's `seed` field"),
    (["--tokenizer", "x"], "from the checkpoint directory"),
    (["--chat-template", "t.jinja"], "tokenizer_config.json's chat_template"),
    (["--enable-log-requests"], "does not log prompts"),
    (["--tool-call-parser", "llama3_json"], "--tool-call-parser llama3_json: moed parses auto, "
                                            "none, qwen, mistral"),
])
def test_vllm_flags_that_contradict_moed_are_refused_by_name(capsys, argv, says):
    rc, out, err = _run(capsys, "check-config", "/m", *argv)
    assert rc == 2 and out == "" and err.startswith("moed: config error: command line: ")
    assert says in err and "unrecognized arguments" not in err


def test_prefix_caching_switch_maps_to_the_engine_field():
    assert _cfg("/m").engine.enable_prefix_caching is True
    assert _cfg("/m", "--no-enable-prefix-caching").engine.enable_prefix_caching is False
    assert _cfg("/m", "--no-enable-prefix-caching",
                "--enable-prefix-caching").engine.enable_prefix_caching is True
    with pytest.raises(ConfigError, match="--enable-prefix-caching: a router node"):
        _cfg("/m", "--role", "router", "--no-enable-prefix-caching")


def test_batch_invariant_switch_maps_to_the_model_field():
    assert _cfg("/m").model.batch_invariant is False
    assert _cfg("/m", "--batch-invariant").model.batch_invariant is True
    assert _cfg("/m", "--batch-invariant", "--no-batch-invariant").model.batch_invariant is False


def test_serve_refuses_pasted_vllm_flags_before_loading_anything(tmp_path):
    """The issue's line, through the real CLI: one line naming the flag, exit 2, at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "moed", "serve", str(tmp_path),
                        "--tensor-parallel-size", "1", "--enable-prefix-caching",
                        "--trust-remote-code"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2 and "unrecognized" not in r.stderr
    assert r.stderr.strip() == ("moed: config error: command line: --trust-remote-code is not "
                                "supported: " + flags.REFUSED_SWITCHES["--trust-remote-code"])


def test_check_config_of_a_directory_says_where_the_model_goes(capsys, tmp_path):
    rc, out, err = _run(capsys, "check-config", str(tmp_path))
    assert rc == 2 and out == ""
    assert err.strip() == (f"moed: config error: command line: CONFIG {tmp_path} is a "
                           f"directory: CONFIG is a TOML file; the model goes in --model "
                           f"(moed check-config --model {tmp_path})")
    rc, _, err = _run(capsys, "serve", "--config", str(tmp_path))
    assert rc == 2 and "--config is a TOML file; the model goes in --model (moed serve " in err


def test_vllms_short_quantization_flag_sets_the_field(capsys, tiny_qwen3):
    rc, out, _ = _run(capsys, "check-config", "--model", str(tiny_qwen3), "-q", "int8")
    assert rc == 0 and tomllib.loads(out)["model"]["quantization"] == "int8"
