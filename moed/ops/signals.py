"""SIGHUP before the daemon can reload: remembered, never fatal.

SIGHUP's default action kills the process, and `moed serve` spends its first second or so
importing (aiohttp, uvloop, the app) before OpsComponent installs the event loop's reload
handler. `hold_sighup()` is the first thing `moed serve` does: from then on a SIGHUP is only
remembered, and OpsComponent, once it owns the signal, `take_held_sighup()`s it and reloads as
soon as the node is ready (the file may have changed after it was first read).
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


def take_held_sighup() -> bool:
    """True once if a SIGHUP arrived while held; the caller reloads for it."""
    global _held
    held, _held = _held, False
    return held
