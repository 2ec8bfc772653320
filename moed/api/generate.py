"""Drive engine requests for one HTTP request: tokenize, admit, run n×prompts streams, clean up.

Lifecycle of one HTTP generation request:
  parse → tokenize → check context → admit (429 if over the bounds) → add n engine requests per
  prompt → merge their TokenEvents (one pump task each) → ... → finally: abort every engine
  request that has not finished (client gone, timeout, error) and release admission tickets.
The finally block is the one place that guarantees no engine request (and so no KV block)
outlives its HTTP request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Mapping

import structlog

from moed.api.admission import Admission, Ticket, Verdict
from moed.api.errors import APIError, bad_request
from moed.api.priority import OTHER, class_label
from moed.api.protocol import GenerationRequest, resolve_max_tokens
from moed.api.tools import template_args
from moed.balance import capacity
from moed.balance.step_time import retry_after_s
from moed.engine.client import EngineClient
from moed.obs import metrics, trace
from moed.types import ErrorKind, FinishReason, PromptLogprob, RequestTimings, TokenEvent

log = structlog.get_logger(__name__)


@dataclass
class Choice:
    """One engine request = one output choice."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    engine_id: str
    ticket: Ticket
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per token
    prompt_logprobs: tuple[PromptLogprob, ...] = ()   # prompt tokens 1.. (params.prompt_logprobs)
    finish_reason: str | None = None
    error: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    added: bool = False                   # the engine knows this request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def check_rough_length(engine: EngineClient, req: GenerationRequest) -> None:
    """400 now, before any tokenizing, for a text prompt that cannot fit the context whatever
    it encodes to (Tokenizer.min_tokens is a lower bound)."""
    min_tokens = getattr(engine.tokenizer, "min_tokens", None)
    if min_tokens is None:
        return
    texts = [m["content"] for m in req.messages] if req.chat else \
        [p for p in req.prompts if isinstance(p, str)]
    at_least = sum(min_tokens(t) for t in texts) if req.chat else \
        max((min_tokens(t) for t in texts), default=0)
    if at_least > engine.max_model_len:
        raise APIError(400, f"This model's maximum context length is {engine.max_model_len} "
                            f"tokens; the prompt has more than {at_least} tokens. Shorten "
                            f"the prompt.", param="messages" if req.chat else "prompt",
                       code="context_length_exceeded")


def encode_prompts(engine: EngineClient, req: GenerationRequest) -> list[list[int]]:
    """Token ids for each prompt (chat: the model's template, rendered then encoded). O(prompt):
    the handlers run it in the offload pool (moed.api.offload), never on the event loop."""
    tok = engine.tokenizer
    vocab = getattr(tok, "vocab_size", None)
    if req.chat:
        try:
            text = tok.apply_chat_template(list(req.messages), **template_args(req))
        except ValueError as e:   # TokenizerError: no template / template raised
            raise bad_request(str(e), "messages") from None
        ids_list = [text if isinstance(text, list) else tok.encode(text, add_special_tokens=False)]
    else:
        ids_list = []
        for p in req.prompts:
            if isinstance(p, str):
                ids_list.append(tok.encode(p))
            else:
                if vocab is not None and any(t >= vocab for t in p):
                    raise bad_request(f"'prompt' token ids must be < the vocabulary size {vocab}",
                                      "prompt")
                ids_list.append(list(p))
    for ids in ids_list:
        if not ids:
            raise bad_request("the prompt encodes to zero tokens", "messages" if req.chat else "prompt")
    return ids_list


def reject_early(engine: EngineClient, prompt_lens: list[int], timeout_s: float | None) -> None:
    """429 now, with the predicted wait, for a request the cost model says cannot get its
    first token before its deadline (balance.reject_over_target × its bucket's TTFT target,
    at most the request timeout): better than a timeout after a full queue wait. Engines
    without the cost policy (or not yet fitted) predict nothing and admit."""
    over = engine.ttft_over_deadline(max(prompt_lens), timeout_s) if prompt_lens else None
    if over is None:
        return
    predicted, limit = over
    retry = retry_after_s(predicted, limit)
    metrics.ADMISSION_REJECTED.labels("predicted_ttft").inc()
    raise APIError(429, f"Server is at capacity: this request's predicted time to first token is "
                        f"{predicted:.1f}s, past its {limit:.1f}s deadline; retry after {retry}s.",
                   code="predicted_ttft", headers={"Retry-After": str(retry)})


