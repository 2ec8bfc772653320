"""The flag table of `moed serve` and `check-config`: each flag of `FLAGS` sets one config
field; the flags vLLM operators know take vLLM's names; one moed cannot honour (`REFUSED`,
`REFUSED_SWITCHES`) is an error, never ignored; one for what moed always does (`SAME`) is
accepted only with a value that means that. settings.resolve applies the refusals.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from moed import __version__
from moed.config import (ACT_QUANTIZATIONS, ATTENTION_BACKENDS, LM_HEAD_QUANTIZATIONS, LOG_FORMATS, LOG_LEVELS,
                         MODEL_DTYPES, QUANTIZATIONS, ROLES)


@dataclass(frozen=True)
class Flag:
    """A command-line flag that sets one config field ("section.field")."""
    name: str
    field: str
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    short: str | None = None        # vLLM's one-letter alias, where it has one

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


# vLLM's spellings, which moed's config reads under its own names
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


# vLLM's --tool-call-parser names for the formats moed parses (model.tool_parser); moed's own
# names pass as they are, any other is refused by model.tool_parser's check
TOOL_PARSER_ALIASES = {"hermes": "qwen"}


def _tool_parser(value: str) -> str:
    return TOOL_PARSER_ALIASES.get(value, value)


def _comma_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


FLAGS: tuple[Flag, ...] = (
    Flag("--role", "server.role", "what this node does", choices=ROLES),
    Flag("--host", "server.host", "address the HTTP API listens on"),
    Flag("--port", "server.port", "HTTP port (0: any free one)", int),
    Flag("--node-name", "server.node_name", "unique in the cluster (default: hostname-port)",
         metavar="NAME"),
    Flag("--served-model-name", "model.served_name",
         "the model id in the API (default: the directory name)", metavar="NAME"),
    Flag("--max-model-len", "model.max_model_len",
         "context length in tokens (default: the checkpoint's max_position_embeddings)", int,
         metavar="TOKENS"),
    Flag("--max-num-seqs", "engine.max_num_seqs", "requests running at once", int, metavar="N"),
    Flag("--max-num-batched-tokens", "engine.max_num_batched_tokens",
         "tokens per engine step (chunked prefill)", int, metavar="N"),
    Flag("--kv-cache-memory", "engine.kv_cache_memory_mb",
         "KV cache size in MB (unless engine.num_kv_blocks is set)", int, metavar="MB"),
    Flag("--kv-cache-memory-fraction", "engine.kv_cache_memory_fraction",
         "KV cache = this share of the memory left beside the weights at start", float,
         metavar="F"),
    Flag("--block-size", "engine.block_size", "tokens per KV block", int, metavar="N"),
    Flag("--dtype", "model.dtype", "weights and KV dtype; auto: the checkpoint's (vLLM's "
         "half and float are float16 and float32)", _dtype, MODEL_DTYPES),
    Flag("--kv-cache-dtype", "engine.kv_cache_dtype", "auto: the model's dtype; fp8 "
         "(fp8_e4m3): float8 e4m3 KV, half of bf16's bytes (fp8_e5m2 is refused)",
         metavar="DTYPE"),
    Flag("--device", "model.device", "auto, cpu, cuda or cuda:N"),
    Flag("--quantization", "model.quantization", "quantize a bf16 checkpoint's weights at load "
         "(a quantized checkpoint's own format needs no flag)", choices=QUANTIZATIONS[1:],
         short="-q"),
    Flag("--quantization-lm-head", "model.quantization_lm_head", "the logits head on a "
         "quantized model: int8 (per output channel) or model (the model's format); none: "
         "plain", choices=LM_HEAD_QUANTIZATIONS),
    Flag("--quantization-activations", "model.quantization_activations", "int8: the quantized "
         "matmuls of decode on int8 activations (integer dot products); none: exact",
         choices=ACT_QUANTIZATIONS),
    Flag("--attention-backend", "engine.attention_backend", "attention kernels",
         choices=ATTENTION_BACKENDS),
    Flag("--log-format", "server.log_format", "console: human-readable lines instead of JSON",
         choices=LOG_FORMATS),
    Flag("--log-level", "server.log_level", "lowest level logged", choices=LOG_LEVELS),
    Flag("--ep-size", "parallel.ep_size", "ranks in this node's expert-parallel group", int,
         metavar="N"),
    Flag("--ep-rank", "parallel.ep_rank", "this process's rank in the group", int, metavar="R"),
    Flag("--ep-init", "parallel.ep_init", "rank 0's rendezvous, tcp://host:port",
         metavar="URL"),
    Flag("--experts-resident-bytes", "experts.resident_bytes", "bytes of routed-expert "
         "weights kept resident; the rest are read from the checkpoint when routed to (0 = all)",
         int, metavar="BYTES"),
    Flag("--experts-move-bytes-per-step", "experts.move_bytes_per_step", "bytes of hot "
         "experts promoted from disk between two steps", int, metavar="BYTES"),
    Flag("--experts-heat-half-life", "experts.heat_half_life_steps", "steps over which an "
         "expert's heat halves", float, metavar="STEPS"),
    Flag("--experts-prefetch", "experts.prefetch_experts", "experts read ahead by layer-ahead "
         "prediction, staged at most this many at a time (-1 auto, 0 off)", int, metavar="N"),
    Flag("--tool-call-parser", "model.tool_parser", "format of the model's tool calls (vLLM's "
         "hermes is qwen)", _tool_parser, metavar="NAME"),
    Flag("--vllm-metrics-path", "server.vllm_metrics_path", "also export the vLLM-named "
         "gauges routers scrape at this path (/metrics: in moed's own scrape)", metavar="PATH"),
    Flag("--priority-classes", "priority.classes", "request priority classes, comma-separated "
         "NAME=PRIORITY (lower runs first), e.g. interactive=0,batch=10", _comma_list,
         metavar="LIST"),
    Flag("--priority-default-class", "priority.default_class", "the class of a request whose "
         "API key names none", metavar="NAME"),
)

# vLLM's on/off flags with a moed field of the same meaning: --X sets it, --no-X clears it
SWITCHES: tuple[Flag, ...] = (
    Flag("--enable-prefix-caching", "engine.enable_prefix_caching",
         "reuse the KV blocks of a cached prompt prefix (on by default)"),
    Flag("--batch-invariant", "model.batch_invariant",
         "a row's result independent of its batch: native CPU kernels at every row count"),
)

# vLLM flags with no honest moed equivalent: refused with the reason, never ignored
REFUSED = {
    "--gpu-memory-utilization": "moed sizes the KV cache in MB, not as a share of GPU memory "
                                "(it runs on CPUs too): use --kv-cache-memory MB",
    "--tokenizer": "moed reads the tokenizer from the checkpoint directory (tokenizer.json, "
                   "tokenizer_config.json): put it there",
    "--chat-template": "moed renders the checkpoint's chat template (tokenizer_config.json's "
                       "chat_template): put yours there",
    "--cpu-offload-gb": "moed keeps the weights on the device it runs on; run on CPU "
                        "(--device cpu) or spread the experts over processes (--ep-size N, "
                        "docs/parallel.md)",
    "--revision": "moed serves a local checkpoint directory: download the revision first "
                  "(huggingface-cli download MODEL --revision R --local-dir DIR), then "
                  "moed serve DIR",
    "--download-dir": "moed serves a local checkpoint directory and downloads nothing: "
                      "moed serve DIR",
    "--reasoning-parser": "moed returns the model's thinking inside content (no "
                          "reasoning_content); chat_template_kwargs {\"enable_thinking\": "
                          "false} turns it off per request where the template reads it",
    "--seed": "moed has no server-wide seed: a request's `seed` field makes its sampling "
              "reproducible",
}
REFUSED_SHORT: dict[str, str] = {}

# vLLM on/off flags moed cannot honour: refused with the reason (they take no value)
REFUSED_SWITCHES = {
    "--trust-remote-code": "moed never runs code from a checkpoint: it serves the "
                           "architectures it implements (docs/models.md) from config.json and "
                           "safetensors; drop the flag",
    "--enable-expert-parallel": "moed's expert parallelism is one process per rank, sized by "
                                "--ep-size N with --ep-rank and --ep-init (docs/parallel.md)",
    "--no-enable-chunked-prefill": "moed always chunks prefill; a step's token budget is "
                                   "--max-num-batched-tokens",
    "--enable-log-requests": "moed does not log prompts or sampling parameters; each request "
                             "gets one 'access' log line (status, token counts, latency)",
    "--enable-lora": "moed serves no LoRA adapters",
}
REFUSED_SWITCH_SHORT = {"--enable-expert-parallel": "-ep"}


@dataclass(frozen=True)
class Same:
    """A vLLM flag for what moed always does: accepted (with a log line) only with a value that
    means that, refused naming what moed does instead otherwise. ok=(): a switch, no value."""
    name: str
    short: str | None
    does: str                                 # what moed does (the log line)
    instead: str = ""                         # the refusal of any other value
    ok: tuple[str, ...] = ()


SAME: tuple[Same, ...] = (
    Same("--tensor-parallel-size", "-tp", "one process holds each layer whole: no tensor "
         "parallelism", "moed has no tensor parallelism; a MoE model's experts spread over "
         "processes with --ep-size N (docs/parallel.md)", ("1",)),
    Same("--pipeline-parallel-size", "-pp", "one process holds every layer: no pipeline "
         "parallelism", "moed has no pipeline parallelism; a MoE model's experts spread over "
         "processes with --ep-size N (docs/parallel.md)", ("1",)),
    Same("--data-parallel-size", "-dp", "one engine per node", "a moed node runs one engine: "
         "run more nodes behind a router (docs/cluster.md; an --ep-size group's attention is "
         "data parallel already)", ("1",)),
    Same("--load-format", None, "weights are read from safetensors",
         "moed reads safetensors checkpoints only", ("auto", "safetensors")),
    Same("--swap-space", None, "preempted requests are recomputed, never swapped",
         "moed preempts by recomputing and keeps no swap space (a host-memory tier for "
         "cached prefixes is tiers.host_bytes, docs/kv-tiers.md)", ("0", "0.0")),
    Same("--enforce-eager", None, "the model runs eagerly: moed captures no CUDA graphs"),
    Same("--enable-chunked-prefill", None, "prefill is always chunked, at most "
         "--max-num-batched-tokens a step"),
    Same("--disable-log-requests", None, "prompts and sampling parameters are never logged "
         "(one 'access' line per request: status, token counts, latency)"),
    Same("--enable-auto-tool-choice", None, "tool calls are parsed under tool_choice auto "
         "(the format: --tool-call-parser, model.tool_parser)"),
)
# --api-key: the keys go to the server through this variable of the process's own
# environment, named by server.api_keys_env, which moed.api.auth.load_keys reads (also on
# SIGHUP): the key stays out of the config, of check-config's output and of /admin/config.
API_KEYS_ENV = "_MOED_CLI_API_KEYS"


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"moed {__version__}")
    p.add_argument("--config", metavar="FILE", help="TOML config (default: built-in defaults)")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (model.path)")
    p.add_argument("--api-key", dest="api_key", action="append", metavar="KEY",
                   help="require this Bearer key on /v1/* (may repeat; server.api_keys_file's "
                   "keys still count, server.api_keys_env is replaced). Visible in ps: prefer "
                   "server.api_keys_file in production")
    for f in FLAGS:
        p.add_argument(*(f.name, f.short) if f.short else (f.name,), dest=f.dest, type=f.type, choices=f.choices, metavar=f.metavar,
                       help=f"{f.help} ({f.field})")
    for f in SWITCHES:
        p.add_argument(f.name, dest=f.dest, action=argparse.BooleanOptionalAction,
                       default=None, help=f"{f.help} ({f.field})")
    vllm = p.add_argument_group("vLLM flags for what moed always does (any other value is "
                                "refused)")
    for same in SAME:
        names = (same.name, same.short) if same.short else (same.name,)
        if same.ok:
            vllm.add_argument(*names, dest=same_dest(same.name), metavar="|".join(same.ok),
                              help=same.does)
        else:
            vllm.add_argument(*names, dest=same_dest(same.name), action="store_const",
                              const="", help=same.does)
    refused = p.add_argument_group("vLLM flags moed refuses (the reason is the error)")
    for name, why in REFUSED.items():
        names = (name, REFUSED_SHORT[name]) if name in REFUSED_SHORT else (name,)
        refused.add_argument(*names, dest=refused_dest(name), metavar="X", help=why)
    for name, why in REFUSED_SWITCHES.items():
        names = (name, REFUSED_SWITCH_SHORT[name]) if name in REFUSED_SWITCH_SHORT else (name,)
        refused.add_argument(*names, dest=refused_dest(name), action="store_const", const="",
                             help=why)
    p.add_argument("--kv-events-config", dest="kv_events_config", metavar="JSON",
                   help="vLLM's KV-events JSON, e.g. '{\"enable_kv_cache_events\": true, "
                   "\"endpoint\": \"tcp://*:5557\"}' (the [kv_events] section; "
                   "docs/kv-events.md)")
    p.add_argument("--speculative-config", dest="speculative_config", metavar="JSON",
                   help="vLLM's speculative-decoding JSON, e.g. '{\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' (the "
                   "[speculative] section; docs/speculative.md)")


def refused_dest(name: str) -> str:
    return "refused_" + name.removeprefix("--").replace("-", "_")


def same_dest(name: str) -> str:
    return "vllm_" + name.removeprefix("--").replace("-", "_")
