"""OpenAI-compatible handlers: /v1/completions, /v1/chat/completions, /v1/models.

Streaming is SSE (`data: {json}\\n\\n`, ending with `data: [DONE]`); with
stream_options.include_usage every chunk carries `"usage": null` and one last chunk with no
choices carries the exact usage; with stream_options.continuous_usage_stats every chunk carries
the request's usage so far (prompt tokens, completion tokens up to and including that chunk's).
Completions `echo` with `logprobs` puts the prompt's tokens first in `logprobs` (the first one
with null logprob and top_logprobs); `text_offset`s index the returned text, echo included;
`prompt_logprobs` (vLLM) adds them per choice in vLLM's shape. `return_token_ids` adds prompt
and completion token ids the way vLLM does (completions: per choice; chat: prompt ids at the
top level). A chat choice's text becomes content and tool_calls in moed.api.tools.ChatOutput
(parsed per model family, streamed as OpenAI's deltas; chat echo too).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

import structlog
from aiohttp import web

from moed.api import tokens
from moed.api.errors import APIError, bad_request
from moed.api.auth import bearer_token
from moed.api.generate import (MIGRATABLE, Choice, Continuation, Generation,
                              check_rough_length, encode_prompts)
# the logprobs' shapes (the names stay importable from here)
from moed.api.logprob_format import (TextOffsets, TopLogprobs, chat_logprobs,  # noqa: F401
                                     completion_logprobs, echo_logprobs, join_logprobs,
                                     vllm_prompt_logprobs)
from moed.api.priority import for_request
from moed.api.protocol import GenerationRequest, parse_request
from moed.api.salt import tenant_tag
from moed.api.tools import ChatOutput, bind
from moed.api.state import FINISH, PRIORITY, REQUEST_ID, STATE, USAGE, ServerState
from moed.obs import metrics, trace

log = structlog.get_logger(__name__)


# ---- response pieces (pure; the logprobs: moed.api.logprob_format) ---------------------

def usage_dict(gen: Generation) -> dict[str, Any]:
    """Exact token counts of the whole request (so far, while it streams)."""
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class Formatter:
    """Builds chunk and response bodies for one request."""

    def __init__(self, req: GenerationRequest, tok: Any, model: str, gen: Generation) -> None:
        self.req, self.tok, self.model, self.gen = req, tok, model, gen
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: list[TextOffsets | None] = [None] * len(gen.choices)   # completions
        self._started = [False] * len(gen.choices)   # chat: role sent / prompt ids sent
        # chat: content and tool calls per choice (the parser keeps state across chunks)
        self._out = [ChatOutput(req) for _ in gen.choices] if req.chat else []

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, ch: Choice, ids: list[int], lps: list[float],
                  tops: list[TopLogprobs], first: bool) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.req.chat:
            return chat_logprobs(self.tok, ids, lps, self.req.logprobs, tops)
        off = self._offsets[ch.index]
        if off is None:     # the completion's offsets start after the echoed prompt
            off = self._offsets[ch.index] = TextOffsets(
                self.tok, len(self._echo(ch)) if self.req.echo else 0, ch.prompt_ids,
                self.req.skip_special_tokens is not False)
        comp = completion_logprobs(self.tok, ids, lps, self.req.logprobs, off.take(ids), tops)
        if not (first and self.req.echo):
            return comp
        prompt = echo_logprobs(self.tok, ch.prompt_ids, ch.prompt_logprobs, self.req.logprobs,
                               TextOffsets(self.tok, 0).take(ch.prompt_ids))
        return join_logprobs(prompt, comp)

    def _echo(self, ch: Choice) -> str:
        p = self.req.prompts[ch.prompt_index]
        return p if isinstance(p, str) else self.tok.decode(list(p))

    def heavy(self, ch: Choice) -> bool:
        """This choice's next chunk is O(prompt) to build (echo with logprobs): build it in the
        offload pool, not on the event loop."""
        return not self._started[ch.index] and self.req.echo and self.req.logprobs is not None \
            and not self.req.chat

    def chunk(self, ch: Choice, ids: list[int], text: str, lps: list[float],
              finish: str | None, tops: list[TopLogprobs] = ()) -> dict[str, Any]:
        first = not self._started[ch.index]
        self._started[ch.index] = True
        echo_lp = first and self.req.echo and not self.req.chat    # the prompt's logprobs
        lp = self._logprobs(ch, ids, lps, list(tops), first) if ids or echo_lp else None
        if self.req.chat:
            out = self._out[ch.index]
            c: dict[str, Any] = {"index": ch.index,
                                 "delta": out.delta(text, first, finish is not None),
                                 "logprobs": lp, "finish_reason": out.finish_reason(finish)}
            body = self._base("chat.completion.chunk")
        else:
            if first and self.req.echo:
                text = self._echo(ch) + text
            c = {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": finish}
            body = self._base("text_completion")
        if self.req.return_token_ids:
            c["token_ids"] = list(ids)
            if first and not self.req.chat:
                c["prompt_token_ids"] = list(ch.prompt_ids)
        if first and self.req.chat and self.req.return_token_ids:
            body["prompt_token_ids"] = list(ch.prompt_ids)     # as in the non-stream response
        body["choices"] = [c]
        if self.req.continuous_usage:     # vLLM's continuous_usage_stats: the counts so far
            body["usage"] = usage_dict(self.gen)
        elif self.req.include_usage:
            body["usage"] = None
        return body

    def resume(self, prior: list[int]) -> None:
        """A continuation (n = 1): the client has the first chunk (role, prompt ids, echo) and
        `prior`'s text, so the text offsets go on from there."""
        self._started = [True]
        if self.req.logprobs is not None and not self.req.chat:
            ch = self.gen.choices[0]
            self._logprobs(ch, [], [], [], False)     # creates the offsets, then skip `prior`
            self._offsets[0].take(prior)  # type: ignore[union-attr]

    def usage_chunk(self) -> dict[str, Any]:
        body = self._base("chat.completion.chunk" if self.req.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage_dict(self.gen)
        return body

    def response(self) -> dict[str, Any]:
        choices = []
        for ch in self.gen.choices:
            lp = self._logprobs(ch, ch.token_ids, ch.logprobs, ch.top_logprobs, True)
            if self.req.chat:
                msg, called = self._out[ch.index].message(ch.text)
                c: dict[str, Any] = {"index": ch.index, "message": msg, "logprobs": lp,
                                     "finish_reason": self._out[ch.index].finish_reason(
                                         ch.finish_reason, called)}
            else:
                text = (self._echo(ch) if self.req.echo else "") + ch.text
                c = {"index": ch.index, "text": text, "logprobs": lp,
                     "finish_reason": ch.finish_reason}
                if self.req.prompt_logprobs is not None:
                    c["prompt_logprobs"] = vllm_prompt_logprobs(
                        self.tok, ch.prompt_logprobs, self.req.prompt_logprobs)
            if self.req.return_token_ids:
                c["token_ids"] = list(ch.token_ids)
                if not self.req.chat:
                    c["prompt_token_ids"] = list(ch.prompt_ids)
            choices.append(c)
        body = self._base("chat.completion" if self.req.chat else "text_completion")
        body["choices"] = choices
        if self.req.chat and self.req.return_token_ids:
            body["prompt_token_ids"] = list(self.gen.prompt_ids[0])
        body["usage"] = usage_dict(self.gen)
        return body


# ---- handlers -----------------------------------------------------------------------------

async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"Request body too large: {request.content_length} bytes "
                            f"(limit {limit}).", code="body_too_large")
    raw = await request.read()
    if len(raw) > limit:
        raise APIError(413, f"Request body too large (limit {limit} bytes).",
                       code="body_too_large")
    return raw


