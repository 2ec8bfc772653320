"""The schema framework (moed/config/schema.py): field declarations, bounds on every number of
every section, text that must be UTF-8."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config
from moed.config import ConfigError
from moed.config.schema import _f


def test_non_utf8_environment_and_flags_are_refused() -> None:
    bad = b"m\xff".decode("utf-8", "surrogateescape")      # what os.environ holds for it
    with pytest.raises(ConfigError, match="environment: model.path: not UTF-8 text"):
        config.load(environ={"MOED_MODEL_PATH": bad})
    with pytest.raises(ConfigError, match="command line: model.path: not UTF-8 text"):
        config.load(environ={}, overrides={"model": {"path": bad}})
    with pytest.raises(ConfigError, match="environment: cluster.seeds: not UTF-8"):
        config.load(environ={"MOED_MODEL_PATH": "m", "MOED_CLUSTER_SEEDS": "a:1," + bad})


# ---- bounds: every number of every section ---------------------------------------------

NUMERIC = config.numeric_fields()


def test_every_numeric_field_has_bounds_within_64_bits() -> None:
    import dataclasses
    import typing

    every = set()                                       # enumerated here, independently
    for sec in dataclasses.fields(config.Config):
        hints = typing.get_type_hints(sec.default_factory)
        every |= {(sec.name, f.name) for f in dataclasses.fields(sec.default_factory)
                  if hints[f.name] in (int, float)}
    assert {(s, n) for s, n, *_ in NUMERIC} == every and len(every) > 40
    for sec, name, tp, bounds in NUMERIC:
        assert bounds is not None, f"{sec}.{name} has no bounds"
        lo, hi = bounds
        assert -(1 << 63) <= lo <= hi <= (1 << 63) - 1, (sec, name, bounds)
        if tp is int:
            assert isinstance(lo, int) and isinstance(hi, int), (sec, name, bounds)


def test_a_field_cannot_be_declared_without_sane_bounds() -> None:
    with pytest.raises(TypeError, match="needs bounds"):
        _f(1)
    with pytest.raises(TypeError, match="needs bounds"):
        _f(1.5, live=True)
    with pytest.raises(TypeError, match="take none"):
        _f("x", bounds=(0, 1))
    with pytest.raises(TypeError, match="outside bounds"):
        _f(5, bounds=(0, 1))
    with pytest.raises(TypeError, match="64 bits"):
        _f(5, bounds=(0, 1 << 64))
    _f(True)                                     # bools are not numbers here


def _toml_number(v: float) -> str:
    if v != v:
        return "nan"
    if v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def _bad_values(tp: type, lo: float, hi: float) -> list[float]:
    out: list[float] = [10 ** 20, -(10 ** 20), 2 ** 62, 10 ** 400]
    out += [hi + 1, lo - 1] if tp is int else [hi * 2 + 1, lo - 1, 1e300, -1e300]
    return out + [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("sec,name,tp,bounds", NUMERIC, ids=[f"{s}.{n}" for s, n, *_ in NUMERIC])
def test_out_of_bounds_values_are_refused_naming_the_field(
        tmp_path: Path, sec: str, name: str, tp: type, bounds: tuple[float, float]) -> None:
    lo, hi = bounds
    p = tmp_path / "moed.toml"
    model = {"model": {"path": "m"}}
    for ok in (lo, hi):                                 # both ends are inclusive
        p.write_text(f"[{sec}]\n{name} = {_toml_number(ok)}\n")
        assert getattr(getattr(config.load(p, environ={}, overrides=model), sec), name) == ok
    for bad in _bad_values(tp, lo, hi):
        p.write_text(f"[{sec}]\n{name} = {_toml_number(bad)}\n")
        with pytest.raises(ConfigError, match=f"{sec}.{name}"):
            config.load(p, environ={}, overrides=model)
        env = {f"MOED_{sec.upper()}_{name.upper()}": _toml_number(bad), "MOED_MODEL_PATH": "m"}
        with pytest.raises(ConfigError, match=f"{sec}.{name}"):
            config.load(environ=env)
