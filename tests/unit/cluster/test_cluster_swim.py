"""The protocol core on the simulator (virtual clock, in-memory network, real wire codec):
join, failure detection, refutation, leave, metadata/load, restarts, partitions, bad input."""
from __future__ import annotations

import dataclasses

from structlog.testing import capture_logs

from moed.cluster import wire
from moed.cluster.members import SwimConfig
from moed.cluster.sim import Simulation
from moed.cluster.state import LoadVector, MemberState, NodeMeta
from moed.cluster.wire import Alive, Dead, Keyring, Suspect

A, S, D, L = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


def test_join_through_one_seed_and_seed_down_at_start() -> None:
    sim = Simulation(6, converged=False, seed=1)    # n0001.. know only n0000's address
    sim.run(10, until=sim.converged)
    assert sim.converged() and sim.sched.now() < 5
    # a node whose seed does not exist yet keeps knocking until it does
    late_seed = "10.9.9.9:7946"
    lone = sim.add("lone", seeds=(late_seed,), start=True)
    sim.run(5)
    assert [m.name for m in lone.view().alive()] == ["lone"]
    assert lone.stats["join_attempts"] >= 4
    sim.add("seed", seeds=(Simulation.addr_of(0),), addr=late_seed, start=True)
    sim.run(10, until=sim.converged)
    assert sim.converged() and len(lone.view().alive()) == 8


def test_crash_is_detected_by_everyone_and_nobody_else_dies() -> None:
    sim = Simulation(10, seed=2)
    sim.run(5)
    trial = sim.crash("n0003")
    sim.run(15, until=lambda: sim.everyone_sees("n0003", (D,)))
    assert sim.everyone_sees("n0003", (D,))
    assert not sim.false_deaths
    print(f"\n10 nodes: crash seen dead by all after {trial.time_to_all(9):.2f} simulated s")


def test_graceful_leave_is_seen_at_once_without_suspicion() -> None:
    sim = Simulation(10, seed=3)
    sim.run(3)
    t0 = sim.sched.now()
    sim.nodes["n0005"].leave()
    sim.run(1.0, until=lambda: sim.everyone_sees("n0005", (L,)))
    assert sim.everyone_sees("n0005", (L,)) and sim.sched.now() - t0 < 1.0
    sim.nodes["n0005"].stop()
    sim.run(10)
    assert sim.everyone_sees("n0005", (L,)) and not sim.false_deaths


def test_false_suspicion_is_refuted_with_a_higher_incarnation() -> None:
    sim = Simulation(8, seed=4)
    sim.run(2)
    victim = sim.nodes["n0002"]
    inc = victim.incarnation
    sim.nodes["n0006"]._on_suspect(Suspect("n0002", inc, "n0006"))    # as after a lost ack
    assert sim.nodes["n0006"].view().get("n0002").state is S
    sim.run(10)
    assert victim.incarnation > inc and victim.stats["refutes"] == 1
    assert sim.everyone_sees("n0002", (A,)) and not sim.false_deaths
    # a suspect/dead message about an older incarnation no longer matters
    sim.nodes["n0006"]._on_dead(Dead("n0002", inc, "n0006"))
    assert sim.nodes["n0006"].view().get("n0002").state is A


def test_metadata_and_load_propagate_without_restart() -> None:
    sim = Simulation(20, seed=5)
    sim.run(2)
    src = sim.nodes["n0007"]
    meta = NodeMeta("prefill", "http://10.0.0.7:8000", "qwen3-moe", "L1", "10.0.0.7:9100")
    src.set_meta(meta)
    src.set_load(LoadVector(3, 5, 1000, 4096))
    sees = lambda: all(m.view().get("n0007").meta == meta and          # noqa: E731
                       m.view().get("n0007").load.queued_prefill_tokens == 4096
                       for m in sim.live())
    sim.run(5, until=sees)
    assert sees()
    assert [m.name for m in sim.nodes["n0000"].view().alive("prefill")] == ["n0007"]


