"""Memory after load: the checkpoint's pages are not held while the weights are copied, and
after the model is built each weight is held once (the kernels' packed copy, plus a oneDNN copy
only where oneDNN was chosen): no plain tensor of the load stays alive."""
from __future__ import annotations

import gc
import os
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moed.model import kernels as K
from moed.model import loader as L
from moed.model import safetensors_file as ST
from moed.model import runner as R
from moed.model.kernels import choice as C
from moed.model.layers import Linear
from moed.model.hf_config import load_spec
from conftest import needs_onednn_bf16     # tests/unit/model/conftest.py

needs_kernels = pytest.mark.skipif(
    not K.cpu_flags_ok() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no AVX512-BF16 or no C compiler: the torch path keeps its plain weights by design")

ONEDNN_PAST_8 = C.LinearChoice((False, False, True, True, True))


def mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, ours, target = 0, False, str(path)
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if head and "-" in head[0] and ":" not in head[0]:
                ours = len(head) == 6 and head[5].strip() == target
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


# What a read fault may map beyond the tensor being copied: fault-around (64 KiB by default)
# or a large page-cache folio (up to 2 MiB on x86), on both sides.
NEAR = 2 * ST.Mapped.BACK + (512 << 10)
on_linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")


@on_linux
def test_a_mapped_file_keeps_only_the_pages_near_the_tensor_being_copied(tmp_path):
    """Copying every tensor of a 48 MB file out of its mapping: its resident pages stay near
    the current tensor's, never the whole file (safetensors' reader held it all until close)."""
    path = tmp_path / "big.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({f"t{i:03d}": torch.randint(0, 255, (384 << 10,), dtype=torch.uint8, generator=g)
               for i in range(128)}, str(path))
    seen, copies = [], []
    with ST.Mapped(path) as f:
        for i, t in enumerate(ST.read_index(f).values()):
            dst = torch.empty(t.shape, dtype=t.dtype)
            t.into(dst)
            copies.append(dst)
            if i % 4 == 3:                   # a read of smaps costs ~20 ms beside torch's maps
                seen.append(mapped_rss(path))
    assert path.stat().st_size > 4 * NEAR
    assert max(seen) <= NEAR, (max(seen), path.stat().st_size)
    assert torch.equal(torch.cat(copies), torch.cat(list(load_file(str(path)).values())))


@on_linux
def test_loading_holds_no_whole_file_of_pages(make_checkpoint, monkeypatch):
    """The same, sampled as load_weights places each tensor of a real (tiny) checkpoint."""
    d = make_checkpoint("qwen3_moe")
    path = d / "model.safetensors"
    seen: list[int] = []
    put = L._Assembler.put

    def spy(self, *a, **kw):
        put(self, *a, **kw)
        calls.append(1)
        if len(calls) % 8 == 0:             # (the whole file's pages only pile up: sampled)
            seen.append(mapped_rss(path))
    calls: list[int] = []
    monkeypatch.setattr(L._Assembler, "put", spy)
    L.load_weights(d, load_spec(d), "bfloat16")
    assert path.stat().st_size > 2 * NEAR
    assert len(seen) > 10 and max(seen) <= NEAR, (max(seen), path.stat().st_size)


def test_reads_the_same_tensors_as_safetensors(make_checkpoint):
    d = make_checkpoint("qwen3_moe", num_experts=4, write_fused=True)
    spec, ref = load_spec(d), load_file(str(d / "model.safetensors"))
    w = L.load_weights(d, spec, "bfloat16")
    assert torch.equal(w["embed"], ref["model.embed_tokens.weight"])
    assert torch.equal(w["layers.1.experts.down"], ref["model.layers.1.mlp.experts.down_proj"])
    f32 = L.load_weights(d, spec, "float32")                       # cast on the copy
    assert f32["embed"].dtype == torch.float32 and torch.equal(f32["embed"], ref["model.embed_tokens.weight"].float())
    ep = L.load_weights(d, spec, "bfloat16", slots=(3, 1, 3))      # expert parallelism: some slots
    fused = ref["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(ep["layers.0.experts.gate_up"], fused[[3, 1, 3]])


def test_a_damaged_file_is_a_weight_error(make_checkpoint, tmp_path):
    src = make_checkpoint("qwen3_moe")
    d = tmp_path / "m"
    shutil.copytree(src, d)
    body = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(body[: len(body) // 2])      # data cut short
    with pytest.raises(L.WeightError, match="within the file"):
        L.load_weights(d, load_spec(d))
    (d / "model.safetensors").write_bytes(b"\xff" * 64)               # no header
    with pytest.raises(L.WeightError, match="not a safetensors file"):
        L.load_weights(d, load_spec(d))


def linears(obj, seen=None) -> list[Linear]:
    """Every Linear reachable from a model object (moed's own objects, lists, tuples, dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, Linear):
        return [obj]
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif type(obj).__module__.startswith("moed."):
        items = [getattr(obj, n) for n in (vars(obj) if hasattr(obj, "__dict__") else ())]
    else:
        return []
    return [lin for x in items for lin in linears(x, seen)]


@needs_kernels
@pytest.mark.parametrize("choice", [C.NATIVE_ONLY, pytest.param(ONEDNN_PAST_8, marks=needs_onednn_bf16)],
                         ids=["native", "onednn-past-8"])
def test_the_built_model_holds_each_weight_once(kern, make_checkpoint, monkeypatch, choice):
    """With the kernels no Linear keeps its plain weight; a oneDNN copy exists only where
    oneDNN was chosen; and no tensor the loader returned outlives the build except the ones
    read as they are (embedding, norms)."""
    kern.choose = C.FixedChooser(choice)
    d = make_checkpoint("qwen3_moe")
    loaded: dict[str, weakref.ref] = {}
    load = R.load_weights

    def spy(*a, **kw):
        w = load(*a, **kw)
        loaded.update({k: weakref.ref(t) for k, t in w.items()})
        return w
    monkeypatch.setattr(R, "load_weights", spy)
    runner = R.ModelRunner(d, dtype="bfloat16", device="cpu", num_blocks=4, block_size=16)
    assert runner.ctx.kernels is kern
    gc.collect()
    alive = {k for k, ref in loaded.items() if ref() is not None}
    assert alive and all(k in ("embed", "norm") or k.endswith(("input_norm", "post_norm")) for k in alive), alive
    lins = linears(runner.model)
    spec = runner.spec
    assert len(lins) == 1 + spec.num_layers * (2 + 1 + 2 * spec.num_experts)   # lm_head; qkv, o; router; experts
    assert all(lin.weight is None and lin.kpacked is not None for lin in lins)
    assert all((lin.packed is not None) == choice.any_onednn for lin in lins)
