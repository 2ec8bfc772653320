"""Pure parts of the prefill/decode roles: peer breaker policy, wire messages, job states."""
from __future__ import annotations

import pytest

from moed.roles.policy import (PeerHealth, PeerState, available, on_failure, on_pick,
                               on_success, pick_peer)
from moed.roles.prefill import JOB_TRANSITIONS, JobState, PrefillJob
from moed.roles.protocol import (FirstToken, PrefillJobSpec, ProtocolError, first_token_params,
                                 sampling_fields)
from moed.types import SamplingParams


def test_breaker_half_open_cycle() -> None:
    h = PeerHealth()
    assert available(h, 0.0, 5.0)
    h = on_failure(h, now=10.0)
    assert h.state is PeerState.OPEN and h.consecutive_failures == 1
    assert not available(h, 14.9, 5.0)          # cooling down
    assert available(h, 15.0, 5.0)              # cooldown over: one trial
    h = on_pick(h)
    assert h.state is PeerState.HALF_OPEN and not available(h, 100.0, 5.0)
    h2 = on_failure(h, now=20.0)                # trial failed: open again, from now
    assert h2.state is PeerState.OPEN and h2.total_failures == 2 and not available(h2, 24.0, 5.0)
    h3 = on_success(h)                          # trial succeeded: healthy, count reset
    assert h3.state is PeerState.CLOSED and h3.consecutive_failures == 0
    assert h3.total_failures == 1
    assert on_pick(h3) is h3


def test_pick_peer_prefers_idle_healthy_and_skips_excluded() -> None:
    hs = {"a": PeerHealth(), "b": PeerHealth(), "c": on_failure(PeerHealth(), 0.0)}
    assert pick_peer(hs, {"a": 2, "b": 1}, set(), 1.0, 5.0) == "b"
    assert pick_peer(hs, {"a": 0, "b": 0}, set(), 1.0, 5.0) == "a"      # tie → name
    assert pick_peer(hs, {}, {"a", "b"}, 6.0, 5.0) == "c"              # c's trial
    # only cooling peers left: the oldest failure is tried rather than failing for sure
    assert pick_peer(hs, {}, {"a", "b"}, 1.0, 5.0) == "c"
    cooling = {"x": on_failure(PeerHealth(), 3.0), "y": on_failure(PeerHealth(), 2.0)}
    assert pick_peer(cooling, {}, set(), 4.0, 5.0) == "y"
    assert pick_peer(hs, {}, {"a", "b", "c"}, 1.0, 5.0) is None        # all tried
    # a peer whose cooldown is over gets the next job as its trial, even when busier
    assert pick_peer({"a": on_failure(PeerHealth(), 0.0), "b": PeerHealth()}, {"a": 3}, set(),
                     10.0, 5.0) == "a"
    assert pick_peer({"a": on_failure(PeerHealth(), 0.0), "b": PeerHealth()}, {}, set(),
                     4.0, 5.0) == "b"
    assert pick_peer({}, {}, set(), 0.0, 1.0) is None


def _spec(**kw) -> PrefillJobSpec:
    base = dict(job_id="r1.1", token_ids=(5, 6, 7, 8, 9), skip_blocks=1, dst_block_ids=(40,),
                decode_node="d", decode_incarnation=7, timeout_s=3.0,
                sampling=sampling_fields(SamplingParams(temperature=0.0)), metadata=b"\x00md")
    return PrefillJobSpec(**{**base, **kw})


def test_job_spec_roundtrip_and_validation() -> None:
    s = _spec()
    assert PrefillJobSpec.from_json(s.to_json()) == s
    assert PrefillJobSpec.from_json(_spec(metadata=None).to_json()).metadata is None
    s.check_blocks(4)                                   # 5 tokens = 2 blocks, 1 cached
    with pytest.raises(ProtocolError, match="needs 1 destination blocks of 4 tokens, got 2"):
        _spec(dst_block_ids=(1, 2)).check_blocks(4)
    with pytest.raises(ProtocolError, match="bad prefill job"):
        PrefillJobSpec.from_json({"job_id": "x"})
    with pytest.raises(ProtocolError, match="empty prompt"):
        PrefillJobSpec.from_json(_spec(token_ids=()).to_json())
    with pytest.raises(ProtocolError):
        PrefillJobSpec.from_json([1, 2])


def test_first_token_params_keep_blocks_and_match_sampling() -> None:
    p = first_token_params(sampling_fields(SamplingParams(temperature=0.7, top_k=5, seed=3,
                                                          stop_token_ids=(9,))))
    # never finishes with "length"/eos on token one, so the KV is held until it is sent
    assert p.max_tokens == 2 and p.ignore_eos and p.stop_token_ids == ()
    assert (p.temperature, p.top_k, p.seed) == (0.7, 5, 3)
    # under min_tokens the first token must not be EOS/stop: same bans as on the decode node
    q = first_token_params(sampling_fields(SamplingParams(min_tokens=2, stop_token_ids=(9,))))
    assert not q.ignore_eos and q.stop_token_ids == (9,) and q.min_tokens == 2
    with pytest.raises(ProtocolError, match="bad sampling params"):
        first_token_params({"temperature": "hot"})


def test_first_token_notif() -> None:
    t = FirstToken("r1.2", 42, -0.5)
    assert FirstToken.decode(t.encode()) == t
    assert FirstToken.decode(FirstToken("j", 1).encode()).logprob is None
    top = FirstToken("j", 7, -0.25, ((7, -0.25), (3, -1.5)))      # top_logprobs ride along
    assert FirstToken.decode(top.encode()) == top
    assert first_token_params(sampling_fields(SamplingParams(logprobs=True, top_logprobs=4))
                              ).top_logprobs == 4
    with pytest.raises(ProtocolError):
        FirstToken.decode(b"\xff garbage")


def test_job_state_machine() -> None:
    job = PrefillJob(_spec(), "pf-r1.1", expires_at=0.0)
    job.move(JobState.FINISHING)
    job.move(JobState.DONE)
    assert job.terminal
    with pytest.raises(RuntimeError, match="illegal prefill job transition done -> cancelled"):
        job.move(JobState.CANCELLED)
    for end in (JobState.CANCELLED, JobState.EXPIRED, JobState.FAILED):
        assert end in JOB_TRANSITIONS[JobState.RUNNING] and not JOB_TRANSITIONS[end]
    assert JobState.DONE not in JOB_TRANSITIONS[JobState.RUNNING]   # only via FINISHING


def test_transfer_config_validation() -> None:
    from moed.config import ConfigError, load

    def cfg(**env: str):
        return load(None, environ={f"MOED_TRANSFER_{k.upper()}": v for k, v in env.items()},
                    overrides={"model": {"path": "/m"}}).transfer

    assert cfg(prefill_peers="http://a:1,https://b:2").prefill_peers == ("http://a:1",
                                                                         "https://b:2")
    with pytest.raises(ConfigError, match="'a:1' is not an http"):
        cfg(prefill_peers="a:1")
    with pytest.raises(ConfigError, match="transfer.backend: 'tcp' is not one of nixl"):
        cfg(backend="tcp")
