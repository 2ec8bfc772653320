"""The three drivers of the one step (moed.engine.step.StepCore.step): what each decides.

    ServeDriver   the asynchronous serving loop: the forward pass on the step thread; a failed
                  one fails its requests, not the engine; idles on the wake event
    GroupDriver   an expert-parallel rank's lock-step loop (moed.parallel.agree): every step
                  opens with the group's agreement, runs under the group's watchdog, and
                  rebalances experts between two steps; any failure ends the group
    SyncDriver    `Engine.generate` (tests, benchmarks): the forward pass on the caller's
                  thread; `run_sync` drives the step's coroutine without an event loop
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from moed.engine.scheduler import StepPlan
from moed.engine.step import Go

if TYPE_CHECKING:
    from moed.engine.engine import Engine
    from moed.parallel.runtime import EPRuntime

log = structlog.get_logger(__name__)

T = TypeVar("T")


class ServeDriver:
    reads_expert_load = True

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
    without work here); when nobody has, the group idles on one wake key."""
    reads_expert_load = True

    def __init__(self, engine: Engine, ep: EPRuntime, wake: asyncio.Event) -> None:
        self._engine, self._ep, self._wake = engine, ep, wake
        self._rebalance: Any = None     # this step's verdict on an expert rebalance
        self.plan: StepPlan | None = None

    def leaving(self) -> bool:
        return self._engine._stopping

    async def agree(self, plan: StepPlan | None) -> Go:
        e, agreement = self._engine, self._ep.agreement
        has_plan = plan is not None
        self.plan = plan            # this step's: the failure log's batch size
        leaving = e._stopping
        if leaving:
            await self.call(agreement.wake_peers)
        verdict = await self.call(agreement.agree, has_plan, leaving,
                                  self._ep.rebalance_wanted())
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
