"""server.vllm_metrics_path on a real `moed serve`: the vLLM-named gauges the Inference
Extension's endpoint picker scrapes equal moed's own, in the same scrape (path /metrics, read
while a request runs) and at their own path, where moed's /metrics still passes
`promtool check metrics` untouched. Appended to /metrics, promtool's only complaint is the
colon in vLLM's names. promtool: as tests/integration/test_metrics_promtool.py (skipped when it
is not on PATH; CI installs it, .ci/run)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest

from moed_server import ServerProcess, parse_metrics

PROMTOOL = shutil.which("promtool")
pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (CI installs it: .ci/run)")]

ENV = {"MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "256",
       "MOED_MODEL_SERVED_NAME": "tiny", "MOED_ENGINE_BLOCK_SIZE": "16"}
VLLM = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
OWN = ("moed_requests_waiting", "moed_requests_running", "moed_kv_cache_usage_ratio")


def promtool(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, text=True,
                          capture_output=True, timeout=60)


def lint(text: str) -> list[str]:
    """promtool's complaints about a scrape (it prints them on stderr, exit code 3)."""
    r = promtool(text)
    return (r.stdout + r.stderr).strip().splitlines()


def _vllm(m: dict[str, float], name: str) -> float:
    return m[f'{name}{{engine="0",model_name="tiny"}}']


def _cache_info(text: str) -> dict[str, str]:
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert line.endswith(" 1.0")
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_own_path_leaves_metrics_clean_and_values_equal(moed_server, tiny_qwen3) -> None:
    srv = moed_server(model=tiny_qwen3, env=ENV, args=["--vllm-metrics-path", "/metrics/vllm"])
    body = json.dumps({"model": "tiny", "prompt": "def main():", "max_tokens": 4}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    own_text = srv.get("/metrics")[1]
    r = promtool(own_text)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    assert "vllm:" not in own_text
    status, vtext = srv.get("/metrics/vllm")[:2]
    assert status == 200
    own, v = parse_metrics(own_text), parse_metrics(vtext)
    for vname, oname in zip(VLLM, OWN):       # an idle node: the same values, scraped twice
        assert _vllm(v, vname) == own[oname], vname
    info = _cache_info(vtext)
    assert info == {"model_name": "tiny", "engine": "0", "block_size": "16",
                    "num_gpu_blocks": str(int(own["moed_kv_blocks_capacity"]))}
    # scraped often by a router: quiet, as /metrics is (no access line)
    assert not [r for r in srv.log_records()
                if r.get("event") == "access" and r.get("path") == "/metrics/vllm"]
    assert [r for r in srv.log_records()
            if r.get("event") == "access" and r.get("path") == "/v1/completions"]
    # only the vLLM names: promtool's one complaint there is the colon
    problems = lint(vtext)
    assert problems and all(p.endswith("metric names should not contain ':'") for p in problems)


def _stream(srv: ServerProcess, done: threading.Event) -> None:
    body = json.dumps({"model": "tiny", "prompt": "def main():", "max_tokens": 200,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            while r.readline():
                pass
    finally:
        done.set()


def test_on_metrics_they_equal_moeds_own_in_one_scrape(moed_server, tiny_qwen3) -> None:
    srv = moed_server(model=tiny_qwen3, env=ENV, args=["--vllm-metrics-path", "/metrics"])
    done = threading.Event()
    t = threading.Thread(target=_stream, args=(srv, done), daemon=True)
    t.start()
    seen_running = False
    end = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < end:
        text = srv.get("/metrics")[1]
        m = parse_metrics(text)
        for vname, oname in zip(VLLM, OWN):
            assert _vllm(m, vname) == m[oname], (vname, text)
        info = _cache_info(text)
        assert info["num_gpu_blocks"] == str(int(m["moed_kv_blocks_capacity"]))
        if m["moed_requests_running"] == 1:
            seen_running = True
            assert _vllm(m, "vllm:kv_cache_usage_perc") > 0
            break
        time.sleep(0.02)
    t.join(120)
    assert seen_running, "never scraped while the request ran"
    problems = lint(srv.get("/metrics")[1])
    assert len(problems) == 4 and all(p.startswith("vllm:") and
                                      p.endswith("metric names should not contain ':'")
                                      for p in problems), problems