def test_restart_with_same_name_comes_back_with_higher_incarnation() -> None:
    sim = Simulation(6, seed=6)
    sim.run(2)
    old_inc = sim.nodes["n0004"].incarnation
    sim.crash("n0004")
    sim.run(15, until=lambda: sim.everyone_sees("n0004", (D,)))
    # new process, new address, and it starts from incarnation 1: it learns from its seed
    # that it was declared dead and refutes with a higher incarnation
    back = sim.add("n0004", seeds=(Simulation.addr_of(0),), start=True, incarnation=1)
    sim.run(10, until=lambda: sim.everyone_sees("n0004", (A,)))
    assert sim.everyone_sees("n0004", (A,)) and back.incarnation > old_inc
    assert sim.nodes["n0000"].view().get("n0004").addr == back.addr


def test_partition_marks_the_other_side_dead_then_heals() -> None:
    sim = Simulation(6, SwimConfig(push_pull_interval_s=5.0), seed=7)
    sim.run(2)
    names = list(sim.nodes)
    addrs = [sim.nodes[n].addr for n in names]
    sim.net.partition(addrs[:3], addrs[3:])
    sim.run(20)
    assert sim.nodes["n0000"].view().get("n0005").state is D
    sim.net.heal()
    sim.run(40, until=sim.converged)
    assert sim.converged()


def test_key_rotation_mixed_cluster_converges() -> None:
    """Rotation: every node first accepts the new key (secondary), then nodes switch their
    primary one by one; both kinds talk. A node with an unrelated key is shut out."""
    old, new = b"o" * 32, b"n" * 32
    sim = Simulation(2, converged=False, keyring=Keyring(old, (new,)), seed=8)
    sim.add("rot1", seeds=(Simulation.addr_of(0),), keyring=Keyring(new, (old,)), start=True)
    sim.add("rot2", seeds=(Simulation.addr_of(1),), keyring=Keyring(new, (old,)), start=True)
    stranger = sim.add("stranger", seeds=(Simulation.addr_of(0),),
                       keyring=Keyring(b"s" * 32), start=True)
    sim.run(10)
    assert {m.name for m in sim.nodes["n0001"].view().alive()} == {"n0000", "n0001", "rot1",
                                                                  "rot2"}
    assert [m.name for m in stranger.view().alive()] == ["stranger"]
    assert sim.nodes["n0000"].stats["dropped.auth"] > 0


def test_bad_packets_are_dropped_counted_and_harmless() -> None:
    sim = Simulation(5, seed=9)
    sim.run(2)
    target = sim.nodes["n0001"]
    victim = sim.nodes["n0002"]
    # a genuine alive of n0002, captured now; n0002 then changes its metadata (new incarnation)
    captured = sim.keyring, "n0002", Alive("n0002", victim.incarnation, victim.addr,
                                            NodeMeta(), 0, LoadVector())
    victim.set_meta(NodeMeta(role="decode"))
    sim.run(3)
    evil = sim.net.attach("6.6.6.6:666")
    good = wire.encode(sim.keyring, "n0000", sim.sched.wall_ms(),
                       [wire.fragment(wire.Ping(1, "n0001", "n0000", "6.6.6.6:666"))])
    bad = [
        bytes(range(256)) * 2,                                           # random junk
        good[:20],                                                       # truncated
        wire.encode(Keyring(b"w" * 32), "n0000", sim.sched.wall_ms(), []),  # wrong key
        good + b"\0" * 2000,                                             # huge
        wire.encode(sim.keyring, "n0000", sim.sched.wall_ms() - 3_600_000,  # an hour old
                    [wire.fragment(Dead("n0002", victim.incarnation, "n0000"))]),
        wire.encode(captured[0], captured[1], sim.sched.wall_ms(),       # replayed old inc
                    [wire.fragment(captured[2]),
                     wire.fragment(Dead("n0002", captured[2].incarnation, "n0000"))]),
    ]
    for data in bad * 50:
        evil.send_packet(target.addr, data)
    sim.run(5)
    st = target.stats
    assert st["dropped.malformed"] + st["dropped.truncated"] + st["dropped.version"] >= 50
    assert st["dropped.truncated"] >= 50 and st["dropped.auth"] >= 50
    assert st["dropped.oversized"] >= 50 and st["dropped.stale_time"] >= 50
    assert st["stale_updates"] >= 100                   # the replayed alive and dead
    info = target.view().get("n0002")
    assert info.state is A and info.meta.role == "decode"
    assert sim.converged() and not sim.false_deaths


