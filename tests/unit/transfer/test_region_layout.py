"""RegionLayout built from the model's KVLayout: byte math equal to the tensor's, peers compared
by layout id (and format), and the metadata envelope still readable by the previous release."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from moed.model.kv_layout import KVLayout
from moed.transfer.base import _MAGIC, IncompatibleLayout, KVRegion, PeerMetadata, RegionLayout


def _region(kv: KVLayout, num_blocks: int) -> tuple[torch.Tensor, RegionLayout]:
    t = kv.allocate(num_blocks, "cpu")
    return t, RegionLayout.from_kv_layout(kv, t.data_ptr(), num_blocks)


@pytest.mark.parametrize("kv", [KVLayout.gqa(3, 2, 16, 4, torch.bfloat16),
                                KVLayout.mla(2, 576, 16, torch.bfloat16)], ids=["gqa", "mla"])
def test_from_kv_layout_matches_the_tensor(kv):
    t, lay = _region(kv, 8)
    assert lay.block_bytes == kv.block_bytes and lay.num_layers == kv.num_layers and lay.num_blocks == 8
    assert lay.nbytes == t.numel() * t.element_size() and lay.layout_id == kv.layout_id
    assert kv.block_format == lay.block_format
    # what transfer derived from the tensor before, except that the layout now has an id
    assert RegionLayout.from_tensor(t) == RegionLayout(**{**lay.__dict__, "layout_id": ""})
    last = kv.num_layers - 1
    assert t[last, 5].data_ptr() == lay.base_addr + last * lay.layer_stride + 5 * lay.block_bytes
    lay.check_covers(t)
    with pytest.raises(ValueError, match="does not match the tensor"):
        lay.check_covers(t[:, :4].clone())
    assert KVRegion(t, lay).layout is lay


def test_peers_compare_layout_ids_then_formats():
    gqa = KVLayout.gqa(2, 2, 16, 4, torch.bfloat16)
    _, a = _region(gqa, 8)
    _, b = _region(gqa, 30)
    a.check_compatible(b)                                   # block counts may differ
    same_bytes = RegionLayout(**{**a.__dict__, "layout_id": "mla-000000000000"})
    with pytest.raises(IncompatibleLayout, match="mla-000000000000"):
        a.check_compatible(same_bytes)                      # same bytes and format, other layout
    _, other = _region(KVLayout.gqa(2, 2, 16, 8, torch.bfloat16), 8)
    with pytest.raises(IncompatibleLayout, match="KV layout mismatch"):
        a.check_compatible(other)
    raw = RegionLayout(**{**a.__dict__, "layout_id": ""})   # a peer without id: format decides
    a.check_compatible(raw)
    raw.check_compatible(a)


def test_envelope_carries_the_id_and_stays_readable_by_the_previous_release():
    _, lay = _region(KVLayout.gqa(2, 2, 16, 4, torch.bfloat16), 8)
    md = PeerMetadata("nixl", "agent-1", lay, b"\x00blob")
    data = md.encode()
    assert PeerMetadata.decode(data) == md
    (n,) = struct.unpack_from("<I", data, len(_MAGIC))
    head = json.loads(data[len(_MAGIC) + 4:len(_MAGIC) + 4 + n])
    # the previous release builds RegionLayout(**head["layout"]) with these six fields
    assert set(head["layout"]) == {"base_addr", "num_layers", "num_blocks", "block_bytes", "layer_stride",
                                   "block_format"}
    assert head["layout_id"] == lay.layout_id
    old_head = json.dumps({"backend": "nixl", "agent": "old", "layout": head["layout"]}).encode()
    old = PeerMetadata.decode(_MAGIC + struct.pack("<I", len(old_head)) + old_head + b"x")
    assert old.layout.layout_id == "" and old.layout.block_format == lay.block_format
    lay.check_compatible(old.layout)
