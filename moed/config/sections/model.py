"""[model], [engine], [structured] and [parallel]: what the node serves and how it steps."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import ConfigError, _check_bounds, _choice, _f, _short

MODEL_DTYPES = ("auto", "bfloat16", "float32", "float16")
QUANTIZATIONS = ("", "fp8", "int8", "int4")     # moed.model.quant.formats.ONLINE, "" = none/checkpoint's
LM_HEAD_QUANTIZATIONS = ("none", "int8", "model")   # moed.model.quant.formats.LM_HEAD
ACT_QUANTIZATIONS = ("none", "int8")    # moed.model.quant.actquant.ACTIVATIONS
TOOL_PARSERS = ("auto", "none", "qwen", "mistral")   # moed.api.tool_parsers.PARSER_SETTINGS
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")       # moed.model.kv_layout.kv_cache_dtype


@dataclass(frozen=True)
class ModelConfig:
    path: str = _f("", doc="Hugging Face checkpoint directory")
    served_name: str = _f("", doc="model id in the API; default: the directory name")
    dtype: str = _f("auto", doc="auto (from config.json) | bfloat16 | float32 | float16")
    device: str = _f("auto", doc="auto | cpu | cuda | cuda:N")
    max_model_len: int = _f(0, bounds=(0, 1 << 24),
                            doc="0 = the checkpoint's max_position_embeddings")
    tool_parser: str = _f("auto", doc="format of the model's tool calls: auto (from the chat "
                                      "template, then model_type) | qwen | mistral | none")
    quantization: str = _f("", doc="weights quantized at load (vLLM's --quantization): fp8 "
                                   "(128x128 blocks) | int8 (per output channel) | int4 (groups "
                                   "of quantization_group_size); \"\" = the checkpoint's own "
                                   "(quantization_config) or none")
    quantization_group_size: int = _f(128, bounds=(2, 1 << 16),
                                      doc="input columns per int4 scale (model.quantization int4)")
    quantization_lm_head: str = _f("none", doc="the logits head on a quantized model: none "
                                   "(plain, the checkpoint's numbers) | int8 (per output "
                                   "channel) | model (the model's format; a checkpoint's "
                                   "quantized lm_head kept as stored)")
    quantization_activations: str = _f("none", doc="activations of the quantized matmuls on "
                                       "few rows (decode): none (exact, fp32 sums of the "
                                       "dequantized weight) | int8 (each row quantized per "
                                       "weight group, integer dot products; int8/int4 weights)")
    batch_invariant: bool = _f(False, doc="a row's result does not depend on the other rows of "
                               "its step: every bf16 matmul on the native CPU kernel at every "
                               "row count (no oneDNN class), so a migrated greedy stream is "
                               "identical at any concurrency (docs/migration.md), and "
                               "speculative decoding's greedy output is plain decoding's token "
                               "for token; costs the AMX speed-up of large batches and prefill")

    def __post_init__(self) -> None:
        _check_bounds("model", self)
        if self.batch_invariant and (self.quantization or self.dtype == "float16"
                                     or self.device.startswith("cuda")):
            raise ConfigError("model.batch_invariant: measured for bf16 (native CPU kernels) "
                              "and float32 weights on CPU only; not with model.quantization, "
                              "dtype float16 or a CUDA device")
        _choice("model.dtype", self.dtype, MODEL_DTYPES)
        _choice("model.tool_parser", self.tool_parser, TOOL_PARSERS)
        _choice("model.quantization", self.quantization, QUANTIZATIONS)
        _choice("model.quantization_lm_head", self.quantization_lm_head, LM_HEAD_QUANTIZATIONS)
        _choice("model.quantization_activations", self.quantization_activations, ACT_QUANTIZATIONS)
        if self.quantization_group_size % 2:
            raise ConfigError(f"model.quantization_group_size: {self.quantization_group_size} "
                              f"is odd; two int4 values share a byte")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device: {_short(self.device)} is not auto, cpu, cuda "
                              f"or cuda:N")


@dataclass(frozen=True)
class EngineConfig:
    attention_backend: str = _f("auto", doc="auto | torch | flashinfer")
    block_size: int = _f(16, bounds=(1, 1024), doc="tokens per KV block")
    num_kv_blocks: int = _f(0, bounds=(0, 1 << 24),
                            doc="0 = size from kv_cache_memory_fraction or kv_cache_memory_mb")
    kv_cache_memory_mb: int = _f(512, bounds=(1, 1 << 24),
                                 doc="KV cache size in MB (unless the fraction is set)")
    kv_cache_memory_fraction: float = _f(0.0, bounds=(0, 0.95),
                                         doc="KV cache = this share of the memory still "
                                         "available at start beside the weights (host "
                                         "MemAvailable capped by the cgroup; free GPU memory); "
                                         "0 = use kv_cache_memory_mb")
    kv_cache_dtype: str = _f("auto", doc="auto: the model's dtype | fp8 (= fp8_e4m3: float8 "
                                         "e4m3, a fixed scale of 1.0 per layer, half the bytes "
                                         "of bf16; vLLM's fp8_e5m2 is refused)")
    enable_prefix_caching: bool = _f(True)
    max_num_seqs: int = _f(64, live=True, bounds=(1, 1 << 16), doc="running requests per step")
    max_num_batched_tokens: int = _f(512, live=True, bounds=(1, 1 << 24),
                                     doc="token budget per step (chunked prefill)")
    num_threads: int = _f(0, bounds=(0, 1024),
                          doc="torch intra-op threads of the step; 0 = auto: OMP_NUM_THREADS "
                              "if set, else the cores this process may use minus one")

    def __post_init__(self) -> None:
        _check_bounds("engine", self)
        _choice("engine.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ConfigError("engine.kv_cache_dtype: fp8_e5m2 is not supported; moed's fp8 KV "
                              "cache is e4m3 (fp8 or fp8_e4m3)")
        _choice("engine.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.num_kv_blocks and self.kv_cache_memory_fraction:
            raise ConfigError("engine.kv_cache_memory_fraction: set it or engine.num_kv_blocks, "
                              "not both (each sizes the KV cache)")



@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism (moed/parallel, docs/parallel.md): ep_size `moed serve` processes,
    one per rank, each with its own HTTP port, scheduler and KV cache, hold the experts
    between them; attention is data parallel. The group's ranks must agree on every field."""
    ep_size: int = _f(1, bounds=(1, 1024), doc="ranks in the expert-parallel group; 1 = off")
    ep_rank: int = _f(0, bounds=(0, 1023), doc="this process's rank, 0 .. ep_size-1")
    ep_init: str = _f("", doc="tcp://host:port of rank 0's rendezvous (rank 0 listens "
                      "there); required when ep_size > 1")
    collective_timeout_s: float = _f(30.0, bounds=(0.1, 3600),
                                     doc="a peer silent this long in a step's exchange fails "
                                     "the group: in-flight requests end 503, the node exits 1")
    rendezvous_timeout_s: float = _f(300.0, bounds=(1, 86400),
                                     doc="how long a starting rank waits for the others")
    rank_memory_mb: int = _f(0, bounds=(0, 1 << 30),
                             doc="memory this rank may use for weights (dense + its experts) "
                             "and KV blocks; a start that does not fit is refused (0 = no check)")
    redundant_experts: int = _f(0, bounds=(0, 1024),
                                doc="extra expert slots per rank per MoE layer, beyond "
                                "ceil(experts / ep_size): replicas of hot experts (EPLB)")
    eplb_interval_s: float = _f(0.0, bounds=(0, 7 * 86400),
                                doc="seconds between expert-balancer decisions over the group's "
                                "expert-load window (0 = the initial layout is kept)")
    eplb_min_gain: float = _f(0.01, bounds=(0, 1),
                              doc="a layer's map changes only if its predicted balancedness "
                              "gain exceeds this")
    eplb_layers_per_step: int = _f(1, bounds=(1, 1024),
                                   doc="MoE layers whose new expert map is applied per step "
                                   "while a rebalance is under way")
    eplb_step_mb: float = _f(2.0, bounds=(0, 1 << 20),
                             doc="expert-weight MB a rank sends, receives or copies per step "
                             "while a rebalance is under way (at least one expert; a layer "
                             "switches once all its experts are in); 0 = whole layers")

    def __post_init__(self) -> None:
        # the checks across fields (ep_rank < ep_size, ep_init given) run in the pre-flight
        # (moed/config/rules.py: parallel), so each field loads alone at its bounds
        _check_bounds("parallel", self)
        if self.ep_init:
            host, _, port = self.ep_init.removeprefix("tcp://").rpartition(":")
            if not self.ep_init.startswith("tcp://") or not host or not port.isdigit() \
                    or not 0 < int(port) < 65536:
                raise ConfigError(f"parallel.ep_init: {_short(self.ep_init)} is not "
                                  f"tcp://host:port")



