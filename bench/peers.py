"""moed vs llama.cpp on the same checkpoint, one run: decode at batch 1/8/32, prefill 512/2048.

    .venv/bin/python bench/peers.py --llama-cpp ~/llama.cpp/build [--threads 2] [--repeats 3]

Given a llama.cpp build directory (docs/benchmarks.md says how to build one), the bench
checkpoint is converted to GGUF bf16 once with that tree's convert_hf_to_gguf.py, run from a
temporary copy whose pre-tokenizer table maps our self-trained BPE tokenizer's hash to "gpt-2"
(the converter refuses tokenizers it does not know; the user's llama.cpp is never edited).
Then, in rounds with the order flipped each round:
  decode   moed Engine.generate at each batch (prompt --prompt, --new tokens) beside
           `llama-batched-bench -npp PROMPT -ntg NEW -npl 1,8,32` (its S_TG: batch x tokens /
           the whole generation phase; moed's figure is the same total over its decode steps);
  prefill  moed at batch 1 with each --prefill length (one step) beside `llama-bench -p
           512,2048 -n 0` (avg t/s).
--quant int8 / int4 runs moed with model.quantization int8 (per output channel) / int4
(groups of 128) against the same GGUF quantized by that build's llama-quantize to Q8_0 /
Q4_K_M (cached beside the bf16 one); bf16 (the default) against the bf16 GGUF. llama.cpp
quantizes its output tensor too (Q8_0: Q8_0; Q4_K_M: Q6_K), so moed's side runs with
model.quantization_lm_head int8 (--lm-head; `none` keeps moed's head bf16, as before), and
--activations int8 sets model.quantization_activations (integer dot products, as llama.cpp's);
the run's first line says both.
--llama-repack 0 turns llama.cpp's weight repacking off from the start (its AMX
path for quantized types crashes on this Xeon: a crash with it on turns it off too).
Each run also prints the CPU's ISA flags, the machine's memory bandwidth (a 256 MiB copy,
best of 5, read + write bytes; beside it the rate of reads alone, a torch.sum over 256 MiB)
and bf16 matmul ceiling (bench/ceiling.py: a 1024 x 4096 x 4096 product through torch and
through moed's kernel, the higher; --probe-rows sizes it, and fewer rows read lower), and what
fraction of them moed's decode at batch 1 (the weight bytes one token reads: attention, router,
top-k experts per layer and lm_head, in the run's format; of both the copy and the read rate)
and prefill (matmul FLOPs) reach.
A smaller CPU on this one (issue 30's rows for a CPU kind not at hand): MOED_CPU_ISA=avx2
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (moed's kernels, oneDNN and ATen all held to
AVX2) against a llama.cpp built for it (-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AVX512=OFF); the run prints and saves what was forced.
Both use --threads threads. Prints moed/llama.cpp ratios (> 1: moed faster), the RSS of each
after load (llama.cpp's: the peak of its process, which holds its KV for -c), the load average
of each round, and writes bench/results/peers.json.

The parsers of the tools' outputs are pure functions (tests/unit/bench/test_peers_parse.py):
llama-bench's md / csv / json / jsonl (-o) and llama-batched-bench's md / jsonl
(--output-format).
"""
from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_model, load_average, rss_bytes  # noqa: E402

# --quant: moed's model.quantization and the llama.cpp type of the same checkpoint it runs against
QUANT_PEERS = {"bf16": ("", "bf16"), "int8": ("int8", "Q8_0"), "int4": ("int4", "Q4_K_M")}
# the output tensor's type in each llama.cpp format (llama-quantize's defaults): what --lm-head matches
LLAMA_OUTPUT = {"bf16": "bf16", "Q8_0": "Q8_0", "Q4_K_M": "Q6_K"}
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16",
             "amx_int8")

BATCHED_FIELDS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_INT_FIELDS = {"pp", "tg", "pl", "n_kv"}