def _parse(raw: bytes, chat: bool, vocab_size: int | None) -> GenerationRequest:
    """Body bytes → a validated request (in the offload pool: O(body))."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:    # JSONDecodeError, bad UTF-8, absurd nesting
        raise bad_request(f"Malformed JSON body: {str(e)[:200]}") from None
    return parse_request(body, chat=chat, vocab_size=vocab_size)


def _check_serving(state: ServerState) -> Any:
    if state.draining:
        metrics.ADMISSION_REJECTED.labels("draining").inc()
        raise APIError(503, "Server is shutting down; retry on another node.", code="draining",
                       headers={"Retry-After": str(state.config.admission.retry_after_s)})
    if state.engine is None or not state.ready:
        raise APIError(503, "Model is not loaded yet.", code="not_ready",
                       headers={"Retry-After": str(state.config.admission.retry_after_s)})
    return state.engine


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def displaceable(req: GenerationRequest, state: ServerState) -> bool:
    """May a more urgent arrival displace this request before its first token (a 429)? A
    response sent whole, yes; a stream only when something more urgent can arrive (a class
    more urgent than its priority): its headers then wait for its first token, so a displaced
    stream has sent nothing. A stream of the most urgent class gets its headers at once."""
    return not req.stream or (req.priority or 0) > min(state.config.priority.values.values())


async def _serve(request: web.Request, chat: bool, cont: Continuation | None = None
                 ) -> web.StreamResponse:
    state = request.app[STATE]
    engine = _check_serving(state)
    t_prep = trace.now_ns()        # body, parse, template, tokenize: one span when traced
    raw = cont.body if cont else await _read_body(request, state.config.server.max_body_bytes)
    retry = state.config.admission.retry_after_s
    vocab = getattr(engine.tokenizer, "vocab_size", None)     # bounds token ids
    req = await state.offload.run(_parse, raw, chat, vocab, retry_after_s=retry)
    tenant = tenant_tag(state.config.server.prefix_cache_isolation,
                        request.headers.get("Authorization"))
    if tenant:
        req = dataclasses.replace(req, tenant=tenant)
    token = bearer_token(request.headers.get("Authorization"))
    priority, klass = for_request(req.priority, token, state.api_keys, state.key_classes,
                                  state.config.priority, cont is not None)
    request[PRIORITY] = (priority, klass)
    req = dataclasses.replace(req, priority=priority)
    if req.model is not None and req.model != state.model_name:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves "
                            f"'{state.model_name}'.", param="model", code="model_not_found")
    if chat and (req.tools is not None or req.template.kwargs):   # needs the checkpoint
        req = await state.offload.run(bind, req, engine.tokenizer,
                                      state.config.model.tool_parser, retry_after_s=retry)
    if req.grammar is not None:    # compiled on its own pool before any engine work: 400/429
        await state.grammar.compile(engine.tokenizer, req.grammar, retry_after_s=retry)
    check_rough_length(engine, req)        # hopeless prompts never reach the tokenizer
    prompt_ids = [cont.prompt_ids] if cont else \
        await state.offload.run(encode_prompts, engine, req, retry_after_s=retry)
    rid = request[REQUEST_ID]
    t_admit = trace.now_ns()
    trace.record("request.prepare", t_prep, t_admit, prompts=len(prompt_ids),
                 prompt_tokens=sum(len(p) for p in prompt_ids))
    with state.track():
        gen = Generation(engine, state.admission, req, prompt_ids, rid,
                         state.config.admission.retry_after_s,
                         timeout_s=state.config.server.request_timeout_s, cont=cont,
                         handoffs=state.handoffs if MIGRATABLE in request.headers else None,
                         classes=state.config.priority.values,
                         displaceable=displaceable(req, state))
        trace.record("admission", t_admit, trace.now_ns(), sequences=len(gen.choices))
        fmt = Formatter(req, engine.tokenizer, state.model_name, gen)
        if cont:
            fmt.resume(cont.output_ids)
        timeout = state.config.server.request_timeout_s
        try:
            async with gen:
                if req.stream:
                    return await _stream(request, gen, fmt, timeout, state)
                try:
                    async with asyncio.timeout(timeout):
                        async for _ in gen.events():
                            pass
                except TimeoutError:
                    metrics.REQUEST_TIMEOUTS.inc()
                    raise APIError(408, f"Request timed out after {timeout:g}s "
                                        f"(server.request_timeout_s).", code="timeout") from None
                body = await state.offload.run(fmt.response, retry_after_s=retry) \
                    if req.logprobs is not None or req.prompt_logprobs is not None \
                    else fmt.response()       # logprobs: O(tokens x top) to format
                return web.json_response(body)
        except asyncio.CancelledError:
            request[FINISH] = "client_disconnect"
            metrics.CLIENT_DISCONNECTS.inc()
            raise
        finally:
            request[USAGE] = (gen.prompt_tokens, gen.completion_tokens)
            request.setdefault(FINISH, ",".join(sorted({c.finish_reason or "abort"
                                                          for c in gen.choices})))


async def _stream(request: web.Request, gen: Generation, fmt: Formatter,
                  timeout: float, state: ServerState) -> web.StreamResponse:
    with trace.span("stream.client") as span:     # SSE to the client, first byte to the last
        try:
            return await _stream_events(request, gen, fmt, timeout, state)
        finally:
            span.set(completion_tokens=gen.completion_tokens, finish_reason=request.get(FINISH))


async def _stream_events(request: web.Request, gen: Generation, fmt: Formatter,
                         timeout: float, state: ServerState) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no",   # proxies: do not buffer
                                       "X-Request-Id": request[REQUEST_ID]})
    # A displaceable stream's headers go with its first event: until then a more urgent
    # request may displace it (moed.api.admission), which its client gets as a plain 429.
    if not gen.displaceable:
        await resp.prepare(request)
    try:
        try:
            async with asyncio.timeout(timeout):
                async for ch, ev in gen.events():
                    if not ev.token_ids and not ev.text and not ev.finished:
                        continue
                    args = (ch, list(ev.token_ids), ev.text, list(ev.logprobs),
                            ch.finish_reason, list(ev.top_logprobs))
                    body = await state.offload.run(fmt.chunk, *args) if fmt.heavy(ch) \
                        else fmt.chunk(*args)
                    if not resp.prepared:
                        await resp.prepare(request)
                    await resp.write(_sse(body))
        except TimeoutError:
            metrics.REQUEST_TIMEOUTS.inc()
            request[FINISH] = "timeout"
            await gen.close()            # abort now, not after a write to a stuck client
            err = APIError(408, f"Request timed out after {timeout:g}s.", code="timeout")
            if not resp.prepared:
                await resp.prepare(request)
            await _write_soon(resp, _sse(err.body()))
            return resp
        except APIError as e:     # headers are gone: report in-band, as OpenAI does
            if not resp.prepared and e.code == "displaced":
                raise             # nothing sent: a plain 429
            trace.mark_error(e.code or e.err_type, e.message)
            await gen.close()
            if not resp.prepared:
                await resp.prepare(request)
            await _write_soon(resp, _sse(e.body()))
            return resp
        if not resp.prepared:
            await resp.prepare(request)
        if gen.req.include_usage:
            await resp.write(_sse(fmt.usage_chunk()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        request[FINISH] = "client_disconnect"
        metrics.CLIENT_DISCONNECTS.inc()
    return resp


async def _write_soon(resp: web.StreamResponse, data: bytes, timeout: float = 5.0) -> None:
    """Best-effort write of a final message (the client may be gone or not reading)."""
    try:
        await asyncio.wait_for(resp.write(data), timeout)
    except (asyncio.TimeoutError, ConnectionError):
        pass


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = []
    if state.engine is not None:
        data.append({"id": state.model_name, "object": "model", "created": state.created,
                     "owned_by": "moed", "max_model_len": state.engine.max_model_len})
    return web.json_response({"object": "list", "data": data})


def add_routes(app: web.Application) -> None:
    tokens.add_routes(app)          # /tokenize, /detokenize, /v1/models/{id}
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
