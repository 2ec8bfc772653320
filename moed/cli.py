"""`moed` command line: serve, check-config, model init, model kernels, and the operator's
release commands against a running node's admin API: canary, config history|rollback|show,
and the scaling planner (plan).

Precedence of settings: defaults < TOML (--config) < MOED_<SECTION>_<FIELD> environment <
flags. Each flag of `FLAGS` sets one config field; the flags vLLM operators know take vLLM's
names, and one moed cannot honour (`REFUSED`) is an error, never ignored. Errors in any of
them stop the command with a one-line message and exit code 2; `serve` and `check-config`
refuse the same things (moed/preflight.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, MutableMapping, Sequence

from moed import __version__
from moed.config import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, LOG_FORMATS, LOG_LEVELS,
                         MODEL_DTYPES, QUANTIZATIONS, ROLES, TOOL_PARSERS, Config, ConfigError,
                         load)


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
    Flag("--tool-call-parser", "model.tool_parser", "format of the model's tool calls (vLLM's "
         "hermes is qwen)", _tool_parser, metavar="NAME"),
    Flag("--vllm-metrics-path", "server.vllm_metrics_path", "also export the vLLM-named "
         "gauges routers scrape at this path (/metrics: in moed's own scrape)", metavar="PATH"),
)

# vLLM's on/off flags with a moed field of the same meaning: --X sets it, --no-X clears it
SWITCHES: tuple[Flag, ...] = (
    Flag("--enable-prefix-caching", "engine.enable_prefix_caching",
         "reuse the KV blocks of a cached prompt prefix (on by default)"),
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


def _add_config_flags(p: argparse.ArgumentParser) -> None:
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
            vllm.add_argument(*names, dest=_same_dest(same.name), metavar="|".join(same.ok),
                              help=same.does)
        else:
            vllm.add_argument(*names, dest=_same_dest(same.name), action="store_const",
                              const="", help=same.does)
    refused = p.add_argument_group("vLLM flags moed refuses (the reason is the error)")
    for name, why in REFUSED.items():
        names = (name, REFUSED_SHORT[name]) if name in REFUSED_SHORT else (name,)
        refused.add_argument(*names, dest=_refused_dest(name), metavar="X", help=why)
    for name, why in REFUSED_SWITCHES.items():
        names = (name, REFUSED_SWITCH_SHORT[name]) if name in REFUSED_SWITCH_SHORT else (name,)
        refused.add_argument(*names, dest=_refused_dest(name), action="store_const", const="",
                             help=why)
    p.add_argument("--kv-events-config", dest="kv_events_config", metavar="JSON",
                   help="vLLM's KV-events JSON, e.g. '{\"enable_kv_cache_events\": true, "
                   "\"endpoint\": \"tcp://*:5557\"}' (the [kv_events] section; "
                   "docs/kv-events.md)")


def _refused_dest(name: str) -> str:
    return "refused_" + name.removeprefix("--").replace("-", "_")


def _same_dest(name: str) -> str:
    return "vllm_" + name.removeprefix("--").replace("-", "_")


def _one(what: str, positional: str | None, flag: str | None) -> str | None:
    if positional and flag and Path(positional) != Path(flag):
        raise ConfigError(f"command line: {what} {positional} and --{what.lower()} {flag} "
                          f"differ; give one")
    return positional or flag


def _resolve(args: argparse.Namespace) -> None:
    """The positional MODEL/CONFIG folded into --model/--config; refused flags and bad keys
    as ConfigErrors."""
    args.model = _one("MODEL", getattr(args, "model_pos", None), args.model)
    args.config = _one("CONFIG", getattr(args, "config_pos", None), args.config)
    if args.config and Path(args.config).is_dir():     # `check-config DIR`, as `serve MODEL`
        what = "CONFIG" if getattr(args, "config_pos", None) else "--config"
        raise ConfigError(f"command line: {what} {args.config} is a directory: {what} is a "
                          f"TOML file; the model goes in --model (moed "
                          f"{getattr(args, 'command', 'check-config')} --model {args.config})")
    parser = getattr(args, "tool_call_parser", None)
    if parser is not None and parser not in TOOL_PARSERS:
        raise ConfigError(f"command line: --tool-call-parser {parser}: moed parses "
                          f"{', '.join(TOOL_PARSERS)} (vLLM's hermes is qwen)")
    kv_dtype = getattr(args, "kv_cache_dtype", None)
    if kv_dtype == "fp8_e5m2":
        raise ConfigError("command line: --kv-cache-dtype fp8_e5m2 is not supported: moed's fp8 "
                          "KV cache is e4m3 (fp8 or fp8_e4m3)")
    if kv_dtype is not None and kv_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"command line: --kv-cache-dtype {kv_dtype}: expected "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    for name in (*REFUSED, *REFUSED_SWITCHES):
        if getattr(args, _refused_dest(name), None) is not None:
            why = REFUSED.get(name) or REFUSED_SWITCHES[name]
            raise ConfigError(f"command line: {name} is not supported: {why}")
    args.vllm_same = []       # (flag, value, what moed does): logged once logging is set up
    for same in SAME:
        value = getattr(args, _same_dest(same.name), None)
        if value is None:
            continue
        if same.ok and value not in same.ok:
            raise ConfigError(f"command line: {same.name} {value} is not supported: "
                              f"{same.instead}")
        args.vllm_same.append((same.name, value, same.does))
    for key in args.api_key or ():
        if not key.strip() or "," in key:   # server.api_keys_env holds comma-separated keys
            raise ConfigError("command line: --api-key: a key must be non-empty and hold no comma")


def kv_events_json(text: str) -> dict[str, Any]:
    """--kv-events-config: vLLM's JSON object as [kv_events] values; an unknown key is an
    error naming it (vLLM's null for publisher or replay_endpoint is moed's empty string)."""
    from moed.config import KVEventsConfig

    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"command line: --kv-events-config: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError("command line: --kv-events-config: expected a JSON object")
    known = [f.name for f in dataclasses.fields(KVEventsConfig)]
    unknown = [k for k in obj if k not in known]
    if unknown:
        raise ConfigError(f"command line: --kv-events-config: unknown key"
                          f"{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(known)})")
    return {k: "" if v is None and k in ("publisher", "replay_endpoint") else v
            for k, v in obj.items()}


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"model": {"path": args.model}, "server": {}}
    for f in (*FLAGS, *SWITCHES):
        section, key = f.field.split(".")
        out.setdefault(section, {})[key] = getattr(args, f.dest)
    if getattr(args, "kv_events_config", None) is not None:
        out["kv_events"] = kv_events_json(args.kv_events_config)
    if args.api_key:
        out["server"]["api_keys_env"] = API_KEYS_ENV
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def to_toml(cfg: Config) -> str:
    lines = [f"# effective config (digest {cfg.digest()})"]
    for sec in dataclasses.fields(cfg):
        lines.append(f"\n[{sec.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, sec.name)).items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _load(args: argparse.Namespace) -> Config:
    _resolve(args)
    if args.api_key:
        os.environ[API_KEYS_ENV] = ",".join(k.strip() for k in args.api_key)
    cfg = load(args.config, environ=os.environ, overrides=_overrides(args))
    _refuse_model_flags_on_a_router(args, cfg)
    return cfg


def _refuse_model_flags_on_a_router(args: argparse.Namespace, cfg: Config) -> None:
    """A router has no engine: those flags would do nothing there. `--model` is taken: the
    router reads the checkpoint's tokenizer (never its weights) to hash prompt prefixes for
    prefix-affinity placement (moed.api.affinity)."""
    if cfg.server.role != "router":
        return
    given = [
        f.name for f in (*FLAGS, *SWITCHES)
        if f.field.startswith(("model.", "engine.")) and getattr(args, f.dest) is not None]
    if given:
        raise ConfigError(f"command line: {', '.join(given)}: a router node has no model or "
                          f"engine for {'them' if len(given) > 1 else 'it'}")


def _configure_logs(cfg: Config, args: argparse.Namespace | None = None) -> None:
    from moed.config import node_name
    from moed.obs import log as obslog

    obslog.configure(cfg.server.log_format, cfg.server.log_level, role=cfg.server.role,
                     node=node_name(cfg))
    if args is not None and getattr(args, "vllm_same", None):
        import structlog

        log = structlog.get_logger(__name__)
        for flag, value, does in args.vllm_same:   # accepted: say why it changes nothing
            log.info("vllm_flag_accepted", flag=flag, value=value or None,
                     detail=f"moed does this anyway: {does}")
    if args is not None:
        import structlog

        for f in SWITCHES:     # vLLM's switches set a moed field: say which, and to what
            on = getattr(args, f.dest, None)
            if on is not None:
                structlog.get_logger(__name__).info(
                    "vllm_flag_applied", flag=f.name if on else f"--no-{f.name[2:]}",
                    field=f.field, value=on)


def cmd_check_config(args: argparse.Namespace) -> int:
    from moed import preflight

    cfg = _load(args)
    _configure_logs(cfg, args)   # on stderr: stdout is the config alone
    preflight.check(cfg)
    sys.stdout.write(to_toml(cfg))
    return 0


# torch's CPU allocator puts large tensors in transparent huge pages when this is set (read at
# each allocation): NIXL then moves KV at >= 60% of memcpy speed, far less without it
# (bench/kv_transfer.py). Nodes that transfer KV get it unless the operator chose otherwise.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def kv_transfer_env(role: str, environ: MutableMapping[str, str]) -> bool:
    """Set THP_MEM_ALLOC_ENABLE=1 for prefill/decode nodes when unset; True if it is on."""
    if role in ("prefill", "decode"):
        environ.setdefault(THP_ENV, "1")
    return environ.get(THP_ENV, "") not in ("", "0")


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    thp = kv_transfer_env(cfg.server.role, os.environ)   # before the engine allocates anything
    import structlog
    import uvloop

    from moed import preflight
    from moed.app import App

    _configure_logs(cfg, args)
    preflight.check(cfg)         # what check-config checks: refused before listening
    if cfg.server.role != "router":
        structlog.get_logger(__name__).info("cpu_huge_pages", thp_alloc=thp)
    # torch threads are set by Engine.from_config, in the loader thread (the router never
    # imports torch at all).

    async def main() -> int:
        return await App(cfg, config_path=args.config, overrides=_overrides(args)).run()

    return uvloop.run(main())


def cmd_model_init(args: argparse.Namespace) -> int:
    from moed.dev import checkpoint as model_init

    return int(model_init.main(args) or 0)


def cmd_model_kernels(args: argparse.Namespace) -> int:
    """Build (or find) every variant of the native CPU kernels and print each .so path (one a
    line, fastest variant first); load those this CPU runs. 1 with the reason if one fails."""
    from moed.model import kernels
    from moed.obs import log as obslog

    obslog.configure("console")      # log lines on stderr: stdout is just the paths
    cache = Path(args.cache) if args.cache else None
    for isa in kernels.ISAS:         # a cache made on one machine serves every CPU that shares it
        try:
            path = kernels.build(cache, isa)
        except kernels.KernelUnavailable as e:
            print(f"moed: CPU kernels cannot be built here: {e}", file=sys.stderr)
            return 1
        print(path)                      # stdout: just the paths, whatever follows
        if why := kernels.isa_missing(isa):      # built for another machine (e.g. an image build)
            print(f"moed: {isa} built, not loaded: {why}", file=sys.stderr)
            continue
        try:
            kernels.CpuKernels(path, isa)
        except (kernels.KernelUnavailable, OSError) as e:
            print(f"moed: {path} does not load: {e}", file=sys.stderr)
            return 1
    return 0


# ---- release commands: a running node's admin API (moed/api/admin.py, moed/roles/router.py) ----

class AdminCallFailed(Exception):
    """The admin call did not get an answer it could use; str() is the one-line reason."""


def _admin_token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            text = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise AdminCallFailed(f"--token-file {args.token_file}: {e.strerror or e}") from None
    elif args.token_env:
        text = os.environ.get(args.token_env, "").strip()
        if not text:
            raise AdminCallFailed(f"--token-env {args.token_env}: the variable is unset or empty")
    else:
        raise AdminCallFailed("give the admin token: --token-file FILE or --token-env VAR")
    return text.splitlines()[0].split(",")[0].strip()    # the first of several (rotation)


def _admin_call(args: argparse.Namespace, method: str, path: str) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of an admin call; AdminCallFailed when there is no JSON answer."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(args.url.rstrip("/") + path, method=method, data=(
        b"" if method == "POST" else None), headers={
        "Authorization": f"Bearer {_admin_token(args)}"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise AdminCallFailed(f"{args.url}: {getattr(e, 'reason', e)}") from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise AdminCallFailed(f"{args.url}{path}: HTTP {status}, not JSON") from None
    if not isinstance(body, dict):
        raise AdminCallFailed(f"{args.url}{path}: HTTP {status}, unexpected body")
    return status, body


def _refused(status: int, body: dict[str, Any]) -> str:
    err = body.get("error")
    msg = err.get("message", "") if isinstance(err, dict) else str(err or body)
    return f"HTTP {status}: {msg}"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


CANARY_EXIT = {"healthy": 0, "unhealthy": 1, "insufficient_data": 3}


def cmd_canary(args: argparse.Namespace) -> int:
    """Canary vs baseline from a router; exit 0 healthy, 1 unhealthy, 3 too little data."""
    status, body = _admin_call(args, "GET", "/admin/canary")
    if status != 200:
        raise AdminCallFailed(_refused(status, body))
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        print(f"canary label {body['label'] or '(none)'}  share {body['share']:g}  "
              f"window {body['window_s']:g} s")
        print(f"{'':10} {'attempts':>9} {'errors':>7} {'err rate':>9} {'TTFT p50':>10} "
              f"{'TTFT p95':>10} {'ITL p50':>10}")
        for side in ("canary", "baseline"):
            f = body[side]
            print(f"{side:10} {f['requests']:>9} {f['errors']:>7} {f['error_rate']:>9.3f} "
                  f"{_ms(f['ttft_p50_s']):>10} {_ms(f['ttft_p95_s']):>10} "
                  f"{_ms(f['itl_p50_s']):>10}")
    verdict = body.get("verdict")
    if not isinstance(verdict, dict):
        print("moed: no canary configured (canary.label)", file=sys.stderr)
        return 2
    if not args.json:
        print(f"verdict: {verdict['health']}")
        for reason in verdict["reasons"]:
            print(f"  - {reason}")
    return CANARY_EXIT.get(verdict["health"], 2)


def cmd_plan(args: argparse.Namespace) -> int:
    """Desired prefill/decode node counts from any node's /cluster (moed/ops/planner.py)."""
    from moed.ops import planner

    try:
        return planner.run(args, _admin_token(args))
    except planner.PlanError as e:
        raise AdminCallFailed(f"plan: {e}") from None


