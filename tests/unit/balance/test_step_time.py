"""The time-budget step policy: least slack first across length buckets, chunk sizes from the
cost model, bounded partial prefills, no starvation either way."""
import pytest

from moed.balance.step_time import URGENT_SHARE, Buckets, Item, Pick, choose, order, slack, \
    chunk_budget, floor_budget, late_budget, step_budget, ttft_deadline, whole_budget
from moed.balance.cost import Coefficients, StepShape, add_chunk, shape_of

# a fast node (GPU-like): 50k prompt tokens/s, attention showing at long contexts
FAST = Coefficients(overhead_s=0.002, per_token_s=2e-5, per_pair_s=2e-10, per_decode_s=2e-4)
BUCKETS = Buckets((512, 4096, 32768), (0.5, 2.0, 10.0, 60.0))
DECODES = shape_of([(1000, 1, True)] * 8)


def _simulate(policy, arrivals, until_s=120.0):
    """Step a queue with `policy(items, now) -> picks`; -> {key: (arrival, first token time)}.
    Each step takes what FAST predicts for its chunks plus 8 running decodes."""
    now, items, done = 0.0, {}, {}
    pending = sorted(arrivals, key=lambda a: a[1])
    while (pending or items) and now < until_s:
        while pending and pending[0][1] <= now:
            key, t, n = pending.pop(0)
            items[key] = Item(key, 0, n, n, 0.0)
        if not items:
            now = pending[0][1]
            continue
        live = [Item(i.key, i.start, i.remaining, i.total, now - arr[i.key], i.partial)
                for i in items.values()]
        picks = policy(live, now)
        assert picks, "no progress"
        shape = DECODES
        for p in picks:
            it = items[p.key]
            assert 0 < p.num_tokens <= it.remaining
            shape = add_chunk(shape, it.start, p.num_tokens)
        now += FAST.predict(shape)
        for p in picks:
            it = items.pop(p.key)
            if p.num_tokens == it.remaining:
                done[p.key] = (arr[p.key], now)
            else:
                items[p.key] = Item(it.key, it.start + p.num_tokens, it.remaining - p.num_tokens,
                                    it.total, 0.0, True)
    return done


arr: dict[str, float] = {}


def _trace():
    """A 100k-token prompt at t=0, then a 300-token prompt every 0.2 s for 20 s."""
    trace = [("long", 0.0, 100_000)] + [(f"s{i}", 0.05 + 0.2 * i, 300) for i in range(100)]
    arr.clear()
    arr.update({k: t for k, t, _ in trace})
    return trace


def _cost_policy(items, now):
    return choose(items, DECODES, FAST, step_budget(True, 0.1, 0.125), BUCKETS, max_partial=4,
                  max_tokens=16384)


def _fcfs_2048(items, now):
    """vLLM's default shape: a fixed token budget, first come first served."""
    picks, left = [], 2048 - 8
    for it in sorted(items, key=lambda i: arr[i.key]):
        n = min(it.remaining, left)
        if n > 0:
            picks.append(Pick(it.key, n))
            left -= n
    return picks


def test_short_ttft_stays_under_target_with_a_100k_prompt_queued():
    done = _simulate(_cost_policy, _trace())
    shorts = [t1 - t0 for k, (t0, t1) in done.items() if k != "long"]
    assert len(shorts) == 100
    assert max(shorts) < BUCKETS.target(300), max(shorts)
    long_t0, long_t1 = done["long"]
    assert long_t1 - long_t0 < BUCKETS.target(100_000)          # finishes within its bound
    # each step kept to its time budget (the long prompt chunked to fit around the shorts)
    assert long_t1 - long_t0 > FAST.prefill_seconds(100_000)     # it shared the node


def test_a_fixed_token_budget_fcfs_misses_that_target():
    """The same trace under a fixed 2048-token FCFS budget: the shorts queue behind the whole
    long prompt (the test above is not passing by construction)."""
    done = _simulate(_fcfs_2048, _trace())
    worst = max(t1 - t0 for k, (t0, t1) in done.items() if k != "long")
    assert worst > 2 * BUCKETS.target(300)


