"""The per-step switch: whether a step's decoding requests may draft at all (no torch).

Drafts pay where a step is bound by reading the weights (one more position is nearly free)
and lose where it is bound by compute or by per-row overhead (batch 16 on the 2-core Xeon:
ngram 0.78x, mtp 0.59x with most drafts accepted). Which one a step is depends on the batch,
the model and the machine, so the switch measures instead of predicting:

    class       the step's number of decoding rows, each count its own class: the arms are
                compared at equal rows. (Power-of-two classes, 9-16 rows in one, compared a
                closed batch's drafting at 16 rows with plain in its tail at 9-12, where a
                step's fixed cost is spread over fewer tokens: plain read 25-35% slow and
                drafting won batch-16 runs it lost, issue 32.)
    arm         "draft" (the step may draft) or "plain" (it may not)
    rate        emitted tokens per second of the arm's steps in the class: averages of tokens
                and of seconds, their ratio; only steps without a prompt chunk are measured (a
                chunk's time is neither arm's). Each run of an arm (its steps in a row) starts
                its estimate over: the median seconds of the run's first MIN_SAMPLES
                measured steps (their mean tokens) replace what the arm had, later steps
                move them by EMA_WEIGHT. So an
                exploration run is a fresh measurement of the loser, not a nudge to a stale
                figure: a warm-up slowed by first calls (new row counts' kernels) is corrected
                at the first exploration, not after many. (Drafting's tokens are a draw per
                row: their average holds at least TOKEN_DRAWS of them, `token_steps`, unless
                a run has clearly `shifted`.) A drafting step of a draining batch (nothing
                waits for a seat) also counts the tail it adds, `spread_cost`: the step
                loop adds it to the step's seconds

Each class runs the arm with the higher rate, except that drafting takes over from plain only
when its rate is DRAFT_MARGIN above plain's (and keeps the lead down to a tie): a switch to
drafting pays what no measured step shows (the run's unmeasured first step; with the MTP
layer that step drafts without verifying and writes the KV entries plain steps left), and a
near tie measured on noisy steps flipped the arms back and forth, a first step each time. At the end of every period of `every`
decisions (EXPLORE_EVERY at first) it runs the other for EXPLORE_RUN steps in a row (a run,
not one step: an MTP draft is made one step before it is verified, so the first step of a
draft run has none), so a loser that has become the winner (the batch's prompts turned
repetitive, the machine got quieter) is found again. A run lasts until EXPLORE_RUN - 1 of its steps were measured (at most
EXPLORE_CAP decisions): a step that might draft but had no draft measures nothing. A run that leaves the winner as it was
doubles the next period (up to EXPLORE_MAX) unless the loser is within NEAR_TIE of the winner
(then the period is the budget's, below, at least EXPLORE_EVERY: a near tie's verdict is
re-measured often, cheaply): a clear loser that keeps losing costs its runs ever
more rarely (4 steps in 64, then in 128, ... 1024), and a loser far behind skips ahead to the
period whose run costs at most EXPLORE_BUDGET of it (a run's EXPLORE_RUN + 1 loser steps each
lose the time the winner would have taken less for their tokens, and its two switches what
they cost beyond their first steps' tokens (`ClassState.switch`: an MTP run's first step
writes the KV entries plain steps deferred, a few plain steps at batch 16): a drafting step
that takes twice a plain step's time for as many tokens, its first 1 s over, goes 64 -> 700
instead of 128; a bandit explores an arm the less, the farther behind it is); a period that ends with the arm its run explored as the winner starts the periods over
at EXPLORE_EVERY. In a class of two rows or more drafting must also stay SPREAD_MARGIN ahead,
always (`spread`): it spreads the rows' progress, and a batch that ends together without drafts
ends in a tail of ever smaller steps with them, a cost no measured step shows; and there
drafting takes over only when a second run, started at once after the one that put it ahead,
keeps it ahead (`confirmed`: one noisy run made a wrong take-over, whose period and tail cost
15% of a batch-16 round). A new class first
runs each arm for MIN_SAMPLES measured steps, drafts first, unless a neighbour has both arms
measured: then it is seeded from the nearest larger such class (`seeded`), its verdict and the
ratio of its arms' rates, and runs that verdict at once. A closed batch's tail passes through
ever smaller classes in a few steps each, and warming each up from scratch cost ~11% of a
batch-16 MTP run (issue 32). Where no larger class is measured, the nearest smaller one seeds
only a plain verdict: drafting pays the less the more rows share a step's weight reads, so a
verdict against it carries upward (a serving batch whose rows move 30, 31, 29, ... does not
warm up drafting at each new count), a verdict for it does not: a large batch never inherits a
small one's drafting. Each arm's first run in the class replaces its seeded figures; until
then an arm still seeded follows the other's measured rate at the neighbour's ratio (rates at
different row counts are not comparable, their ratio roughly is). The classes live as long as
the step loop: what one batch learned serves the next requests. The decision is `decide` and the measurement `observe`, pure; `StepGate` holds the
classes' states for the engine (one writer: the step loop).
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

EMA_WEIGHT = 0.2
MIN_SAMPLES = 4
EXPLORE_EVERY = 64
EXPLORE_MAX = 1024     # 4 steps in 1024: a recovery within ~2000 steps at worst
EXPLORE_RUN = 4
EXPLORE_CAP = 4 * EXPLORE_RUN  # the most decisions a run may take to measure its steps
EXPLORE_BUDGET = 0.01   # the share of a period a confirmed loser's run may lose, at most
# (2% let a closed batch-16 mtp bench round hold a run at 64 and at 192 decisions: both a
# switch's catch-up pass, 3-4% of those rounds)
DRAFT_MARGIN = 0.05     # drafting wins when its rate is this much above plain's
# ... and, in a class of 2 rows or more, this much more, always (not a hysteresis): drafting
# spreads the rows' progress (a request whose drafts keep failing, paused, falls behind), so a
# batch that ends together without drafts ends in a tail of ever smaller steps with them,
# which no measured step of the class shows: 12.6% of a batch-16 mtp run's time on the demo
# model (edit prompts, 64 tokens, every step drafting; the straggler's lag grows with its
# length, so the share does not shrink with longer requests). One row has no tail.
SPREAD_MARGIN = 0.10
# a loser within this share of the winner's rate is a near tie: its period is not doubled
# (bench/spec.py's rounds: a step's rate moves 10-20% with the prompt and the machine)
NEAR_TIE = 0.15
SPIKE = 4.0
# tokens per step: a run starts from the arm's last figure counted as TOKEN_PRIOR steps (not
# over: a drafting step's tokens are a draw, each draft accepted or not, 1 or 2 at batch 1),
# then its plain mean up to TOKEN_STEPS steps, then an EMA of weight 1 / TOKEN_STEPS (seconds,
# measured not drawn: each run starts over, up to MIN_SAMPLES, then EMA_WEIGHT). With the
# seconds' weights for tokens one rejected first step of a run, or two or three in a row,
# handed batch 1 to plain for the next period, doubled each time (demo model, mtp, batch 1:
# plain ran ~90% of a bench round's steps while drafting steps were 20-40% ahead).
TOKEN_PRIOR = 4
TOKEN_STEPS = 16
# ... and at least as many steps as hold these many row draws (`token_steps`): a step of one
# row is one draw (1 or 2 tokens at k = 1), one of 16 rows averages 16 of them. Counted in
# steps alone, batch 1's estimate moved by ~6% at random (a few rejections in a row at a run's
# start weighed 1/5 each): mtp drafting 17% ahead still lost its lead for whole periods, 18%
# of a bench round's steps ran plain (demo model, 2026-12-05; 4% of its tok/s)
TOKEN_PRIOR_DRAWS = 32
TOKEN_DRAWS = 64
# a run whose mean tokens lie further than this many standard errors (and this share) from
# the arm's figure starts the figure over from the run (`shifted`); batch 1, mtp, 73% accepted:
# 4 rejections in a row (0.5% of runs) start it over, 3 do not
SHIFT_Z = 3.0
SHIFT_FLOOR = 0.05

_D = TypeVar("_D")


class Why(enum.Enum):
    """Why a step drafts or not (the label of moed_spec_decode_steps_total's `decision`)."""
    WARMUP = "warmup"       # the class has too few samples of an arm: measuring it
    WINNER = "winner"       # the arm with the higher measured rate
    EXPLORE = "explore"     # the loser's periodic run


@dataclass(frozen=True)
class Arm:
    tokens: float = 0.0     # average of emitted tokens per measured step (TOKEN_STEPS long)
    seconds: float = 0.0    # EMA of seconds per measured step
    samples: int = 0
    var: float = 0.0        # drafting's: its steps' tokens' variance about `tokens`, averaged alike

    @property
    def rate(self) -> float:
        """Emitted tokens per second (0 before any sample)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ClassState:
    draft: Arm = field(default_factory=Arm)
    plain: Arm = field(default_factory=Arm)
    decisions: int = 0      # the exploration clock: decisions taken in this period
    explored: bool = False  # the arm the current exploration run measures (the loser at its start)
    last: bool | None = None    # the arm of the last step observed
    run: int = 0            # measured steps of the current run of `last`
    every: int = EXPLORE_EVERY  # this period's length, its exploration run last
    won: bool = False       # drafting was the winner at the last decision
    # (draft, plain): the arm's figures are still a larger class's (`seeded`); such an arm's
    # rate is kept at `ratio` times the other's (ratio: draft's rate over plain's)
    seeded: tuple[bool, bool] = (False, False)
    ratio: float = 1.0
    # seconds a switch of arms costs beyond its first step's tokens at the left arm's rate
    # (an MTP draft run's first step writes the KV entries plain steps deferred): what no
    # measured step shows, charged to the exploration budget
    switch: float = 0.0
    # the current run's first measured steps' seconds (at most MIN_SAMPLES): the arm's figure
    # is their median, so one step stalled by another process or the collector does not
    # decide a run alone (a mean of an exploration run's 3 steps did: batch 1, one 139 ms
    # step among 4 ms ones held plain as the loser for a 1024-step period)
    window: tuple[float, ...] = ()
    run_tokens: float = 0.0     # the current run's measured steps' tokens, summed (`shifted`)
    # a class with a spread margin: draft.samples when drafting was first measured ahead of a
    # plain winner (-1: not pending); it takes over only if the run after that keeps it ahead
    confirm: int = -1


def size_class(rows: int) -> int:
    """The class of a step with `rows` decoding rows: the row count (0 rows counts as 1)."""
    return max(rows, 1)


def spread(c: int) -> float:
    """The margin drafting must keep over plain in class c for the tail it causes."""
    return SPREAD_MARGIN if c > 1 else 0.0


def decide(s: ClassState, spread: float = 0.0) -> tuple[bool, Why, ClassState]:
    """(draft this step?, why, the state with its clock advanced); spread: the class's
    `spread` margin."""
    if s.draft.samples < MIN_SAMPLES:
        return True, Why.WARMUP, s
    if s.plain.samples < MIN_SAMPLES:
        return False, Why.WARMUP, s
    # drafting takes over by the margin and keeps the lead down to a tie (hysteresis: a rate
    # inside the margin flips nothing either way)
    ahead = s.draft.rate >= (1.0 if s.won else 1 + DRAFT_MARGIN) * (1 + spread) * s.plain.rate
    winner, s = confirmed(s, ahead, spread)
    decisions, every = s.decisions, s.every     # (one replace below: the step loop's per-step cost)
    # a run ends once it has measured EXPLORE_RUN - 1 steps of its arm (the first after the
    # switch is not measured), or at the cap: steps with no draft measure nothing (ngram found
    # no match), and a run of such steps must not pass for a loser confirmed
    measured = s.last == s.explored and s.run >= EXPLORE_RUN - 1
    if decisions >= every - EXPLORE_RUN + EXPLORE_CAP or (decisions >= every and measured):
        same = winner != s.explored     # the period ended: its run explored its start's loser
        nxt = next_period(s, winner) if same else EXPLORE_EVERY
        decisions, every = 0, min(nxt, EXPLORE_MAX)
    phase = decisions - (every - EXPLORE_RUN)   # the period's run begins at phase 0
    if phase < 0:
        return winner, Why.WINNER, replace(s, won=winner, decisions=decisions + 1, every=every)
    arm = not winner if phase == 0 else s.explored      # one arm for the whole run
    return arm, Why.EXPLORE, replace(s, won=winner, decisions=decisions + 1, every=every, explored=arm)


def confirmed(s: ClassState, ahead: bool, spread: float) -> tuple[bool, ClassState]:
    """(whether drafting is the winner, the state): drafting `ahead` by its margins takes over
    from plain at once in one row; in a class with a spread margin only when a second run,
    started at once, keeps it ahead (`ClassState.confirm`). A wrong take-over costs a period of
    drafting and the tail it spreads, and one noisy run made it: mtp, batch 16, drafting ~1%
    ahead per step (15.5% needed) held the lead for ~30% of a closed batch's steps, whose tail
    then took 23% more (bench/spec_profile.py, 2026-12-05 17:02 UTC: 0.85x plain)."""
    if not ahead or s.won or spread == 0:
        return ahead, (s if s.confirm < 0 else replace(s, confirm=-1))
    if s.last and s.run < EXPLORE_RUN - 1:     # a drafting run still measuring: its end decides
        return False, s
    if s.confirm < 0:       # hold plain, run drafting again now (the period's run, early), afresh
        return False, replace(s, confirm=s.draft.samples, decisions=s.every - EXPLORE_RUN, run=0, window=(),
                            run_tokens=0.0)
    if s.draft.samples < s.confirm + EXPLORE_RUN - 1:
        return False, s
    return True, replace(s, confirm=-1)


def next_period(s: ClassState, winner: bool) -> int:
    """The period after a run that left the winner as it was: doubled (at least the budget's)
    for a clear loser; for one within NEAR_TIE of the winner, only the budget's (at least
    EXPLORE_EVERY): a near tie's verdict is as noisy as the steps that made it, and a
    doubled period held a wrong one for a whole bench round (demo model, mtp, batch 1:
    drafting ~18% ahead, read behind once, plain for the next 512 steps)."""
    w, lose = (s.draft, s.plain) if winner else (s.plain, s.draft)
    near = lose.rate * (1 + NEAR_TIE) >= w.rate
    return max(EXPLORE_EVERY if near else 2 * s.every, budgeted(s, winner))


def budgeted(s: ClassState, winner: bool) -> int:
    """The shortest period whose exploration run, EXPLORE_RUN + 1 steps of the loser (the
    first unmeasured), loses at most EXPLORE_BUDGET of it: a loser step loses its seconds
    less what the winner takes for its tokens, in winner steps, and the run's two switches
    what they cost beyond that (`ClassState.switch`)."""
    w, lose = (s.draft, s.plain) if winner else (s.plain, s.draft)
    if w.rate <= 0:
        return EXPLORE_EVERY
    lost = max(lose.seconds - lose.tokens / w.rate, 0.0) / w.seconds
    return math.ceil(((EXPLORE_RUN + 1) * lost + 2 * s.switch / w.seconds) / EXPLORE_BUDGET)


def seeded(classes: dict[int, ClassState], c: int) -> ClassState:
    """A new class c's first state: from the nearest larger class with both arms measured, else
    from the nearest smaller one whose verdict is plain (its arms, verdict and rate ratio, the
    exploration clock started over); else empty (the warm-up measures both arms)."""
    def measured(s: ClassState) -> bool:
        return min(s.draft.samples, s.plain.samples) >= MIN_SAMPLES and s.draft.rate > 0 and s.plain.rate > 0

    larger = next((classes[k] for k in sorted(classes) if k > c and measured(classes[k])), None)
    smaller = next((classes[k] for k in sorted(classes, reverse=True) if k < c and measured(classes[k])), None)
    src = larger if larger is not None else smaller if smaller is not None and not smaller.won else None
    if src is None:
        return ClassState()
    return ClassState(draft=src.draft, plain=src.plain, won=src.won, seeded=(True, True),
                      ratio=src.draft.rate / src.plain.rate)


def _follow(s: ClassState) -> ClassState:
    """An arm still seeded set to `ratio` times the other, measured, arm's rate."""
    d, p = s.seeded
    if d and not p:
        return replace(s, draft=replace(s.draft, tokens=s.plain.tokens, seconds=s.plain.seconds / s.ratio))
    if p and not d:
        return replace(s, plain=replace(s.plain, tokens=s.draft.tokens, seconds=s.draft.seconds * s.ratio))
    return s


def token_steps(rows: int) -> tuple[int, int]:
    """(the prior, the window) of the drafting arm's token average in a class of `rows` rows, in
    steps (a plain step's tokens are its rows, no draw: TOKEN_PRIOR and TOKEN_STEPS): TOKEN_PRIOR
    and TOKEN_STEPS, or more where they would hold fewer than TOKEN_PRIOR_DRAWS / TOKEN_DRAWS
    row draws."""
    rows = max(rows, 1)
    return max(TOKEN_PRIOR, -(-TOKEN_PRIOR_DRAWS // rows)), max(TOKEN_STEPS, -(-TOKEN_DRAWS // rows))


def shifted(a: Arm, mean: float, n: int) -> bool:
    """Whether a run's n measured steps, `mean` tokens each, say the arm has changed: further
    from its figure than SHIFT_Z of their mean's standard errors (from the arm's variance) and
    SHIFT_FLOOR of the figure. Then the run's own mean replaces the figure: the large prior
    that keeps batch 1's draws from moving it must not also hold a real change (the prompts
    turned repetitive: 4 tokens a step where 1 was) for a whole window."""
    return abs(mean - a.tokens) > max(SHIFT_Z * math.sqrt(a.var / n), SHIFT_FLOOR * a.tokens)


def observe(s: ClassState, drafted: bool, tokens: int, seconds: float, rows: int = 1) -> ClassState:
    """The class (of `rows` decoding rows) after one step of arm `drafted` that emitted `tokens`
    in `seconds`. The first step after a switch of arms is not measured (the switch's cost is
    neither arm's: an MTP draft is made a step before it is verified, so a draft run's first
    step has none). The run's first measured step replaces the arm's averages, its next ones
    make its seconds the run's median (up to MIN_SAMPLES steps), later ones move them by
    EMA_WEIGHT (tokens, a draw: from the arm's last figure as the prior's steps, over the
    window's, `token_steps`, unless the run has `shifted`); each step's seconds capped at SPIKE
    times the arm's average (a step slowed by another process on the cores must not decide
    alone)."""
    if s.last is not None and drafted != s.last:
        left = s.plain if drafted else s.draft      # the arm this step took over from
        # capped as a measured step's seconds are: a switch step stalled by another process
        # must not push the exploration out to EXPLORE_MAX alone
        extra = min(max(seconds - tokens / left.rate, 0.0), SPIKE * left.seconds) if left.rate > 0 else 0.0
        return replace(s, last=drafted, run=0, window=(), run_tokens=0.0, switch=extra if s.switch == 0 else
                       (1 - EMA_WEIGHT) * s.switch + EMA_WEIGHT * extra)
    a, n = (s.draft if drafted else s.plain), s.run + 1
    mine = s.seeded[0 if drafted else 1]    # its figures are a neighbour's: no cap from them
    sec = max(seconds, 0.0) if a.samples == 0 or mine else min(max(seconds, 0.0), SPIKE * a.seconds)
    window = (*s.window, sec) if n <= MIN_SAMPLES else s.window
    secs = _median(window) if n <= MIN_SAMPLES else (1 - EMA_WEIGHT) * a.seconds + EMA_WEIGHT * sec
    # a drafting figure weighs as many steps as it holds (a warm-up's 4 are not 32 draws)
    prior, steps = token_steps(rows) if drafted else (TOKEN_PRIOR, TOKEN_STEPS)  # plain's: no draw
    prior = min(prior, a.samples) if drafted else prior
    run_tokens = s.run_tokens + tokens
    wt = 1.0 / min(n + (0 if a.samples == 0 or mine else prior), steps)
    var = (1 - wt) * a.var + wt * (tokens - a.tokens) ** 2 if drafted and a.samples else a.var  # `shifted`'s
    fresh = drafted and a.samples > 0 and not mine and shifted(a, run_tokens / n, n)
    a = Arm(run_tokens / n if fresh else (1 - wt) * a.tokens + wt * tokens, secs, a.samples + 1, var)
    arm = {"draft": a, "seeded": (False, s.seeded[1])} if drafted else {"plain": a, "seeded": (s.seeded[0], False)}
    s = replace(s, last=drafted, run=n, window=window, run_tokens=run_tokens, **arm)
    return _follow(s) if any(s.seeded) else s


def replace(obj: _D, **changes: object) -> _D:
    """dataclasses.replace for this module's frozen dataclasses (every field an init field) at
    about half its cost: no field walk. decide and observe make one each per step."""
    return type(obj)(**{**obj.__dict__, **changes})


def _median(xs: tuple[float, ...]) -> float:
    """statistics.median of a few floats, without its generality (once per measured step)."""
    o = sorted(xs)
    m = len(o) // 2
    return o[m] if len(o) % 2 else (o[m - 1] + o[m]) / 2


def spread_cost(emitted: Sequence[int], remaining: Sequence[int], fixed_s: float) -> float:
    """Seconds a drafting step of a draining batch (nothing waits to take a finished row's
    seat) adds to the batch's tail: emitted[i] tokens of row i, which had remaining[i] to go
    before it (max_tokens less its output); fixed_s, the part of a step's seconds that does not
    grow with its rows. A draining batch runs max(remaining) more steps for what would take
    mean(remaining) at equal progress: the gap is a tail of smaller steps, each paying the fixed
    part. The step's cost is what it widens the gap by: the rows' mean gain less the gain of
    the slowest row of those with the most to go (none where that row gained most: a credit
    for closing the gap, tried, read ngram at batch 4 ~10% lower, 1.04 / 1.01 against
    1.15 / 1.14). A closed batch-16 ngram run on edit prompts measured drafting 14.7% ahead
    per step, and the tail its few copying rows left took 5% of the run (demo model,
    2026-12-05). One row, or rows that gain alike, cost nothing."""
    if len(emitted) < 2 or fixed_s <= 0:
        return 0.0
    most = max(remaining)
    slowest = min(e for e, r in zip(emitted, remaining) if r == most)
    return fixed_s * max(sum(emitted) / len(emitted) - slowest, 0.0)


class StepGate:
    """The classes' states, decided and measured by the step loop."""

    def __init__(self) -> None:
        self.classes: dict[int, ClassState] = {}

    def choose(self, rows: int) -> tuple[bool, Why]:
        """Whether a step with `rows` decoding rows may draft, and why."""
        c = size_class(rows)
        draft, why, self.classes[c] = decide(self._state(c), spread(c))
        return draft, why

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        c = size_class(rows)
        self.classes[c] = observe(self._state(c), drafted, tokens, seconds, c)

    def _state(self, c: int) -> ClassState:
        s = self.classes.get(c)
        return seeded(self.classes, c) if s is None else s
