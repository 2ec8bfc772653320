"""Messages between a decode node and a prefill node (frozen, validated, JSON on the wire).

RPC: the decode node POSTs a `PrefillJobSpec` to `/internal/prefill`; the prefill node answers
with a stream of JSON lines (`{"event": "accepted"|"done"|"error", ...}`) and keeps it open while
it holds the job, so a dead peer on either side is seen at once as a closed connection.
`DELETE /internal/prefill/{job_id}` cancels explicitly. The data path is NIXL: block writes into
the decode node's KV, then a notification `FirstToken` (after the data).
"""
from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from typing import Any

from moed.config import PRIORITY_MAX, PRIORITY_MIN
from moed.types import GrammarSpec, SamplingParams

# Text fields (stop, skip_special_tokens) are not sent: the decode node detokenizes token one
# itself, in the request it holds.
_FIRST_TOKEN_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_tokens", "stop_token_ids",
                       "ignore_eos", "logprobs", "top_logprobs", "presence_penalty",
                       "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")


class ProtocolError(ValueError):
    """A malformed message; the text says which field."""


@dataclass(frozen=True)
class PrefillJobSpec:
    job_id: str
    token_ids: tuple[int, ...]
    skip_blocks: int               # leading prompt blocks the decode node holds (prefix hit)
    dst_block_ids: tuple[int, ...]  # decode blocks for prompt blocks skip_blocks, +1, ...
    decode_node: str
    decode_incarnation: int
    timeout_s: float               # the job's lease on the prefill node
    sampling: dict[str, Any]       # what the first token's sampling needs (see first_token_params)
    metadata: bytes | None = None  # decode node's transfer metadata, sent once per peer incarnation
    # issued by the decode node for exactly this job's node, blocks and expiry
    # (moed.api.internal): the prefill node writes nowhere else, and echoes it in FirstToken
    capability: str = ""
    expires_ms: int = 0            # wall clock: the capability is void after this
    # the decode node's checkpoint hash (moed.model.identity): a prefill node serving another
    # checkpoint refuses the job, also for a static peer that membership never compared
    model_id: str = ""
    # the decode node's KV has the MTP layer (it drafts with speculative.method mtp): the
    # prefill node must compute that layer's KV over the prompt too, and send its first draft
    mtp: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_ids"], d["dst_block_ids"] = list(self.token_ids), list(self.dst_block_ids)
        d["metadata"] = None if self.metadata is None else base64.b64encode(self.metadata).decode()
        return d

    @classmethod
    def from_json(cls, d: Any) -> "PrefillJobSpec":
        if not isinstance(d, dict):
            raise ProtocolError("prefill job must be a JSON object")
        try:
            md = d.get("metadata")
            spec = cls(job_id=str(d["job_id"]), token_ids=tuple(int(t) for t in d["token_ids"]),
                       skip_blocks=int(d["skip_blocks"]),
                       dst_block_ids=tuple(int(b) for b in d["dst_block_ids"]),
                       decode_node=str(d["decode_node"]),
                       decode_incarnation=int(d["decode_incarnation"]),
                       timeout_s=float(d["timeout_s"]), sampling=dict(d["sampling"]),
                       metadata=None if md is None else base64.b64decode(md, validate=True),
                       capability=str(d.get("capability", "")),
                       expires_ms=int(d.get("expires_ms", 0)),
                       model_id=str(d.get("model_id", "")), mtp=_flag(d.get("mtp", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad prefill job: {type(e).__name__}: {e}") from None
        if not spec.token_ids or not spec.job_id or spec.timeout_s <= 0 or spec.skip_blocks < 0:
            raise ProtocolError("bad prefill job: empty prompt or id, or non-positive timeout")
        if any(b < 0 for b in spec.dst_block_ids) or any(t < 0 for t in spec.token_ids):
            raise ProtocolError("bad prefill job: negative block or token id")
        return spec

    def check_blocks(self, block_size: int) -> None:
        need = -(-len(self.token_ids) // block_size) - self.skip_blocks
        if need < 1 or len(self.dst_block_ids) != need:
            raise ProtocolError(f"prompt of {len(self.token_ids)} tokens with {self.skip_blocks} "
                                f"cached blocks needs {max(need, 0)} destination blocks of "
                                f"{block_size} tokens, got {len(self.dst_block_ids)}")


def sampling_fields(p: SamplingParams) -> dict[str, Any]:
    d = {k: getattr(p, k) for k in _FIRST_TOKEN_FIELDS}
    d["stop_token_ids"] = list(p.stop_token_ids)
    d["logit_bias"] = [[t, b] for t, b in p.logit_bias]
    if p.cache_salt:    # the prefill node's own prefix cache is salted alike
        d["cache_salt"] = p.cache_salt
    if p.grammar is not None:   # the first token obeys the request's grammar (structured outputs)
        d["grammar"] = {"kind": p.grammar.kind, "source": p.grammar.source}
    if p.priority:      # the prefill node seats jobs by it too (a node before: ignored)
        d["priority"] = p.priority
    return d


def first_token_params(d: dict[str, Any]) -> SamplingParams:
    """Params for the prefill node's prefill-only request: sample the first token exactly as the
    decode node would, but never finish for a reason that frees the KV before it is sent (the
    decode node applies its own stop checks to the token). EOS stays banned under min_tokens.
    Token one has no output history: of the penalties only repetition_penalty (over the prompt)
    and logit_bias can change it, and they are applied here as on the decode node. A grammar
    constrains token one here as it will every later one on the decode node."""
    try:
        min_tokens = int(d.get("min_tokens", 0))
        g = d.get("grammar")
        grammar = None if g is None else GrammarSpec(str(g["kind"]), str(g.get("source", "")))
        return SamplingParams(
            max_tokens=2, temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)), top_k=int(d.get("top_k", 0)),
            seed=None if d.get("seed") is None else int(d["seed"]), min_tokens=min_tokens,
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())) if min_tokens else (),
            ignore_eos=bool(d.get("ignore_eos", False)) if min_tokens else True,
            logprobs=bool(d.get("logprobs", False)),
            top_logprobs=int(d.get("top_logprobs", 0)),
            presence_penalty=float(d.get("presence_penalty", 0.0)),
            frequency_penalty=float(d.get("frequency_penalty", 0.0)),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            min_p=float(d.get("min_p", 0.0)),
            logit_bias=tuple((int(t), float(b)) for t, b in d.get("logit_bias", ())),
            grammar=grammar, cache_salt=str(d.get("cache_salt", "")),
            priority=_priority(d.get("priority", 0)))
    except (TypeError, ValueError, KeyError) as e:
        raise ProtocolError(f"bad sampling params: {e}") from None