def test_long_prompt_is_not_starved_by_a_saturating_stream_of_shorts():
    # shorts alone would fill every step's budget: the long one must still finish by its
    # target, through aging (its slack drops below theirs)
    trace = [("long", 0.0, 20_000)] + [(f"s{i}", 0.01 * i, 400) for i in range(4000)]
    arr.clear()
    arr.update({k: t for k, t, _ in trace})
    done = _simulate(_cost_policy, trace, until_s=80.0)
    assert "long" in done
    t0, t1 = done["long"]
    # the documented bound: past its target it gets at least URGENT_SHARE of each step
    assert t1 - t0 <= BUCKETS.target(20_000) + FAST.prefill_seconds(20_000) / URGENT_SHARE


def test_order_is_least_slack_first_and_age_moves_long_prompts_up():
    short = Item("short", 0, 300, 300, 0.0)
    young_long = Item("long", 0, 50_000, 50_000, 0.0)
    old_long = Item("long", 0, 50_000, 50_000, 59.0)
    assert [i.key for i in order([young_long, short], FAST, BUCKETS)] == ["short", "long"]
    assert [i.key for i in order([short, old_long], FAST, BUCKETS)] == ["long", "short"]
    assert slack(old_long, FAST, BUCKETS) < slack(young_long, FAST, BUCKETS)


def test_chunks_fit_the_budget_and_the_cap():
    items = [Item("a", 0, 100_000, 100_000, 0.0, True)]
    picks = choose(items, DECODES, FAST, 0.1, BUCKETS, max_partial=4, max_tokens=10**6)
    shape = add_chunk(DECODES, 0, picks[0].num_tokens)
    assert FAST.predict(shape) <= 0.1 < FAST.predict(add_chunk(DECODES, 0,
                                                               picks[0].num_tokens + 1))
    capped = choose(items, DECODES, FAST, 0.1, BUCKETS, max_partial=4, max_tokens=512)
    assert capped == [Pick("a", 512)]


def test_partial_prefills_are_bounded():
    items = [Item(f"p{i}", 0, 30_000, 30_000, float(i)) for i in range(6)]
    picks = choose(items, StepShape(), FAST, 10.0, BUCKETS, max_partial=2, max_tokens=10**6)
    assert len(picks) == 6 or sum(p.num_tokens < 30_000 for p in picks) <= 2
    under_way = [Item("p0", 5000, 25_000, 30_000, 9.0, True),
                 Item("p1", 5000, 25_000, 30_000, 9.0, True)]
    more = choose(under_way + [Item("new", 0, 30_000, 30_000, 20.0)], StepShape(), FAST, 0.05,
                  BUCKETS, max_partial=2, max_tokens=10**6)
    assert "new" not in {p.key for p in more}          # would be a third partial prefill
    # ... but a new prompt that completes in this step needs no slot
    fresh = [Item(i.key, i.start, i.remaining, i.total, 0.0, True) for i in under_way]
    done = choose(fresh + [Item("tiny", 0, 50, 50, 0.0)], StepShape(), FAST, 0.05,
                  BUCKETS, max_partial=2, max_tokens=10**6)
    assert Pick("tiny", 50) in done


def test_seats_limit_new_prompts():
    items = [Item(f"n{i}", 0, 100, 100, 0.0) for i in range(5)]
    picks = choose(items, StepShape(), FAST, 1.0, BUCKETS, max_partial=4, max_tokens=10**6,
                   max_new=2)
    assert len(picks) == 2


def test_progress_when_not_even_one_token_fits():
    """A budget below the decodes' own time: the chunk gets the floor (floor_budget: the
    smallest step's time again), not min_tokens a step (issue 30 item 6, a slow CPU)."""
    items = [Item("a", 0, 1000, 1000, 0.0)]
    picks = choose(items, DECODES, FAST, FAST.predict(DECODES) / 2, BUCKETS, max_partial=4,
                   max_tokens=4096, min_tokens=16)
    assert len(picks) == 1 and picks[0].key == "a" and 16 < picks[0].num_tokens < 1000
    assert FAST.predict(add_chunk(DECODES, 0, picks[0].num_tokens)) <= \
        floor_budget(FAST, DECODES, 16) + 1e-12


