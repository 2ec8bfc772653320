"""The daemon component: key loading rules, start/leave/stop on real UDP, GET /cluster's
JSON, live reload of timings and keys."""
from __future__ import annotations

import asyncio
import dataclasses
import os
from types import SimpleNamespace

import pytest

from moed.cluster.service import ClusterError, MembershipComponent, load_keyring, parse_key
from moed.config import ClusterConfig, Config, ConfigError, ServerConfig


def test_key_rules(tmp_path) -> None:
    hexkey = tmp_path / "k.hex"
    hexkey.write_text("00" * 16 + "ff" * 16 + "\n")
    raw = tmp_path / "k.raw"
    raw.write_bytes(b"a raw key that is long enough")
    short = tmp_path / "short"
    short.write_text("abcd")
    ring = load_keyring(ClusterConfig(key_file=str(hexkey), secondary_key_file=str(raw)))
    assert ring.primary == bytes(16) + b"\xff" * 16
    assert ring.secondary == (b"a raw key that is long enough",)
    assert load_keyring(ClusterConfig(key_env="K"), {"K": "ab" * 16}).primary == b"\xab" * 16
    with pytest.raises(ClusterError, match="no cluster key"):
        load_keyring(ClusterConfig())
    with pytest.raises(ClusterError, match="unset or empty"):
        load_keyring(ClusterConfig(key_env="K"), {})
    with pytest.raises(ClusterError, match="at least 16 bytes"):
        load_keyring(ClusterConfig(key_file=str(short)))
    with pytest.raises(ClusterError, match="cannot read"):
        load_keyring(ClusterConfig(key_file=str(tmp_path / "missing")))
    assert load_keyring(ClusterConfig(insecure=True)).primary == b""
    assert issubclass(ClusterError, ConfigError)      # the CLI prints it and exits 2
    assert parse_key(b"  " + b"0f" * 20 + b" ", "t") == b"\x0f" * 20


def _cfg(**cluster) -> Config:
    return Config(server=ServerConfig(role="router", node_name="svc"),
                  cluster=ClusterConfig(enabled=True, bind_port=0, **cluster))


async def test_component_start_view_reload_leave_stop() -> None:
    cfg = _cfg(key_env="K")
    comp = MembershipComponent(cfg, environ={"K": "11" * 32})
    tasks: list[asyncio.Task] = []

    def spawn(coro, name: str) -> asyncio.Task:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]
    app = SimpleNamespace(port=8123, node="svc", state=SimpleNamespace(engine=None), spawn=spawn)
    await comp.start(app)
    try:
        view = comp.view()
        me = view.get("svc")
        assert me.state.value == "alive" and me.meta.role == "router"
        assert me.meta.http == "http://127.0.0.1:8123"
        doc = view.to_json()
        assert doc["self"] == "svc" and doc["counts"]["alive"] == 1
        comp.update_meta(transfer="127.0.0.1:9100")
        assert comp.view().get("svc").meta.transfer == "127.0.0.1:9100"
        assert comp.view().get("svc").incarnation == me.incarnation + 1

        # live reload: new timings and a new key, no restart
        new = dataclasses.replace(cfg, cluster=dataclasses.replace(
            cfg.cluster, probe_interval_ms=700, secondary_key_file=""))
        os.environ["K"] = "22" * 32
        try:
            commit = comp.prepare_reload(cfg, new)
        finally:
            del os.environ["K"]
        assert commit is not None
        commit()
        assert comp.core.cfg.probe_interval_s == 0.7
        assert comp.core.codec.keyring.primary == b"\x22" * 32
        assert comp.transport.keyring is comp.core.codec.keyring   # stream headers too
        bad = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, key_env="NOPE"))
        with pytest.raises(ClusterError):
            comp.prepare_reload(cfg, bad)
        assert comp.prepare_reload(cfg, cfg) is None

        await comp.leave(timeout=0.1)
        assert comp.view().get("svc").state.value == "left"
    finally:
        await comp.stop()
        for t in tasks:
            t.cancel()


async def test_wildcard_bind_needs_an_advertised_address() -> None:
    comp = MembershipComponent(Config(server=ServerConfig(role="router"), cluster=ClusterConfig(
        enabled=True, bind_host="0.0.0.0", bind_port=0, insecure=True)))
    app = SimpleNamespace(port=1, node="w", state=SimpleNamespace(engine=None),
                          spawn=lambda coro, name: None)
    with pytest.raises(ClusterError, match="advertise_host"):
        await comp.start(app)


