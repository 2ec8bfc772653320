"""SIGHUP before the daemon can reload: remembered, never fatal.

SIGHUP's default action kills the process, and `moed serve` spends its first second or so
importing (aiohttp, uvloop, the app) before OpsComponent installs the event loop's reload
handler. `hold_sighup()` is the first thing `moed serve` does: from then on a SIGHUP is only
remembered, and OpsComponent, once it owns the signal, `take_held_sighup()`s it and reloads as
soon as the node is ready (the file may have changed after it was first read). A stopping
node ignores it (`ignore_sighup()`), up to the very end of the process.
Kept free of imports beyond `signal`, so it costs nothing that early.
"""
from __future__ import annotations

import signal
from types import FrameType

_held = False


def _remember(signum: int, frame: FrameType | None) -> None:
    global _held
    _held = True


def hold_sighup() -> None:
    """Install the remembering handler (main thread only, as any signal.signal call)."""
    signal.signal(signal.SIGHUP, _remember)


def ignore_sighup() -> None:
    """For a stopping node: SIG_IGN, which (unlike a Python handler) also outlives the
    interpreter's shutdown, when native libraries (UCX) still tear down for a while."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def take_held_sighup() -> bool:
    """True once if a SIGHUP arrived while held; the caller reloads for it."""
    global _held
    held, _held = _held, False
    return held