def test_budget_and_deadline():
    assert step_budget(True, 0.1, 0.5) == 0.1
    assert step_budget(False, 0.1, 0.5) == 0.5
    assert ttft_deadline(2.0, 4.0, 600.0) == 8.0
    assert ttft_deadline(2.0, 0.0, 600.0) == 600.0
    assert ttft_deadline(2.0, 4.0, 5.0) == 5.0
    assert ttft_deadline(2.0, 0.0, None) == float("inf")


def test_buckets_validate():
    assert BUCKETS.bucket(512) == 0 and BUCKETS.bucket(513) == 1 and BUCKETS.bucket(10**6) == 3
    with pytest.raises(ValueError):
        Buckets((512, 4096), (1.0, 2.0))
    with pytest.raises(ValueError):
        Buckets((4096, 512), (1.0, 2.0, 3.0))


def test_a_long_prompt_that_only_progresses_never_holds_back_one_that_finishes():
    """The measured regression: a long prompt predicted to miss its own target has the least
    slack; a one-pass fill gave it every step and the shorts behind it waited 12 s."""
    slow = Coefficients(overhead_s=0.04, per_token_s=5e-4, per_pair_s=3e-7, per_decode_s=1e-3)
    hopeless = Item("long", 500, 2500, 3000, 0.5, True)     # needs > its 2 s target
    short = Item("short", 0, 200, 200, 0.0)
    assert order([hopeless, short], slow, BUCKETS)[0].key == "long"
    picks = choose([hopeless, short], StepShape(), slow, 0.3, BUCKETS, max_partial=4,
                   max_tokens=8192)
    assert picks[0] == Pick("short", 200)                    # its first token this step
    assert picks[1].key == "long" and picks[1].num_tokens > 0   # the long one gets the rest
    # once the long one has waited past its target it no longer yields: shorts that finish
    # get at most half of the prefill time before it, it gets the rest
    urgent = Item("long", 500, 2500, 3000, 2.5, True)
    shorts = [Item(f"s{i}", 0, 100, 100, 0.0) for i in range(6)]
    picks = choose([urgent, *shorts], StepShape(), slow, 0.3, BUCKETS, max_partial=4,
                   max_tokens=8192)
    long_n = next(p.num_tokens for p in picks if p.key == "long")
    long_s = slow.predict(add_chunk(StepShape(), 500, long_n)) - slow.overhead_s
    assert long_s >= (0.3 - slow.overhead_s) / 2 - 0.01
    assert any(p.key.startswith("s") for p in picks)        # and the shorts still flow
    # without shorts it takes the whole step
    alone = choose([urgent], StepShape(), slow, 0.3, BUCKETS, max_partial=4, max_tokens=8192)
    assert slow.predict(add_chunk(StepShape(), 500, alone[0].num_tokens)) > 0.29


def test_a_prompt_whose_context_outgrows_the_budget_moves_in_amortized_chunks():
    reads = Coefficients(overhead_s=0.002, per_token_s=1e-4, per_pair_s=0.0, per_context_s=1e-4)
    deep = Item("deep", 5000, 20_000, 25_000, 0.0, True)     # reading 5000 tokens: 0.5 s
    picks = choose([deep], StepShape(), reads, 0.1, BUCKETS, max_partial=4, max_tokens=10**6)
    assert len(picks) == 1 and picks[0].key == "deep"
    # its chunk is worth its fixed cost (~0.5 s of reads buys ~5000 tokens), not 16 tokens
    assert picks[0].num_tokens > 4000


