"""Admission bounds (pure) and API-key handling."""
from __future__ import annotations

import pytest

from moed.api.admission import Admission, Verdict
from moed.api.auth import AuthConfigError, bearer_token, check_bearer, load_keys
from moed.api.errors import APIError


def test_waiting_bound_and_release():
    a = Admission(max_waiting=2, max_queued_tokens=1000, max_running=1)
    v, t1 = a.try_admit([10])
    assert v is Verdict.ADMIT
    v, t2 = a.try_admit([10])
    assert v is Verdict.ADMIT
    assert a.try_admit([10])[0] is Verdict.TOO_MANY_WAITING
    a.started(t1[0])                   # first token: no longer waiting, still live
    assert a.pending == 1 and a.live == 2
    v, t3 = a.try_admit([10])          # live cap = max_running + max_waiting = 3
    assert v is Verdict.ADMIT
    a.started(t2[0])
    a.started(t3[0])
    assert a.pending == 0 and a.try_admit([10])[0] is Verdict.TOO_MANY_LIVE
    for t in (t1, t2, t3):
        a.release(t[0])
        a.release(t[0])                # idempotent
    assert a.pending == 0 and a.live == 0 and a.pending_tokens == 0


def test_n_choices_are_all_or_nothing():
    a = Admission(max_waiting=3, max_queued_tokens=1000, max_running=8)
    assert a.try_admit([5] * 4) == (Verdict.TOO_MANY_WAITING, [])
    assert a.pending == 0 and a.live == 0


def test_token_bound_lets_a_lone_request_in():
    a = Admission(max_waiting=10, max_queued_tokens=100, max_running=8)
    v, t = a.try_admit([500])
    assert v is Verdict.ADMIT          # alone: admitted however long
    assert a.try_admit([1])[0] is Verdict.TOO_MANY_TOKENS
    a.release(t[0])
    assert a.try_admit([60, 40])[0] is Verdict.ADMIT


def test_keys_from_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nalpha\n\nbeta\n")
    keys = load_keys(str(f), "K", {"K": "gamma, delta"})
    assert keys == (b"alpha", b"beta", b"gamma", b"delta")
    assert load_keys("", "", {}) == ()
    with pytest.raises(AuthConfigError, match="cannot read"):
        load_keys(str(tmp_path / "missing"), "", {})
    with pytest.raises(AuthConfigError, match="not set"):
        load_keys("", "NOPE", {})


@pytest.mark.parametrize("header,status", [
    (None, 401), ("", 401), ("Basic abc", 401), ("Bearer ", 401), ("Bearer wrong", 401),
    ("Bearer alphax", 401), ("Bearer alph", 401), ("Bearer \udcff\udcfe", 401),
])
def test_bearer_rejections(header, status):
    with pytest.raises(APIError) as e:
        check_bearer(header, (b"alpha", b"beta"))
    assert e.value.status == status
    assert e.value.headers == {"WWW-Authenticate": "Bearer"}


def test_a_key_valid_elsewhere_is_403_and_unknown_keys_stay_401():
    admin, tenant = (b"adm1n",), (b"alpha", b"beta")
    check_bearer("Bearer adm1n", admin, elsewhere=tenant)
    with pytest.raises(APIError) as e:
        check_bearer("Bearer beta", admin, elsewhere=tenant)
    assert e.value.status == 403 and e.value.code == "key_not_allowed"
    for header in ("Bearer nope", None, "Basic adm1n"):
        with pytest.raises(APIError) as e:
            check_bearer(header, admin, elsewhere=tenant)
        assert e.value.status == 401


def test_bearer_token_keeps_the_bytes_sent():
    # aiohttp decodes header values with surrogateescape: the key's raw bytes come back
    assert bearer_token("Bearer k\udcff") == b"k\xff"
    assert bearer_token("bearer  tok ") == b"tok"
    assert bearer_token("Basic tok") is None and bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    check_bearer("Bearer k\udcff", (b"k\xff",))


def test_key_file_comments_blank_lines_crlf_and_bom(tmp_path):
    f = tmp_path / "keys"
    f.write_bytes(b"\xef\xbb\xbfalpha\r\n  # indented comment\r\n\t# tab comment\r\n\r\n"
                  b"   \r\n beta \r\n#top comment\ngamma")
    assert load_keys(str(f), "", {}) == (b"alpha", b"beta", b"gamma")
    f.write_text("  # only\n\t#comments\n\n")
    with pytest.raises(AuthConfigError, match="holds no keys"):
        load_keys(str(f), "", {})
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(AuthConfigError, match="not UTF-8"):
        load_keys(str(f), "", {})


def test_bearer_accepts_any_configured_key_and_no_keys_means_open():
    check_bearer("Bearer beta", (b"alpha", b"beta"))
    check_bearer("bearer alpha", (b"alpha",))
    check_bearer(None, ())
