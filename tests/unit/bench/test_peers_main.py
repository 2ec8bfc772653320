"""bench/peers.py end to end against stand-in llama.cpp tools (shell scripts that print the
tools' sample outputs) on the tiny checkpoint: flags reach the tools, results are parsed,
ratios and RSS land in the JSON. No llama.cpp build needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_peers_parse import BATCHED_MD, BENCH_JSON

ROOT = Path(__file__).resolve().parents[3]


def _tool(path: Path, stdout: str, stderr: str = "") -> None:
    path.write_text("#!/bin/sh\n"
                    f"echo \"$0 $*\" >> {path.parent / 'calls.log'}\n"
                    f"cat <<'EOF_OUT'\n{stdout}EOF_OUT\n"
                    f"cat >&2 <<'EOF_ERR'\n{stderr}EOF_ERR\n")
    path.chmod(0o755)


def test_peers_runs_the_tools_and_writes_ratios(tiny_qwen3, tmp_path):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    _tool(bin_dir / "llama-batched-bench", "", BATCHED_MD)   # its table on stderr: read too
    _tool(bin_dir / "llama-bench", BENCH_JSON, "load_backend: loaded CPU backend\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "peers.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--llama-cpp",
                        str(tmp_path / "build"), "--gguf", str(gguf), "--model", str(tiny_qwen3),
                        "--batches", "1,8", "--prefill", "512", "--prompt", "16", "--new", "4",
                        "--threads", "1", "--repeats", "2", "--probe-rows", "64", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    dec, pre = d["table"]["decode"], d["table"]["prefill"]
    assert dec["1"]["llama_cpp"] == 183.38 and dec["8"]["llama_cpp"] == 384.96
    assert dec["1"]["moed"] > 0 and dec["1"]["ratio"] == dec["1"]["moed"] / 183.38
    assert pre["512"]["llama_cpp"] == 1490.25 and pre["512"]["moed"] > 0
    assert len(d["rounds"]) == 2 and all("load_before" in x for x in d["rounds"])
    assert d["rss_bytes"]["moed_after_load"] > 0
    calls = (bin_dir / "calls.log").read_text().splitlines()
    assert len(calls) == 4                                  # both tools, each round
    tg = next(c for c in calls if "batched-bench" in c)
    assert f"-m {gguf}" in tg and "-npp 16 -ntg 4 -npl 1,8 -t 1" in tg
    pp = next(c for c in calls if c.split()[0].endswith("llama-bench"))
    assert "-p 512 -n 0 -t 1" in pp and "-o json" in pp
    assert "moed/llama" in r.stdout


def test_peers_quant_requantizes_for_llama_and_quantizes_moed(tiny_qwen3, tmp_path):
    """--quant int4: llama.cpp gets the GGUF llama-quantize made as Q4_K_M (made once, then
    reused), moed quantizes at load (the JSON says which)."""
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    _tool(bin_dir / "llama-batched-bench", "", BATCHED_MD)
    _tool(bin_dir / "llama-bench", BENCH_JSON)
    (bin_dir / "llama-quantize").write_text(f"#!/bin/sh\necho \"$0 $*\" >> {bin_dir / 'calls.log'}\ncp \"$1\" \"$2\"\n")
    (bin_dir / "llama-quantize").chmod(0o755)
    gguf = tmp_path / "m.bf16.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "peers.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--llama-cpp", str(tmp_path / "build"),
           "--gguf", str(gguf), "--model", str(tiny_qwen3), "--quant", "int4", "--batches", "1",
           "--prefill", "512", "--prompt", "16", "--new", "4", "--threads", "1", "--repeats", "1",
           "--probe-rows", "64", "--out", str(out)]
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads(out.read_text())["quant"] == "int4"
    assert "moed int4 (lm_head int8, activations none) vs llama.cpp Q4_K_M (output Q6_K)" in r.stdout
    calls = (bin_dir / "calls.log").read_text().splitlines()
    quantized = tmp_path / "m.Q4_K_M.gguf"
    assert [c for c in calls if "llama-quantize" in c] == \
        [f"{bin_dir / 'llama-quantize'} {gguf} {quantized.with_suffix('.tmp')} Q4_K_M 1"]   # once
    assert all(f"-m {quantized}" in c for c in calls if "llama-quantize" not in c)


def test_peers_says_which_tool_is_missing(tmp_path):
    (tmp_path / "bin").mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--llama-cpp",
                        str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and "llama-batched-bench not found" in r.stderr
