"""`moed plan`'s loop (moed/ops/planner.py) without a cluster: flags refused with a reason,
hook templates checked at start, one hook run per node to add or drain, with its values."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moed import cli
from moed.balance.scale import Decision
from moed.balance.scale_view import NodeLoad
from moed.ops import planner


def args(*extra: str):
    return cli.build_parser(["plan"]).parse_args(["plan", *extra])


def test_flags_become_a_plan_config() -> None:
    cfg = planner.plan_config(args("--ttft-ms", "500", "--itl-ms", "50", "--min", "decode=2",
                                   "--max", "prefill=9", "--cooldown-in", "0",
                                   "--drain-window", "5"))
    assert (cfg.ttft_target_s, cfg.itl_target_s, cfg.cooldown_in_s) == (0.5, 0.05, 0.0)
    assert cfg.drain_s == 5.0 and planner.plan_config(args()).drain_s == 30.0
    assert cfg.min_nodes["decode"] == 2 and cfg.max_nodes["prefill"] == 9
    assert cfg.min_nodes["prefill"] == 1 and cfg.max_nodes["decode"] == 64


@pytest.mark.parametrize("extra, says", [
    (("--min", "router=1"), "ROLE=N"), (("--max", "decode=x"), "ROLE=N"),
    (("--util-low", "0.9"), "util_low"), (("--interval", "0"), "--interval"),
    (("--drain", "--on-scale-in", "true"), "one scale-in action"),
    (("--min", "decode=5", "--max", "decode=2"), "min 5"),
    (("--drain-window", "-1"), "drain_s")])
def test_bad_flags_are_refused(extra, says) -> None:
    with pytest.raises(planner.PlanError, match=says):
        planner.plan_config(args(*extra))


def test_templates_checked_at_start() -> None:
    assert planner._template("systemctl start moed@{role}-{index}", "--on-scale-out",
                             planner.OUT_PLACEHOLDERS) == ["systemctl", "start",
                                                           "moed@{role}-{index}"]
    with pytest.raises(planner.PlanError, match=r"unknown placeholder \{node\}"):
        planner._template("stop {node}", "--on-scale-out", planner.OUT_PLACEHOLDERS)
    with pytest.raises(planner.PlanError, match="unknown placeholder"):
        planner._template("stop {nod}", "--on-scale-in", planner.PLACEHOLDERS)
    with pytest.raises(planner.PlanError, match="--on-scale-in"):
        planner._template("'unclosed", "--on-scale-in", planner.PLACEHOLDERS)


def test_hooks_run_once_per_node(tmp_path: Path) -> None:
    log = tmp_path / "log"
    script = f"import json,sys; open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')"
    words = [sys.executable, "-c", script, "{role}", "{index}", "{count}", "{node}", "{url}"]
    a = args("--hook-timeout", "20")
    out = Decision("decode", 2, 4, "out", "r")
    lines = planner.act(out, a, "tok", words, None)
    assert len(lines) == 2 and all(x.startswith("ran:") for x in lines)
    d1 = NodeLoad("D1", "decode", http="http://127.0.0.1:1")
    d2 = NodeLoad("D2", "decode", http="http://127.0.0.1:2")
    lines = planner.act(Decision("decode", 4, 2, "in", "r", drain=(d1, d2)), a, "tok", None, words)
    assert len(lines) == 2
    got = [json.loads(x) for x in log.read_text().splitlines()]
    assert got == [["decode", "3", "4", "", ""], ["decode", "4", "4", "", ""],
                   ["decode", "2", "2", "D1", "http://127.0.0.1:1"],
                   ["decode", "2", "2", "D2", "http://127.0.0.1:2"]]
    # a failing hook says so; --drain against a node that is not there too
    failing = planner.act(out, a, "tok", [sys.executable, "-c", "raise SystemExit(3)"], None)
    assert failing[0].startswith("FAILED") and "exit 3" in failing[0]
    lines = planner.act(Decision("decode", 2, 1, "in", "r", drain=(d1,)), args("--drain",
                        "--timeout", "2"), "tok", None, None)
    assert len(lines) == 1 and lines[0].startswith("FAILED")
    assert planner.act(Decision("decode", 2, 2, "hold", "r"), a, "tok", words, words) == []


def test_unreachable_node_is_an_error() -> None:
    with pytest.raises(planner.PlanError, match="127.0.0.1:1"):
        planner.run(args("--url", "http://127.0.0.1:1", "--timeout", "1"), "tok")