@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs' budget (moed/model/grammar.py, docs/api.md): grammars compile on
    their own pool before admission, under a time budget and llguidance's limits; a request
    whose grammar overruns them is a 400 `grammar_too_complex`, alone."""
    compile_workers: int = _f(2, bounds=(1, 64), doc="threads that compile grammars (apart "
                              "from the parse/tokenize pool)")
    compile_queue: int = _f(32, bounds=(1, 4096), doc="compilations waiting for a worker; "
                            "beyond this: 429 grammar_busy")
    compile_queue_timeout_s: float = _f(10.0, bounds=(0.01, 3600.0), doc="a compilation not "
                                        "started within this: 429 grammar_busy")
    compile_timeout_s: float = _f(2.0, bounds=(0.01, 600.0), doc="one grammar's compile and "
                                  "probe budget (wall clock): past it, 400 grammar_too_complex")
    mask_timeout_ms: int = _f(100, bounds=(1, 60000), doc="a request whose token mask is still "
                              "computing this long after it began is failed alone (400 "
                              "grammar_too_complex)")
    mask_workers: int = _f(2, bounds=(1, 64), doc="threads that compute token masks while the "
                           "forward pass runs")
    probe_tokens: int = _f(8, bounds=(1, 1024), doc="tokens tried at each of the compile "
                           "probe's first step")
    probe_depth: int = _f(3, bounds=(1, 64), doc="steps the compile probe walks")
    max_grammar_size: int = _f(500_000, bounds=(1, 1 << 32), doc="llguidance: symbols in the "
                               "grammar's productions")
    initial_lexer_fuel: int = _f(1_000_000, bounds=(1, 1 << 40), doc="llguidance: lexer "
                                 "construction fuel (~50k/ms)")
    step_lexer_fuel: int = _f(200_000, bounds=(1, 1 << 40), doc="llguidance: one mask's lexer "
                              "fuel (~14k/ms)")
    step_max_items: int = _f(50_000, bounds=(1, 1 << 32), doc="llguidance: Earley items per "
                             "mask (~20k/ms)")
    max_items_in_row: int = _f(2_000, bounds=(1, 1 << 32), doc="llguidance: items in one "
                               "Earley row (a schema of many optional properties hits it)")
    max_lexer_states: int = _f(250_000, bounds=(1, 1 << 32), doc="llguidance: lexer states "
                               "per grammar, shared by its requests (~1-2 kB each)")

    def __post_init__(self) -> None:
        _check_bounds("structured", self)