# ---- parsing llama.cpp's outputs (pure) -----------------------------------------------------
def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's result rows, from its markdown table or its JSONL
    (--output-format jsonl); log lines around them are skipped. -> one dict per (pp, tg, pl)
    with BATCHED_FIELDS (ints for pp/tg/pl/n_kv, floats for the rest)."""
    rows = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{") and '"speed_tg"' in s:
            d = json.loads(s)
            rows.append({k: (int(d[k]) if k in _INT_FIELDS else float(d[k])) for k in BATCHED_FIELDS})
        elif s.startswith("|"):
            cells = [c.strip() for c in s.strip("|").split("|")]
            if len(cells) != len(BATCHED_FIELDS) or not cells[0].isdigit():
                continue                # the header, its rule, or another table
            rows.append({k: (int(v) if k in _INT_FIELDS else float(v))
                         for k, v in zip(BATCHED_FIELDS, cells)})
    return rows


_TEST_RE = re.compile(r"^(?:pp(?P<p>\d+))?\+?(?:tg(?P<g>\d+))?(?: @ d(?P<d>\d+))?$")


def _bench_row(d: dict) -> dict:
    """A llama-bench record (any format's fields) -> the fields a comparison needs."""
    return {"n_prompt": int(d["n_prompt"]), "n_gen": int(d["n_gen"]),
            "n_depth": int(d.get("n_depth") or 0), "n_threads": int(d["n_threads"]),
            "avg_ts": float(d["avg_ts"]), "stddev_ts": float(d["stddev_ts"]),
            "model_type": str(d.get("model_type", ""))}


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's results in any of its -o formats (json, jsonl, csv, md); the format is
    told from the text. -> one dict per test: n_prompt, n_gen, n_depth, n_threads, avg_ts,
    stddev_ts, model_type."""
    s = text.strip()
    if not s:
        return []
    if s.startswith("["):
        return [_bench_row(d) for d in json.loads(s)]
    if s.startswith("{"):
        return [_bench_row(json.loads(x)) for x in s.splitlines() if x.strip().startswith("{")]
    if s.startswith("build_commit") or s.startswith('"build_commit"'):
        return [_bench_row(d) for d in csv.DictReader(io.StringIO(s))]
    return _parse_bench_md(s)


def _parse_bench_md(s: str) -> list[dict]:
    header: list[str] | None = None
    rows = []
    for line in s.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "test" in cells and "t/s" in cells:
                header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue                    # the rule under the header
        d = dict(zip(header, cells))
        m = _TEST_RE.match(d["test"])
        if m is None:
            raise ValueError(f"llama-bench test name not understood: {d['test']!r}")
        avg, _, std = d["t/s"].partition("±")
        rows.append({"n_prompt": int(m["p"] or 0), "n_gen": int(m["g"] or 0),
                     "n_depth": int(m["d"] or 0), "n_threads": int(d.get("threads", 0) or 0),
                     "avg_ts": float(avg), "stddev_ts": float(std or 0),
                     "model_type": d.get("model", "")})
    return rows


# ---- the converter's pre-tokenizer check (pure) ---------------------------------------------
_CHKTXT_RE = re.compile(r"^(\s*)chktxt = (.+)$", re.M)
_RES_NONE_RE = re.compile(r"^(\s*)res = None\s*$", re.M)


def pre_tokenizer_probe(source: str) -> str:
    """The text convert_hf_to_gguf hashes the tokenization of (`chktxt` in
    get_vocab_base_pre), read from the converter's source."""
    m = _CHKTXT_RE.search(source)
    if m is None:
        raise ValueError("no `chktxt = ...` in the converter's source: unknown llama.cpp layout")
    return ast.literal_eval(m.group(2).strip())


def pre_tokenizer_hash(token_ids: list[int]) -> str:
    """The converter's tokenizer id: sha256 of str(the probe's token ids)."""
    return hashlib.sha256(str(token_ids).encode()).hexdigest()


def map_pre_tokenizer(source: str, chkhsh: str, name: str = "gpt-2") -> str:
    """The converter's source with `chkhsh` mapped to pre-tokenizer `name`, inserted right
    after get_vocab_base_pre's `res = None` (before the known hashes and the refusal)."""
    probe = _CHKTXT_RE.search(source)
    m = _RES_NONE_RE.search(source, probe.end()) if probe else None
    if m is None:
        raise ValueError("no `res = None` in get_vocab_base_pre: unknown llama.cpp layout")
    ind = m.group(1)
    patch = (f"\n{ind}if chkhsh == {chkhsh!r}:  # moed bench: self-trained byte-level BPE\n"
             f"{ind}    res = {name!r}\n")
    return source[:m.end()] + patch + source[m.end():]


# ---- llama.cpp on disk -----------------------------------------------------------------------
def find_tool(build: Path, name: str) -> Path:
    for p in (build / "bin" / name, build / name):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise SystemExit(f"{name} not found in {build}/bin or {build} (build it: docs/benchmarks.md)")


def find_source(build: Path) -> Path:
    """The llama.cpp tree holding convert_hf_to_gguf.py: the build dir or one above it."""
    for d in (build, *build.parents[:3]):
        if (d / "convert_hf_to_gguf.py").is_file():
            return d
    raise SystemExit(f"convert_hf_to_gguf.py not found at or above {build}: pass --llama-cpp-src")


def convert(src: Path, model_dir: Path, out: Path) -> None:
    """HF checkpoint -> GGUF bf16 through a temporary copy of the converter with our
    tokenizer's hash mapped (the user's tree is read, never written)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="moed-convert-") as tmp:
        t = Path(tmp)
        shutil.copy2(src / "convert_hf_to_gguf.py", t)
        if (src / "conversion").is_dir():       # newer trees split the converter into a package
            shutil.copytree(src / "conversion", t / "conversion")
            target = t / "conversion" / "base.py"
        else:
            target = t / "convert_hf_to_gguf.py"
        (t / "gguf-py").symlink_to(src / "gguf-py")
        code = target.read_text()
        tok = AutoTokenizer.from_pretrained(model_dir)
        chkhsh = pre_tokenizer_hash(tok.encode(pre_tokenizer_probe(code)))
        target.write_text(map_pre_tokenizer(code, chkhsh))
        print(f"converting {model_dir} -> {out} (pre-tokenizer hash {chkhsh[:12]}... -> gpt-2)",
              flush=True)
        r = subprocess.run([sys.executable, str(t / "convert_hf_to_gguf.py"), str(model_dir),
                            "--outtype", "bf16", "--outfile", str(out)],
                           capture_output=True, text=True)
        if r.returncode != 0 or not out.is_file():
            raise SystemExit(f"convert_hf_to_gguf failed ({r.returncode}):\n{r.stderr[-3000:]}")


def requantize(tool: Path, src: Path, qtype: str, threads: int) -> Path:
    """src (a bf16 GGUF) requantized to qtype with llama-quantize, once (cached beside it)."""
    stem = src.name.removesuffix(".gguf").removesuffix(".bf16")
    out = src.with_name(f"{stem}.{qtype}.gguf")
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        p = subprocess.run([str(tool), str(src), str(tmp), qtype, str(threads)], capture_output=True,
                           text=True, timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"llama-quantize {qtype} failed:\n{(p.stdout + p.stderr)[-2000:]}")
        tmp.rename(out)
    return out


def run_tool(cmd: list[str]) -> tuple[str, str, int]:
    """Run a llama.cpp tool -> (stdout, stderr, peak RSS bytes sampled every 50 ms). Results
    are on stdout (llama-bench -o, batched-bench's table), its logs on stderr."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got: dict[str, str] = {}
    readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()), daemon=True)
               for k, f in (("out", p.stdout), ("err", p.stderr))]
    for t in readers:
        t.start()
    peak = 0
    while p.poll() is None:
        peak = max(peak, rss_bytes(p.pid))
        time.sleep(0.05)
    for t in readers:
        t.join(10)
    out, err = got.get("out", ""), got.get("err", "")
    if p.returncode in (-4, -11):
        raise Crashed(" ".join(cmd))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-3000:]}")
    return out, err, peak