def admit(admission: Admission, prompt_lens: list[int], retry_after_s: int,
          priority: int = 0, klass: str = "", on_displaced: Callable[[], None] | None = None
          ) -> list[Ticket]:
    """Tickets for the request's engine requests, or 429. A priority arrival may displace
    less urgent pending requests (moed.api.admission.displace); `klass` labels the metrics."""
    before = admission.displaced
    verdict, tickets = admission.try_admit(prompt_lens, priority, on_displaced)
    gauges(admission)
    if verdict is not Verdict.ADMIT:
        metrics.ADMISSION_REJECTED.labels(verdict.value).inc()
        metrics.PRIORITY_REQUESTS.labels(klass or OTHER, "rejected").inc()
        raise APIError(429, f"Server is at capacity ({verdict.value.replace('_', ' ')}); "
                            f"retry after {retry_after_s}s.",
                       code=verdict.value, headers={"Retry-After": str(retry_after_s)})
    metrics.PRIORITY_REQUESTS.labels(klass or OTHER, "admitted").inc()
    if admission.displaced > before:
        log.info("admission_displaced", requests=admission.displaced - before,
                 priority=priority)
    return tickets


def gauges(admission: Admission, classes: Mapping[str, int] | None = None) -> None:
    """The admission gauges; with `classes`, the per-class pending ones too."""
    metrics.ADMISSION_PENDING.set(admission.pending)
    metrics.ADMISSION_PENDING_TOKENS.set(admission.pending_tokens)
    if classes is not None:
        by = admission.pending_by_priority
        for name, value in classes.items():
            metrics.PRIORITY_PENDING.labels(name).set(by.get(value, 0))
        known = set(classes.values())
        metrics.PRIORITY_PENDING.labels(OTHER).set(
            sum(n for p, n in by.items() if p not in known))


class Displaced(Exception):
    """A more urgent arrival took this request's admission place before its first token."""


MIGRATABLE = "X-Moed-Migratable"    # set by a router that moves this request if it ends here


class HandOff(Exception):
    """Drain: this request ends here so its router continues it (a stream) or resubmits it
    (not streamed: nothing was sent yet) elsewhere."""


@dataclass(frozen=True)
class Continuation:
    """A migrated stream resumed on this node (moed.api.continuation): the client's original
    body, its prompt's token ids and the output token ids the client already has."""
    body: bytes
    prompt_ids: list[int]
    output_ids: list[int]
    replay: str = "decode"      # moed.engine.resume.REPLAYS


