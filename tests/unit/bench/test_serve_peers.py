"""bench/serve_peers.py's two orders with stand-in servers and a stand-in load driver: which
server gets which load when, and how the rounds become one row and one ratio."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import serve_peers
finally:
    sys.path.remove(str(ROOT / "bench"))


class _Proc:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def send_signal(self, sig: int) -> None:
        self.log.append(("stop", self.name))

    def wait(self, timeout: float) -> int:
        return 0


@pytest.fixture
def fake(monkeypatch):
    """Servers that only log; drive() answers from a per-side script of tok/s values."""
    log: list = []
    rates = {"http://moed": iter([100.0, 300.0, 120.0, 90.0]),
             "http://vllm": iter([50.0, 100.0, 40.0, 60.0])}

    def start_server(model_dir, env, log_path):
        log.append(("up", "moed"))
        return _Proc(log, "moed"), "http://moed"

    def start_vllm(python, model_dir, threads, log_path, timeout_s):
        log.append(("up", "vllm"))
        return _Proc(log, "vllm"), "http://vllm"

    async def drive(url, model, prompts, max_tokens, concurrency, api_key, timeout_s):
        if max_tokens == 4:          # the warm-up
            return {}
        side = url.removeprefix("http://")
        log.append(("load", side, concurrency))
        tok_s = next(rates[url])
        return {"requests": len(prompts), "ok": len(prompts) - (side == "moed" and tok_s == 90.0),
                "output_tok_s": tok_s, "ttft_ms": {"p50": 1000.0 / tok_s, "p99": 2000.0 / tok_s}}

    monkeypatch.setattr(serve_peers, "start_server", start_server)
    monkeypatch.setattr(serve_peers, "start_vllm", start_vllm)
    monkeypatch.setattr(serve_peers, "drive", drive)
    monkeypatch.setattr(serve_peers, "load_average", lambda: (1.0, 1.0, 1.0))
    return log


def test_one_round_runs_one_server_at_a_time(fake, tmp_path):
    res = serve_peers.compare(tmp_path, "py", [1, 8], 4, 16, 2)
    assert res["order"] == "sequential"
    assert fake == [("up", "moed"), ("load", "moed", 1), ("load", "moed", 8), ("stop", "moed"),
                    ("up", "vllm"), ("load", "vllm", 1), ("load", "vllm", 8), ("stop", "vllm")]
    assert res["ratio"][1]["output_tok_s"] == 2.0 and res["ratio"][8]["output_tok_s"] == 3.0


def test_rounds_interleave_both_servers_with_alternating_order_and_take_medians(fake, tmp_path):
    res = serve_peers.compare(tmp_path, "py", [1], 4, 16, 2, rounds=4)
    assert res["order"] == "interleaved, 4 rounds"
    # both up before any load, vLLM (the slow start) first; the order flips every round
    assert fake[:2] == [("up", "vllm"), ("up", "moed")]
    loads = [e[1] for e in fake if e[0] == "load"]
    assert loads == ["moed", "vllm", "vllm", "moed", "moed", "vllm", "vllm", "moed"]
    assert {e for e in fake if e[0] == "stop"} == {("stop", "moed"), ("stop", "vllm")}
    # per-round ratios 2, 3, 3, 1.5: their median, not the ratio of the medians (110 / 55 = 2)
    assert res["ratio"][1]["output_tok_s"] == 2.5
    assert res["moed"][1]["output_tok_s"] == 110.0 and res["vllm"][1]["output_tok_s"] == 55.0
    assert res["ratio"][1]["moed_failed"] == 1 and res["moed"][1]["ok"] == res["moed"][1]["requests"] - 1
