"""Priority classes (pure parts): the [priority] section, the key file's classes, a request's
priority against its key's class, the bounded class label, and admission's displacement."""
from __future__ import annotations

import pytest

from moed.api.admission import (Admission, Limits, Load, Queued, Verdict, displace, verdict)
from moed.api.auth import AuthConfigError, key_class, split_classes
from moed.api.errors import APIError
from moed.api.priority import OTHER, class_label, for_request, resolve
from moed.api.protocol import parse_request
from moed.config import ConfigError, PriorityConfig

CLASSES = {"interactive": 0, "batch": 10}


# ---- config -------------------------------------------------------------------------------

def test_config_classes_parse_and_refuse_what_they_cannot_apply():
    cfg = PriorityConfig(classes=("rt=-5", "interactive=0", "batch=10"), default_class="batch")
    assert cfg.values == {"rt": -5, "interactive": 0, "batch": 10}
    for classes, default, where in [
            (("interactive=0",), "batch", "default_class"),       # unknown default class
            (("a=1", "a=2"), "a", "repeats"),                     # a name twice
            (("a=1", "b=1"), "a", "repeats"),                     # a value twice
            (("a",), "a", "NAME=PRIORITY"),
            (("A B=1",), "A B", "NAME=PRIORITY"),
            (("a=x",), "a", "integer"),
            (("a=99999999999",), "a", "must be in"),
            (tuple(f"c{i}={i}" for i in range(9)), "c0", "between 1 and 8")]:
        with pytest.raises(ConfigError, match=where):
            PriorityConfig(classes=classes, default_class=default)


# ---- the key file ---------------------------------------------------------------------------

def test_key_entries_name_their_class_and_an_unknown_class_is_refused_without_the_key():
    keys, classes = split_classes((b"k1", b"k2 batch", b"k3\tinteractive"), CLASSES)
    assert keys == (b"k1", b"k2", b"k3") and classes == ("", "batch", "interactive")
    assert key_class(b"k2", keys, classes) == "batch"
    assert key_class(b"k1", keys, classes) == "" and key_class(b"nope", keys, classes) == ""
    with pytest.raises(AuthConfigError, match=r"key #2 names priority class 'bulk'") as e:
        split_classes((b"k1", b"secret-key bulk"), CLASSES)
    assert "secret-key" not in str(e.value)


# ---- a request's priority -----------------------------------------------------------------

def test_request_priority_defaults_to_its_class_and_may_only_be_less_urgent():
    assert resolve(None, "batch", CLASSES) == 10
    assert resolve(None, "interactive", CLASSES) == 0
    assert resolve(25, "batch", CLASSES) == 25              # less urgent: allowed
    with pytest.raises(APIError) as e:
        resolve(0, "batch", CLASSES)                        # more urgent than its key: 400
    assert e.value.status == 400 and e.value.param == "priority"
    assert e.value.code == "priority_not_allowed"


def test_for_request_uses_the_keys_class_else_the_default_and_labels_by_value():
    cfg = PriorityConfig()
    keys, classes = split_classes((b"k-batch batch", b"k-plain"), cfg.values)
    assert for_request(None, b"k-batch", keys, classes, cfg) == (10, "batch")
    assert for_request(None, b"k-plain", keys, classes, cfg) == (0, "interactive")
    assert for_request(None, None, (), (), cfg) == (0, "interactive")      # no auth
    assert for_request(7, None, (), (), cfg) == (7, OTHER)                 # bounded label
    with pytest.raises(APIError):
        for_request(-1, b"k-plain", keys, classes, cfg)
    # a migrated stream's continuation (signed by the cluster, no tenant key): kept as sent
    assert for_request(-1, None, keys, classes, cfg, continuation=True) == (-1, OTHER)


def test_class_label_is_a_class_name_or_other():
    assert [class_label(p, CLASSES) for p in (0, 10, 5, -3)] == \
        ["interactive", "batch", OTHER, OTHER]


@pytest.mark.parametrize("value,ok", [(3, True), (-2, True), (3.0, True), ("3", False),
                                      (True, False), (1.5, False), (1 << 31, False),
                                      (-(1 << 31) - 1, False)])