def test_a_step_without_decodes_finishes_a_short_prompt_whole():
    """Measured: a 250-token prompt on an idle node ran in three 125 ms steps (prefill_step
    budget) instead of one ~150 ms step. Without decodes the step may grow to half the
    smallest TTFT target to finish whole prompts; with decodes the ITL budget holds."""
    slow = Coefficients(overhead_s=0.01, per_token_s=6e-4, per_pair_s=3e-7)
    short = Item("short", 0, 250, 250, 0.0)
    assert slow.predict(add_chunk(StepShape(), 0, 250)) > 0.125       # over prefill_step
    assert whole_budget(False, 0.125, 0.5) == 0.25
    assert whole_budget(True, 0.1, 0.5) == 0.1
    chopped = choose([short], StepShape(), slow, 0.125, BUCKETS, max_partial=4,
                     max_tokens=8192)
    assert chopped[0].num_tokens < 250                                 # the old behaviour
    whole = choose([short], StepShape(), slow, 0.125, BUCKETS, max_partial=4, max_tokens=8192,
                   whole_s=whole_budget(False, 0.125, 0.5))
    assert whole == [Pick("short", 250)]
    # a long prompt is still chunked to the step budget, not to the whole-prompt one
    long = Item("long", 0, 3000, 3000, 0.0)
    chunk = choose([long], StepShape(), slow, 0.125, BUCKETS, max_partial=4, max_tokens=8192,
                   whole_s=0.25)
    assert slow.predict(add_chunk(StepShape(), 0, chunk[0].num_tokens)) <= 0.125


def test_a_late_short_prompt_finishes_whole_beside_decodes_that_fill_the_itl_target():
    """2 cores, 32 streams: the decodes take 66 of the 100 ms ITL target, so the chunks beside
    them were a few dozen tokens and 128-token prompts queued for seconds. Past its TTFT
    target a short prompt finishes whole (more of them while the step stays within the
    decodes + the ITL target, the oldest one even past that); on time, or of a longer target,
    it is chunked within the ITL target as before."""
    cpu = Coefficients(overhead_s=0.002, per_token_s=5e-4, per_decode_s=2e-3)
    decodes = shape_of([(200, 1, True)] * 32)
    base_s = cpu.predict(decodes)
    late = late_budget(True, base_s, 0.1, whole_budget(True, 0.1, 0.5))
    assert late == pytest.approx(base_s + 0.1)
    assert late_budget(False, 0.0, 0.1, 0.25) == 0.25               # no decodes: whole_s
    kw = dict(max_partial=4, max_tokens=2048, whole_s=0.1, late_s=late)

    def step_s(picks):
        shape = decodes
        for p in picks:
            shape = add_chunk(shape, 0, p.num_tokens)
        return cpu.predict(shape)

    on_time = choose([Item("fresh", 0, 128, 128, 0.2)], decodes, cpu, 0.1, BUCKETS, **kw)
    assert on_time[0].num_tokens < 128 and step_s(on_time) <= 0.1
    overdue = [Item(f"late{i}", 0, 128, 128, 0.6 + i) for i in range(3)]
    picks = choose(overdue, decodes, cpu, 0.1, BUCKETS, **kw)
    assert picks == [Pick("late2", 128)]        # the oldest, whole: one fits late_s
    assert 0.1 < step_s(picks) <= late
    # a loaded machine: the decodes alone take the ITL target and no prompt fits late_s;
    # the oldest late short still finishes, alone (the rule before gave it a 16-token chunk)
    slow = Coefficients(overhead_s=0.002, per_token_s=2e-3, per_decode_s=3.5e-3)
    slow_late = late_budget(True, slow.predict(decodes), 0.1, 0.1)
    assert slow.predict(add_chunk(decodes, 0, 128)) > slow_late
    picks = choose(overdue, decodes, slow, 0.1, BUCKETS, **{**kw, "late_s": slow_late})
    assert picks == [Pick("late2", 128)]
    # ...unless a long prompt has waited longer still: it keeps its turn (no short forced)
    older = Item("long", 500, 2500, 3000, 9.0, True)
    picks = choose([older, *overdue], decodes, slow, 0.1, BUCKETS,
                   **{**kw, "late_s": slow_late})
    assert all(p.num_tokens < 128 for p in picks if p.key != "long")
    long_late = Item("long", 0, 600, 600, 2.5)  # 2 s target, missed: chunked as before
    picks = choose([long_late], decodes, cpu, 0.1, BUCKETS, **kw)
    assert picks[0].num_tokens < 600 and step_s(picks) <= 0.1