class Generation:
    """The engine side of one HTTP request; use as `async with` and iterate `events()`."""

    def __init__(self, engine: EngineClient, admission: Admission, req: GenerationRequest,
                 prompt_ids: list[list[int]], request_id: str, retry_after_s: int,
                 timeout_s: float | None = None, cont: Continuation | None = None,
                 handoffs: set | None = None,
                 classes: Mapping[str, int] | None = None, displaceable: bool = False) -> None:
        """classes: [priority]'s class -> value (the metrics' priority_class label);
        displaceable: a more urgent arrival may take this request's admission place until its
        first token (its response has not started; see moed.api.openai)."""
        self.engine = engine
        self._handoffs = handoffs    # drain hands this stream to its router (ServerState's)
        self.cont = cont             # a migrated stream's continuation (n = 1)
        self.resume = list(cont.output_ids) if cont else []     # the client has these
        # "decode" replay: the engine publishes the sent tokens again; dropped here
        self._replaying = list(self.resume) if cont and cont.replay == "decode" else []
        self.admission = admission
        self.req = req
        self.prompt_ids = prompt_ids
        self.request_id = request_id
        self.retry_after_s = retry_after_s
        self.arrival = time.perf_counter()
        self.trace_parent = trace.current()    # the request's span (None: not traced)
        self.max_tokens = [resolve_max_tokens(req, len(p), engine.context) for p in prompt_ids]
        lens = [len(p) for p in prompt_ids for _ in range(req.n)]
        if len(lens) > admission.max_waiting:     # could never be admitted: not a 429
            raise bad_request(f"{len(prompt_ids)} prompt(s) x n={req.n} = {len(lens)} sequences; "
                              f"this server takes at most {admission.max_waiting} per request",
                              "n" if req.n > 1 else "prompt")
        self.classes = classes or {}
        self.displaceable = displaceable
        self.klass = class_label(req.priority or 0, self.classes)
        self._queue: asyncio.Queue[tuple[Choice, TokenEvent | BaseException]] = asyncio.Queue()
        reject_early(engine, lens, timeout_s)
        tickets = admit(admission, lens, retry_after_s, req.priority or 0, self.klass,
                        self._displaced if displaceable else None)
        self.choices = [
            Choice(index=pi * req.n + c, prompt_index=pi, prompt_ids=p,
                   engine_id=f"{request_id}-{pi}-{c}", ticket=tickets[pi * req.n + c])
            for pi, p in enumerate(prompt_ids) for c in range(req.n)]
        gauges(admission, self.classes)
        self._pumps: list[asyncio.Task] = []
        if handoffs is not None:
            handoffs.add(self.hand_off)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.resume) + sum(len(c.token_ids) for c in self.choices)

    async def __aenter__(self) -> Generation:
        try:
            for ch in self.choices:
                params = self.req.sampling_params(self.max_tokens[ch.prompt_index],
                                                  ch.index % self.req.n)
                try:
                    stream = self.engine.add_request(
                        ch.engine_id, ch.prompt_ids, params, resume=self.resume,
                        replay=self.cont.replay) if self.cont and self.resume else \
                        self.engine.add_request(ch.engine_id, ch.prompt_ids, params)
                except ValueError as e:
                    raise bad_request(str(e), "messages" if self.req.chat else "prompt") from None
                except RuntimeError as e:   # the engine is stopping (shutdown or a crashed loop)
                    log.error("engine_refused", error=str(e))
                    raise APIError(503, "The engine is not accepting requests.",
                                   code="engine_unavailable") from None
                ch.added = True
                self._pumps.append(asyncio.create_task(self._pump(ch, stream),
                                                       name=f"pump-{ch.engine_id}"))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _pump(self, ch: Choice, stream: AsyncIterator[TokenEvent]) -> None:
        try:
            async for ev in stream:
                self._queue.put_nowait((ch, ev))
                if ev.finished:
                    return
            self._queue.put_nowait((ch, RuntimeError("engine stream ended without a finish")))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced to the handler as a 500 with the request id
            self._queue.put_nowait((ch, e))

    async def events(self) -> AsyncIterator[tuple[Choice, TokenEvent]]:
        """Yield (choice, event) until every choice finished; updates the choices and metrics."""
        remaining = sum(1 for c in self.choices if not c.finished)
        while remaining:
            ch, ev = await self._queue.get()
            if self._replaying and not isinstance(ev, BaseException) and ev.token_ids:
                ev = self._drop_replayed(ev)
                if ev is None:
                    continue
            if isinstance(ev, Displaced):
                if not any(c.t_first is not None for c in self.choices):
                    metrics.ADMISSION_REJECTED.labels("displaced").inc()
                    metrics.PRIORITY_REQUESTS.labels(self.klass, "displaced").inc()
                    raise APIError(429, "Server is at capacity: a more urgent request took "
                                        f"this one's place; retry after {self.retry_after_s}s.",
                                   code="displaced",
                                   headers={"Retry-After": str(self.retry_after_s)})
                # its first token was already on the way: it has been sent, so it goes on
                log.warning("displace_after_first_token", request_id=self.request_id)
                continue
            if isinstance(ev, HandOff):    # in-band event or a 503: the router moves it
                raise APIError(503, "This node is draining; the stream continues on another.",
                               code="handed_off")
            if isinstance(ev, BaseException):
                log.error("engine_stream_failed", engine_request=ch.engine_id, error=repr(ev))
                raise APIError(500, f"Internal server error (request id {self.request_id}).",
                               code="engine_error")
            self._observe(ch, ev)
            if ev.finish_reason is FinishReason.ERROR:
                log.error("engine_request_failed", engine_request=ch.engine_id, error=ev.error)
                if ev.error_kind is ErrorKind.GRAMMAR:   # its own grammar overran: alone
                    from moed.api.structured import too_complex_in_flight
                    raise too_complex_in_flight(getattr(self.req, "grammar", None),
                                                ev.error or "")
                if ev.error_kind is ErrorKind.UNAVAILABLE:   # e.g. remote prefill failed
                    raise APIError(503, f"This node cannot serve the request now: {ev.error} "
                                        f"(request id {self.request_id}).", code="unavailable",
                                   headers={"Retry-After": str(self.retry_after_s)})
                raise APIError(500, f"The engine failed to serve this request (request id "
                                    f"{self.request_id}).", code="engine_error")
            if ev.finished:
                remaining -= 1
            yield ch, ev

    def _drop_replayed(self, ev: TokenEvent) -> TokenEvent | None:
        """A decode replay's event minus the tokens the client already has (None: nothing
        left). One token per step: an event is all replayed or all new."""
        n = min(len(ev.token_ids), len(self._replaying))
        if list(ev.token_ids[:n]) != self._replaying[:n]:
            log.error("replay_mismatch", request_id=self.request_id)   # forced: cannot happen
        del self._replaying[:n]
        if n == len(ev.token_ids) and not ev.finished:
            return None
        return dataclasses.replace(ev, token_ids=ev.token_ids[n:], logprobs=ev.logprobs[n:],
                                   top_logprobs=ev.top_logprobs[n:],
                                   text=ev.text if n < len(ev.token_ids) else "")

    def _observe(self, ch: Choice, ev: TokenEvent) -> None:
        now = time.perf_counter()
        m = metrics.request_series()
        if ev.token_ids:
            if ch.t_first is None:
                ch.t_first = now
                m.ttft.observe(now - self.arrival)
                metrics.PRIORITY_TTFT.labels(self.klass).observe(now - self.arrival)
                self.admission.started(ch.ticket)
                gauges(self.admission, self.classes)
            elif ch.t_last is not None:
                gap = (now - ch.t_last) / len(ev.token_ids)
                for _ in ev.token_ids:
                    m.itl.observe(gap)
            ch.t_last = now
            ch.token_ids.extend(ev.token_ids)
            ch.logprobs.extend(ev.logprobs)
            ch.top_logprobs.extend(ev.top_logprobs)
            if ev.prompt_logprobs:
                ch.prompt_logprobs = ev.prompt_logprobs
            m.generation_tokens.inc(len(ev.token_ids))
        ch.text += ev.text
        if ev.finished:
            reason = ev.finish_reason.value if isinstance(ev.finish_reason, FinishReason) \
                else str(ev.finish_reason)
            ch.finish_reason = reason
            ch.error = ev.error
            self.admission.release(ch.ticket)
            gauges(self.admission, self.classes)
            m.e2e.observe(now - self.arrival)
            m.prompt_tokens.inc(len(ch.prompt_ids))
            m.request_prompt_tokens.observe(len(ch.prompt_ids))
            m.request_generation_tokens.observe(len(ch.token_ids))
            m.finished(reason).inc()
            t = ev.timings          # the engine's own clock: queue, prefill, decode phases
            if t is not None:
                for hist, s in ((m.queue_time, t.queue_s), (m.prefill_time, t.prefill_s),
                                (m.decode_time, t.decode_s)):
                    if s is not None:
                        hist.observe(s)
                capacity.METER.on_finish(t)         # queue vs compute time (capacity signals)
                if self.trace_parent is not None:
                    self._trace_phases(ch, ev, t)
        metrics.ADMISSION_PENDING.set(self.admission.pending)
        metrics.ADMISSION_PENDING_TOKENS.set(self.admission.pending_tokens)

    def _trace_phases(self, ch: Choice, ev: TokenEvent, t: RequestTimings) -> None:
        """The engine's phases of a traced request, as spans laid back from its finish (the
        engine measured them; nothing per token was traced)."""
        end = trace.now_ns()
        at = end
        phases = (("engine.decode", t.decode_s, dict(completion_tokens=len(ch.token_ids),
                                                     finish_reason=ch.finish_reason)),
                  ("engine.prefill", t.prefill_s, dict(prompt_tokens=len(ch.prompt_ids),
                                                       cached_tokens=ev.num_cached_tokens)),
                  ("engine.queue", t.queue_s, {}))
        for name, seconds, attrs in phases:
            if seconds is None:
                continue
            start = at - int(seconds * 1e9)
            trace.record(name, start, at, parent=self.trace_parent, engine_request=ch.engine_id,
                         **attrs)
            at = start

    def _displaced(self) -> None:
        """Admission displaced this request (its tickets are released): end it with a 429."""
        self._queue.put_nowait((self.choices[0], Displaced()))

    def hand_off(self) -> None:
        """Drain: end this request with a server_error (a stream's in-band event, else a 503
        before any byte); its router continues or resubmits it elsewhere."""
        self._queue.put_nowait((self.choices[0], HandOff()))

    async def close(self) -> None:
        """Abort unfinished engine requests, stop pumps, release tickets. Idempotent."""
        if self._handoffs is not None:
            self._handoffs.discard(self.hand_off)
        for ch in self.choices:
            if ch.added and not ch.finished:
                ch.finish_reason = FinishReason.ABORT.value
                metrics.request_series().finished(FinishReason.ABORT.value).inc()
                try:
                    self.engine.abort(ch.engine_id)
                except Exception as e:  # never let cleanup hide the original error
                    log.warning("abort_failed", engine_request=ch.engine_id, error=repr(e))
            self.admission.release(ch.ticket)
        for t in self._pumps:
            t.cancel()
        gauges(self.admission, self.classes)
