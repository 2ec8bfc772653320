"""The router's side of prefix affinity: a request's prompt as the nodes' prefix digests see
it (moed.balance.router.place scores the overlap).

The router has no model, but with `model.path` set it loads the checkpoint's tokenizer (no
weights, no torch) and renders a request's prompt roughly as a serving node does: a
completions `prompt` (text, or token ids) is encoded; chat `messages` go through the chat
template with the generation prompt. Anything it cannot render (no template, a batch of
prompts, a template that needs request fields it does not pass) gives no prefix: the request
is then placed by load alone. A rendering that differs from the node's only costs affinity
(the hashes do not match), never correctness. O(prompt): call it in the offload pool.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from moed.cluster.state import digest_depths, digest_key
from moed.kvcache.pool import hash_block

MAX_PREFIX_BLOCKS = 1 << 14        # hash at most this many leading blocks (deeper: no gain)


def prompt_ids(body: bytes, path: str, tok: Any) -> list[int] | None:
    """The token ids of a /v1/completions or /v1/chat/completions body; None when the router
    cannot tell (a body the node will refuse is the node's to explain)."""
    try:
        req = json.loads(body)
        if not isinstance(req, dict):
            return None
        if path.endswith("/chat/completions"):
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            text = tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tools=req.get("tools") or None)
            return tok.encode(text, add_special_tokens=False)
        if path.endswith("/completions"):
            p = req.get("prompt")
            if isinstance(p, list) and len(p) == 1:
                p = p[0]
            if isinstance(p, str):
                return tok.encode(p)
            if isinstance(p, list) and p and all(type(t) is int for t in p):
                return p
        return None
    except Exception:      # a template error, odd JSON: affinity is a hint, the node decides
        return None


def client_salt(body: bytes) -> str:
    """The body's `cache_salt` (vLLM's field), '' when absent or not a string (the node
    refuses what is malformed; affinity only hints)."""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    salt = req.get("cache_salt") if isinstance(req, dict) else None
    return salt if isinstance(salt, str) else ""


def prompt_prefix(ids: Sequence[int], block_sizes: Collection[int], root: int | None = None
                  ) -> dict[int, tuple[tuple[int, int], ...]]:
    """block size → ((depth, digest key), ...) at the digest's depths (1, 2, 4, ...), over the
    full blocks a prefix hit may cover (never the last token: moed.kvcache.manager); root: the
    request's salt (moed.kvcache.pool.salt_root), as the serving node will chain it."""
    out: dict[int, tuple[tuple[int, int], ...]] = {}
    for bs in block_sizes:
        if bs <= 0:
            continue
        n = min((len(ids) - 1) // bs, MAX_PREFIX_BLOCKS)
        wanted = set(digest_depths(n))
        got: list[tuple[int, int]] = []
        parent: int | None = root
        for d in range(1, max(wanted, default=0) + 1):
            parent = hash_block(parent, ids[(d - 1) * bs:d * bs])
            if d in wanted:
                got.append((d, digest_key(parent)))
        out[bs] = tuple(got)
    return out
