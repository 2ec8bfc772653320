"""Migration of a proxied stream (the router role): the pure half — what the router records of
a stream, what the client sees of each event, and what is resubmitted when the node fails.

Glossary
  ledger        one client stream's record: the original body, the prompt's token ids and
                the output token ids the client has received, the first chunk's id/created
  continuation  POST /internal/continue/<path> on another node (moed.api.continuation):
                {request, prompt_token_ids, output_token_ids}, signed with the cluster key
  fresh resubmit  the node failed before any event reached the client: the original request
                again, to the ordinary /v1 path (nothing to continue from)

A stream's phases (StreamPhase; TRANSITIONS is the one place they change):

    RELAYING ──failure──▶ MIGRATING ──next node streams──▶ RELAYING ── [DONE] ──▶ DONE
        │                    └── limit reached / no node / refused ──▶ FAILED
        └── [DONE] ──▶ DONE

The router asks every node for token ids (vLLM's `return_token_ids`) and strips them from
what the client sees unless the client asked for them itself. Events are forwarded whole (an
event cut by the failure never reaches the client), so the recorded token ids are exactly
the client's. Streams of one prompt without tool calling migrate (best_of unset or 1);
`eligible` says why not for the others, which end as before with one server_error event.

n > 1: the ledger keeps each choice's sent ids and finish apart (`outputs`, `done`). After a
failure the unfinished choices continue one after another, each as its own n = 1
continuation (`current`: the choice being continued; its events are re-indexed to it, its
usage chunk and [DONE] dropped), seeded as the node seeds choice i (`choice_seed`). When the
last one finishes the router ends the stream itself (`closing`: one usage chunk, [DONE]).
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

MIGRATABLE_PATHS = ("/v1/completions", "/v1/chat/completions")
SEED_MIN = -(1 << 63)          # moed.api.protocol's seed range (choice i's seed wraps in it)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed the node gives choice `choice` of a request seeded `seed` (as
    moed.api.protocol's per-choice parameters): its n = 1 continuation is seeded with it."""
    return None if seed is None else (seed + choice - SEED_MIN) % (1 << 64) + SEED_MIN


class StreamPhase(enum.Enum):
    RELAYING = "relaying"
    MIGRATING = "migrating"
    DONE = "done"
    FAILED = "failed"


TRANSITIONS: dict[StreamPhase, frozenset[StreamPhase]] = {
    StreamPhase.RELAYING: frozenset({StreamPhase.MIGRATING, StreamPhase.DONE,
                                     StreamPhase.FAILED}),
    StreamPhase.MIGRATING: frozenset({StreamPhase.RELAYING, StreamPhase.FAILED}),
    StreamPhase.DONE: frozenset(),
    StreamPhase.FAILED: frozenset(),
}


class Reason(str, enum.Enum):
    """Why a stream migrated (the label of moed_router_migrations_total)."""
    CONNECTION = "connection"      # read error, reset, or the stream ended without [DONE]
    ERROR_EVENT = "error_event"    # the node's own in-band error of a server-side kind
    NODE_DEAD = "node_dead"        # membership no longer lists the node while it is silent
    DRAIN = "drain"                # a draining node handed the stream back (code handed_off)


def eligible(path: str, body: bytes) -> dict[str, Any] | None:
    """The parsed body when this request's stream can migrate, else None (passed through as
    before)."""
    if path not in MIGRATABLE_PATHS:
        return None
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(req, dict) or req.get("stream") is not True:
        return None
    n = req.get("n", 1)
    if type(n) is not int or n < 1 or req.get("best_of") not in (None, 1) or req.get("tools"):
        return None
    opts = req.get("stream_options")
    if n > 1 and isinstance(opts, dict) and opts.get("continuous_usage_stats"):
        return None          # per-chunk usage of n > 1 is not rebuilt across continuations
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return None          # several prompts: several choices
    return req


def non_streamed(path: str, body: bytes) -> bool:
    """A non-streamed completion or chat request (any n): a draining node may hand it back
    before its first byte (a 503, code handed_off), and the router resubmits it from scratch
    elsewhere, as after any 503 (router.max_attempts). Its work there is lost, but the drain
    no longer waits for its max_tokens."""
    if path not in MIGRATABLE_PATHS:
        return False
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(req, dict) and req.get("stream") in (None, False)