def cmd_config_history(args: argparse.Namespace) -> int:
    status, body = _admin_call(args, "GET", "/admin/config/history")
    if status != 200:
        raise AdminCallFailed(_refused(status, body))
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    for e in body["entries"]:
        mark = "  <- running" if e["hash"] == body["running"] else ""
        print(f"{e['time']}  {e['hash']}  {e['source']}{mark}")
    return 0


def cmd_config_rollback(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    status, body = _admin_call(args, "POST", f"/admin/config/rollback?to={quote(args.hash)}")
    if status != 200:
        if "result" not in body:
            raise AdminCallFailed(_refused(status, body))
        why = body.get("error") or "only restart-only fields differ: " + ", ".join(
            c["key"] for c in body.get("needs_restart", []))
        raise AdminCallFailed(f"rollback {body['result']}, nothing changed: {why}")
    print(f"rollback {body['result']}: running {body['hash']} (config v{body['version']})")
    for c in body.get("applied", []):
        print(f"  {c['key']}: {c['old']!r} -> {c['new']!r}")
    for c in body.get("needs_restart", []):
        print(f"  {c['key']}: needs a restart, left at {c['old']!r}")
    if body.get("file_differs"):
        print("moed: the config file still says otherwise; the next reload reads it again: "
              "restore it (moed config show HASH)", file=sys.stderr)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """A history entry as TOML, from the state directory (full values: the admin API
    redacts anything named like a key, which a restored file needs)."""
    from moed.config import from_dict
    from moed.ops.history import FILE, MAX_FILE_BYTES, ConfigHistory, parse
    from moed.safefile import FileRefused, read_regular_file

    directory = args.state_dir or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if not directory:
        raise AdminCallFailed("give --state-dir DIR (the node's server.state_dir)")
    try:
        entries = parse(read_regular_file(Path(directory) / FILE, MAX_FILE_BYTES))
    except (OSError, FileRefused, ValueError) as e:
        raise AdminCallFailed(f"{Path(directory) / FILE}: {e}") from None
    entry = ConfigHistory(None, max(1, len(entries)), entries).find(args.hash)
    if entry is None:
        raise AdminCallFailed(f"no config {args.hash} in {Path(directory) / FILE}")
    sys.stdout.write(to_toml(from_dict(entry.config, f"history entry {entry.hash}")))
    return 0


def _add_admin_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the node's HTTP address (default: %(default)s)")
    p.add_argument("--token-file", metavar="FILE", help="file holding the admin token")
    p.add_argument("--token-env", metavar="VAR", help="environment variable holding it")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the answer (default: %(default)s)")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moed", description="Mixture-of-Experts serving daemon")
    parser.add_argument("--version", action="version", version=f"moed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a node (HTTP API, engine, membership)")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL",
                       help="checkpoint directory (model.path), as --model")
    _add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="run serve's checks without serving; print "
                           "the effective config")
    check.add_argument("config_pos", nargs="?", metavar="CONFIG", help="TOML config, as --config")
    _add_config_flags(check)
    check.set_defaults(func=cmd_check_config)

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    init = msub.add_parser("init", help="write a random-weight Hugging Face checkpoint")
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:2]) == ["model", "init"]:   # lazy: the init module imports torch and transformers
        from moed.dev import checkpoint as model_init

        model_init.add_arguments(init)
    init.set_defaults(func=cmd_model_init)
    kern = msub.add_parser("kernels", help="build every variant of the native CPU kernels ahead of time and print the .so paths")
    kern.add_argument("--cache", metavar="DIR",
                      help="where to put them (default: $MOED_KERNEL_CACHE, $CACHE_DIRECTORY or ~/.cache/moed)")
    kern.set_defaults(func=cmd_model_kernels)

    can = sub.add_parser("canary", help="a router's canary vs baseline figures and verdict "
                         "(exit 0 healthy, 1 unhealthy, 3 too few canary requests)")
    _add_admin_flags(can)
    can.add_argument("--json", action="store_true", help="the report as JSON")
    can.set_defaults(func=cmd_canary)

    plan = sub.add_parser("plan", help="the scaling planner: desired prefill and decode "
                          "node counts for TTFT/ITL targets, with the reason; optional action "
                          "hooks (docs/scaling.md)")
    _add_admin_flags(plan)
    if list(argv[:1]) == ["plan"]:     # lazy: `moed serve` never imports the planner
        from moed.ops.planner import add_arguments as add_plan_arguments

        add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    conf = sub.add_parser("config", help="a node's config history and rollback")
    csub = conf.add_subparsers(dest="config_command", required=True)
    hist = csub.add_parser("history", help="configs the node applied, oldest first")
    _add_admin_flags(hist)
    hist.add_argument("--json", action="store_true", help="entries with their configs, as JSON")
    hist.set_defaults(func=cmd_config_history)
    back = csub.add_parser("rollback", help="apply an earlier config (by hash) through the "
                           "reload path")
    back.add_argument("hash", metavar="HASH", help="from `moed config history`")
    _add_admin_flags(back)
    back.set_defaults(func=cmd_config_rollback)
    show = csub.add_parser("show", help="print a history entry as TOML (to restore the file)")
    show.add_argument("hash", metavar="HASH")
    show.add_argument("--state-dir", metavar="DIR",
                      help="the node's state directory (default: $STATE_DIRECTORY)")
    show.set_defaults(func=cmd_config_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        from moed.ops.signals import hold_sighup

        hold_sighup()    # before the heavy imports: an early SIGHUP must not kill the node
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"moed: config error: {e}", file=sys.stderr)
        return 2
    except AdminCallFailed as e:
        print(f"moed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
