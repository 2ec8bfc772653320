"""The three drivers of the one step (moed.engine.step.StepCore.step): what each decides.

    ServeDriver   the asynchronous serving loop: the forward pass on the step thread; a failed
                  one fails its requests, not the engine; idles on the wake event
    GroupDriver   an expert-parallel rank's lock-step loop (moed.parallel.agree): every step
                  opens with the group's agreement, runs under the group's watchdog, and
                  rebalances experts between two steps; any failure ends the group
    SyncDriver    `Engine.generate` (tests, benchmarks): the forward pass on the caller's
                  thread; `run_sync` drives the step's coroutine without an event loop

and the three loops around them (`serve`, `serve_group`, `generate`): each calls the one step.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from moed.engine.plan import StepPlan
from moed.engine.step import Go
from moed.types import FinishReason, SamplingParams

if TYPE_CHECKING:
    from moed.engine.engine import Engine
    from moed.parallel.runtime import EPRuntime

log = structlog.get_logger(__name__)

T = TypeVar("T")


class ServeDriver:
    reads_expert_load = True
    join_mtp = False            # no group

    def __init__(self, engine: Engine, wake: asyncio.Event) -> None:
        self._engine, self._wake = engine, wake
        self._loop = asyncio.get_running_loop()

    def leaving(self) -> bool:
        return False        # the loop checks _stopping before each step

    async def agree(self, plan: StepPlan | None) -> Go:
        return Go.IDLE if plan is None else Go.STEP

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._loop.run_in_executor(self._engine._executor, fn, *args)

    def contain(self, plan: StepPlan, err: Exception) -> bool:
        # a broken step fails its requests, not the engine
        log.exception("engine_step_failed", batch=plan.batch.num_seqs)
        self._engine._fail(plan, err)
        return True

    def after_forward(self) -> None:
        pass

    async def between_steps(self) -> None:
        pass

    async def idle(self) -> None:
        e = self._engine
        self._wake.clear()
        if not e._inbox and not e._stopping and not e._tier_results():
            await self._wake.wait()


class GroupDriver:
    """When anyone in the group has work every rank runs one forward pass (an empty one
    without work here); when nobody has, the group idles on one wake key. With the MTP layer
    drafting (speculative decoding) a rank whose own MTP pass skips the layer's MoE joins its
    exchange with no rows whenever a peer's runs it (`join_mtp`, moed.parallel.agree)."""
    reads_expert_load = True

    def __init__(self, engine: Engine, ep: EPRuntime, wake: asyncio.Event) -> None:
        self._engine, self._ep, self._wake = engine, ep, wake
        self._rebalance: Any = None     # this step's verdict on an expert rebalance
        self.plan: StepPlan | None = None
        self.join_mtp = False

    def leaving(self) -> bool:
        return self._engine._stopping

    async def agree(self, plan: StepPlan | None) -> Go:
        e, agreement = self._engine, self._ep.agreement
        has_plan = plan is not None
        self.plan = plan            # this step's: the failure log's batch size
        leaving = e._stopping
        if leaving:
            await self.call(agreement.wake_peers)
        mtp = e._mtp_full(plan)
        verdict = await self.call(agreement.agree, has_plan, leaving,
                                  self._ep.rebalance_wanted(), mtp)
        if leaving:
            return Go.LEAVE
        if verdict.leaving:
            if e._ep_draining:          # the whole group is stopping: not a failure
                e._group_down("a peer rank left the group", failed=False)
                return Go.LEAVE
            raise self._ep.fail("a peer rank left the group")
        if not verdict.working:
            return Go.IDLE
        self._rebalance = verdict.rebalance
        self.join_mtp = verdict.join_mtp(mtp)
        return Go.STEP if has_plan else Go.EMPTY

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn on the step thread, under the group's watchdog (gloo times out first; this is
        the backstop for a thread that never returns)."""
        ep = self._ep
        fut = asyncio.get_running_loop().run_in_executor(self._engine._executor, fn, *args)
        try:
            return await asyncio.wait_for(fut, ep.watchdog_s)
        except asyncio.TimeoutError:
            raise ep.fail(f"a step made no progress for {ep.watchdog_s:g} s") from None

    def contain(self, plan: StepPlan, err: Exception) -> bool:
        return False    # a local failure mid-step leaves the peers' collectives unmatched

    def after_forward(self) -> None:
        self._ep.observe_step()

    async def between_steps(self) -> None:
        if self._ep.rebalance_due(self._rebalance):     # EPLB, between two steps
            await self.call(self._ep.rebalance_step, self._rebalance)

    async def idle(self) -> None:
        e = self._engine
        self._wake.clear()
        if e._inbox or e._stopping or e._tier_results():
            # work came after this step's schedule: idle() returns at once, but sets the
            # epoch's key first, since the peers are idling on it
            self._wake.set()
        await self._ep.agreement.idle(self._wake, e._executor)


class SyncDriver:
    reads_expert_load = False   # generate() leaves the runner's counts to its caller
    join_mtp = False

    def leaving(self) -> bool:
        return False

    async def agree(self, plan: StepPlan | None) -> Go:
        return Go.IDLE if plan is None else Go.STEP

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def contain(self, plan: StepPlan, err: Exception) -> bool:
        return False

    def after_forward(self) -> None:
        pass

    async def between_steps(self) -> None:
        pass


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (a step under SyncDriver) to its result, on this
    thread, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a synchronous step tried to wait")


# ---- the loops: each calls the one step -----------------------------------------------------
async def serve(engine: Engine, driver: ServeDriver) -> None:
    """The serving loop: steps until shutdown, idling on the wake event."""
    while not engine._stopping:
        if await engine.step(driver) is Go.IDLE:
            await driver.idle()


async def serve_group(engine: Engine, driver: GroupDriver) -> None:
    """An expert-parallel rank's loop. A failed or left peer ends every request here with a
    503 and the node exits non-zero."""
    from moed.parallel.group import GroupFailed

    ep = driver._ep
    try:
        while (go := await engine.step(driver)) is not Go.LEAVE:
            if go is Go.IDLE:
                await driver.idle()
    except GroupFailed as e:
        ep.fail(str(e))
        engine._group_down(str(e))
    except Exception as e:      # a local failure mid-step leaves the peers' collectives unmatched
        plan = driver.plan
        log.exception("engine_step_failed", batch=0 if plan is None else plan.batch.num_seqs)
        ep.fail(f"this rank's step failed: {type(e).__name__}: {e}")
        engine._group_down(f"this rank's step failed: {type(e).__name__}")


def generate(engine: Engine, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
    """Engine.generate: the prompts to completion on this thread (the loop not running)."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError("one SamplingParams per prompt (or a single one for all)")
    base = f"gen-{engine.steps}-{id(prompts)}"
    reqs = [engine._new_request(f"{base}-{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, plist))]
    for r in reqs:
        engine.scheduler.add(r)
    driver = SyncDriver()
    while any(not r.finished for r in reqs):
        if run_sync(engine.step(driver)) is Go.STEP:
            continue
        if all(r.finished for r in reqs):    # e.g. a prompt that can never fit
            break
        if engine.scheduler.loading and engine.tiers is not None:
            if not engine.tiers.wait(30.0):
                raise RuntimeError("KV tier loads did not finish within 30 s")
            continue
        raise RuntimeError("scheduler made no progress with requests pending")
    for r in reqs:
        if r.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"request {r.request_id} failed: {r.error}")
    return [r.output_token_ids for r in reqs]
