"""From argv to a Config: the positional MODEL/CONFIG folded into the flags, the refusals of
the flag table applied, the flags as overrides of the top layer (defaults < TOML <
MOED_<SECTION>_<FIELD> environment < flags), and the effective config as TOML.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from moed.cli.flags import (API_KEYS_ENV, FLAGS, REFUSED, REFUSED_SWITCHES, SAME, SWITCHES,
                            refused_dest, same_dest)
from moed.config import KV_CACHE_DTYPES, TOOL_PARSERS, Config, ConfigError, load


def _one(what: str, positional: str | None, flag: str | None) -> str | None:
    if positional and flag and Path(positional) != Path(flag):
        raise ConfigError(f"command line: {what} {positional} and --{what.lower()} {flag} "
                          f"differ; give one")
    return positional or flag


def resolve(args: argparse.Namespace) -> None:
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
        if getattr(args, refused_dest(name), None) is not None:
            why = REFUSED.get(name) or REFUSED_SWITCHES[name]
            raise ConfigError(f"command line: {name} is not supported: {why}")
    args.vllm_same = []       # (flag, value, what moed does): logged once logging is set up
    for same in SAME:
        value = getattr(args, same_dest(same.name), None)
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


def speculative_json(text: str) -> dict[str, Any]:
    """--speculative-config: vLLM's JSON object as [speculative] values. Any other vLLM key
    (a draft model, its parallelism, ...) is refused by name; as in vLLM, a lone
    prompt_lookup_min or prompt_lookup_max stands for both."""
    from moed.config import SpeculativeConfig

    flag = "command line: --speculative-config"
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{flag}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{flag}: expected a JSON object")
    known = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    for k in obj:
        if k not in known:
            raise ConfigError(f"{flag}: {k} is not supported (moed reads "
                              f"{', '.join(known)})")
    lo, hi = "prompt_lookup_min", "prompt_lookup_max"
    if (lo in obj) != (hi in obj):
        obj[hi if lo in obj else lo] = obj[lo if lo in obj else hi]
    return {k: "" if v is None and k == "method" else v for k, v in obj.items()}


def overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"model": {"path": args.model}, "server": {}}
    for f in (*FLAGS, *SWITCHES):
        section, key = f.field.split(".")
        out.setdefault(section, {})[key] = getattr(args, f.dest)
    if getattr(args, "kv_events_config", None) is not None:
        out["kv_events"] = kv_events_json(args.kv_events_config)
    if getattr(args, "speculative_config", None) is not None:
        out["speculative"] = speculative_json(args.speculative_config)
    if args.api_key:
        out["server"]["api_keys_env"] = API_KEYS_ENV
    return out


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def to_toml(cfg: Config) -> str:
    lines = [f"# effective config (digest {cfg.digest()})"]
    for sec in dataclasses.fields(cfg):
        lines.append(f"\n[{sec.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, sec.name)).items():
            lines.append(f"{k} = {toml_value(v)}")
    return "\n".join(lines) + "\n"


def load_config(args: argparse.Namespace) -> Config:
    resolve(args)
    if args.api_key:
        os.environ[API_KEYS_ENV] = ",".join(k.strip() for k in args.api_key)
    cfg = load(args.config, environ=os.environ, overrides=overrides(args))
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


def configure_logs(cfg: Config, args: argparse.Namespace | None = None) -> None:
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