def test_a_step_that_gives_a_short_prompt_its_first_token_is_not_stretched_by_a_long_one():
    """The short's TTFT includes its whole step: a long prompt with slack to spare does not
    add its chunk there (it runs in the next step); one running late still does."""
    slow = Coefficients(overhead_s=0.01, per_token_s=6e-4, per_pair_s=3e-7)
    short = Item("short", 0, 200, 200, 0.0)
    relaxed = Item("long", 1000, 2000, 40_000, 0.1, True)   # 60 s target, 2.4 s of work
    picks = choose([relaxed, short], DECODES, slow, 0.25, BUCKETS, max_partial=4,
                   max_tokens=8192)
    assert picks == [Pick("short", 200)]
    alone = choose([relaxed], DECODES, slow, 0.25, BUCKETS, max_partial=4, max_tokens=8192)
    assert alone[0].key == "long" and alone[0].num_tokens > 0     # it runs without the short
    late = Item("long", 1000, 2000, 40_000, 58.0, True)     # predicted to miss, not urgent
    picks = choose([late, short], DECODES, slow, 0.25, BUCKETS, max_partial=4, max_tokens=8192)
    assert picks[0] == Pick("short", 200) and picks[1].key == "long"


def test_chunk_steps_are_kept_to_prefill_step_even_when_the_itl_target_allows_more():
    """A short prompt arriving mid-step waits for the rest of it: chunks of a long prompt
    fill `prefill_step_s`, whole prompts may still use the ITL budget."""
    slow = Coefficients(overhead_s=0.01, per_token_s=6e-4, per_pair_s=3e-7)
    assert chunk_budget(True, 0.25, 0.125) == 0.125
    assert chunk_budget(True, 0.1, 0.125) == 0.1
    assert chunk_budget(False, 0.25, 0.125) == 0.125
    long = Item("long", 1000, 2000, 3000, 0.0, True)
    step = choose([long], DECODES, slow, chunk_budget(True, 0.25, 0.125), BUCKETS,
                  max_partial=4, max_tokens=8192, whole_s=0.25)
    t = slow.predict(add_chunk(DECODES, 1000, step[0].num_tokens))
    assert 0.1 < t <= 0.125
    shorts = [Item(f"s{i}", 0, 150, 150, 0.0) for i in range(2)]    # ~0.1 s each, whole
    picks = choose(shorts, DECODES, slow, 0.125, BUCKETS, max_partial=4, max_tokens=8192,
                   whole_s=0.25)
    assert picks == [Pick("s0", 150), Pick("s1", 150)]


def test_only_a_shortest_target_prompt_grows_the_step_past_the_chunk_budget():
    """A long prompt's last 150 tokens (~0.23 s) fit the 0.25 s whole-prompt budget but not
    the 0.125 s chunk budget: it finishes in two chunk steps; a short of the same cost is
    taken whole."""
    slow = Coefficients(overhead_s=0.01, per_token_s=6e-4, per_pair_s=3e-7)
    tail = Item("long", 2850, 150, 3000, 0.5, True)          # bucket target 2 s: slack > 0
    assert slack(tail, slow, BUCKETS) > 0
    assert 0.125 < slow.predict(add_chunk(DECODES, 2850, 150)) <= 0.25
    picks = choose([tail], DECODES, slow, 0.125, BUCKETS, max_partial=4, max_tokens=8192,
                   whole_s=0.25)
    assert picks[0].key == "long" and 0 < picks[0].num_tokens < 150
    assert slow.predict(add_chunk(DECODES, 2850, picks[0].num_tokens)) <= 0.125
    short = Item("short", 0, 350, 350, 0.0)                   # ~0.22 s, bucket target 0.5 s
    assert choose([short], DECODES, slow, 0.125, BUCKETS, max_partial=4, max_tokens=8192,
                  whole_s=0.25) == [Pick("short", 350)]
