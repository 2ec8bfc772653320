"""Authentication of node-to-node calls with the cluster's own secret (never a tenant API key).

Who may call what
-----------------
    /internal/prefill (POST, DELETE)   a request signed with the cluster secret
    /internal/transfer, /cluster       a signed request, or the admin token (Bearer)
A tenant API key opens none of them (403 if it is a valid one, 401 otherwise).

A signed request carries four headers:
    X-Moed-Node       the caller's node name (for the log; every member holds the same secret)
    X-Moed-Timestamp  milliseconds since the epoch; refused outside ±window_s of our clock
    X-Moed-Nonce      random, refused when seen again within the window (replays)
    X-Moed-Signature  hex HMAC-SHA256(rpc key, "moed-rpc-v1" | method | path | ts | nonce |
                      node | sha256(body)), so neither the body nor the route can be swapped
The rpc key is derived from the gossip key (HMAC(key, "moed internal rpc v1")), so a leaked
rpc signature says nothing about the gossip MAC; rotation follows the gossip keyring (primary
signs; primary or secondary verify).

A prefill job also carries a *capability*, issued by the decode node for exactly that job:
HMAC(rpc key, "moed-cap-v1" | job id | decode node | incarnation | skip | destination blocks |
expiry). The prefill node refuses a job whose capability does not match its fields or has
expired, so a captured job cannot be pointed at other blocks or another node; it echoes the
capability in the first-token notification, and the decode node checks it again there.

`insecure` (cluster.insecure with no key, loopback only) signs with the empty key and accepts
unsigned calls: the same code path, nothing to authenticate with.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import structlog
from aiohttp import web

from moed.api.admin import ADMIN
from moed.api.auth import bearer_token, key_matches
from moed.api.errors import APIError
from moed.api.state import STATE
from moed.cluster.wire import Keyring
from moed.config import Config, ConfigError

log = structlog.get_logger(__name__)

H_NODE, H_TS, H_NONCE, H_SIG = ("X-Moed-Node", "X-Moed-Timestamp", "X-Moed-Nonce",
                                "X-Moed-Signature")
_RPC_LABEL = b"moed internal rpc v1"
START_SKEW_S = 2.0
MAX_NONCES = 200_000       # ~ a few hundred calls a second over a 2-minute window
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; '' and 0.0.0.0 (every interface) are not."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposed_hosts(cfg: Config) -> list[str]:
    """The addresses off loopback where an insecure node would take unsigned calls: its HTTP
    listener (every role that has a cluster key serves /internal/* or /cluster, and a colocated
    node with tiers.peer_reuse lends KV there) and, with membership, its gossip socket."""
    hosts = [f"server.host {cfg.server.host or '(every interface)'}"] \
        if not is_loopback(cfg.server.host) else []
    if cfg.cluster.enabled and not is_loopback(cfg.cluster.bind_host):
        hosts.append(f"cluster.bind_host {cfg.cluster.bind_host or '(every interface)'}")
    return hosts


def derive(key: bytes) -> bytes:
    return hmac.digest(key, _RPC_LABEL, hashlib.sha256)


def _mac(key: bytes, *parts: bytes) -> str:
    return hmac.new(key, b"\x00".join(parts), hashlib.sha256).hexdigest()


def _string_to_sign(method: str, path: str, ts: str, nonce: str, node: str,
                    body: bytes) -> tuple[bytes, ...]:
    return (b"moed-rpc-v1", method.upper().encode(), path.encode(), ts.encode(),
            nonce.encode(), node.encode(), hashlib.sha256(body).hexdigest().encode())


class InternalAuth:
    """Signs our calls and checks other nodes' (an app component: its prepare_reload follows
    cluster key rotation on SIGHUP; `app.state.internal_auth` is how handlers reach it)."""

    name = "internal-auth"

    def __init__(self, keyring: Keyring, node: str, *, insecure: bool, window_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.insecure = insecure
        self.window_s = window_s
        self._clock = clock
        # a replay to a node that restarted (its nonces forgotten) is still refused: nothing
        # signed before this node existed is for it (allowing for a little clock skew)
        self._not_before = clock() - START_SKEW_S
        self._keys = self._derive(keyring)
        self._nonces: OrderedDict[str, float] = OrderedDict()   # nonce -> expiry (clock time)

    @staticmethod
    def _derive(keyring: Keyring) -> tuple[bytes, ...]:
        return tuple(derive(k) for k in (keyring.primary, *keyring.secondary))

    @classmethod
    def from_config(cls, cfg: Config, node: str,
                    environ: Mapping[str, str] | None = None) -> "InternalAuth":
        """The cluster keyring (cluster.key_file / key_env); no key → refuse, unless
        cluster.insecure on a loopback address (said loudly)."""
        from moed.cluster.service import load_keyring   # raises ClusterError (a ConfigError)

        cc = cfg.cluster
        keyring = load_keyring(cc) if environ is None else load_keyring(cc, environ)
        insecure = not keyring.primary
        if insecure:
            exposed = exposed_hosts(cfg)
            if exposed:
                raise ConfigError(
                    f"cluster.insecure: a {cfg.server.role} node without a cluster key would "
                    f"take unsigned node-to-node calls (/internal/*, KV leases, gossip) from "
                    f"anyone who reaches {', '.join(exposed)}; set cluster.key_file or "
                    f"cluster.key_env (insecure is for loopback test clusters only)")
        if insecure:
            log.warning("internal_rpc_insecure", detail="no cluster key: /internal/* and "
                        "/cluster are open to anyone who reaches this port (loopback only)")
        window = cc.replay_window_ms / 1000.0 or 120.0
        return cls(keyring, node, insecure=insecure, window_s=window)

    # ---- component protocol (moed.app) -------------------------------------------------
    def add_routes(self, web_app: web.Application) -> None:
        pass

    async def start(self, app: Any) -> None:
        app.state.internal_auth = self

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def prepare_reload(self, old: Config, new: Config) -> Callable[[], None]:
        """Re-read the keys on every SIGHUP: a key rotated under the same file name counts."""
        from moed.cluster.service import load_keyring

        keyring = load_keyring(new.cluster)          # ClusterError: the reload is refused
        if self.insecure != (not keyring.primary):
            raise ConfigError("cluster key: adding or removing the key needs a restart")
        keys = self._derive(keyring)

        def commit() -> None:
            self._keys = keys
        return commit

    # ---- signing -------------------------------------------------------------------------
    def sign(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        """Headers for a call to another node (`path` as the server will see it, unquoted)."""
        ts = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(16)
        sig = _mac(self._keys[0], *_string_to_sign(method, path, ts, nonce, self.node, body))
        return {H_NODE: self.node, H_TS: ts, H_NONCE: nonce, H_SIG: sig}

    def verify(self, request: web.Request, body: bytes = b"") -> str:
        """The caller's node name, or APIError(401). Call with the exact body bytes read."""
        h = request.headers
        node, ts, nonce, sig = (h.get(H_NODE, ""), h.get(H_TS, ""), h.get(H_NONCE, ""),
                                h.get(H_SIG, ""))
        if not sig:
            if self.insecure:
                return node or "?"
            raise _denied(request, "this endpoint takes a request signed with the cluster "
                                   "secret", "missing_signature")
        if not (ts.isdigit() and 16 <= len(nonce) <= 64 and len(node) <= 256):
            raise _denied(request, "malformed signature headers", "bad_signature")
        now, sent = self._clock(), int(ts) / 1000.0
        if abs(now - sent) > self.window_s or sent < self._not_before:
            raise _denied(request, "request timestamp outside the replay window "
                                   "(check the clocks)", "stale_signature")
        parts = _string_to_sign(request.method, request.path, ts, nonce, node, body)
        if not any(hmac.compare_digest(_mac(k, *parts), sig) for k in self._keys):
            raise _denied(request, "bad signature", "bad_signature")
        self._remember(nonce, now)
        return node

    def _remember(self, nonce: str, now: float) -> None:
        while self._nonces:                         # drop expired nonces (oldest first)
            first, exp = next(iter(self._nonces.items()))
            if exp > now and len(self._nonces) < MAX_NONCES:
                break
            self._nonces.pop(first)
        if nonce in self._nonces:
            raise APIError(401, "replayed request", code="replayed_request")
        self._nonces[nonce] = now + 2 * self.window_s

    # ---- per-job capabilities ------------------------------------------------------------
    def capability(self, job_id: str, decode_node: str, incarnation: int, skip: int,
                   dst_blocks: Sequence[int], expires_ms: int) -> str:
        return _mac(self._keys[0], *_cap_parts(job_id, decode_node, incarnation, skip,
                                                dst_blocks, expires_ms))

    def check_capability(self, cap: str, job_id: str, decode_node: str, incarnation: int,
                         skip: int, dst_blocks: Sequence[int], expires_ms: int) -> str | None:
        """None when `cap` was issued for exactly these fields and has not expired, else why."""
        if expires_ms / 1000.0 < self._clock():
            return "capability expired"
        parts = _cap_parts(job_id, decode_node, incarnation, skip, dst_blocks, expires_ms)
        if not any(hmac.compare_digest(_mac(k, *parts), cap) for k in self._keys):
            return "capability does not match the job"
        return None


def _cap_parts(job_id: str, node: str, incarnation: int, skip: int, dst: Sequence[int],
               expires_ms: int) -> tuple[bytes, ...]:
    return (b"moed-cap-v1", job_id.encode(), node.encode(), str(incarnation).encode(),
            str(skip).encode(), ",".join(map(str, dst)).encode(), str(expires_ms).encode())


def _denied(request: web.Request, why: str, code: str) -> APIError:
    """401 for a missing/bad credential; 403 when the caller sent a valid tenant API key (it
    authenticates, but never for internal endpoints)."""
    state = request.app.get(STATE)
    token = bearer_token(request.headers.get("Authorization"))
    keys = state.api_keys if state is not None else ()
    if token is not None and keys and key_matches(token, keys):
        return APIError(403, "API keys do not open internal endpoints.", code="key_not_allowed")
    log.warning("internal_auth_refused", path=request.path, reason=code, peer=request.remote)
    return APIError(401, f"Unauthorized: {why}.", code=code,
                    headers={"WWW-Authenticate": "Bearer"})


def require_signed(request: web.Request, body: bytes = b"") -> str:
    """Guard for node-to-node routes: the verified caller's node name, or APIError."""
    auth: InternalAuth | None = getattr(request.app[STATE], "internal_auth", None)
    if auth is None:
        raise APIError(503, "Node is starting.", code="not_ready")
    return auth.verify(request, body)


def require_operator(request: web.Request) -> None:
    """Guard for routes that disclose the cluster (/cluster, /internal/transfer): the admin
    token (Bearer; server.admin_token_file/_env) or a signed call from another node."""
    hooks = request.app.get(ADMIN)
    admin_tokens = hooks.tokens() if hooks is not None else ()
    token = bearer_token(request.headers.get("Authorization"))
    if admin_tokens and token is not None and key_matches(token, admin_tokens):
        return
    state = request.app.get(STATE)
    if state is not None and getattr(state, "internal_auth", None) is None:
        from moed.config import needs_cluster_key
        if not needs_cluster_key(state.config):
            # no cluster key on this node, ever: the admin token is the one way in (not a
            # 503 "starting" that never ends)
            if not admin_tokens:
                raise APIError(403, f"{request.path} takes the admin token, and this node has "
                                    f"none: set server.admin_token_file or "
                                    f"server.admin_token_env.", code="admin_disabled")
            raise _denied(request, f"{request.path} takes the admin token (Authorization: "
                                   f"Bearer; server.admin_token_file or "
                                   f"server.admin_token_env)", "missing_admin_token"
                          if token is None else "bad_admin_token")
    try:
        require_signed(request)
    except APIError as e:
        if e.status != 401:
            raise
        # the caller is most likely an operator: name their credential before the nodes'
        why = "" if e.code == "missing_signature" else \
            f" ({e.message.removeprefix('Unauthorized: ').rstrip('.')})"
        raise APIError(401, f"Unauthorized: {request.path} takes the admin token "
                            f"(Authorization: Bearer; server.admin_token_file or "
                            f"server.admin_token_env) or a call signed with the cluster "
                            f"secret{why}.", code=e.code, headers=e.headers) from None