def test_the_field_is_an_integer_in_int32(value, ok):
    for chat in (False, True):
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        body["priority"] = value
        if ok:
            assert parse_request(body, chat=chat).priority == int(value)
        else:
            with pytest.raises(APIError) as e:
                parse_request(body, chat=chat)
            assert e.value.status == 400 and e.value.param == "priority"
    assert parse_request({"prompt": "hi"}, chat=False).priority is None


# ---- admission: displacement (pure) ---------------------------------------------------------

LIM = Limits(max_waiting=4, max_queued_tokens=1000, max_running=8)


def test_displace_takes_the_least_urgent_newest_first_and_only_as_many_as_needed():
    queued = [Queued(1, 10, 1, 5), Queued(2, 10, 1, 5), Queued(3, 5, 1, 5), Queued(4, 0, 1, 5)]
    load = Load(pending=4, pending_tokens=20, live=4)
    assert verdict(load, 1, 5, LIM) is Verdict.TOO_MANY_WAITING
    assert displace(queued, load, 0, 1, 5, LIM) == [2]          # batch, the newest
    assert displace(queued, load, 0, 2, 10, LIM) == [2, 1]
    assert displace(queued, load, 0, 3, 15, LIM) == [2, 1, 3]   # then priority 5
    assert displace(queued, load, 5, 3, 15, LIM) is None        # never an equal priority
    assert displace(queued, load, 10, 1, 5, LIM) is None        # batch displaces nobody
    assert displace([Queued(1, 10, 4, 20)], load, 0, 1, 5, LIM) == [1]   # a whole request


def test_admission_displaces_pending_requests_and_calls_them_back():
    adm = Admission(max_waiting=2, max_queued_tokens=1000, max_running=8)
    hit: list[str] = []
    _, b1 = adm.try_admit([5], 10, lambda: hit.append("b1"))
    _, b2 = adm.try_admit([5], 10, lambda: hit.append("b2"))
    assert adm.pending == 2 and adm.pending_by_priority == {10: 2}
    v, t = adm.try_admit([5], 10)                  # another batch: plain 429
    assert v is Verdict.TOO_MANY_WAITING and t == [] and adm.displaced == 0 and hit == []
    adm.started(b1[0])                             # b1 has its first token: never displaced
    _, b3 = adm.try_admit([5], 10, lambda: hit.append("b3"))
    v, inter = adm.try_admit([5], 0)               # full: the newest batch request goes
    assert v is Verdict.ADMIT and adm.displaced == 1 and hit == ["b3"]
    assert not b3[0].pending and not b3[0].live
    assert adm.pending == 2 and adm.live == 3 and adm.pending_by_priority == {10: 1, 0: 1}
    v, _ = adm.try_admit([5], 0)                   # then b2 (b1 started: not eligible)
    assert v is Verdict.ADMIT and adm.displaced == 2 and hit == ["b3", "b2"]
    v, _ = adm.try_admit([5], 0)                   # only interactive pending now: 429
    assert v is Verdict.TOO_MANY_WAITING and adm.displaced == 2 and hit == ["b3", "b2"]
    for tk in (*b1, *b2, *b3, *inter):
        adm.release(tk)
        adm.release(tk)                            # idempotent
    assert adm.live == 1 and adm.pending == 1 and adm.pending_by_priority == {0: 1}


def test_a_request_without_a_displacement_callback_is_never_displaced():
    adm = Admission(max_waiting=1, max_queued_tokens=1000, max_running=8)
    adm.try_admit([5], 10)                    # e.g. a stream whose headers went out already
    v, _ = adm.try_admit([5], 0)
    assert v is Verdict.TOO_MANY_WAITING and adm.displaced == 0


def test_only_streams_something_more_urgent_can_displace_wait_for_their_first_token():
    from types import SimpleNamespace

    import dataclasses

    from moed.api.openai import displaceable

    state = SimpleNamespace(config=SimpleNamespace(priority=PriorityConfig()))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    stream = parse_request({**chat, "stream": True}, chat=True)
    whole = parse_request(chat, chat=True)
    assert displaceable(dataclasses.replace(whole, priority=0), state)     # sent whole: yes
    assert not displaceable(dataclasses.replace(stream, priority=0), state)  # most urgent
    assert displaceable(dataclasses.replace(stream, priority=10), state)
