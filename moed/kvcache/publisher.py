"""The KV-events publisher: vLLM's ZMQ PUB + ROUTER replay, on its own thread.

Wire (vLLM's vllm/distributed/kv_events.py, which its consumers read):
- PUB: multipart [topic, seq, payload]; seq is an 8-byte big-endian counter from 0 per process,
  payload a msgpack KVEventBatch (moed.kvcache.events.encode_batch).
- ROUTER (replay_endpoint): a client sends the first sequence number it wants (8 bytes
  big-endian; through REQ or DEALER, so the ROUTER sees [identity, b"", seq]); it gets every
  buffered batch from there as [topic, seq, payload], then [b"", -1 (8 bytes, signed), b""].

The engine's loop only puts (timestamp, events) on a bounded queue (`publish`, never blocks;
a full queue drops the batch and counts it); this thread encodes, sends and answers replays.
zmq is imported when a publisher is made, so a node without events never loads it.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import structlog

from moed.config import KVEventsConfig
from moed.kvcache.events import Event, encode_batch
from moed.obs import metrics

log = structlog.get_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05           # the thread's longest wait for a batch (replay requests between)
CLOSE_S = 5.0           # shutdown: queued batches get this long to go out
DROP_LOG_S = 10.0       # a full queue is logged at most this often (the engine publishes per step)


def offset_port(endpoint: str, rank: int) -> str:
    """An expert-parallel rank's endpoint: tcp port + rank, inproc/ipc name + _dp<rank>
    (vLLM's rule for data-parallel ranks, each of which has its own KV pool)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address (or ipc/inproc) is bound, anything else connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    def __init__(self, cfg: KVEventsConfig, block_size: int, rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self.block_size = block_size
        self.rank = rank
        self.endpoint = offset_port(cfg.endpoint, rank)
        self.replay_endpoint = offset_port(cfg.replay_endpoint, rank)
        self._topic = cfg.topic.encode()
        self._format = cfg.event_format
        self._queue: queue.Queue[tuple[float, list[Event]] | None] = \
            queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot open {self.endpoint} / "
                             f"{self.replay_endpoint or '(no replay)'}: {e}") from None
        self._dropped, self._dropped_logged = 0, -DROP_LOG_S
        self._thread = threading.Thread(target=self._run, name="moed-kv-events", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint,
                 replay_endpoint=self.replay_endpoint or None, topic=cfg.topic, rank=rank)

    # ---- the engine's side (loop thread) ------------------------------------------------------
    def publish(self, events: Sequence[Event]) -> None:
        try:
            self._queue.put_nowait((time.time(), list(events)))
        except queue.Full:     # counted always, logged at most every DROP_LOG_S (per step)
            metrics.KV_EVENT_BATCHES.labels("dropped").inc()
            self._dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged >= DROP_LOG_S:
                log.warning("kv_events_dropped", batches=self._dropped, events=len(events),
                            effect="subscribers see a sequence gap and may replay")
                self._dropped, self._dropped_logged = 0, now

    def close(self, timeout: float = CLOSE_S) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv_events_close_timeout", queued=self._queue.qsize())
            return      # the daemon thread still owns the sockets; the process is ending
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread --------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0, zmq.POLLIN):
                        self._serve_replay()
                except Exception as e:      # one bad replay must not end the thread either
                    log.warning("kv_events_replay_failed", error=f"{type(e).__name__}: {e}")
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.block_size, self.rank, self._format)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
            except Exception as e:      # a broken send must not end the thread
                metrics.KV_EVENT_BATCHES.labels("dropped").inc()
                log.warning("kv_events_send_failed", error=f"{type(e).__name__}: {e}")
                continue
            self._buffer.append((self._seq, payload))
            self._seq += 1
            metrics.KV_EVENT_BATCHES.labels("sent").inc()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
