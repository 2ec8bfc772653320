"""vLLM's KV-events stream from a real `moed serve` (tiny Qwen3-MoE, fp32, an L1 of 16 blocks of
4 tokens, an L3 disk tier): a real ZMQ SUB socket (plus the replay socket for what it missed)
decodes every batch with vLLM's struct definitions (tests/vllm_kv_events.py); the per-node
index the events build matches what the node says it holds (moed_kv_blocks_cached, the disk
tier's block count) and moed's own chained hashes, through stores, L1 evictions to disk and a
restart (sequence from 0, AllBlocksCleared first, the disk blocks found again). Then an
llm-d-style scorer fed by two nodes' streams sends a repeated prefix to the node holding it,
where it is a prefix-cache hit. A PUB endpoint already taken stops the start, saying so."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from moed.kvcache.events import wire_hash  # noqa: E402
from moed.kvcache.pool import hash_block  # noqa: E402
from moed_server import ServerProcess, free_port  # noqa: E402
from vllm_kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                            KVEventBatch, PrefixIndex, Subscriber)

pytestmark = pytest.mark.timeout(300)

BS = 4
PROMPTS = [f"Session {i}: the quick brown fox jumps over the lazy dog while the cat {i} sat "
           f"on the mat and watched the rain" for i in range(5)]


def _post(srv: ServerProcess, path: str, body: dict) -> dict:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def complete(srv: ServerProcess, prompt: str) -> str:
    out = _post(srv, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                         "temperature": 0})
    return out["choices"][0]["text"]


def tokens(srv: ServerProcess, prompt: str) -> list[int]:
    return _post(srv, "/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]


def chain(toks: list[int]) -> list[int]:
    """moed's chained hashes of the full blocks of `toks`, as the events carry them."""
    out, parent = [], None
    for i in range(len(toks) // BS):
        parent = hash_block(parent, toks[i * BS:(i + 1) * BS])
        out.append(wire_hash(parent))
    return out


class Follower:
    """One node's stream as a consumer follows it: live from the SUB socket, a gap (or the
    batches sent before the subscription took) filled from the replay socket."""

    def __init__(self, node: str, port: int, rport: int, idx: PrefixIndex) -> None:
        self.node, self.idx = node, idx
        self.sub = Subscriber(f"tcp://127.0.0.1:{port}", f"kv@{node}",
                              f"tcp://127.0.0.1:{rport}")
        self.last = -1
        self.batches: list[tuple[int, KVEventBatch]] = []

    def _take(self, seq: int, batch: KVEventBatch) -> None:
        if seq <= self.last:
            return          # seen already (live and replayed)
        if seq > self.last + 1:
            for _, s, b in self.sub.replay(self.last + 1):
                if self.last < s < seq:
                    self._apply(s, b)
        assert seq == self.last + 1, f"{self.node}: batch {seq} after {self.last}"
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.idx.apply(self.node, batch)
        self.last = seq
        self.batches.append((seq, batch))

    def sync(self, quiet: float = 1.0, deadline: float = 30.0) -> None:
        """Everything the node has sent so far (replay from the next one, then live until
        `quiet` seconds pass without a batch)."""
        for topic, s, b in self.sub.replay(self.last + 1):
            assert topic == f"kv@{self.node}".encode()
            self._take(s, b)
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            got = self.sub.recv(timeout=quiet)
            if got is None:
                return
            assert got[0] == f"kv@{self.node}".encode()
            self._take(got[1], got[2])
        raise AssertionError("the stream never went quiet")

    def restarted(self) -> None:
        """A new process on the same endpoints: its sequence starts again at 0."""
        self.last = -1

    def events(self, since: int = 0) -> list:
        return [e for seq, b in self.batches[since:] for e in b.events]


def _env(port: int, rport: int, node: str, **extra: str) -> dict[str, str]:
    return {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": str(BS),
            "MOED_ENGINE_NUM_KV_BLOCKS": "16", "MOED_MODEL_MAX_MODEL_LEN": "60",
            "MOED_MODEL_SERVED_NAME": "tiny", **extra}


def _args(port: int, rport: int, node: str) -> list[str]:
    return ["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{rport}", "topic": f"kv@{node}"})]


def _held(idx: PrefixIndex, node: str, medium: str) -> set[int]:
    return idx.blocks.get(node, {}).get(medium, set())


