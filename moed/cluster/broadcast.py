"""Transmit-limited broadcast queue: updates ride piggyback on probe and gossip packets.

Each update is keyed by the member it is about: a newer update about the same member
replaces the queued one. Fewest-sent updates go first (newest first among equals), and an
update is dropped after `limit` transmissions (retransmit_mult * ceil(log10(n + 1))).
"""
from __future__ import annotations


class BroadcastQueue:
    def __init__(self) -> None:
        self._buckets: dict[int, dict[str, bytes]] = {}    # transmits -> key -> fragment
        self._sent: dict[str, int] = {}                     # key -> transmits

    def __len__(self) -> int:
        return len(self._sent)

    def add(self, key: str, frag: bytes) -> None:
        self.discard(key)
        self._buckets.setdefault(0, {})[key] = frag
        self._sent[key] = 0

    def discard(self, key: str) -> None:
        old = self._sent.pop(key, None)
        if old is not None:
            self._pop(old, key)

    def _pop(self, t: int, key: str) -> bytes:
        bucket = self._buckets[t]
        frag = bucket.pop(key)
        if not bucket:
            del self._buckets[t]
        return frag

    def transmits(self, key: str) -> int | None:
        return self._sent.get(key)

    def take(self, budget: int, limit: int, max_skips: int = 32) -> list[bytes]:
        """Fragments whose sizes (plus one separator byte each) fit in `budget` bytes."""
        if not self._sent or budget < 16:
            return []
        picked: list[tuple[int, str, bytes]] = []
        skips = 0
        for t in sorted(self._buckets):
            for key, frag in reversed(self._buckets[t].items()):
                size = len(frag) + 1
                if size <= budget:
                    picked.append((t, key, frag))
                    budget -= size
                    if budget < 16:
                        break
                else:
                    skips += 1
                    if skips > max_skips:
                        break
            if budget < 16 or skips > max_skips:
                break
        for t, key, frag in picked:
            self._pop(t, key)
            if t + 1 >= limit:
                del self._sent[key]
            else:
                self._buckets.setdefault(t + 1, {})[key] = frag
                self._sent[key] = t + 1
        return [frag for _, _, frag in picked]
