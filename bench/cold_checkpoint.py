"""Checkpoints for bench/cold_experts.py too big to build the usual way.

`init_checkpoint` builds the whole HF model in memory in fp32 before writing it in bf16: a
checkpoint of 4.5 GiB of experts needs ~14 GiB for that. `grow` builds a 2-layer checkpoint of
the same shape that way and writes the N-layer one from it, tensor by tensor: layers 0 and 1
are the template's, every matrix of a later layer is drawn afresh with its template matrix's
standard deviation (so each layer's experts are distinct bytes, as a real model's are), vectors
(norms, the router bias) are copied. It streams the safetensors file (header, then each
tensor's bytes as drawn), so memory stays at one tensor whatever the size.

`patch_tensor` rewrites one tensor's bytes in place in a safetensors file (the Zipf bias of
cold_experts_llama's skewed copy), without loading the file.
"""
from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import torch

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def header(path: Path) -> tuple[dict, int]:
    """The safetensors header and where its data starts."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def grow(template: Path, out: Path, layers: int, seed: int = 0) -> Path:
    """out: template's checkpoint with `layers` layers (see the module's doc)."""
    meta, base = header(template / "model.safetensors")
    meta.pop("__metadata__", None)
    names: list[tuple[str, str]] = []          # (name in out, template name)
    for name in meta:
        m = LAYER.match(name)
        if m is None:
            names.append((name, name))
        elif int(m[1]) == 0:
            names += [(f"model.layers.{i}.{m[2]}", f"model.layers.{i if i < 2 else i % 2}.{m[2]}")
                      for i in range(layers)]
    head, off = {}, 0
    for name, src in names:
        size = meta[src]["data_offsets"][1] - meta[src]["data_offsets"][0]
        head[name] = {"dtype": meta[src]["dtype"], "shape": meta[src]["shape"], "data_offsets": [off, off + size]}
        off += size
    head["__metadata__"] = {"format": "pt"}
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)               # the data starts 8-byte aligned
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.part"
    g = torch.Generator().manual_seed(seed)
    with open(template / "model.safetensors", "rb") as src_f, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, src in names:
            b, e = meta[src]["data_offsets"]
            src_f.seek(base + b)
            data = src_f.read(e - b)
            m = LAYER.match(name)
            if m is not None and int(m[1]) >= 2 and len(meta[src]["shape"]) == 2:
                t = torch.frombuffer(bytearray(data), dtype=DTYPES[meta[src]["dtype"]]).float()
                data = (torch.randn(t.numel(), generator=g) * t.std()).to(DTYPES[meta[src]["dtype"]]) \
                    .view(torch.uint8).numpy().tobytes()
            f.write(data)
    for p in template.iterdir():
        if p.suffix != ".safetensors" and p.is_file():
            shutil.copy2(p, out / p.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.rename(out / "model.safetensors")       # last: the file's presence means a whole build
    return out


def patch_tensor(path: Path, name: str, value: torch.Tensor) -> None:
    """Write `value` (cast to the stored dtype) over tensor `name`'s bytes in place."""
    meta, base = header(path)
    b, e = meta[name]["data_offsets"]
    data = value.to(DTYPES[meta[name]["dtype"]]).contiguous().view(torch.uint8).numpy().tobytes()
    if len(data) != e - b:
        raise ValueError(f"{name}: {len(data)} bytes for a tensor of {e - b}")
    with open(path, "r+b") as f:
        f.seek(base + b)
        f.write(data)