def test_metadata_too_large_for_a_packet_is_refused() -> None:
    sim = Simulation(2, seed=10)
    node = sim.nodes["n0000"]
    try:
        node.set_meta(NodeMeta(role="x" * 250, http="y" * 250, model="z" * 250,
                               layout="w" * 250, transfer="v" * 250))
    except ValueError as e:
        assert "too large" in str(e)
    else:
        raise AssertionError("oversized metadata accepted")
    assert node.view().get("n0000").meta == NodeMeta()


def test_swim_config_maps_cluster_config() -> None:
    from moed.config import ClusterConfig
    cfg = SwimConfig.from_cluster(ClusterConfig(probe_interval_ms=700, gossip_nodes=5))
    assert cfg.probe_interval_s == 0.7 and cfg.gossip_nodes == 5
    assert dataclasses.replace(cfg, probe_timeout_s=0.1).probe_timeout_s == 0.1


def _views_of(sim: Simulation, name: str) -> dict[str, tuple]:
    """(state, addr, incarnation) of `name` in every other live node's view."""
    return {m.name: (lambda i: (i.state, i.addr, i.incarnation))(m.view().get(name))
            for m in sim.live() if m.name != name}


def _duplicate(sim: Simulation, name: str, addr: str, seed: str, incarnation: int):
    """A second process wrongly configured with `name` (the first still runs)."""
    from moed.cluster.swim import Membership
    dup = Membership(name, sim.net.attach(addr), sim.sched, sim.cfg, sim.codec,
                     seeds=(seed,), incarnation=incarnation)
    outcomes: list = []
    dup.on_join = outcomes.append
    dup.start()
    return dup, outcomes


def test_a_duplicate_name_is_refused_at_join_and_the_holder_keeps_its_entry() -> None:
    from moed.cluster.names import NameTaken
    sim = Simulation(5, seed=13)
    sim.run(2)
    holder = sim.nodes["n0002"]
    before = _views_of(sim, "n0002")
    # through the holder itself, then through another member: both refused, every time
    for i, seed in enumerate((holder.addr, Simulation.addr_of(0))):
        with capture_logs() as logs:
            dup, outcomes = _duplicate(sim, "n0002", f"10.8.8.{i}:7946", seed,
                                       incarnation=holder.incarnation + 1000)
            sim.run(10)
        assert len(outcomes) == 1 and isinstance(outcomes[0], NameTaken)
        assert outcomes[0].holder == holder.addr and "n0002" in str(outcomes[0])
        assert dup._stopped and dup.stats["name_taken"] == 1
        taken = [e for e in logs if e["event"] == "cluster_name_taken"]
        assert taken == [dict(taken[0], node="n0002", addr=dup.addr, holder=holder.addr)]
        seen_by = {e["node"] for e in logs if e["event"] == "cluster_name_conflict"
                   and e["intruder"] == dup.addr and e["addr"] == holder.addr}
        assert "n0002" in seen_by and (seed == holder.addr or "n0000" in seen_by)
        assert _views_of(sim, "n0002") == before      # nobody moved the entry, no refute
    assert holder.stats["refutes"] == 0 and sim.converged() and not sim.false_deaths