def test_events_match_the_blocks_through_evictions_and_a_restart(moed_server, tiny_qwen3,
                                                                  tmp_path: Path) -> None:
    port, rport = free_port(), free_port()
    env = _env(port, rport, "a", MOED_TIERS_DISK_BYTES=str(1 << 24),
               MOED_TIERS_DISK_DIR=str(tmp_path / "l3"))
    srv = moed_server(model=tiny_qwen3, env=env, args=_args(port, rport, "a"))
    idx = PrefixIndex()
    f = Follower("a", port, rport, idx)
    try:
        f.sync()
        first = f.batches[0][1].events
        assert f.batches[0][0] == 0 and isinstance(first[0], AllBlocksCleared)
        toks = [tokens(srv, p) for p in PROMPTS]
        for p in PROMPTS:
            complete(srv, p)
            f.sync()
        m = srv.metrics()
        gpu, disk = _held(idx, "a", "GPU"), _held(idx, "a", "STORAGE")
        assert len(gpu) == m["moed_kv_blocks_cached"] > 0
        assert len(disk) == m['moed_kv_tier_blocks{tier="disk"}'] > 0
        evs = f.events()
        assert any(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in evs)  # evictions
        stored = [e for e in evs if isinstance(e, BlockStored)]
        assert all(e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
                   for e in stored)     # every block this process cached: with its tokens
        # the last prompt's blocks are in L1 under moed's hashes, and its tokens find them
        assert set(chain(toks[-1])) <= gpu
        assert idx.score("a", toks[-1], BS) == len(toks[-1]) // BS
        # the first prompt's went down to disk when L1 reused their blocks
        assert not set(chain(toks[0])) & gpu and set(chain(toks[0])) <= disk
        assert srv.stop() == 0

        again = moed_server(model=tiny_qwen3, env=env, args=_args(port, rport, "a"))
        f.restarted()
        mark = len(f.batches)
        f.sync()
        seq0, batch0 = f.batches[mark]
        assert seq0 == 0 and isinstance(batch0.events[0], AllBlocksCleared)
        m = again.metrics()
        # L1 holds what the start's cost-model calibration cached (random prompts), no more
        assert len(_held(idx, "a", "GPU")) == m["moed_kv_blocks_cached"]
        assert not set(chain(toks[-1])) & _held(idx, "a", "GPU")
        # the disk tier found every block it held, and said so first (without tokens)
        assert disk <= _held(idx, "a", "STORAGE")
        assert len(_held(idx, "a", "STORAGE")) == m['moed_kv_tier_blocks{tier="disk"}']
        restored = [e for e in batch0.events[1:] if isinstance(e, BlockStored)
                    and e.medium == "STORAGE"]
        assert {h for e in restored for h in e.block_hashes} >= disk
        assert all(e.token_ids == [] for e in restored)
        complete(again, PROMPTS[0])     # its blocks come back to L1 (loaded or recomputed)
        f.sync()
        assert set(chain(toks[0])) <= _held(idx, "a", "GPU")
        assert idx.score("a", toks[0], BS) == len(toks[0]) // BS
        assert len(_held(idx, "a", "GPU")) == again.metrics()["moed_kv_blocks_cached"]
    finally:
        f.sub.close()


def test_a_scorer_fed_by_the_events_routes_a_prefix_to_its_node(moed_server,
                                                                 tiny_qwen3) -> None:
    idx = PrefixIndex()
    nodes, follow = {}, {}
    for name in ("a", "b"):
        port, rport = free_port(), free_port()
        nodes[name] = moed_server(model=tiny_qwen3, env=_env(port, rport, name),
                                  args=_args(port, rport, name))
        follow[name] = Follower(name, port, rport, idx)
    try:
        system = {"a": "Alpha team rules: you are a terse assistant; answer in one line.",
                  "b": "Beta team rules: you are a verbose assistant; answer at length."}
        for name, srv in nodes.items():
            complete(srv, system[name] + " Question one?")
            follow[name].sync()
        for name in nodes:
            other = "b" if name == "a" else "a"
            prompt = system[name] + " Question two?"
            toks = tokens(nodes[name], prompt)
            assert idx.score(name, toks, BS) >= 4 and idx.score(other, toks, BS) == 0
            picked = idx.pick(["a", "b"], toks, BS)
            assert picked == name
            before = nodes[picked].metrics()["moed_prefix_cache_hit_tokens_total"]
            complete(nodes[picked], prompt)
            hit = nodes[picked].metrics()["moed_prefix_cache_hit_tokens_total"] - before
            assert hit >= BS * idx.score(name, toks, BS) - BS   # the held prefix was reused
    finally:
        for fl in follow.values():
            fl.sub.close()


def test_a_taken_endpoint_stops_the_start_saying_why(tiny_qwen3, tmp_path: Path) -> None:
    import socket

    from moed_server import start_server

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = start_server(model=tiny_qwen3, env={"MOED_BALANCE_CALIBRATION_STEPS": "0"},
                           args=["--kv-events-config", json.dumps(
                               {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})],
                           wait=None, log_dir=tmp_path)
        try:
            assert srv.proc.wait(timeout=120) != 0
        finally:
            srv.stop(timeout=5.0)
    failed = [r for r in srv.log_records() if r.get("event") == "start_failed"]
    assert failed and f"cannot open tcp://*:{port}" in failed[0]["error"]
