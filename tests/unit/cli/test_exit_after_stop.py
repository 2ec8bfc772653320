"""`moed serve` ends with exit_after_stop: the exit code kept, buffered output flushed, and
nothing of interpreter or C-level finalization run (native libraries' destructors raced their
own threads there: a SIGSEGV after "stopped")."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_after_stop_flushes_and_skips_finalization() -> None:
    code = textwrap.dedent("""
        import atexit, logging, sys
        from moed.cli.serve import exit_after_stop
        atexit.register(lambda: print("atexit ran", flush=True))
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
        logging.getLogger("t").warning("logged before exit")
        sys.stdout.write("buffered, no newline")
        exit_after_stop(3)
        print("after exit")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONUNBUFFERED": ""})
    assert p.returncode == 3
    assert p.stdout == "buffered, no newline"          # flushed; neither atexit nor later code ran
    assert "logged before exit" in p.stderr
