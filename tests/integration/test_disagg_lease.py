"""A prefill job outlives its lease → the prefill node drops it (EXPIRED, blocks freed, counted)
and the decode node, with no other prefill node to try, fails the request with a clear error
and frees its destination blocks. Real processes, real NIXL."""
from __future__ import annotations

import json

import openai
import pytest

from test_disagg import COMMON, LONG, _jobs, _kv_used, _metric, _prompt, _wait_until


def test_expired_lease_frees_both_sides_and_fails_clearly(moed_server, tiny_qwen3) -> None:
    p = moed_server(model=tiny_qwen3, role="prefill", wait=None, ready_timeout=150,
                    env={**COMMON, "MOED_TRANSFER_LEASE_S": "0.2"})
    d = moed_server(model=tiny_qwen3, role="decode", ready_timeout=150,
                    env={**COMMON, "MOED_TRANSFER_PREFILL_PEERS": p.url,
                         "MOED_TRANSFER_MAX_PREFILL_RETRIES": "0",
                         "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": "6"})
    _wait_until(lambda: p.get("/ready")[0] == 200, 150, "prefill ready")
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError, match="prefill lease expired") as err:
        c.completions.create(model="tiny", prompt=_prompt(LONG, 3), max_tokens=3, temperature=0)
    assert err.value.status_code == 503            # not the engine's fault: retry elsewhere
    assert _metric(p, "moed_transfer_leases_expired_total") == 1
    assert _metric(p, 'moed_transfer_jobs_total{result="expired",role="prefill"}') == 1
    assert not _jobs(p)
    _wait_until(lambda: _kv_used(p) == 0 and _kv_used(d) == 0, 5, "blocks freed on both nodes")
    assert _metric(d, 'moed_transfer_failures_total{kind="expired"}') == 1
    assert _metric(d, 'moed_transfer_jobs_total{result="failed",role="decode"}') == 1
    failed = [json.loads(line) for line in d.logs().splitlines()
              if '"remote_prefill_failed"' in line]
    assert len(failed) == 1 and "prefill lease expired" in failed[0]["error"]
    # a short prompt still fits in the lease: the pair is not poisoned by the failure
    ok = c.completions.create(model="tiny", prompt=_prompt(8, 4), max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    done = 'moed_transfer_jobs_total{result="done",role="prefill"}'
    assert _metric(p, done) == 1
    # at most local_prefill_max_tokens: prefilled on the decode node, no prefill job at all
    local = c.completions.create(model="tiny", prompt=_prompt(6, 5), max_tokens=2, temperature=0)
    assert local.choices[0].finish_reason == "length" and _metric(p, done) == 1
