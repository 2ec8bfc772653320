"""bench/peers.py's readers of llama.cpp's outputs and its converter patch, on captured samples
(no llama.cpp needed). The samples follow the tools' printf formats (tools/llama-bench,
tools/batched-bench of the llama.cpp vendored by llama-cpp-python 0.3.36)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"moed_bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


peers = _load("peers")
common = _load("common")

BATCHED_MD = """\
llama_context: n_ctx = 4352
main: n_kv_max = 4352, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.086 |  1490.12 |    0.349 |   183.38 |    0.435 |   441.37 |
|   128 |     64 |    8 |   1536 |    0.674 |  1519.20 |    1.330 |   384.96 |    2.004 |   766.47 |
|   128 |     64 |   32 |   6144 |    2.801 |  1462.33 |    4.120 |   497.09 |    6.921 |   887.73 |

llama_perf_context_print:        load time =     210.52 ms
"""

BATCHED_JSONL = """\
main: n_kv_max = 4352, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
{"n_kv_max": 4352, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 1, \
"n_kv": 192, "t_pp": 0.085900, "speed_pp": 1490.115234, "t_tg": 0.349000, \
"speed_tg": 183.381088, "t": 0.434900, "speed": 441.365845}
{"n_kv_max": 4352, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 8, \
"n_kv": 1536, "t_pp": 0.674000, "speed_pp": 1519.198853, "t_tg": 1.330000, \
"speed_tg": 384.962402, "t": 2.004000, "speed": 766.467041}

llama_perf_context_print:        load time =     210.52 ms
"""

_FIELDS = ("build_commit,build_number,cpu_info,gpu_info,backends,model_filename,model_type,"
           "model_size,model_n_params,n_batch,n_ubatch,n_threads,cpu_mask,cpu_strict,poll,"
           "type_k,type_v,n_gpu_layers,n_cpu_moe,split_mode,main_gpu,no_kv_offload,flash_attn,"
           "devices,tensor_split,tensor_buft_overrides,load_mode,lazy_mode,embeddings,"
           "no_op_offload,no_host,repack,fit_target,fit_min_ctx,n_prompt,n_gen,n_depth,"
           "test_time,avg_ns,stddev_ns,avg_ts,stddev_ts")


def _csv_row(n_prompt: int, n_gen: int, avg_ts: float, std_ts: float) -> str:
    vals = ["0c1e570", "1", "AMD EPYC", "", "CPU", "/m/q.gguf", "qwen3moe ?B BF16", "576021952",
            "287983616", "2048", "512", "2", "0x0", "0", "50", "f16", "f16", "99", "0", "layer",
            "0", "0", "-1", "auto", "0.00", "none", "mmap", "auto", "0", "0", "0", "0", "1024",
            "4096", str(n_prompt), str(n_gen), "0", "2026-12-01T19:40:00Z", "343600000",
            "1200000", f"{avg_ts:.6f}", f"{std_ts:.6f}"]
    return ",".join(f'"{v}"' for v in vals)


BENCH_CSV = "\n".join([_FIELDS, _csv_row(512, 0, 1490.25, 12.5), _csv_row(2048, 0, 1203.5, 3.25)])

BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "model_type": "qwen3moe ?B BF16",
    "n_threads": 2,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 343600000,
    "stddev_ns": 1200000,
    "avg_ts": 1490.250000,
    "stddev_ts": 12.500000,
    "samples_ns": [ 343600000 ],
    "samples_ts": [ 1490.25 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "model_type": "qwen3moe ?B BF16",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "avg_ns": 700000000,
    "stddev_ns": 2000000,
    "avg_ts": 182.850000,
    "stddev_ts": 0.500000,
    "samples_ns": [ 700000000 ],
    "samples_ts": [ 182.85 ]
  }
]
"""

BENCH_JSONL = (
    '{"build_commit": "0c1e570", "model_type": "qwen3moe ?B BF16", "n_threads": 2, '
    '"n_prompt": 2048, "n_gen": 0, "n_depth": 0, "avg_ts": 1203.500000, "stddev_ts": 3.250000, '
    '"samples_ns": [ 1 ],"samples_ts": [ 1203.5 ]}\n'
    '{"build_commit": "0c1e570", "model_type": "qwen3moe ?B BF16", "n_threads": 2, '
    '"n_prompt": 0, "n_gen": 64, "n_depth": 4096, "avg_ts": 90.000000, "stddev_ts": 1.000000, '
    '"samples_ns": [ 1 ],"samples_ts": [ 90 ]}\n')

