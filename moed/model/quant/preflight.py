"""The start-up check of a quantized checkpoint: every quantized matrix complete and its scales
and zero points shaped as quantization_config declares, from the safetensors headers (plus the
few tiny tensors that carry shapes: compressed-tensors' weight_shape, GPTQ's g_idx). No weight
is read; every file stays mapped until the end, so parts split across shards meet."""
from __future__ import annotations

import contextlib
from pathlib import Path

from moed.model.loader import checkpoint_files
from moed.model.quant.checkpoint import Grouper
from moed.model.quant.formats import CheckpointQuant
from moed.model.safetensors_file import Mapped, read_index


def check_headers(model_dir: Path, ck: CheckpointQuant) -> int:
    """The number of quantized matrices; WeightError (a ValueError) naming the first bad tensor."""
    grouper, n = Grouper(ck), 0
    with contextlib.ExitStack() as stack:
        for path in checkpoint_files(model_dir):
            f = stack.enter_context(Mapped(path))
            for _, source in grouper.feed(read_index(f).items()):
                n += not hasattr(source, "into")        # a QuantSource, not a plain Stored
        grouper.finish()
    return n