@dataclass
class Ledger:
    """One client stream, as the router relays it (see the module docstring)."""
    request: dict[str, Any]
    chat: bool
    client_ids: bool                       # the client asked for token ids itself
    phase: StreamPhase = StreamPhase.RELAYING
    prompt_ids: list[int] | None = None
    outputs: dict[int, list[int]] = field(default_factory=dict)   # choice → ids sent
    done: set[int] = field(default_factory=set)         # choices whose finish was relayed
    current: int | None = None   # n > 1: the choice the node streams alone (None: all)
    ended: bool = False          # the node sent [DONE]
    first_id: str | None = None            # the first chunk's id and created: kept across nodes
    created: int | None = None
    handed_off: bool = False               # the last node's error: it was draining
    migrations: int = 0

    @classmethod
    def open(cls, path: str, request: dict[str, Any]) -> Ledger:
        return cls(request, path.endswith("/chat/completions"),
                   bool(request.get("return_token_ids")))

    @property
    def n(self) -> int:
        return self.request.get("n", 1)

    @property
    def output_ids(self) -> list[int]:
        """The ids sent of the choice continued next (n = 1: the one choice)."""
        return self.outputs.setdefault(self.current or 0, [])

    @property
    def finished(self) -> bool:
        """Every choice's finish_reason was relayed."""
        return len(self.done) >= self.n

    def pending(self) -> int | None:
        """The lowest choice not yet finished, or None."""
        return next((i for i in range(self.n) if i not in self.done), None)

    def to(self, new: StreamPhase) -> None:
        if new not in TRANSITIONS[self.phase]:
            raise ValueError(f"stream phase {self.phase.value} -> {new.value}")
        self.phase = new

    def backend_body(self) -> bytes:
        """The original request, asking for token ids."""
        return json.dumps({**self.request, "return_token_ids": True}).encode()

    def resubmission(self, replay: str = "decode") -> tuple[str, bytes]:
        """(path suffix kind, body) for the next node: a continuation once the client has an
        event with the prompt's ids, else the original request again ('fresh')."""
        if self.prompt_ids is None:
            return "fresh", self.backend_body()
        req = {**self.request, "return_token_ids": True}
        if self.n > 1:
            if self.current is None or self.current in self.done:
                self.current = self.pending()
            req["n"] = 1
            if req.get("seed") is not None:
                req["seed"] = choice_seed(req["seed"], self.current)
        return "continue", json.dumps({
            "request": req,
            "prompt_token_ids": self.prompt_ids, "output_token_ids": self.output_ids,
            "replay": replay}).encode()

    def relay(self, data: bytes) -> tuple[bytes | None, bool]:
        """One SSE event's data (after 'data: ') → (what the client gets, or None to drop it;
        whether it is a server-side error that should migrate instead)."""
        if data.strip() == b"[DONE]":
            self.ended = True
            if self.current is not None:
                return None, False       # one choice's continuation: the router closes
            if self.phase is StreamPhase.RELAYING:
                self.to(StreamPhase.DONE)
            return b"[DONE]", False
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return data, False                        # not ours to judge: pass it on
        if not isinstance(obj, dict):
            return data, False
        if self.current is not None and "usage" in obj and not obj.get("choices"):
            return None, False           # one choice's usage: `closing` counts them all
        if "error" in obj:
            err = obj["error"]
            self.handed_off = isinstance(err, dict) and err.get("code") == "handed_off"
            return None if server_side(err) else data, server_side(err)
        self._record(obj)
        return json.dumps(obj, separators=(",", ":")).encode(), False

    def _record(self, obj: dict[str, Any]) -> None:
        if self.first_id is None:
            self.first_id, self.created = obj.get("id"), obj.get("created")
        else:               # a continuation's chunks carry the new node's id: the client's
            obj["id"], obj["created"] = self.first_id, self.created
        top = obj.pop("prompt_token_ids", None) if not self.client_ids \
            else obj.get("prompt_token_ids")
        if isinstance(top, list) and self.prompt_ids is None:
            self.prompt_ids = top                     # chat: on the first chunk's body
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            if self.current is not None:
                ch["index"] = self.current
            idx = ch.get("index", 0)
            p = ch.get("prompt_token_ids") if self.client_ids \
                else ch.pop("prompt_token_ids", None)
            if isinstance(p, list) and self.prompt_ids is None:
                self.prompt_ids = p                   # completions: on the first choice
            ids = ch.get("token_ids") if self.client_ids else ch.pop("token_ids", None)
            if isinstance(ids, list):
                self.outputs.setdefault(idx, []).extend(ids)
            if ch.get("finish_reason") is not None:
                self.done.add(idx)

    def closing(self) -> list[bytes]:
        """The node died after the last token's chunk (finish_reason relayed) but before its
        usage chunk / [DONE], or the last choice's continuation ended (n > 1): the router
        ends the stream itself, with the exact counts (the prompt once, every choice's ids)."""
        out: list[bytes] = []
        opts = self.request.get("stream_options") or {}
        if isinstance(opts, dict) and opts.get("include_usage") and self.prompt_ids is not None:
            p, c = len(self.prompt_ids), sum(map(len, self.outputs.values()))
            out.append(json.dumps({
                "id": self.first_id, "created": self.created, "model": self.request.get("model"),
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c,
                                         "total_tokens": p + c}}).encode())
        return out + [b"[DONE]"]


def server_side(err: Any) -> bool:
    """An in-band error event the node raised for its own failure (not the request's fault)."""
    return isinstance(err, dict) and err.get("type") in ("server_error", "internal_server_error",
                                                         "service_unavailable")


class EventSplitter:
    """Bytes of an SSE stream → complete events' data payloads; a cut event stays held."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        out = []
        while True:
            i = self._buf.find(b"\n\n")
            if i < 0:
                return out
            event, self._buf = self._buf[:i], self._buf[i + 2:]
            data = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))


def error_event(message: str, code: str) -> bytes:
    """The one error a stream ends with when it cannot migrate (OpenAI's server_error)."""
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": code}}).encode()
