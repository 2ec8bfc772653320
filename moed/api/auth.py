"""Optional Bearer API keys, read from a file (one per line) or an env var (comma-separated).

No keys configured = no auth. Keys are compared with hmac.compare_digest against every key
(no early exit), so timing does not reveal which key or prefix matched.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Mapping

from moed.api.errors import APIError


class AuthConfigError(ValueError):
    """The configured key source cannot be read."""


def load_keys(keys_file: str, keys_env: str, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as e:
            raise AuthConfigError(f"server.api_keys_file {keys_file}: cannot read: {e.strerror}") from None
        keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        if not keys:
            raise AuthConfigError(f"server.api_keys_file {keys_file}: holds no keys")
    if keys_env:
        raw = env.get(keys_env)
        if raw is None:
            raise AuthConfigError(f"server.api_keys_env: variable {keys_env} is not set")
        from_env = [k.strip() for k in raw.split(",") if k.strip()]
        if not from_env:
            raise AuthConfigError(f"server.api_keys_env: variable {keys_env} holds no keys")
        keys += from_env
    return tuple(k.encode() for k in keys)


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    # Digests first: compare_digest is constant-time only for equal lengths, and hashing
    # hides the configured keys' lengths too.
    p = hashlib.sha256(presented).digest()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(p, hashlib.sha256(k).digest())
    return ok


def check_bearer(authorization: str | None, keys: tuple[bytes, ...]) -> None:
    """Raise 401 without credentials, 403 with a wrong key; return if allowed."""
    if not keys:
        return
    if not authorization:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                       code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "Malformed Authorization header: expected 'Bearer <key>'.",
                       code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not key_matches(token.strip().encode(), keys):
        raise APIError(403, "Invalid API key.", code="invalid_api_key")
