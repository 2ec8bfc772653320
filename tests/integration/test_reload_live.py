"""SIGHUP reload on a real `moed serve` process, driven with the openai client.

One node serves the whole module; every test starts by reloading the baseline file.
- a live change (admission limit) takes effect while streams are in flight, none is dropped;
- an invalid file or an unreadable key file changes nothing and says why in one log line;
- a restart-only change is reported and left as it was;
- engine limits (max_num_seqs, max_num_batched_tokens) reach the running engine's scheduler;
- API keys rotate live (the key file is re-read on every reload), their priority classes too
  (a class the config does not define: the reload is invalid);
- a burst of SIGHUPs under streaming load: no failed request, no crash, no fd/thread growth.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest
from moed_server import serve_process

pytestmark = pytest.mark.timeout(180)

BASE = """
[model]
served_name = "tiny"
[server]
api_keys_file = "{keys}"
admin_token_file = "{admin}"
[engine]
kv_cache_memory_mb = 16
[admission]
max_waiting_requests = {waiting}
"""


class Node:
    def __init__(self, srv, conf: Path, keys: Path, admin: Path) -> None:
        self.srv, self.conf, self.keys, self.admin = srv, conf, keys, admin

    def write(self, waiting: int = 8, extra: str = "") -> None:
        self.conf.write_text(BASE.format(keys=self.keys, admin=self.admin, waiting=waiting) + extra)

    def reloads(self) -> dict[str, float]:
        return {k.split('"')[1]: v for k, v in self.srv.metrics().items()
                if k.startswith("moed_config_reloads_total{")}

    def admin_config(self) -> dict:
        status, body = self.srv.get("/admin/config", headers={"Authorization": "Bearer adm"})
        assert status == 200, body
        return json.loads(body)

    def reload(self, expect: str) -> dict:
        """SIGHUP and wait until one more reload with result `expect` is counted."""
        before = self.reloads().get(expect, 0)
        self.srv.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while self.reloads().get(expect, 0) <= before:
            assert time.monotonic() < deadline, f"no {expect} reload; log:\n{self.srv.tail()}"
            time.sleep(0.05)
        return self.admin_config()

    def events(self, name: str) -> list[dict]:
        return [r for r in self.srv.log_records() if r.get("event") == name]

    def client(self, key: str = "k1") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.srv.url + "/v1", api_key=key, max_retries=0,
                                  timeout=60)


@pytest.fixture(scope="module")
def node(tiny_qwen3, tmp_path_factory):
    d = tmp_path_factory.mktemp("reload")
    keys, admin, conf = d / "keys", d / "admin", d / "node.toml"
    keys.write_text("k1\n")
    admin.write_text("adm\n")
    n = Node(None, conf, keys, admin)
    n.write()
    with serve_process(model=tiny_qwen3, config=conf, log_dir=d) as srv:
        n.srv = srv
        yield n
        assert srv.stop(signal.SIGTERM) == 0


@pytest.fixture
def baseline(node):
    node.keys.write_text("k1\n")
    node.write()
    node.reload("applied") if node.admin_config()["config"]["admission"][
        "max_waiting_requests"] != 8 else node.reload("unchanged")
    return node


async def _stream(client: openai.AsyncOpenAI, tokens: int, started: asyncio.Event | None = None
                  ) -> tuple[int, str | None]:
    n, finish = 0, None
    stream = await client.completions.create(model="tiny", prompt="reload me", max_tokens=tokens,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        for c in chunk.choices:
            n += 1 if c.text is not None else 0
            finish = c.finish_reason or finish
        if started is not None:
            started.set()
    return n, finish


async def test_live_admission_change_keeps_inflight_streams(baseline) -> None:
    node = baseline
    model = "tiny"
    ok = await node.client().completions.create(model=model, prompt="a", max_tokens=2, n=2)
    assert len(ok.choices) == 2                                    # 2 waiting ≤ 8: admitted

    started = [asyncio.Event() for _ in range(3)]
    streams = [asyncio.create_task(_stream(node.client(), 200, s)) for s in started]
    all_started = asyncio.ensure_future(asyncio.gather(*(s.wait() for s in started)))
    await asyncio.wait([all_started, *streams], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    assert all_started.done(), [t.exception() for t in streams if t.done()]
    node.write(waiting=1)
    cfg = await asyncio.to_thread(node.reload, "applied")
    assert cfg["config"]["admission"]["max_waiting_requests"] == 1 and cfg["version"] >= 2
    assert cfg["last_reload"]["applied"] == [{"key": "admission.max_waiting_requests",
                                              "old": 8, "new": 1}]
    with pytest.raises(openai.APIStatusError) as refused:         # 2 waiting > 1: refused now
        await node.client().completions.create(model=model, prompt="a", max_tokens=2, n=2)
    assert refused.value.status_code in (400, 429)   # over the queue, or more than it can ever hold
    results = await asyncio.gather(*streams)
    assert all(r == (200, "length") for r in results), results    # none dropped or cut
    log = node.events("config_reloaded")[-1]
    assert log["applied"] == [{"key": "admission.max_waiting_requests", "old": 8, "new": 1}]


@pytest.mark.parametrize("text,reason", [
    ("[admission\n", "not valid TOML"),
    (None, "admission.max_waiting_requests"),
    ("UNREADABLE", "cannot read"),
])
def test_invalid_reload_changes_nothing(baseline, text, reason) -> None:
    node = baseline
    before = node.admin_config()
    if text is None:
        node.write(waiting=-1)
    elif text == "UNREADABLE":
        node.conf.write_text(node.conf.read_text().replace(str(node.keys), "/nonexistent/keys"))
    else:
        node.conf.write_text(text)
    after = node.reload("invalid")
    assert (after["version"], after["hash"], after["config"]) == (
        before["version"], before["hash"], before["config"])
    assert after["last_reload"]["result"] == "invalid" and reason in after["last_reload"]["error"]
    rec = node.events("config_reload_rejected")[-1]
    assert reason in rec["error"] and rec["level"] == "error"
    assert "the running config is unchanged" in rec["detail"]
    assert node.srv.get("/ready")[0] == 200


def _effective(node: Node, want: dict) -> dict:
    """/admin/config's engine_effective once it equals `want` (the engine adopts a reload at
    its next step boundary), else whatever it last was."""
    deadline = time.monotonic() + 5
    while True:
        got = node.admin_config()["engine_effective"]
        if got == want or time.monotonic() > deadline:
            return got


async def test_engine_limits_apply_live(baseline) -> None:
    node = baseline
    default = {"max_num_seqs": 64, "max_num_batched_tokens": 512}
    assert _effective(node, default) == default
    node.conf.write_text(node.conf.read_text().replace(
        "kv_cache_memory_mb = 16",
        "kv_cache_memory_mb = 16\nmax_num_seqs = 1\nmax_num_batched_tokens = 48"))
    cfg = await asyncio.to_thread(node.reload, "applied")
    assert {c["key"] for c in cfg["last_reload"]["applied"]} == {
        "engine.max_num_seqs", "engine.max_num_batched_tokens"}
    limited = {"max_num_seqs": 1, "max_num_batched_tokens": 48}
    assert _effective(node, limited) == limited
    # the engine runs one request at a time now: the others queue behind it
    streams = [asyncio.create_task(_stream(node.client(), 40)) for _ in range(3)]
    seen: set[tuple[int, int]] = set()
    while not all(t.done() for t in streams):
        ready = json.loads((await asyncio.to_thread(node.srv.get, "/ready"))[1])
        seen.add((ready["running"], ready["waiting"]))
        await asyncio.sleep(0.01)
    assert [await t for t in streams] == [(40, "length")] * 3
    assert max(r for r, _ in seen) == 1 and max(w for _, w in seen) >= 1, seen
    node.write()                                  # back to the baseline for the next tests
    await asyncio.to_thread(node.reload, "applied")
    assert _effective(node, default) == default


def test_restart_only_change_is_reported_and_left(baseline) -> None:
    node = baseline
    before = node.admin_config()
    node.conf.write_text(node.conf.read_text().replace("kv_cache_memory_mb = 16",
                                                       "kv_cache_memory_mb = 16\nblock_size = 32"))
    after = node.reload("restart_required")
    assert after["config"]["engine"]["block_size"] == 16 and after["hash"] == before["hash"]
    assert after["last_reload"]["needs_restart"] == [{"key": "engine.block_size",
                                                     "old": 16, "new": 32}]
    rec = node.events("config_reload_needs_restart")[-1]
    assert rec["level"] == "warning" and rec["needs_restart"][0]["key"] == "engine.block_size"


async def test_api_keys_rotate_live(baseline) -> None:
    node = baseline
    await node.client("k1").models.list()
    node.keys.write_text("k2\n")
    await asyncio.to_thread(node.reload, "unchanged")              # same config, new file content
    with pytest.raises(openai.AuthenticationError):                # an unknown key: 401
        await node.client("k1").models.list()
    await node.client("k2").models.list()
    secrets = [json.dumps(r) for r in node.events("config_reloaded")]
    assert not any(str(node.keys) in s for s in secrets)          # key paths are redacted


async def test_key_classes_reload_live(baseline) -> None:
    """A key's priority class (docs/priority.md) is read on reload like the key; a class the
    config does not define makes the reload invalid, and the keys in use stay."""
    node = baseline
    node.keys.write_text("k1\nk3 bulk\n")
    after = await asyncio.to_thread(node.reload, "invalid")     # the file is read, then refused
    assert "names priority class 'bulk'" in after["last_reload"]["error"]
    rec = node.events("config_reload_rejected")[-1]
    assert "names priority class 'bulk'" in rec["error"] and "k3" not in rec["error"]
    with pytest.raises(openai.AuthenticationError):
        await node.client("k3").models.list()                       # not adopted
    node.write(extra='[priority]\nclasses = ["interactive=0", "bulk=20"]\n')
    await asyncio.to_thread(node.reload, "applied")
    with pytest.raises(openai.BadRequestError) as e:                # capped at its class
        await node.client("k3").completions.create(model="tiny", prompt="x", max_tokens=1,
                                                   extra_body={"priority": 0})
    assert "priority" in str(e.value)
    out = await node.client("k3").completions.create(model="tiny", prompt="x", max_tokens=1,
                                                     extra_body={"priority": 25})
    assert out.choices[0].finish_reason == "length"
    node.keys.write_text("k1\n")                                   # back to the baseline
    node.write()
    await asyncio.to_thread(node.reload, "applied")


def _fds_threads(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = int(next(line.split()[1] for line in open(f"/proc/{pid}/status")
                       if line.startswith("Threads:")))
    return fds, threads


async def test_sighup_burst_under_load(baseline) -> None:
    node = baseline
    pid = node.srv.proc.pid
    await _stream(node.client(), 5)                                # warm: lazily created things
    fds0, threads0 = _fds_threads(pid)
    before = sum(node.reloads().values())
    stop = asyncio.Event()
    done: list[tuple[int, str | None]] = []

    async def worker() -> None:
        client = node.client()
        while not stop.is_set():
            done.append(await _stream(client, 20))
        await client.close()

    workers = [asyncio.create_task(worker()) for _ in range(3)]
    for i in range(40):
        node.write(waiting=8 if i % 2 else 16)
        node.srv.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.03)
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*workers), 60)
    assert node.srv.alive and node.srv.get("/ready")[0] == 200
    assert done and all(r == (20, "length") for r in done), done[:5]
    count = sum(node.reloads().values()) - before
    assert 1 <= count <= 40                                        # bursts coalesce
    assert not node.events("config_reload_crashed")
    deadline = time.monotonic() + 10          # closed client connections take a moment to go
    while True:
        fds1, threads1 = _fds_threads(pid)
        if (fds1 <= fds0 + 4 and threads1 <= threads0 + 2) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert fds1 <= fds0 + 4 and threads1 <= threads0 + 2, (fds0, fds1, threads0, threads1)
