"""Optional Bearer API keys, read from a file (one per line) or an env var (comma-separated).

A line of the key file (an entry of the variable) may name the key's priority class after
the key, separated by white space (`sk-abc123 batch`, moed/api/priority.py): `split_classes`
takes it off; a class that `[priority] classes` does not define is an error at load.

No keys configured = no auth. Keys are compared with hmac.compare_digest against every key
(no early exit), so timing does not reveal which key or prefix matched.

Status codes (as OpenAI and vLLM): no credential, a malformed one or an unknown key is 401 with
`WWW-Authenticate: Bearer`; 403 is kept for a key that is valid, only not for this endpoint
(e.g. a tenant API key on /admin or /internal: pass the tenant keys as `elsewhere`).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Collection, Mapping

from moed.api.errors import APIError
from moed.safefile import FileRefused, read_regular_file

MAX_KEYS_BYTES = 1 << 20     # a file of API keys or tokens; /dev/zero-like files are refused


class AuthConfigError(ValueError):
    """The configured key source cannot be read."""


def load_keys(keys_file: str, keys_env: str, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if keys_file:
        where = f"server.api_keys_file {keys_file}"
        try:   # a regular file only, read without blocking (a FIFO would hang the loop)
            raw = read_regular_file(keys_file, MAX_KEYS_BYTES)
        except FileRefused as e:
            raise AuthConfigError(f"{where}: {e}") from None
        except (OSError, ValueError) as e:
            raise AuthConfigError(f"{where}: cannot read: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        try:
            text = raw.decode("utf-8-sig")        # a BOM is not key material
        except UnicodeDecodeError as e:
            raise AuthConfigError(f"{where}: not UTF-8 text at byte {e.start}") from None
        lines = (ln.strip() for ln in text.splitlines())     # also drops a CRLF file's \r
        keys += [ln for ln in lines if ln and not ln.startswith("#")]
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


def split_classes(keys: tuple[bytes, ...], classes: Collection[str]
                  ) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    """API key entries -> (the keys, each key's priority class or ""). The error names the
    entry's position and the class, never the key."""
    out, named = [], []
    for i, entry in enumerate(keys):
        parts = entry.split(None, 1)      # "<key>" or "<key> <class>"
        key = parts[0] if parts else b""
        cls_s = parts[1].strip().decode("utf-8", "replace") if len(parts) > 1 else ""
        if cls_s and cls_s not in classes:
            raise AuthConfigError(f"server.api_keys: key #{i + 1} names priority class "
                                  f"{cls_s[:40]!r}, which [priority] classes does not define "
                                  f"(known: {', '.join(classes)})")
        if not key:
            raise AuthConfigError(f"server.api_keys: key #{i + 1} is empty")
        out.append(key)
        named.append(cls_s)
    return tuple(out), tuple(named)


def key_class(presented: bytes, keys: tuple[bytes, ...], classes: tuple[str, ...]) -> str:
    """The priority class of the key `presented` ("" when it names none or is unknown). Every
    key is compared, as in key_matches."""
    p = hashlib.sha256(presented).digest()
    found = ""
    for k, c in zip(keys, classes):
        if hmac.compare_digest(p, hashlib.sha256(k).digest()):
            found = c
    return found


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    # Digests first: compare_digest is constant-time only for equal lengths, and hashing
    # hides the configured keys' lengths too.
    p = hashlib.sha256(presented).digest()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(p, hashlib.sha256(k).digest())
    return ok


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an 'Authorization: Bearer <token>' header, or None (absent, other scheme,
    empty). Bytes as sent: aiohttp decodes header values with surrogateescape."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("utf-8", "surrogateescape")


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


def check_bearer(authorization: str | None, keys: tuple[bytes, ...], *,
                 elsewhere: tuple[bytes, ...] = ()) -> None:
    """Return if the Bearer token is one of `keys` (or no keys are configured). Raise 401 when it
    is missing, malformed or unknown; 403 when it is one of `elsewhere`, the keys of another
    endpoint (valid, but not here)."""
    if not keys:
        return
    if not authorization:
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'.",
                            "missing_api_key")
    token = bearer_token(authorization)
    if token is None:
        raise _unauthorized("Malformed Authorization header: expected 'Bearer <key>'.",
                            "missing_api_key")
    if key_matches(token, keys):
        return
    if elsewhere and key_matches(token, elsewhere):
        raise APIError(403, "This key may not use this endpoint.", code="key_not_allowed")
    raise _unauthorized("Invalid API key.", "invalid_api_key")