class Crashed(Exception):
    """A llama.cpp tool died of SIGSEGV or SIGILL: its AMX path on a Q8_0 MoE did both on a
    Sapphire Rapids Xeon with the llama-cpp-python 0.3.36 sources (ggml_backend_amx_mul_mat)."""


def run_llama(cmds: dict[str, list[str]], repack: list[bool]) -> dict[str, tuple[str, str, int]]:
    """Each command -> run_tool's result. `repack` ([True] to start) is llama.cpp's weight
    repacking (its AMX / interleaved layouts); a crash with it on turns it off for this and every
    later call (llama-bench `--repack 0`, llama-batched-bench `-nr`), said once."""
    out = {}
    for name, cmd in cmds.items():
        off = ["--repack", "0"] if Path(cmd[0]).name == "llama-bench" else ["-nr"]
        try:
            out[name] = run_tool(cmd if repack[0] else cmd + off)
        except Crashed as e:
            if not repack[0]:
                raise SystemExit(f"{e} crashed with repacking off too") from None
            print(f"  llama.cpp crashed with weight repacking on ({Path(cmd[0]).name}): "
                  f"repacking off from here on (the AMX path)", flush=True)
            repack[0] = False
            out[name] = run_tool(cmd + off)
    return out


FORCING_ENV = ("MOED_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def forced_isa() -> dict[str, str]:
    """The settings that run a smaller CPU's code here (moed's kernel variant, oneDNN's and
    ATen's ISA caps: set all three to stand in for that CPU, beside a llama.cpp built for it)."""
    return {k: os.environ[k] for k in FORCING_ENV if os.environ.get(k)}


def isa_flags() -> list[str]:
    """The ISA flags that choose kernels (moed's and llama.cpp's), as /proc/cpuinfo says."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return []
    return [f for f in ISA_FLAGS if f in flags]


def memory_bandwidth(threads: int) -> float:
    """Bytes/s of a 256 MiB copy (read + write counted), best of 5, on `threads` threads."""
    import torch

    from ceiling import best_of
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    torch.set_num_threads(threads)
    return 2 * src.numel() / best_of(lambda: dst.copy_(src), 5)


def decode_bytes_per_token(spec, fmt: str, head: str = "") -> float:  # noqa: ANN001
    """Weight bytes one decoded token reads: per layer q/k/v/o and its top-k experts in `fmt`
    (int8: 1 byte + a 4-byte scale per row; int4: half a byte + 4 bytes per 128-column group),
    the router in bf16; then lm_head in `head` ("" = bf16; model.quantization_lm_head's format)."""
    from ceiling import model_shapes
    s = model_shapes(spec)

    def qbytes(n: int, k: int, f: str = fmt) -> float:
        per = {"": 2.0, "int8": 1.0, "int4": 0.5}[f]
        scale = {"": 0.0, "int8": 4.0, "int4": 4.0 / 128}[f]
        return n * k * per + n * (scale if f != "int4" else scale * k)

    per_layer = qbytes(*s["qkv"]) + qbytes(*s["o_proj"]) + 2.0 * s["router"][0] * s["router"][1]
    per_layer += spec.top_k * (qbytes(*s["expert_gate_up"]) + qbytes(*s["expert_down"]))
    return per_layer * spec.num_layers + qbytes(*s["lm_head"], head)


# ---- the comparison ---------------------------------------------------------------------------
def moed_decode(side, prompts: list[list[int]], new: int) -> float:  # noqa: ANN001
    """Tokens decoded / the decode steps' total time, like llama-batched-bench's S_TG (batch x
    tokens / its whole generation phase)."""
    t = side.run(prompts, new)
    secs = sum(s for _, s in t.decode)
    return sum(b for b, _ in t.decode) / secs if secs else 0.0


def compare(rounds: list[dict], batches: list[int], lengths: list[int]) -> dict:
    """Per-round records -> {"decode": {batch: row}, "prefill": {length: row}}, each row the
    median over rounds of moed's and llama.cpp's tok/s and moed/llama.cpp (> 1: moed faster;
    NaN where a side has no figure)."""
    nan = float("nan")

    def med(key: str, k: int) -> float:
        xs = [x[key][k] for x in rounds if k in x.get(key, {})]
        return statistics.median(xs) if xs else nan

    def row(m: float, l: float) -> dict:
        return {"moed": m, "llama_cpp": l, "ratio": m / l if l and l == l and m == m else nan}

    return {"decode": {b: row(med("moed_decode", b), med("llama_decode", b)) for b in batches},
            "prefill": {n: row(med("moed_prefill", n), med("llama_prefill", n)) for n in lengths}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp build directory")
    ap.add_argument("--vllm", metavar="PY", help="a Python with vLLM's CPU build: also compare "
                    "serving (bench/serve_peers.py) at --serve-concurrency")
    ap.add_argument("--serve-concurrency", default="1,8,32")
    ap.add_argument("--serve-requests", type=int, default=4, help="requests per concurrency x c "
                                                                  "(at least 8)")
    ap.add_argument("--serve-rounds", type=int, default=1,
                    help="1: one server at a time; N > 1: both up at once, each concurrency "
                         "sent to each in turn for N rounds (order alternating), medians")
    ap.add_argument("--llama-cpp-src", type=Path, help="its source tree (default: found above)")
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--prompt", type=int, default=128, help="decode runs' prompt length")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-rows", type=int, default=1024, help="rows of the compute-ceiling probe "
                    "([rows, 4096] x [4096, 4096] bf16; fewer is quicker and reads lower)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--quant", default="bf16", choices=sorted(QUANT_PEERS),
                    help="moed's weight format and llama.cpp's (bf16, int8 vs Q8_0, int4 vs Q4_K_M)")
    ap.add_argument("--lm-head", default="int8", choices=("none", "int8", "model"),
                    help="moed's model.quantization_lm_head with --quant int8/int4 (llama.cpp "
                         "quantizes its output tensor too: Q8_0, Q6_K in Q4_K_M); none: bf16")
    ap.add_argument("--activations", default="none", choices=("none", "int8"),
                    help="moed's model.quantization_activations with --quant int8/int4")
    ap.add_argument("--llama-repack", type=int, choices=(0, 1), default=1,
                    help="llama.cpp's weight repacking (AMX / x8 layouts) from the start; a crash "
                         "with it on turns it off for the rest of the run either way")
    ap.add_argument("--gguf", type=Path, help="the bf16 GGUF to use instead of converting (--quant "
                                              "requantizes it, once)")
    ap.add_argument("--model", type=Path, help="HF checkpoint (default: the bench preset's)")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--out", help="JSON (default bench/results/peers[-QUANT].json)")
    a = ap.parse_args()
    if not a.llama_cpp and not a.vllm:
        ap.error("give --llama-cpp DIR, --vllm PY, or both")
    if not 1 <= a.probe_rows <= 4096:
        ap.error("--probe-rows must be in 1..4096")
    if a.serve_rounds < 1:
        ap.error("--serve-rounds must be >= 1")
    if a.vllm and a.quant != "bf16":
        ap.error("--vllm: the serving comparison runs bf16 (vLLM's CPU backend serves the "
                 "checkpoint as it is); drop --quant")
    if not a.llama_cpp:
        return serve_only(a)
    batches = [int(x) for x in a.batches.split(",")]
    lengths = [int(x) for x in a.prefill.split(",")]
    build = a.llama_cpp.expanduser().resolve()
    batched, lbench = find_tool(build, "llama-batched-bench"), find_tool(build, "llama-bench")

    import torch

    import engine as eb     # bench/engine.py: the moed side and its step timing
    torch.set_num_threads(a.threads)
    model_dir = a.model or eb._checkpoint(a.arch, Path(a.cache))
    moed_fmt, qtype = QUANT_PEERS[a.quant]
    gguf = a.gguf or Path(a.cache) / f"{model_dir.name}.bf16.gguf"
    if not gguf.is_file():
        convert(a.llama_cpp_src or find_source(build), model_dir, gguf)
    if moed_fmt:
        gguf = requantize(find_tool(build, "llama-quantize"), gguf, qtype, a.threads)
    cpu, isa, forced = cpu_model(), isa_flags(), forced_isa()
    if a.activations != "none" and not moed_fmt:
        raise SystemExit("--activations int8 needs --quant int8 or int4 (moed refuses it on bf16 weights)")
    head, acts = ("none", "none") if not moed_fmt else (a.lm_head, a.activations)
    print(f"{model_dir.name}, moed {a.quant} (lm_head {'bf16' if head == 'none' else head}, activations {acts}) vs "
          f"llama.cpp {qtype} (output {LLAMA_OUTPUT[qtype]}), {a.threads} threads, "
          f"{a.repeats} rounds; CPU: {cpu}; ISA: {' '.join(isa)}; load {load_average()[0]:.2f}",
          flush=True)
    if forced:
        print("forced (a smaller CPU's code on this one): " + " ".join(f"{k}={v}" for k, v in forced.items()),
              flush=True)
    from ceiling import bandwidth as read_bandwidth, ceiling, flops_per_token
    from moed.model.hf_config import load_spec
    from moed.model.kernels import cpu_kernels
    bandwidth = memory_bandwidth(a.threads)
    read_rate = read_bandwidth(5, 256 << 20)    # reads only: what a decode step's weights need
    flop_s = ceiling(3, cpu_kernels(), rows=a.probe_rows)["flop_s"]   # both probes rows x 4096 x 4096
    spec = load_spec(model_dir)
    print(f"machine: memory {bandwidth / 1e9:.1f} GB/s (copy, {a.threads} threads; reads alone "
          f"{read_rate / 1e9:.1f}), bf16 matmul {flop_s / 1e9:.0f} GFLOP/s", flush=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    longest = max(lengths + [a.prompt])
    pool = torch.randint(0, vocab, (max(batches), longest), generator=g).tolist()
    ctx = max(max(batches) * (a.prompt + a.new), longest) + 64     # both engines' KV size
    side = eb.MoedSide(model_dir, max(batches), longest, a.new, kv_tokens=ctx,
                       quantization=moed_fmt, lm_head=head, activations=acts)
    moed_rss = rss_bytes()
    side.run([pool[0][:a.prompt]], 4)                                   # warm-up
    cmd_tg = [str(batched), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
              "-npp", str(a.prompt), "-ntg", str(a.new), "-npl", a.batches, "-t", str(a.threads),
              "--output-format", "jsonl"] + ([] if a.llama_repack else ["--no-repack"])
    cmd_pp = [str(lbench), "-m", str(gguf), "-p", a.prefill, "-n", "0", "-t", str(a.threads),
              "-r", "1", "-o", "json"] + ([] if a.llama_repack else ["--repack", "0"])
    rounds = []
    llama_rss = 0
    repack = [bool(a.llama_repack)]
    for r in range(a.repeats):
        before = load_average()
        rec: dict = {"round": r, "load_before": before}
        steps = ["moed", "llama"] if r % 2 == 0 else ["llama", "moed"]
        for who in steps:
            if who == "moed":
                rec["moed_decode"] = {b: moed_decode(side, [p[:a.prompt] for p in pool[:b]], a.new)
                                      for b in batches}
                rec["moed_prefill"] = {n: side.run([pool[0][:n]], 1).summary()["prefill_tok_s"]
                                       for n in lengths}
            else:
                got = run_llama({"tg": cmd_tg, "pp": cmd_pp}, repack)
                (out, err, peak), (out2, _, peak2) = got["tg"], got["pp"]
                # the table may go to either stream
                rec["llama_decode"] = {x["pl"]: x["speed_tg"]
                                       for x in parse_batched_bench(out + "\n" + err)}
                rec["llama_prefill"] = {x["n_prompt"]: x["avg_ts"] for x in parse_llama_bench(out2)
                                        if x["n_gen"] == 0}
                if not rec["llama_decode"] or not rec["llama_prefill"]:
                    raise SystemExit("no result rows in llama.cpp's output:\n"
                                     f"{(out + err)[-2000:]}\n{out2[-2000:]}")
                llama_rss = max(llama_rss, peak, peak2)
        rec["load_after"] = load_average()
        rounds.append(rec)
        print(f"  round {r + 1}/{a.repeats}: load {before[0]:.2f} -> {rec['load_after'][0]:.2f}",
              flush=True)

    table = compare(rounds, batches, lengths)
    print(f"\n{'':<16} {'moed':>9} {'llama.cpp':>9} {'moed/llama':>10}   (tok/s, median of rounds)")
    for kind, rows in table.items():
        for k, v in rows.items():
            label = f"decode batch {k}" if kind == "decode" else f"prefill {k}"
            print(f"{label:<16} {v['moed']:9.1f} {v['llama_cpp']:9.1f} {v['ratio']:10.2f}")
    per_tok = decode_bytes_per_token(spec, moed_fmt, {"none": "", "int8": "int8", "model": moed_fmt}[head])
    b1 = table["decode"].get(1, {}).get("moed", float("nan"))
    roof = {"decode_bytes_per_token": per_tok, "memory_bytes_s": bandwidth, "read_bytes_s": read_rate,
            "flop_s": flop_s, "decode_b1_bandwidth_fraction": b1 * per_tok / bandwidth,
            "decode_b1_read_fraction": b1 * per_tok / read_rate,
            "prefill_compute_fraction": {n: v["moed"] * flops_per_token(spec) / flop_s
                                         for n, v in table["prefill"].items()}}
    print(f"decode batch 1 reads {per_tok / 2**20:.1f} MiB of weights a token: "
          f"{b1 * per_tok / 1e9:.1f} GB/s, {roof['decode_b1_bandwidth_fraction']:.0%} of the "
          f"measured bandwidth ({roof['decode_b1_read_fraction']:.0%} of the read rate); prefill at "
          + ", ".join(f"{n}: {f:.0%}" for n, f in roof["prefill_compute_fraction"].items())
          + " of the bf16 matmul ceiling")
    print(f"RSS after load: moed {moed_rss / 2**20:.0f} MiB (KV for the bench only), "
          f"llama.cpp peak {llama_rss / 2**20:.0f} MiB (-c {ctx})")
    serving = serve_table(a, model_dir) if a.vllm else None
    out_path = Path(a.out or ROOT / "bench" / "results" /
                    ("peers.json" if a.quant == "bf16" else f"peers-{a.quant}.json"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "bench": "peers", "model_dir": str(model_dir), "threads": a.threads, "cpu": cpu,
        "gguf": str(gguf), "llama_cpp": str(build), "commands": {"decode": cmd_tg, "prefill": cmd_pp},
        "quant": a.quant, "llama_type": qtype, "lm_head": head, "activations": acts, "isa": isa, "forced_isa": forced, "roofline": roof,
        "llama_repack": repack[0], "serving": serving,
        "prompt_len": a.prompt, "new_tokens": a.new, "table": table, "rounds": rounds,
        "rss_bytes": {"moed_after_load": moed_rss, "llama_cpp_peak": llama_rss},
        "load_average": load_average()}, indent=2, default=str))
    print(f"saved {out_path}")
    return 0


def serve_table(a, model_dir: Path) -> dict:  # noqa: ANN001
    """The serving comparison against vLLM (bench/serve_peers.py), printed as a table."""
    import serve_peers
    cs = [int(x) for x in a.serve_concurrency.split(",")]
    print(f"\nserving: prompt {a.prompt}, {a.new} out, {a.threads} threads; load "
          f"{load_average()[0]:.2f}", flush=True)
    res = serve_peers.compare(model_dir, a.vllm, cs, a.prompt, a.new, a.threads, a.serve_requests,
                              rounds=a.serve_rounds)
    print(f"\nserving order: {res['order']}")
    print(f"{'concurrency':<12} {'moed tok/s':>10} {'vLLM tok/s':>10} {'ratio':>6} | "
          f"{'moed TTFT p50':>13} {'vLLM':>8} {'ratio':>6} | failed moed / vLLM")
    for c in cs:
        m, v, r = res["moed"][c], res["vllm"][c], res["ratio"][c]
        print(f"{c:<12} {m['output_tok_s']:10.1f} {v['output_tok_s']:10.1f} "
              f"{r['output_tok_s']:6.2f} | {m['ttft_ms']['p50']:11.0f}ms {v['ttft_ms']['p50']:6.0f}ms "
              f"{r['ttft_p50']:6.2f} | {r['moed_failed']} / {r['vllm_failed']}")
    return res


def serve_only(a) -> int:  # noqa: ANN001
    """--vllm without --llama-cpp: the serving comparison alone."""
    import engine as eb
    model_dir = a.model or eb._checkpoint(a.arch, Path(a.cache))
    print(f"{model_dir.name}, bf16; CPU: {cpu_model()}; ISA: {' '.join(isa_flags())}", flush=True)
    serving = serve_table(a, model_dir)
    out_path = Path(a.out or ROOT / "bench" / "results" / "peers-serve.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"bench": "peers-serve", "model_dir": str(model_dir),
                                    "cpu": cpu_model(), "isa": isa_flags(), "threads": a.threads,
                                    "serving": serving, "load_average": load_average()},
                                   indent=2, default=str))
    print(f"saved {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
