"""A checkpoint's model id: what membership compares before a decode node takes KV from a
prefill node (moed.balance.candidate.incompatibility). No torch.

The id is a hash of config.json, the safetensors index when there is one, and for each weight
file its name, size and last 64 KiB. A full content hash would read every weight at start
(hundreds of GB for a large MoE); the tail of each file tells apart checkpoints that share a
config and shapes (a retrained or re-seeded model writes other bytes there) at a cost of one
small read per file.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

SAMPLE_BYTES = 64 * 1024
INDEX = "model.safetensors.index.json"


def model_id(path: str | Path) -> str:
    """12 hex digits naming the checkpoint in `path`; "" when there is none (a router, or a
    directory the preflight checks refuse anyway)."""
    d = Path(path)
    if not str(path) or not (d / "config.json").is_file():
        return ""
    h = hashlib.sha256()
    for name in ("config.json", INDEX):
        p = d / name
        h.update(name.encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    for w in sorted(d.glob("*.safetensors")):
        size = w.stat().st_size
        h.update(f"{w.name}\0{size}\0".encode())
        with open(w, "rb") as f:
            f.seek(max(0, size - SAMPLE_BYTES), os.SEEK_SET)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:12]
