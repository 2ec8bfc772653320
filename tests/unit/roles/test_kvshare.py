"""Cluster prefix reuse's two sides (moed/roles/kvshare.py) over real HTTP (aiohttp test
server, signed calls) with a real KV manager and a fake transfer worker: the lender refuses
unsigned, malformed and incompatible lease requests, pins the leading run it holds and unpins
it on the reader's DELETE or at the TTL; the reader adopts what it read as cached blocks, and on
a failed read or an unreachable lender recomputes with a counted reason, leaking no block on
either side."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moed.api.middleware import auth, request_context
from moed.api.state import STATE, ServerState
from moed.cluster.wire import Keyring
from moed.api.internal import InternalAuth
from moed.config import ClusterConfig, Config, ModelConfig, ServerConfig, TiersConfig
from moed.kvcache.manager import KVCacheManager
from moed.cluster.state import digest_key
from moed.kvcache.tiers.peer import prompt_hashes
from moed.obs import metrics
from moed.roles import kvshare
from moed.roles.kvshare import KVShareComponent
from moed.transfer import TransferHandle, TransferState, TransferStatus

BS = 4
PROMPT = list(range(200, 237))          # 9 full blocks
KEY = b"k" * 32
# what A's gossip digest would say of PROMPT: depths 1, 2, 4, 8
a_digest = tuple(digest_key(prompt_hashes(PROMPT, BS)[d - 1]) for d in (1, 2, 4, 8))


class FakeEngine:
    block_size = BS
    kv_layout_id = "lay"
    alive = True

    def __init__(self) -> None:
        self.kv = KVCacheManager(32, BS)
        self.scheduler = type("S", (), {"tiers": None,
                                        "predict_prefill_s": staticmethod(
                                            lambda tokens, start: tokens * 1e-3)})()

    tiers = None

    def predict_prefill_s(self, tokens: int, start: int) -> float:
        return self.scheduler.predict_prefill_s(tokens, start)

    def use_prompt_source(self, source: Any) -> None:
        self.source = source

    def at_step_boundary(self, fn: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn())
        return fut

    def cache(self, tokens: list[int]) -> None:
        self.kv.allocate_prompt("r", tokens, self.kv.prefix_hit(tokens), len(tokens))
        self.kv.commit("r", tokens, len(tokens))
        self.kv.free("r")


class FakeWorker:
    def __init__(self, outcome: TransferState) -> None:
        self.outcome = outcome
        self.reads: list[tuple[str, list[int], list[int]]] = []

    async def local_metadata(self) -> bytes:
        return b"metadata"

    async def add_peer(self, name: str, md: bytes, incarnation: int) -> bool:
        assert md == b"metadata"
        return True

    async def remove_peer(self, name: str) -> None:
        pass

    async def read_blocks(self, peer: str, src: list[int], dst: list[int]) -> TransferHandle:
        self.reads.append((peer, list(src), list(dst)))
        return TransferHandle(len(self.reads), peer, len(src), len(src) * 64, 1)

    async def wait(self, h: TransferHandle, timeout_s: float) -> TransferStatus:
        reason = {TransferState.DONE: "", TransferState.ABORTED: "timeout"}.get(
            self.outcome, "peer_disconnected")
        return TransferStatus(self.outcome, reason)


def _cfg(cache_metrics_batch: int = 1) -> Config:
    """Counters released at every request (the batching itself: test_peer_counters_move_in_
    batches_of_requests)."""
    return Config(server=ServerConfig(role="colocated", cache_metrics_batch=cache_metrics_batch),
                  model=ModelConfig(path="/m"),
                  cluster=ClusterConfig(enabled=True), tiers=TiersConfig(peer_reuse=True))


def _share(node: str, outcome: TransferState = TransferState.DONE) -> KVShareComponent:
    s = KVShareComponent(_cfg(), node)
    s.engine, s.worker = FakeEngine(), FakeWorker(outcome)
    s.model_id, s.block_bytes = "mod", 64
    s._auth = InternalAuth(Keyring(KEY, ()), node, insecure=False, window_s=60)
    return s


async def _lender(share: KVShareComponent) -> TestClient:
    state = ServerState(config=_cfg(), api_keys=())
    state.internal_auth = share._auth
    app = web.Application(middlewares=[request_context, auth])
    app[STATE] = state
    share.add_routes(app)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def _body(hashes: list[int], layout: str = "lay") -> bytes:
    return json.dumps({"hashes": [f"{h:032x}" for h in hashes], "layout_id": layout,
                       "model_id": "mod"}).encode()


async def test_lender_refuses_bad_calls_pins_the_leading_run_and_unpins_it(monkeypatch) -> None:
    a = _share("A")
    a.engine.cache(PROMPT)
    hs = prompt_hashes(PROMPT, BS)
    client = await _lender(a)
    reader = InternalAuth(Keyring(KEY, ()), "B", insecure=False, window_s=60)
    other = InternalAuth(Keyring(KEY, ()), "C", insecure=False, window_s=60)
    try:
        path = "/internal/kv/lease"
        assert (await client.post(path, data=_body(hs))).status == 401
        bad = b'{"hashes": 3}'
        assert (await client.post(path, data=bad, headers=reader.sign("POST", path, bad))
                ).status == 400
        wrong = _body(hs, layout="other")
        assert (await client.post(path, data=wrong, headers=reader.sign("POST", path, wrong))
                ).status == 409
        body = _body(hs[:5] + [7] + hs[5:])         # the peer holds the run up to the gap
        r = await client.post(path, data=body, headers=reader.sign("POST", path, body))
        grant = await r.json()
        assert r.status == 200 and len(grant["block_ids"]) == 5 and grant["incarnation"] > 0
        assert a.engine.kv.num_used_blocks == 5 and len(a.leases) == 1
        gone = f"{path}/{grant['lease']}"
        assert (await client.delete(gone, headers=other.sign("DELETE", gone))).status == 404
        assert a.engine.kv.num_used_blocks == 5         # another node cannot release it
        r = await client.delete(gone, headers=reader.sign("DELETE", gone))
        assert r.status == 200 and (await r.json())["released"] == 5
        assert a.engine.kv.num_used_blocks == 0 and metrics.PEER_LENT_BLOCKS._value.get() == 0

        # a reader that never says DELETE: the TTL unpins
        monkeypatch.setattr(kvshare, "LEASE_TTL_S", 0.05)
        a._expiry = asyncio.create_task(a._expire_loop())
        r = await client.post(path, data=_body(hs), headers=reader.sign("POST", path, _body(hs)))
        assert r.status == 200 and a.engine.kv.num_used_blocks == 9
        for _ in range(40):
            if a.engine.kv.num_used_blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert a.engine.kv.num_used_blocks == 0 and len(a.leases) == 0
    finally:
        if a._expiry is not None:
            a._expiry.cancel()
        await client.close()


def _hits() -> float:
    return metrics.PEER_HITS._value.get()


def _failures(reason: str) -> float:
    return metrics.PEER_FAILURES.labels(reason)._value.get()


@pytest.mark.parametrize("outcome", [TransferState.DONE, TransferState.FAILED])
async def test_reader_adopts_a_read_or_recomputes_leaking_nothing(outcome) -> None:
    import aiohttp
    a, b = _share("A"), _share("B", outcome)
    a.engine.cache(PROMPT)
    client = await _lender(a)
    b.session = aiohttp.ClientSession()
    url = str(client.make_url("")).rstrip("/")
    b._peers = lambda: [("A", url, a_digest)]
    hits, failed = _hits(), _failures("read_failed")
    try:
        await b.prefetch("req-1", PROMPT)
        for _ in range(40):         # the DELETE (and a failed read's release) run as tasks
            if not b._tasks:
                break
            await asyncio.sleep(0.01)
        assert len(b.worker.reads) == 1 and len(b.worker.reads[0][1]) == 9
        assert a.engine.kv.num_used_blocks == 0 and len(a.leases) == 0
        assert b.engine.kv.num_used_blocks == 0
        got = len(b.engine.kv.prefix_hit(PROMPT).block_ids)
        if outcome is TransferState.DONE:
            assert got == 9 and _hits() == hits + 1
        else:
            assert got == 0 and _failures("read_failed") == failed + 1
    finally:
        await b.session.close()
        await client.close()


async def test_reader_recomputes_when_the_lender_is_gone() -> None:
    import aiohttp
    b = _share("B")
    b.session = aiohttp.ClientSession()
    b._peers = lambda: [("A", "http://127.0.0.1:9", a_digest)]    # nothing listens there
    before = _failures("lease_unreachable")
    try:
        await b.prefetch("req-2", PROMPT)
    finally:
        await b.session.close()
    assert _failures("lease_unreachable") == before + 1
    assert b.worker.reads == [] and b.engine.kv.num_used_blocks == 0


async def test_a_timed_out_read_keeps_its_blocks_until_a_second_timeout(monkeypatch) -> None:
    """Aborted, a stalled peer's READ might still land: the blocks are not handed out again at
    once, but they do come back."""
    import aiohttp
    monkeypatch.setattr(kvshare, "READ_TIMEOUT_S", 0.1)
    a, b = _share("A"), _share("B", TransferState.ABORTED)
    a.engine.cache(PROMPT)
    client = await _lender(a)
    b.session = aiohttp.ClientSession()
    url = str(client.make_url("")).rstrip("/")
    b._peers = lambda: [("A", url, a_digest)]
    before = _failures("read_timeout")
    try:
        await b.prefetch("req-3", PROMPT)
        assert _failures("read_timeout") == before + 1
        assert b.engine.kv.num_used_blocks == 9          # quarantined
        for _ in range(50):
            if not b._tasks:
                break
            await asyncio.sleep(0.02)
        assert b.engine.kv.num_used_blocks == 0 and a.engine.kv.num_used_blocks == 0
        assert len(b.engine.kv.prefix_hit(PROMPT).block_ids) == 0
    finally:
        await b.session.close()
        await client.close()


async def test_on_a_prefill_node_the_prefill_components_worker_reads_and_its_jobs_ask(
        monkeypatch) -> None:
    """One transfer worker per process: the prefill component's; its jobs call our reader
    (PrefillComponent.reuse) until we stop, and stopping leaves its worker open."""
    async def no_second_worker(*a: Any) -> None:
        raise AssertionError("a second transfer worker was started")

    monkeypatch.setattr(kvshare, "start_worker", no_second_worker)
    engine = FakeEngine()
    layout = type("L", (), {"block_bytes": 16, "num_layers": 4})()
    engine.kv_region = lambda: type("R", (), {"layout": layout})()
    closed: list[bool] = []
    worker = FakeWorker(TransferState.DONE)
    worker.close = lambda: closed.append(True)        # type: ignore[attr-defined]
    from moed.roles.prefill import PrefillComponent

    prefill = PrefillComponent(_cfg(), "P2")    # found by its type
    prefill.worker, prefill.incarnation = worker, 42
    state = type("St", (), {"internal_auth": None, "model_id": "mod", "engine": engine})()
    app = type("App", (), {"components": [prefill], "state": state})()
    s = KVShareComponent(_cfg(), "P2")
    await s.start(app)
    try:
        assert s.worker is worker and s.incarnation == 42 and s.block_bytes == 64
        assert prefill.reuse is s
        await s.prefetch("pf-j", PROMPT)    # no membership: no peer, the job computes it all
        assert engine.kv.num_used_blocks == 0
    finally:
        await s.stop()
    assert prefill.reuse is None and not closed and s.session is None
    await s.prefetch("pf-late", PROMPT)     # a job still running after stop: no-op
