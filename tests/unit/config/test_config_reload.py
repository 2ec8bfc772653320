"""Reload diffing (moed/config/reload.py): what differs, and what a running node adopts."""
from __future__ import annotations

from moed import config


def test_diff_and_apply_live_keep_cold_fields() -> None:
    old = config.load(environ={"MOED_MODEL_PATH": "m"})
    new = config.load(environ={"MOED_MODEL_PATH": "other", "MOED_ADMISSION_MAX_WAITING_REQUESTS": "3",
                               "MOED_SERVER_PORT": "9999"})
    changes = {c.key: c for c in config.diff(old, new)}
    assert set(changes) == {"model.path", "admission.max_waiting_requests", "server.port"}
    assert changes["admission.max_waiting_requests"].live
    assert not changes["model.path"].live and not changes["server.port"].live
    adopted = config.apply_live(old, new)
    assert adopted.admission.max_waiting_requests == 3
    assert adopted.model.path == "m" and adopted.server.port == old.server.port
    assert adopted.digest() != old.digest()
    assert config.diff(old, old) == []