BENCH_MD = """\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| qwen3moe ?B BF16               | 549.33 MiB |   287.98 M | CPU        |       2 |           pp512 |      1490.25 ± 12.50 |
| qwen3moe ?B BF16               | 549.33 MiB |   287.98 M | CPU        |       2 |          pp2048 |       1203.50 ± 3.25 |
| qwen3moe ?B BF16               | 549.33 MiB |   287.98 M | CPU        |       2 |     tg64 @ d4096 |         90.00 ± 1.00 |
| qwen3moe ?B BF16               | 549.33 MiB |   287.98 M | CPU        |       2 |     pp512+tg128 |        600.00 ± 0.00 |

build: 0c1e570 (1)
"""


def test_batched_bench_markdown_rows():
    rows = peers.parse_batched_bench(BATCHED_MD)
    assert [r["pl"] for r in rows] == [1, 8, 32]
    assert rows[1] == {"pp": 128, "tg": 64, "pl": 8, "n_kv": 1536, "t_pp": 0.674,
                       "speed_pp": 1519.20, "t_tg": 1.330, "speed_tg": 384.96, "t": 2.004,
                       "speed": 766.47}


def test_batched_bench_jsonl_matches_markdown():
    md = {r["pl"]: r for r in peers.parse_batched_bench(BATCHED_MD)}
    js = peers.parse_batched_bench(BATCHED_JSONL)
    assert [r["pl"] for r in js] == [1, 8]
    for r in js:
        assert isinstance(r["pl"], int) and r["pp"] == 128
        assert r["speed_tg"] == pytest.approx(md[r["pl"]]["speed_tg"], abs=0.01)


def test_batched_bench_no_table_is_empty():
    assert peers.parse_batched_bench("main: error: unable to load model\n") == []


@pytest.mark.parametrize("text", [BENCH_JSON, BENCH_CSV, BENCH_MD], ids=["json", "csv", "md"])
def test_llama_bench_prompt_rows_agree_across_formats(text):
    rows = peers.parse_llama_bench(text)
    pp512 = [r for r in rows if r["n_prompt"] == 512 and r["n_gen"] == 0]
    assert len(pp512) == 1
    assert pp512[0]["avg_ts"] == pytest.approx(1490.25)
    assert pp512[0]["stddev_ts"] == pytest.approx(12.5)
    assert pp512[0]["n_threads"] == 2


def test_llama_bench_jsonl_and_depth():
    rows = peers.parse_llama_bench(BENCH_JSONL)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows] == [(2048, 0, 0), (0, 64, 4096)]
    md = peers.parse_llama_bench(BENCH_MD)
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in md] == \
        [(512, 0, 0), (2048, 0, 0), (0, 64, 4096), (512, 128, 0)]
    assert md[2]["avg_ts"] == pytest.approx(90.0)


def test_llama_bench_unknown_test_name_is_an_error():
    bad = BENCH_MD.replace("pp2048", "weird1")
    with pytest.raises(ValueError, match="weird1"):
        peers.parse_llama_bench(bad)


CONVERTER = '''\
class TextModel:
    def get_vocab_base_pre(self, tokenizer) -> str:
        chktxt = '\\n \\n\\n 3 33 🚀 I\\'ve been'

        chktok = tokenizer.encode(chktxt)
        chkhsh = sha256(str(chktok).encode()).hexdigest()

        res = None

        if chkhsh == "aaaa":
            res = "llama-bpe"

        if res is None:
            raise NotImplementedError("BPE pre-tokenizer was not recognized")
        return res
'''


def test_converter_patch_maps_our_hash_and_keeps_the_others():
    probe = peers.pre_tokenizer_probe(CONVERTER)
    assert probe == "\n \n\n 3 33 🚀 I've been"
    ids = [10, 20, 30]
    h = peers.pre_tokenizer_hash(ids)
    import hashlib
    assert h == hashlib.sha256(b"[10, 20, 30]").hexdigest()
    known = peers.pre_tokenizer_hash([5, 5])
    patched = peers.map_pre_tokenizer(CONVERTER.replace("aaaa", known), h)
    ns: dict = {}
    exec(patched, {"sha256": hashlib.sha256}, ns)     # the patched method must still run

    class Tok:
        def __init__(self, out):
            self.out = out

        def encode(self, _text):
            return self.out

    model = ns["TextModel"]()
    assert model.get_vocab_base_pre(Tok(ids)) == "gpt-2"
    assert model.get_vocab_base_pre(Tok([5, 5])) == "llama-bpe"
    with pytest.raises(NotImplementedError):          # other unknown tokenizers still refused
        model.get_vocab_base_pre(Tok([7, 7]))


def test_converter_patch_refuses_an_unknown_layout():
    with pytest.raises(ValueError, match="res = None"):
        peers.map_pre_tokenizer("chktxt = 'x'\nres = 1\n", "ab")
    with pytest.raises(ValueError, match="chktxt"):
        peers.pre_tokenizer_probe("def f(): pass\n")