def test_a_duplicate_that_got_into_a_view_is_outranked_by_the_holder() -> None:
    """Had a duplicate's claim reached a member anyway (a seed that did not know the holder
    yet), the holder hears it through gossip and refutes: every view returns to it."""
    sim = Simulation(5, seed=14)
    sim.run(2)
    holder = sim.nodes["n0002"]
    with capture_logs() as logs:
        sim.nodes["n0000"]._on_alive(Alive("n0002", holder.incarnation + 5, "10.8.8.8:7946",
                                           NodeMeta(), 0, LoadVector()))
        sim.run(10, until=lambda: all(v[1] == holder.addr
                                      for v in _views_of(sim, "n0002").values()))
    assert all(v == (A, holder.addr, holder.incarnation)
               for v in _views_of(sim, "n0002").values())
    assert holder.stats["refutes"] == 1
    assert any(e["event"] == "cluster_name_conflict" and e["node"] == "n0002" and
               e["intruder"] == "10.8.8.8:7946" for e in logs)


def test_restarts_that_reuse_a_name_are_not_conflicts() -> None:
    sim = Simulation(5, seed=15)
    sim.run(2)
    # kill -9 and back on the same address at once (its old entry still alive)
    old = sim.nodes["n0003"]
    inc = old.incarnation
    sim.crash("n0003")
    back = sim.add("n0003", seeds=(Simulation.addr_of(0),), addr=old.addr, incarnation=inc + 1)
    outcomes: list = []
    back.on_join = outcomes.append
    back.start()
    sim.run(10, until=lambda: all(v == (A, old.addr, inc + 1)
                                  for v in _views_of(sim, "n0003").values()))
    assert outcomes == [None] and not back._stopped
    assert all(v == (A, old.addr, inc + 1) for v in _views_of(sim, "n0003").values())
    # left, then started elsewhere (from incarnation 1: it outranks its LEFT entry)
    gone = sim.nodes["n0001"]
    gone.leave()
    sim.run(2, until=lambda: sim.everyone_sees("n0001", (L,)))
    gone.stop()
    moved = sim.add("n0001", seeds=(Simulation.addr_of(0),), start=True, incarnation=1)
    sim.run(10, until=lambda: all(v[:2] == (A, moved.addr)
                                  for v in _views_of(sim, "n0001").values()))
    assert all(v[:2] == (A, moved.addr) for v in _views_of(sim, "n0001").values())
    assert sum(m.stats["name_conflicts"] for m in sim.live()) == 0


def test_a_restart_on_a_new_address_outranks_its_silent_previous_life() -> None:
    """kill -9 and back at once on another address (a new pod IP, a new port) while every
    view still holds the old entry alive: the holder does not answer the newcomer's ping, so
    it is a previous life, not a duplicate; the newcomer outranks it and every view moves."""
    sim = Simulation(5, seed=16)
    sim.run(2)
    old = sim.nodes["n0003"]
    inc = old.incarnation
    sim.crash("n0003")
    with capture_logs() as logs:
        back = sim.add("n0003", seeds=(Simulation.addr_of(0),), incarnation=1)
        outcomes: list = []
        back.on_join = outcomes.append
        back.start()
        sim.run(10, until=lambda: all(v[:2] == (A, back.addr)
                                      for v in _views_of(sim, "n0003").values()))
    assert back.addr != old.addr and outcomes == [None] and not back._stopped
    assert all(v[:2] == (A, back.addr) and v[2] > inc for v in _views_of(sim, "n0003").values())
    assert back.stats["past_lives_outranked"] == 1 and back.stats["name_taken"] == 0
    assert [e["previous"] for e in logs if e["event"] == "cluster_previous_life_outranked"] \
        == [old.addr]
    assert not any(e["event"] == "cluster_name_taken" for e in logs)
    sim.run(5)
    assert sim.converged() and not back._stopped