@dataclass(frozen=True)
class FirstToken:
    """The NIXL notification that ends a job: the prompt's KV is in place, here is token one."""

    job_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()   # when the request asked for them
    capability: str = ""           # the job's, echoed: the decode node checks it again
    # with the MTP layer (PrefillJobSpec.mtp): its greedy draft for the position after token one
    draft: int | None = None

    def encode(self) -> bytes:
        d: dict[str, Any] = {"j": self.job_id, "t": self.token_id, "lp": self.logprob,
                             "c": self.capability}
        if self.top_logprobs:
            d["tl"] = [[t, v] for t, v in self.top_logprobs]
        if self.draft is not None:
            d["d"] = self.draft
        return json.dumps(d).encode()

    @classmethod
    def decode(cls, msg: bytes) -> "FirstToken":
        try:
            d = json.loads(msg)
            return cls(str(d["j"]), int(d["t"]), None if d.get("lp") is None else float(d["lp"]),
                       tuple((int(t), float(v)) for t, v in d.get("tl", ())),
                       str(d.get("c", "")), None if d.get("d") is None else int(d["d"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"bad first-token notification: {e}") from None


def line(event: str, **kw: Any) -> bytes:
    return json.dumps({"event": event, **kw}).encode() + b"\n"


def _flag(v: Any) -> bool:
    if type(v) is not bool:     # "false" would be truthy: a flag is a JSON boolean
        raise ValueError(f"mtp {v!r:.40} is not a boolean")
    return v


def _priority(v: Any) -> int:
    if type(v) is not int or not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise ValueError(f"priority {v!r:.40} is not an int32")
    return v
