"""Pure parts of the prefill/decode roles: wire messages, job states (the peer choice and its
breaker: tests/unit/balance)."""
from __future__ import annotations

import pytest

from moed.roles.prefill import JOB_TRANSITIONS, JobState, PrefillJob
from moed.roles.protocol import (FirstToken, PrefillJobSpec, ProtocolError, first_token_params,
                                 sampling_fields)
from moed.types import SamplingParams


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


def test_the_mtp_flag_travels_with_the_job_and_the_draft_with_the_token() -> None:
    """A decode node drafting with the MTP layer says so in the job; the prefill node's first
    draft rides in the notification. A node before (no field) reads as no MTP layer."""
    s = _spec(mtp=True)
    assert PrefillJobSpec.from_json(s.to_json()) == s and s.to_json()["mtp"] is True
    old = {k: v for k, v in _spec().to_json().items() if k != "mtp"}
    assert PrefillJobSpec.from_json(old).mtp is False
    for bad in ("true", 1, None):
        with pytest.raises(ProtocolError, match="mtp"):
            PrefillJobSpec.from_json({**s.to_json(), "mtp": bad})
    t = FirstToken("j", 7, -0.25, (), "cap", draft=11)
    assert FirstToken.decode(t.encode()) == t
    assert b'"d"' not in FirstToken("j", 7).encode()       # no draft: the message as before
    assert FirstToken.decode(FirstToken("j", 7).encode()).draft is None


def test_a_prefill_node_says_which_side_lacks_the_mtp_layer() -> None:
    from moed.roles.prefill import mtp_mismatch

    assert "this prefill node has no MTP layer" in mtp_mismatch(True)
    assert 'method = "mtp"' in mtp_mismatch(True)
    assert "the decode node's KV has no such layer" in mtp_mismatch(False)


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


def test_the_requests_priority_reaches_the_prefill_node() -> None:
    assert first_token_params(sampling_fields(SamplingParams(priority=10))).priority == 10
    assert "priority" not in sampling_fields(SamplingParams())      # a node before: unchanged
    assert first_token_params(sampling_fields(SamplingParams())).priority == 0
    for bad in ("10", 1.5, 1 << 31, True):
        with pytest.raises(ProtocolError, match="priority"):
            first_token_params({"priority": bad})


def test_the_cache_salt_travels_with_the_job() -> None:
    """The prefill node's own prefix cache is salted as the decode node's (moed.api.salt)."""
    assert first_token_params(sampling_fields(SamplingParams(cache_salt="k\x1fs"))).cache_salt \
        == "k\x1fs"
    assert "cache_salt" not in sampling_fields(SamplingParams())
    assert first_token_params(sampling_fields(SamplingParams())).cache_salt == ""


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


def test_a_kv_write_whose_wait_runs_out_with_the_lease_is_the_lease_expiring() -> None:
    """The KV write's wait is bounded by the job's lease. When it returns aborted for
    "timeout" (it can beat the handler's own timer at the same instant), _send raises
    TimeoutError: the handler's expiry path (EXPIRED, counted, "prefill lease expired"), not a
    job failed with kind "timeout". Any other aborted write stays a JobFailed."""
    import asyncio
    from types import SimpleNamespace

    from moed.roles.prefill import JobFailed, PrefillComponent
    from moed.transfer.base import TransferState, TransferStatus

    class Worker:
        def __init__(self, reason: str) -> None:
            self.reason, self.waited = reason, []

        async def write_blocks(self, node, src, dst, notif):
            return SimpleNamespace(nbytes=0)

        async def wait(self, handle, timeout_s):
            self.waited.append(timeout_s)
            return TransferStatus(TransferState.ABORTED, self.reason)

        async def remove_peer(self, node):
            pass

    async def send(reason: str) -> Worker:
        worker = Worker(reason)
        job = PrefillJob(_spec(dst_block_ids=(40, 41)), "pf-r1.1", asyncio.get_running_loop().time() + 0.05)
        job.table = [3, 4, 5]
        await PrefillComponent._send(SimpleNamespace(worker=worker), job, 3)
        return worker

    with pytest.raises(TimeoutError):
        asyncio.run(send("timeout"))
    with pytest.raises(JobFailed) as err:
        asyncio.run(send("peer_disconnected"))
    assert err.value.kind == "peer_disconnected"
