"""The engine's step boundary: the typed commands applied there (one handler each, the only
place that mutates the scheduler besides the step), new requests checked on their way in, and
the end of an expert-parallel group. `moed.engine.engine.Engine` builds on it."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from moed.config import EngineConfig
from moed.engine.commands import (Abort, AddRequest, ApplyConfig, CallAtBoundary, Command,
                                  CompleteRemotePrefill, ReleaseKV)
from moed.engine.request import Request
from moed.engine.step import StepCore
from moed.model.sampler import make_generator, skip_one_token
from moed.types import ContextRule, ErrorKind, FinishReason, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from moed.parallel.runtime import EPRuntime

log = structlog.get_logger(__name__)


class Boundary(StepCore):
    """The attributes below are the engine's, set in its __init__."""
    cfg: EngineConfig
    ep: EPRuntime | None
    on_group_failure: Callable[[str], None] | None
    _ep_draining: bool
    _stopping: bool
    _max_model_len: int
    _inbox: deque[Command]
    _wake: asyncio.Event | None
    _parked: dict[str, Request]

    @property
    def spec(self) -> Any:
        return self.runner.spec

    def _post(self, cmd: Command) -> None:
        self._inbox.append(cmd)
        if self._wake is not None:
            self._wake.set()

    def _new_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                     remote_kv: bool = False, prefill_only: bool = False) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        # the model's context only: a prompt over this node's KV capacity is the scheduler's
        # to refuse (an error event), so a prefill role's caller can retry on a bigger node
        err = ContextRule(self._max_model_len).prompt_error(len(prompt))
        if err is not None:
            raise ValueError(err)
        vocab = self.spec.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        detok = None
        if self._tokenizer is not None:
            from moed.model.tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self._tokenizer, prompt,
                                           skip_special_tokens=params.skip_special_tokens)
        return Request(request_id, prompt, params, self.eos_token_ids, self._max_model_len,
                       detok, remote_kv=remote_kv, prefill_only=prefill_only,
                       rng=None if params.seed is None else make_generator(params.seed),
                       grammar=self._grammar(params))

    def _grammar(self, params: SamplingParams) -> Any:
        """The request's own grammar matcher (None without a grammar). The API handler (and a
        prefill node's job handler) compiled the spec off the loop, so this is a cache hit and
        a ~2 us copy; a GrammarError is a ValueError (the caller's 400)."""
        if params.grammar is None:
            return None
        from moed.model.grammar import compiler_for
        return compiler_for(self._tokenizer).matcher(params.grammar)

    # ---- commands: one handler each, applied only here (the step loop's boundary) ----------
    def _apply_commands(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            self._HANDLERS[type(cmd)](self, cmd)

    def _add(self, cmd: AddRequest) -> None:
        if self._stopping:
            self._publish([TokenEvent.finish(cmd.request.request_id, FinishReason.ABORT)])
        else:
            self.scheduler.add(cmd.request)

    def _abort(self, cmd: Abort) -> None:
        ev = self.scheduler.abort(cmd.request_id)
        if ev is None and self._parked.pop(cmd.request_id, None) is not None:
            ev = TokenEvent.finish(cmd.request_id, FinishReason.ABORT)  # its source held it
        if ev is not None:
            self._publish([ev])

    def _complete_remote(self, cmd: CompleteRemotePrefill) -> None:
        req = self.scheduler.remote.get(cmd.request_id)
        if req is not None:     # token one was drawn remotely: consume its randomness
            skip_one_token(req.rng, req.params, self.spec.vocab_size)
        try:
            self._publish([self.scheduler.complete_remote_prefill(
                cmd.request_id, cmd.token_id, cmd.logprob, cmd.top_logprobs)])
        except KeyError:
            log.warning("remote_prefill_unknown_request", request_id=cmd.request_id)
            return
        d = cmd.draft       # the MTP layer's draft for the first step (a guess: verified)
        if self._mtp and req is not None and d is not None and 0 <= d < self.spec.vocab_size \
                and not req.finished:
            req.drafter = (req.num_tokens, d)

    def _release(self, cmd: ReleaseKV) -> None:
        self.scheduler.release(cmd.request_id)

    def _call(self, cmd: CallAtBoundary) -> None:
        try:
            res = cmd.fn()
        except Exception as e:
            if not cmd.future.done():
                cmd.future.set_exception(e)
        else:
            if not cmd.future.done():
                cmd.future.set_result(res)

    def _config(self, cmd: ApplyConfig) -> None:
        self.cfg = cfg = cmd.config
        self.scheduler.set_limits(cfg.max_num_seqs, cfg.max_num_batched_tokens)

    _HANDLERS: dict[type, Callable[[Boundary, Any], None]] = {
        AddRequest: _add, Abort: _abort, CompleteRemotePrefill: _complete_remote,
        ReleaseKV: _release, CallAtBoundary: _call, ApplyConfig: _config}

    def _remote_allocated(self, req: Request, block_ids: list[int]) -> None:
        s = self._streams.get(req.request_id)
        if s is not None and s.kv_blocks is not None and not s.kv_blocks.done():
            s.kv_blocks.set_result((block_ids, req.num_cached_tokens))

    def expect_group_end(self) -> None:
        """The node drains (SIGTERM): a peer rank leaving the EP group from now on is the
        group stopping together, not a failure (this node then exits 0)."""
        self._ep_draining = True

    def _group_down(self, reason: str, failed: bool = True) -> None:
        """The EP group cannot step: every request ends 503 (retryable on another node), the
        loop ends, and (failed) the app is told to leave membership and exit non-zero."""
        self._stopping = True
        msg = "the node's expert-parallel group lost a rank"     # no peer address to clients
        for rid in list(self.scheduler.requests):
            req = self.scheduler.requests[rid]
            self.scheduler.finish(req, FinishReason.ERROR, msg)
            self._publish([TokenEvent.finish(rid, FinishReason.ERROR, prompt_tokens=req.num_prompt_tokens,
                                             cached_tokens=req.num_cached_tokens, error=msg,
                                             error_kind=ErrorKind.UNAVAILABLE)])
        for rid in list(self._streams):
            self._publish([TokenEvent.finish(rid, FinishReason.ERROR, error=msg,
                                             error_kind=ErrorKind.UNAVAILABLE)])
        if failed and self.on_group_failure is not None:
            self.on_group_failure(f"expert-parallel group failed: {reason}")
        elif not failed:
            log.info("ep_group_ended", reason=reason)

