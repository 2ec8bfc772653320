"""An in-process engine double with the real Engine's interface, for fast API unit tests.

Byte-level tokenizer (id = byte, 256 = EOS); tokens are a deterministic function of the prompt
and position (so "greedy" is reproducible); KV blocks are counted like the real pool so tests
can assert nothing leaks. The real engine is exercised by tests/integration/test_server*.py.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from moed.types import ContextRule, EngineStats, FinishReason, SamplingParams, TokenEvent

EOS = 256


class ByteTokenizer:
    vocab_size = 257
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    blocks: int = 0
    done: bool = False


class FakeEngine:
    def __init__(self, *, max_model_len: int = 128, num_blocks: int = 64, block_size: int = 4,
                 max_running: int = 4, step_s: float = 0.005, eos_after: int | None = None) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_running, self.step_s, self.eos_after = max_running, step_s, eos_after
        self.reqs: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.on_step = None
        self._task: asyncio.Task | None = None

    # -- the Engine interface (the parts of moed.engine.client.EngineClient the API uses) --
    @property
    def context(self) -> ContextRule:
        return ContextRule(self.max_model_len, self.num_blocks * self.block_size)

    @property
    def alive(self) -> bool:
        """As Engine.alive: the step loop runs (started, not shut down, not crashed)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def shutdown(self) -> None:
        if self._task:
            self._task.cancel()
        for r in list(self.reqs.values()):
            self._finish(r, FinishReason.ABORT)

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams):
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds {self.max_model_len}")
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        r = _Req(rid, list(prompt), params)
        self.reqs[rid] = r
        return self._stream(r)

    def abort(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is not None:
            self.aborted.append(rid)
            self._finish(r, FinishReason.ABORT)

    def ttft_over_deadline(self, prompt_tokens: int, timeout_s: float | None):
        return None         # no cost model: nothing predicted, every request admitted

    def stats(self) -> EngineStats:
        used = sum(r.blocks for r in self.reqs.values())
        running = sum(1 for r in self.reqs.values() if r.blocks)
        return EngineStats(running=running, waiting=len(self.reqs) - running,
                           kv_blocks_total=self.num_blocks, kv_blocks_used=used,
                           kv_blocks_free=self.num_blocks - used)

    # -- internals --
    async def _stream(self, r: _Req):
        while True:
            ev = await r.queue.get()
            yield ev
            if ev.finished:
                return

    def _finish(self, r: _Req, reason: FinishReason) -> None:
        if not r.done:
            r.done = True
            r.queue.put_nowait(TokenEvent(r.rid, (), "", (), reason, len(r.prompt)))
        r.blocks = 0
        self.reqs.pop(r.rid, None)

    def token_at(self, prompt: list[int], i: int) -> int:
        return ord("a") + (sum(prompt) + 7 * i) % 26

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            running = [r for r in self.reqs.values() if r.blocks][: self.max_running]
            for r in list(self.reqs.values()):
                if len(running) >= self.max_running:
                    break
                if not r.blocks:
                    r.blocks = math.ceil(len(r.prompt) / self.block_size)
                    running.append(r)
            for r in running:
                self._step(r)

    def _step(self, r: _Req) -> None:
        out = getattr(r, "out", [])
        i = len(out)
        tok = EOS if (self.eos_after is not None and i == self.eos_after
                      and not r.params.ignore_eos) else self.token_at(r.prompt, i)
        out.append(tok)
        r.out = out  # type: ignore[attr-defined]
        r.blocks = math.ceil((len(r.prompt) + len(out)) / self.block_size)
        text = "" if tok == EOS else chr(tok)
        lp = (-0.5,) if r.params.logprobs else ()
        gen_text = "".join(chr(t) for t in out if t != EOS)
        reason = None
        if tok == EOS:
            reason = FinishReason.STOP
        elif any(s in gen_text for s in r.params.stop):
            reason, text = FinishReason.STOP, ""   # stop string cut: its text is not emitted
        elif len(out) >= r.params.max_tokens or len(r.prompt) + len(out) >= self.max_model_len:
            reason = FinishReason.LENGTH
        r.queue.put_nowait(TokenEvent(r.rid, (tok,), text, lp, reason, len(r.prompt)))
        if reason is not None:
            r.done = True
            r.blocks = 0
            self.reqs.pop(r.rid, None)
