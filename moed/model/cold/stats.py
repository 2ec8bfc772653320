"""The cold-expert store's counters: since start (ColdStats, which advances the metrics with them;
the tests and the bench read it) and one layer call's prefetched experts (LayerFetch)."""
from __future__ import annotations

from dataclasses import dataclass

from moed.obs import metrics


@dataclass
class ColdStats:
    """Counters since start (the metrics advance with them; tests and the bench read them)."""
    hits: int = 0                   # expert reads (an expert run by a layer call) resident
    misses: int = 0                 # ... read from disk first, the step waiting (no prefetch)
    prefetch_ready: int = 0         # ... served by a prefetch complete when the layer needed it
    prefetch_waited: int = 0        # ... served by a prefetch still in flight (the step waited)
    hit_rows: int = 0               # token-expert choices whose expert was resident
    prefetch_rows: int = 0          # ... whose expert was a completed prefetch
    miss_rows: int = 0              # ... the rest (read on a miss or waited for)
    miss_stall_s: float = 0.0
    prefetch_wait_s: float = 0.0
    prefetch_reads: int = 0         # prefetch reads started
    prefetch_unused: int = 0        # ... read but not needed (a wrong prediction)
    prefetch_cached: int = 0        # ... not staged: the page cache held it (a miss copies it)
    predicted: int = 0              # experts predicted for a layer (summed over layer calls)
    predicted_needed: int = 0       # experts those layer calls ran
    predicted_right: int = 0        # ... of them predicted

    def count(self, hits: int, misses: int, stall_s: float, hit_rows: int, rows: int,
              fetched: LayerFetch, expert_bytes: int) -> None:
        """One layer call's expert reads (rows: the call's token-expert choices), metrics too."""
        metrics.EXPERT_WEIGHT_HITS.inc(hits)
        if fetched.ready or fetched.waited:
            metrics.EXPERT_WEIGHT_PREFETCHES.labels("ready").inc(fetched.ready)
            metrics.EXPERT_WEIGHT_PREFETCHES.labels("waited").inc(fetched.waited)
            metrics.EXPERT_WEIGHT_PREFETCH_WAIT.inc(fetched.wait_s)
            metrics.EXPERT_WEIGHT_MOVED_BYTES.labels("prefetch").inc((fetched.ready + fetched.waited) * expert_bytes)
        if misses:
            metrics.EXPERT_WEIGHT_MISSES.inc(misses)
            metrics.EXPERT_WEIGHT_MISS_STALL.inc(stall_s)
            metrics.EXPERT_WEIGHT_MOVED_BYTES.labels("miss").inc(misses * expert_bytes)
        self.hits += hits
        self.misses += misses
        self.hit_rows += hit_rows
        self.prefetch_rows += fetched.ready_rows
        self.miss_rows += rows - hit_rows - fetched.ready_rows
        self.miss_stall_s += stall_s
        self.miss_bytes += misses * expert_bytes
        self.prefetch_ready += fetched.ready
        self.prefetch_waited += fetched.waited
        self.prefetch_wait_s += fetched.wait_s

    def promoted(self, nbytes: int) -> None:
        """Expert bytes the mover installed (moved bytes, "promote")."""
        self.promoted_bytes += nbytes
        metrics.EXPERT_WEIGHT_MOVED_BYTES.labels("promote").inc(nbytes)

    def read_failed(self, where: str) -> None:
        """A disk-tier read that failed (where: miss, prefetch, promote)."""
        self.read_failures += 1
        metrics.EXPERT_WEIGHT_READ_FAILURES.labels(where).inc()

    @property
    def in_memory(self) -> float:
        """Expert reads whose expert was in memory when its layer needed it (resident, or a
        completed prefetch), over all expert reads."""
        total = self.hits + self.misses + self.prefetch_ready + self.prefetch_waited
        return (self.hits + self.prefetch_ready) / max(total, 1)

    @property
    def recall(self) -> float:
        """Share of the experts layer calls ran that their prediction named."""
        return self.predicted_right / max(self.predicted_needed, 1)

    @property
    def precision(self) -> float:
        return self.predicted_right / max(self.predicted, 1)
    miss_bytes: int = 0
    cached_reads: int = 0           # misses copied from the page cache on the step thread
    direct: int = 0                 # ... of them run straight from it, no slot (packread.run_direct)
    onednn_restored: int = 0        # refilled slots' oneDNN copies copied back (onednn.py)
    onednn_packed: int = 0          # ... packed (the first time, or not restored)
    promoted_bytes: int = 0
    read_failures: int = 0


@dataclass
class LayerFetch:
    """One layer call's prefetched experts: ready (complete when needed) or waited for."""
    ready: int = 0
    ready_rows: int = 0
    waited: int = 0
    wait_s: float = 0.0
