"""Prefix-cache isolation: which requests may share cached KV blocks.

Two requests share a cached prefix only when their salts are equal (moed.kvcache.pool.salt_root
is the parent hash of a salted prompt's first block). The salt folds in:
- the request's `cache_salt` (vLLM's field): a client, or a gateway on a user's behalf, opts a
  request out of sharing with anyone who does not know the salt;
- with `server.prefix_cache_isolation = "api_key"`, a tag of the tenant's API key, so no tenant
  ever hits (or times, or counts in /metrics) another tenant's cached prefix.

The default is "shared": one tenant's system prompt or document then serves every tenant's
requests from the cache, the main win of prefix caching on a shared deployment, and the same
as vLLM and SGLang. The price is a side channel (a hit is faster and counted): a tenant who
guesses another's prompt prefix can confirm it. Turn isolation on where tenants do not trust
each other; requests with no key (auth off) stay unsalted either way.
"""
from __future__ import annotations

import hashlib

from moed.api.auth import bearer_token

ISOLATION = ("shared", "api_key")
MAX_CLIENT_SALT = 512          # the client's part; the tenant tag adds 36 characters


def tenant_tag(isolation: str, authorization: str | None) -> str:
    """'' unless isolation is by API key and the request carries one: then a digest of the key
    (the key itself never travels to other nodes or into a log)."""
    if isolation != "api_key":
        return ""
    token = bearer_token(authorization)
    return "" if token is None else "key:" + hashlib.sha256(token).hexdigest()[:32]


def effective_salt(tenant: str, client_salt: str) -> str:
    """The engine's SamplingParams.cache_salt: '' when neither part is set. The separator keeps
    (tenant, salt) pairs distinct: the tag has a fixed form and never holds it."""
    if not tenant and not client_salt:
        return ""
    return f"{tenant}\x1f{client_salt}"