def test_spread_quantiles():
    s = common.spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["n"] == 5
    assert s["p10"] == pytest.approx(1.4) and s["p90"] == pytest.approx(61.6)
    assert s["mean"] == pytest.approx(22.0)
    assert common.quantile([], 0.5) != common.quantile([], 0.5)      # NaN for no samples


def test_compare_takes_round_medians_and_ratios():
    rounds = [{"moed_decode": {1: 100.0, 8: 300.0}, "llama_decode": {1: 50.0, 8: 0.0},
               "moed_prefill": {512: 2000.0}, "llama_prefill": {512: 1000.0}},
              {"moed_decode": {1: 120.0, 8: 310.0}, "llama_decode": {1: 60.0},
               "moed_prefill": {512: 2200.0}, "llama_prefill": {512: 1100.0}},
              {"moed_decode": {1: 500.0, 8: 320.0}, "llama_decode": {1: 55.0},
               "moed_prefill": {512: 2100.0}, "llama_prefill": {512: 1050.0}}]
    two = peers.compare(rounds[:2], [1], [])          # an even count: the middle two's mean
    assert two["decode"][1]["moed"] == 110.0
    t = peers.compare(rounds, [1, 8, 32], [512])
    assert t["decode"][1] == {"moed": 120.0, "llama_cpp": 55.0, "ratio": 120.0 / 55.0}
    assert t["decode"][8]["moed"] == 310.0
    assert t["prefill"][512]["ratio"] == pytest.approx(2.0)
    assert t["decode"][8]["llama_cpp"] == 0.0 and t["decode"][8]["ratio"] != t["decode"][8]["ratio"]
    assert t["decode"][32]["moed"] != t["decode"][32]["moed"]        # no figure: NaN, not 0


def test_weight_bytes_a_decoded_token_reads():
    """Per layer q/k/v/o and top-k experts in the format, the router and lm_head in bf16."""
    from types import SimpleNamespace
    spec = SimpleNamespace(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, num_experts=4,
                           moe_intermediate_size=4, vocab_size=10, top_k=2, num_layers=3)
    # qkv [16, 8], o [8, 8], router [4, 8], gate_up [8, 8], down [8, 4], lm_head [10, 8]
    weights = 16 * 8 + 8 * 8 + 2 * (8 * 8 + 8 * 4)
    rows = 16 + 8 + 2 * (8 + 8)
    fixed = 3 * 2 * 4 * 8 + 2 * 10 * 8
    assert peers.decode_bytes_per_token(spec, "") == 3 * 2 * weights + fixed
    assert peers.decode_bytes_per_token(spec, "int8") == 3 * (weights + 4 * rows) + fixed
    assert peers.decode_bytes_per_token(spec, "int4") == pytest.approx(
        3 * (0.5 * weights + 4 / 128 * weights) + fixed)
    # model.quantization_lm_head int8 (what --quant runs against llama.cpp's quantized output)
    head = 2 * 10 * 8
    assert peers.decode_bytes_per_token(spec, "int4", "int8") == pytest.approx(
        3 * (0.5 * weights + 4 / 128 * weights) + fixed - head + (10 * 8 + 4 * 10))


def test_a_llama_tool_that_crashes_with_repacking_is_rerun_without_it(tmp_path, capsys):
    """llama.cpp's AMX path crashed on a Q8_0 MoE (SIGSEGV / SIGILL): the run turns weight
    repacking off (llama-bench --repack 0, llama-batched-bench -nr) for that call and the rest."""
    tools = {}
    for name, flag in (("llama-bench", "--repack"), ("llama-batched-bench", "-nr")):
        t = tmp_path / name
        t.write_text(f"#!/bin/sh\ncase \"$*\" in *{flag}*) echo ok-$#;; *) kill -SEGV $$;; esac\n")
        t.chmod(0o755)
        tools[name] = [str(t), "-m", "x.gguf"]
    repack = [True]
    got = peers.run_llama({"tg": tools["llama-batched-bench"], "pp": tools["llama-bench"]}, repack)
    assert repack == [False]
    assert got["tg"][0].strip() == "ok-3" and got["pp"][0].strip() == "ok-4"
    assert "repacking off" in capsys.readouterr().out
    # with repacking already off, a crash is an error, not a loop
    bad = tmp_path / "llama-bench2"
    bad.write_text("#!/bin/sh\nkill -SEGV $$\n")
    bad.chmod(0o755)
    with pytest.raises(SystemExit, match="crashed with repacking off too"):
        peers.run_llama({"pp": [str(bad)]}, repack)