async def test_engine_load_is_published_in_the_view() -> None:
    from moed.types import EngineStats
    comp = MembershipComponent(_cfg(insecure=True, load_update_interval_ms=20))
    stats = EngineStats(running=3, waiting=2, waiting_remote_kv=1, queued_prompt_tokens=500,
                        kv_blocks_free=77)
    tasks: list[asyncio.Task] = []

    def spawn(coro, name: str) -> asyncio.Task:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]
    app = SimpleNamespace(port=1, node="svc", spawn=spawn,
                          state=SimpleNamespace(engine=SimpleNamespace(
                              stats=lambda: stats, kv=None, advertised=lambda: None,
                              kv_layout_id="")))
    await comp.start(app)
    try:
        for _ in range(100):
            load = comp.view().get("svc").load
            if load.running == 3:
                break
            await asyncio.sleep(0.02)
        assert (load.waiting, load.running, load.free_kv_blocks,
                load.queued_prefill_tokens) == (3, 3, 77, 500)
    finally:
        await comp.stop()
        for t in tasks:
            t.cancel()


async def test_start_fails_when_a_live_member_holds_our_name() -> None:
    """The seed's answer shows "svc" alive elsewhere: start raises (the app exits 1), the
    holder keeps its entry."""
    from moed.cluster.clock import AsyncioScheduler
    from moed.cluster.members import SwimConfig
    from moed.cluster.swim import Membership
    from moed.cluster.udp import UdpTransport
    from moed.cluster.wire import Keyring, WireCodec
    ring = Keyring(b"\x11" * 32)
    t = UdpTransport("127.0.0.1", 0, keyring=ring)
    await t.start()
    holder = Membership("svc", t, AsyncioScheduler(), SwimConfig(), WireCodec(ring))
    holder.start()
    comp = MembershipComponent(_cfg(key_env="K", seeds=(holder.addr,)),
                               environ={"K": "11" * 32})
    app = SimpleNamespace(port=1, node="svc", state=SimpleNamespace(engine=None),
                          spawn=lambda coro, name: pytest.fail("spawned after a refusal"))
    try:
        with pytest.raises(ClusterError, match=f"'svc' is taken by a live member at {holder.addr}"):
            await asyncio.wait_for(comp.start(app), 5.0)
        assert comp.core._stopped
        assert [(m.name, m.addr) for m in holder.view().members] == [("svc", holder.addr)]
        # it saw the intruder (its join, and the ping that asked whether the holder lives)
        assert holder.stats["name_conflicts"] >= 1
    finally:
        holder.stop()


async def test_a_name_refused_after_start_fails_the_app() -> None:
    """The seed came up only after our start stopped waiting for it: the refusal arrives later
    and must still stop the node with a failure (app.fail → exit 1), not a clean stop."""
    from moed.cluster.clock import AsyncioScheduler
    from moed.cluster.members import SwimConfig
    from moed.cluster.swim import Membership
    from moed.cluster.udp import UdpTransport
    from moed.cluster.wire import Keyring, WireCodec
    ring = Keyring(b"\x11" * 32)
    t = UdpTransport("127.0.0.1", 0, keyring=ring)
    await t.start()
    seed = t.local_address()
    t.shutdown()                       # nothing listens there yet
    await asyncio.sleep(0.05)
    comp = MembershipComponent(_cfg(key_env="K", seeds=(seed,), join_retry_ms=200),
                               environ={"K": "11" * 32})
    failed: list[str] = []
    tasks: list[asyncio.Task] = []

    def spawn(coro, name: str) -> asyncio.Task:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]
    app = SimpleNamespace(port=1, node="svc", state=SimpleNamespace(engine=None), spawn=spawn,
                          fail=failed.append)
    holder = None
    try:
        await asyncio.wait_for(comp.start(app), 5.0)        # no seed answered: it started
        host, port = seed.rsplit(":", 1)
        t2 = UdpTransport(host, int(port), keyring=ring)
        await t2.start()
        holder = Membership("svc", t2, AsyncioScheduler(), SwimConfig(), WireCodec(ring))
        holder.start()
        end = asyncio.get_running_loop().time() + 5
        while not failed:
            assert asyncio.get_running_loop().time() < end, "the late refusal never came"
            await asyncio.sleep(0.02)
        assert "taken" in failed[0]
    finally:
        if holder is not None:
            holder.stop()
        await comp.stop()
        for task in tasks:
            task.cancel()
