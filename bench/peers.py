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
Both use --threads threads. --quant int8 / int4: moed quantizes at load (model.quantization,
the native quantized matmul, group 128 for int4) and llama.cpp runs the GGUF requantized with
that build's llama-quantize to Q8_0 / Q4_K_M (cached beside the bf16 one): the issue-30 pairs.
--llama-repack 0 turns llama.cpp's weight repacking off (its AMX path for quantized types dies
with SIGILL on a VM that does not grant AMX tiles; this also drops its AVX x8 repacks). Prints moed/llama.cpp ratios (> 1: moed faster), the RSS of each
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


# moed's model.quantization -> the llama.cpp type it is compared with (issue 30's acceptance)
LLAMA_QUANT = {"int8": "Q8_0", "int4": "Q4_K_M"}


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
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-3000:]}")
    return out, err, peak


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
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp build directory")
    ap.add_argument("--llama-cpp-src", type=Path, help="its source tree (default: found above)")
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--prompt", type=int, default=128, help="decode runs' prompt length")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--quant", default="none", choices=("none", *LLAMA_QUANT),
                    help="moed model.quantization vs llama.cpp's type for it (LLAMA_QUANT)")
    ap.add_argument("--llama-repack", type=int, choices=(0, 1), default=1,
                    help="llama.cpp's weight repacking (AMX / x8 layouts); 0 where its AMX path "
                         "dies with SIGILL (a VM that does not grant AMX tiles)")
    ap.add_argument("--gguf", type=Path, help="use this GGUF instead of converting")
    ap.add_argument("--model", type=Path, help="HF checkpoint (default: the bench preset's)")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "peers.json"))
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    lengths = [int(x) for x in a.prefill.split(",")]
    build = a.llama_cpp.expanduser().resolve()
    batched, lbench = find_tool(build, "llama-batched-bench"), find_tool(build, "llama-bench")

    import torch

    import engine as eb     # bench/engine.py: the moed side and its step timing
    torch.set_num_threads(a.threads)
    model_dir = a.model or eb._checkpoint(a.arch, Path(a.cache))
    gguf = a.gguf or Path(a.cache) / f"{model_dir.name}.bf16.gguf"
    if not gguf.is_file():
        convert(a.llama_cpp_src or find_source(build), model_dir, gguf)
    quant = "" if a.quant == "none" else a.quant
    if quant:
        gguf = requantize(find_tool(build, "llama-quantize"), gguf, LLAMA_QUANT[quant], a.threads)
    cpu = cpu_model()
    label = f"moed {quant} vs llama.cpp {LLAMA_QUANT[quant]}" if quant else "bf16"
    print(f"{model_dir.name}, {label}, {a.threads} threads, {a.repeats} rounds; CPU: {cpu}",
          flush=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    longest = max(lengths + [a.prompt])
    pool = torch.randint(0, vocab, (max(batches), longest), generator=g).tolist()
    ctx = max(max(batches) * (a.prompt + a.new), longest) + 64     # both engines' KV size
    side = eb.MoedSide(model_dir, max(batches), longest, a.new, kv_tokens=ctx, quantization=quant)
    moed_rss = rss_bytes()
    side.run([pool[0][:a.prompt]], 4)                                   # warm-up
    cmd_tg = [str(batched), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
              "-npp", str(a.prompt), "-ntg", str(a.new), "-npl", a.batches, "-t", str(a.threads),
              "--output-format", "jsonl"] + ([] if a.llama_repack else ["--no-repack"])
    cmd_pp = [str(lbench), "-m", str(gguf), "-p", a.prefill, "-n", "0", "-t", str(a.threads),
              "-r", "1", "-o", "json"] + ([] if a.llama_repack else ["--repack", "0"])
    rounds = []
    llama_rss = 0
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
                out, err, peak = run_tool(cmd_tg)       # the table may go to either stream
                rec["llama_decode"] = {x["pl"]: x["speed_tg"]
                                       for x in parse_batched_bench(out + "\n" + err)}
                out2, _, peak2 = run_tool(cmd_pp)
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
    print(f"RSS after load: moed {moed_rss / 2**20:.0f} MiB (KV for the bench only), "
          f"llama.cpp peak {llama_rss / 2**20:.0f} MiB (-c {ctx})")
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "bench": "peers", "model_dir": str(model_dir), "threads": a.threads, "cpu": cpu, "quant": a.quant,
        "gguf": str(gguf), "llama_cpp": str(build), "commands": {"decode": cmd_tg, "prefill": cmd_pp},
        "prompt_len": a.prompt, "new_tokens": a.new, "table": table, "rounds": rounds,
        "rss_bytes": {"moed_after_load": moed_rss, "llama_cpp_peak": llama_rss},
        "load_average": load_average()}, indent=2, default=str))
    print(f"saved {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
