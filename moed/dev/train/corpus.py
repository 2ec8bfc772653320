"""The corpus: the running interpreter's standard-library .py sources, split by a hash of each
file's relative path (fixed, whatever the machine) into train and held-out.

The stdlib differs between Python versions, so the committed checkpoint records the files it
used (split.json next to it); quality benchmarks read the held-out names from there and skip a
file this interpreter lacks (saying so).
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Not library code (tests, the IDE, the removed 2to3) or a vendored tree; big generated files
# (pydoc_data/topics.py, _pydecimal.py) would dominate a small corpus.
EXCLUDED_TOP = ("site-packages", "test", "idlelib", "lib2to3")
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    """The split: the first 4 bytes of sha256(relative posix path) mod 100 < HELDOUT_PERCENT."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 100 < HELDOUT_PERCENT


def list_files(root: Path | None = None) -> list[str]:
    """Relative posix paths of the corpus's files under root, sorted."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if parts[0] in EXCLUDED_TOP or "tests" in parts or p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p.relative_to(root).as_posix())
    return out


def split(files: list[str]) -> tuple[list[str], list[str]]:
    train = [f for f in files if not is_heldout(f)]
    return train, [f for f in files if is_heldout(f)]


def read(rel: str, root: Path | None = None) -> str | None:
    """A file's text, or None when this interpreter lacks it or it is not UTF-8."""
    try:
        return ((root or stdlib_root()) / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def chunks(ids: list[int], size: int) -> list[list[int]]:
    """A file's tokens in consecutive windows of at most `size` (the perplexity unit: each
    window is scored on its tokens after the first, so windows of < 2 tokens are dropped)."""
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) >= 2]
