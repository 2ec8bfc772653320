"""moed/model/kernels/compile.py on tiny C files: several sources, one .so; a failing source is
named with the compiler's message; nothing is left beside the output either way."""
from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from moed.model.kernels.compile import CompileFailed, compile_shared

CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(not CC, reason="no C compiler")
FLAGS = ("-O1", "-fPIC", "-shared")


def test_sources_compile_at_once_into_one_library(tmp_path):
    (tmp_path / "a.c").write_text("int twice(int x) { return 2 * x; }\n")
    (tmp_path / "b.c").write_text("int twice(int); int quad(int x) { return twice(twice(x)); }\n")
    out = tmp_path / "out" / "lib.so"
    out.parent.mkdir()
    compile_shared(CC, FLAGS, (tmp_path / "a.c", tmp_path / "b.c"), out)
    assert ctypes.CDLL(str(out)).quad(5) == 20                  # b calls into a: linked together
    assert os.listdir(out.parent) == ["lib.so"]                 # the objects' folder is gone


def test_a_failing_source_is_named_and_nothing_is_left(tmp_path):
    (tmp_path / "good.c").write_text("int one(void) { return 1; }\n")
    (tmp_path / "bad.c").write_text("int two(void) { return undeclared_name; }\n")
    out = tmp_path / "out" / "lib.so"
    out.parent.mkdir()
    with pytest.raises(CompileFailed) as e:
        compile_shared(CC, FLAGS, (tmp_path / "good.c", tmp_path / "bad.c"), out)
    assert e.value.step == "bad.c" and "undeclared_name" in e.value.stderr
    assert os.listdir(out.parent) == []
