"""Wire format: authenticated, compact, strictly validated.

    packet = VERSION (1 byte) | body (JSON) | HMAC-SHA256(key, VERSION | body) (32 bytes)
    body   = [sender_name, sent_at_ms, [message, ...]]
    message = [tag, field, ...]   (one short JSON array per message type, see _ENCODERS)

Packets go over UDP (at most MAX_PACKET bytes: one probe plus as many piggybacked updates as
fit); push-pull state goes over a stream (at most MAX_STREAM bytes), framed as

    frame  = header | HMAC-SHA256(key, header) (32 bytes) | packet
    header = VERSION (1 byte) | len(packet) (4 bytes) | sent_at_ms (8 bytes), big-endian

so a receiver authenticates the announced length before it reads (and buffers) the packet.

Evolving the wire: VERSION is the major version, bumped only for a change an older node cannot
skip (it drops such packets: "version"). Anything else is added so that the release before
reads it: a new field goes at the END of its message, NodeMeta or LoadVector list (older
decoders take the fields they know and ignore the rest; newer ones give a missing trailing
field its default), and a new message type gets a new tag (older decoders skip unknown tags,
the packet's other messages still count). tests/unit/cluster/test_cluster_wire.py gossips a
"next release" encoder with today's decoder to keep this true.
Everything that fails length, version, MAC, JSON or field checks raises DecodeError with a
short `reason` used as a metric label: the receiver counts it and drops the packet (or closes
the stream), it never crashes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any, Callable, Union

from .state import (DIGEST_BYTES, MAX_BUCKETS, MAX_DIGEST, MAX_PRIORITY_COUNT,
                    MAX_PRIORITY_PAIRS, PRIORITY_RANGE, LoadVector, MemberState, NodeMeta,
                    digest_of_text)

VERSION = 1
MAC_LEN = 32
MAX_PACKET = 1400
# A push-pull carries one state entry per member, and each entry must fit a packet (it is
# gossiped as an Alive): 4 MiB holds ~3500 members at that worst case, 20000 at a typical
# ~175 bytes.
MAX_STREAM = 4 * 1024 * 1024
MAX_NAME = 128
MAX_FIELD = 256
MAX_INT = (1 << 63) - 1
_HEADER = bytes([VERSION])


class DecodeError(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Keyring:
    """Signs with `primary`; accepts `primary` or any of `secondary` (key rotation).
    An insecure ring uses the empty key: still a checksum, never mixes with keyed nodes."""
    primary: bytes
    secondary: tuple[bytes, ...] = ()

    @classmethod
    def insecure(cls) -> Keyring:
        return cls(b"")

    def sign(self, data: bytes) -> bytes:
        return hmac.digest(self.primary, data, hashlib.sha256)

    def verify(self, data: bytes, mac: bytes) -> bool:
        for key in (self.primary, *self.secondary):
            if hmac.compare_digest(hmac.digest(key, data, hashlib.sha256), mac):
                return True
        return False


# ---- messages ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Ping:
    seq: int
    target: str          # the name we expect to answer: a reused address must not ack
    source: str
    source_addr: str


@dataclass(frozen=True)
class IndirectPing:
    seq: int
    target: str
    target_addr: str
    source: str
    source_addr: str
    nack: bool           # Lifeguard: tell the source if the target did not answer


@dataclass(frozen=True)
class Ack:
    seq: int


@dataclass(frozen=True)
class Nack:
    seq: int


@dataclass(frozen=True)
class Alive:
    name: str
    incarnation: int
    addr: str
    meta: NodeMeta
    load_seq: int
    load: LoadVector


@dataclass(frozen=True)
class Suspect:
    name: str
    incarnation: int
    source: str


@dataclass(frozen=True)
class Dead:
    name: str
    incarnation: int
    source: str          # == name: the member left on purpose

    @property
    def is_leave(self) -> bool:
        return self.source == self.name


@dataclass(frozen=True)
class Load:
    name: str
    load_seq: int
    load: LoadVector


@dataclass(frozen=True)
class StateEntry:
    name: str
    incarnation: int
    state: MemberState
    addr: str
    meta: NodeMeta
    load_seq: int
    load: LoadVector


@dataclass(frozen=True)
class PushPull:
    join: bool
    reply: bool
    source_addr: str
    states: tuple[StateEntry, ...]


Message = Union[Ping, IndirectPing, Ack, Nack, Alive, Suspect, Dead, Load, PushPull]


# ---- field checks ------------------------------------------------------------------------

def _int(v: Any) -> int:
    if type(v) is not int or not (0 <= v <= MAX_INT):
        raise DecodeError("malformed", f"bad integer {v!r:.40}")
    return v


def _str(v: Any, limit: int = MAX_FIELD) -> str:
    if type(v) is not str or len(v) > limit:
        raise DecodeError("malformed", f"bad string {v!r:.40}")
    return v


def _name(v: Any) -> str:
    s = _str(v, MAX_NAME)
    if not s:
        raise DecodeError("malformed", "empty name")
    return s


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise DecodeError("malformed", f"bad bool {v!r:.40}")
    return v


def _list(v: Any, n: int | None = None) -> list:
    """A JSON list of at least `n` items; items past the first `n` belong to a later release
    (see "Evolving the wire" above) and are dropped."""
    if type(v) is not list or (n is not None and len(v) < n):
        raise DecodeError("malformed", f"bad list {v!r:.40}")
    return v if n is None else v[:n]


def record(v: Any, cls: type, required: int, check: Callable[[Any], Any]) -> Any:
    """A dataclass from its JSON list: at least `required` values (what wire version 1 had),
    at most the fields `cls` has now; values past those are a later release's and dropped,
    fields past the values sent keep their defaults (an earlier release sent them)."""
    n = len(dataclasses.fields(cls))
    if type(v) is not list or len(v) < required:
        raise DecodeError("malformed", f"bad {cls.__name__} {v!r:.40}")
    return cls(*(check(x) for x in v[:n]))


def _meta(v: Any) -> NodeMeta:
    # role, http, model, layout, transfer (wire version 1), then the release fields
    # version, label, model_id, config, protocol, then ep_group, ep_rank, ep_size (missing
    # from a release before: "")
    return record(v, NodeMeta, 5, _str)


def _float(v: Any) -> float:
    """A finite, non-negative number (JSON may send 0 as an integer)."""
    if type(v) not in (int, float) or not (0.0 <= v <= 1e18):    # NaN fails both sides
        raise DecodeError("malformed", f"bad number {v!r:.40}")
    return float(v)


def _ints(v: Any, limit: int) -> tuple[int, ...]:
    if type(v) is not list or len(v) > limit:
        raise DecodeError("malformed", f"bad list {v!r:.40}")
    return tuple(_int(x) for x in v)


def _digest(v: Any) -> tuple[int, ...]:
    if type(v) is not str or len(v) > 4 * -(-MAX_DIGEST * DIGEST_BYTES // 3):
        raise DecodeError("malformed", f"bad digest {v!r:.40}")
    try:
        return digest_of_text(v)
    except (ValueError, UnicodeEncodeError):
        raise DecodeError("malformed", f"bad digest {v!r:.40}") from None


def _measured(v: Any) -> float:
    """A capacity signal: a _float, or -1 (not measured yet)."""
    return -1.0 if type(v) in (int, float) and v == -1 else _float(v)


def _priority_pairs(v: Any) -> tuple[tuple[int, int], ...]:
    """[priority, count, priority, count, ...] (LoadVector.waiting_by_priority, flat)."""
    lo, hi = PRIORITY_RANGE
    pairs = tuple(zip(v[::2], v[1::2])) if type(v) is list and not len(v) % 2 else ()
    if type(v) is not list or len(v) % 2 or len(v) > 2 * MAX_PRIORITY_PAIRS or any(
            type(p) is not int or type(n) is not int or not lo <= p <= hi
            or not 0 <= n <= MAX_PRIORITY_COUNT for p, n in pairs):
        raise DecodeError("malformed", f"bad priority pairs {v!r:.40}")
    return pairs


# LoadVector after wire version 1's four integers (waiting, running, free_kv_blocks, queued
# tokens), in order; each one a node of the release before does not send keeps its default
_LOAD_TAIL: tuple[Callable[[Any], Any], ...] = (
    lambda v: _ints(v, MAX_BUCKETS),                             # bucket_edges
    lambda v: _ints(v, MAX_BUCKETS), lambda v: _ints(v, MAX_BUCKETS),   # queued tokens, requests
    lambda v: tuple(_float(x) for x in _ints_or_floats(v)),      # cost coefficients
    _float, _int, _int,                                          # prefill_share, chunk, block
    _digest,                                                     # prefix_digest
    # the capacity signals (moed.balance.capacity): tok/s, step, queue, compute, TTFT, tokens
    *(_measured,) * 5, _int,
    _priority_pairs)                                             # waiting_by_priority


def _ints_or_floats(v: Any) -> list:
    if type(v) is not list or len(v) > 16:
        raise DecodeError("malformed", f"bad list {v!r:.40}")
    return v


def _load(v: Any) -> LoadVector:
    if type(v) is not list or len(v) < 4:
        raise DecodeError("malformed", f"bad LoadVector {v!r:.40}")
    head = [_int(x) for x in v[:4]]
    tail = [check(x) for check, x in zip(_LOAD_TAIL, v[4:])]    # a later release's: dropped
    return LoadVector(*head, *tail)


_STATES = {s.value: s for s in MemberState}


def _state(v: Any) -> MemberState:
    if type(v) is not str or v not in _STATES:
        raise DecodeError("malformed", f"bad state {v!r:.40}")
    return _STATES[v]


def _entry(v: Any) -> StateEntry:
    f = _list(v, 7)
    return StateEntry(_name(f[0]), _int(f[1]), _state(f[2]), _str(f[3]), _meta(f[4]),
                      _int(f[5]), _load(f[6]))


# tag -> (field count, decoder)
_DECODERS: dict[str, tuple[int, Callable[[list], Message]]] = {
    "p": (4, lambda f: Ping(_int(f[0]), _name(f[1]), _name(f[2]), _str(f[3]))),
    "i": (6, lambda f: IndirectPing(_int(f[0]), _name(f[1]), _str(f[2]), _name(f[3]),
                                    _str(f[4]), _bool(f[5]))),
    "a": (1, lambda f: Ack(_int(f[0]))),
    "n": (1, lambda f: Nack(_int(f[0]))),
    "A": (6, lambda f: Alive(_name(f[0]), _int(f[1]), _str(f[2]), _meta(f[3]), _int(f[4]),
                             _load(f[5]))),
    "S": (3, lambda f: Suspect(_name(f[0]), _int(f[1]), _name(f[2]))),
    "D": (3, lambda f: Dead(_name(f[0]), _int(f[1]), _name(f[2]))),
    "L": (3, lambda f: Load(_name(f[0]), _int(f[1]), _load(f[2]))),
    "P": (4, lambda f: PushPull(_bool(f[0]), _bool(f[1]), _str(f[2]),
                                tuple(_entry(e) for e in _list(f[3])))),
}


def to_fields(m: Message) -> list:
    """A message as its JSON array."""
    if isinstance(m, Ping):
        return ["p", m.seq, m.target, m.source, m.source_addr]
    if isinstance(m, IndirectPing):
        return ["i", m.seq, m.target, m.target_addr, m.source, m.source_addr, m.nack]
    if isinstance(m, Ack):
        return ["a", m.seq]
    if isinstance(m, Nack):
        return ["n", m.seq]
    if isinstance(m, Alive):
        return ["A", m.name, m.incarnation, m.addr, m.meta.to_list(), m.load_seq,
                m.load.to_list()]
    if isinstance(m, Suspect):
        return ["S", m.name, m.incarnation, m.source]
    if isinstance(m, Dead):
        return ["D", m.name, m.incarnation, m.source]
    if isinstance(m, Load):
        return ["L", m.name, m.load_seq, m.load.to_list()]
    if isinstance(m, PushPull):
        return ["P", m.join, m.reply, m.source_addr,
                [[e.name, e.incarnation, e.state.value, e.addr, e.meta.to_list(), e.load_seq,
                  e.load.to_list()] for e in m.states]]
    raise TypeError(f"not a message: {m!r}")


def fragment(m: Message) -> bytes:
    """One message encoded once, so a broadcast can be piggybacked many times cheaply."""
    return json.dumps(to_fields(m), separators=(",", ":")).encode()


def from_fields(v: Any) -> Message | None:
    """A message, or None for a tag this release does not know (a later release's message:
    skipped, the rest of the packet still counts). Extra trailing fields are ignored."""
    f = _list(v)
    if not f or type(f[0]) is not str or not 0 < len(f[0]) <= 8:
        raise DecodeError("malformed", f"bad message {str(f[:1]):.40}")
    if f[0] not in _DECODERS:
        return None
    count, dec = _DECODERS[f[0]]
    if len(f) < count + 1:
        raise DecodeError("malformed", f"message {f[0]} has {len(f) - 1} fields")
    return dec(f[1:count + 1])


# ---- packets -----------------------------------------------------------------------------

class Codec:
    """How the core turns messages into transport payloads. WireCodec is the real one;
    the simulator may swap in a cheaper one that skips bytes but not protocol."""
    max_packet = MAX_PACKET

    def fragment(self, m: Message) -> bytes:
        return fragment(m)

    def encode(self, sender: str, sent_at_ms: int, fragments: list) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, max_size: int) -> tuple[str, int, list[Message]]:
        raise NotImplementedError


class WireCodec(Codec):
    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    def encode(self, sender: str, sent_at_ms: int, fragments: list) -> bytes:
        return encode(self.keyring, sender, sent_at_ms, fragments)

    def decode(self, data: bytes, max_size: int) -> tuple[str, int, list[Message]]:
        return decode(self.keyring, data, max_size)


def packet_overhead(sender: str) -> int:
    """Bytes a packet spends besides its message fragments (and their commas)."""
    return 1 + len(json.dumps(sender)) + 2 + 20 + 4 + MAC_LEN


def encode(keyring: Keyring, sender: str, sent_at_ms: int, fragments: list[bytes]) -> bytes:
    body = b"[%s,%d,[%s]]" % (json.dumps(sender).encode(), sent_at_ms, b",".join(fragments))
    data = _HEADER + body
    return data + keyring.sign(data)


def decode(keyring: Keyring, data: bytes, max_size: int) -> tuple[str, int, list[Message]]:
    """(sender, sent_at_ms, messages) or DecodeError; cheap checks before the MAC."""
    if len(data) > max_size:
        raise DecodeError("oversized", f"{len(data)} > {max_size} bytes")
    if len(data) < 1 + 2 + MAC_LEN:
        raise DecodeError("truncated", f"{len(data)} bytes")
    if data[0] != VERSION:
        raise DecodeError("version", f"version {data[0]}")
    signed, mac = data[:-MAC_LEN], data[-MAC_LEN:]
    if not keyring.verify(signed, mac):
        raise DecodeError("auth")
    try:
        body = json.loads(signed[1:])
    except (ValueError, RecursionError) as e:
        raise DecodeError("malformed", f"json: {e}") from None
    try:
        f = _list(body, 3)
        msgs = (from_fields(m) for m in _list(f[2]))
        return _name(f[0]), _int(f[1]), [m for m in msgs if m is not None]
    except RecursionError:
        raise DecodeError("malformed", "too deep") from None


# ---- stream frames -----------------------------------------------------------------------

_FRAME = struct.Struct(">BIQ")           # version, payload length, sent_at_ms
FRAME_HEADER = _FRAME.size + MAC_LEN


def frame_header(keyring: Keyring, length: int, sent_at_ms: int) -> bytes:
    """The signed header that opens a stream carrying `length` bytes of packet."""
    head = _FRAME.pack(VERSION, length, sent_at_ms)
    return head + keyring.sign(head)


def check_frame_header(keyring: Keyring, data: bytes, max_size: int, now_ms: int,
                       window_ms: int) -> int:
    """The payload length an authentic header announces, or DecodeError. Cheap checks come
    first; `window_ms` (0 = off) bounds how long a captured header can be replayed."""
    if len(data) != FRAME_HEADER:
        raise DecodeError("truncated", f"{len(data)}-byte stream header")
    version, length, sent_ms = _FRAME.unpack_from(data)
    if version != VERSION:
        raise DecodeError("version", f"stream version {version}")
    if length > max_size:
        raise DecodeError("oversized", f"stream of {length} > {max_size} bytes")
    if not keyring.verify(data[:_FRAME.size], data[_FRAME.size:]):
        raise DecodeError("auth")
    if window_ms and abs(now_ms - sent_ms) > window_ms:
        raise DecodeError("stale_time", f"stream stamped {now_ms - sent_ms} ms ago")
    return length
