"""The attention cost model: one step's time from its chunks, fitted online on this node's steps.

Glossary
    chunk       (start, n, decode): n new tokens of one sequence whose first `start` tokens are
                already in the KV cache; `decode` when it is a one-token catch-up of a request
                that is generating (n > 1: its known token + n - 1 speculative drafts)
    StepShape   a step's features: prefill tokens, attention pairs, decode sequences, experts
    pairs       Σ over chunks of n·start + n(n+1)/2: the (query, key) pairs causal attention
                computes — the term that makes a long context expensive
    Coefficients  seconds per unit of each feature (overhead, per token, per pair, per
                decode sequence, per expert-fraction touched)

    t(step) = c0 + c1·prefill_tokens + c2·pairs + c3·decode_seqs + c4·experts_touched
              + c5·prefill_context + c6·verified_positions

`prefill_context` is Σ start over the prefill chunks: the cached tokens each chunk reads
whatever its size. Measured on the bench preset (torch attention backend): a 33-token chunk
at context 2648 took 0.34 s, as long as a 256-token one there — without this term the model
priced it at 0.12 s, and the budget chopped long prompts into small chunks that each paid it.
`experts_touched` is the expected share of a layer's experts that the step's tokens reach,
1 − (1 − k/E)^T for T tokens routed to top-k of E experts (uniform routing): a small batch
touches few experts and costs less per token than the linear term alone says (0 on a dense
model). `verified_positions` are speculative decoding's draft positions (Σ n − 1 over decode
chunks): a draft is verified beside its request's decode, reads the same history, and costs
neither a prompt token nor a prompt chunk's context read (the decode's own context is already
priced); its own term lets the cost policy give drafts only what the ITL target has left.
Measured on the bench preset, 2 threads: 256 new tokens take 0.12 s at context 0 and
0.40 s at context 3840, about 2.9e-7 s per pair; 16 decodes take 36 ms.

The fit is least squares with forgetting (recursive: exponentially weighted sufficient
statistics updated per step, `ewls_update`; solved per step, `solve_nonneg`, 7 unknowns) on
relative error: each row is divided by its measured time, so a 10 ms decode step weighs as
much as a 1 s prefill (the scheduler budgets both); once fitted, by √(predicted · measured)
(≈ the log error: symmetric, not biased low on noisy steps), and a step more than 50% off
the prediction gets a Huber weight (`huber_weight`: a step slowed by another process on the
cores must not retune the budget of the next ones). Coefficients are kept ≥ 0 and, in
directions no recent step informs (no prefill for an hour), held at their last fit by a small
ridge: a plain RLS covariance winds up there and its estimate drifts (measured: a decode-only
stretch turned a 18 ms decode prediction into 1 s once negative terms were clipped). `CostModel` is the
small stateful wrapper the engine feeds; `AdvertisedCost` is what a prefill node would tell
the decode nodes (coefficients + its queue per length bucket) and what both node choice
(`moed.balance.prefill`) and early rejection predict from.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FEATURES = ("overhead", "prefill_tokens", "attention_pairs", "decode_seqs", "experts_touched",
            "prefill_context", "verified_positions")
# Internal units keep the RLS matrix well conditioned (features of order 1): kilo-tokens,
# mega-pairs, tens of sequences, tens of draft positions.
_SCALE = (1.0, 1e-3, 1e-6, 0.1, 1.0, 1e-4, 0.1)


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0
    attention_pairs: float = 0.0
    decode_seqs: int = 0
    experts_touched: float = 0.0
    prefill_context: int = 0        # Σ start over prefill chunks: cached tokens they read
    verified_positions: int = 0     # speculative drafts verified beside their decodes

    def raw(self) -> tuple[float, ...]:
        return (1.0, self.prefill_tokens, self.attention_pairs, self.decode_seqs,
                self.experts_touched, self.prefill_context, self.verified_positions)

    def features(self) -> tuple[float, ...]:
        return tuple(x * s for x, s in zip(self.raw(), _SCALE))


@dataclass(frozen=True)
class ExpertShape:
    """How tokens reach experts: top-k of E (None / E = 0: a dense model)."""
    num_experts: int = 0
    top_k: int = 0

    def touched(self, tokens: int) -> float:
        if self.num_experts <= 0 or self.top_k <= 0 or tokens <= 0:
            return 0.0
        return 1.0 - (1.0 - min(self.top_k, self.num_experts) / self.num_experts) ** tokens


def chunk_pairs(start: int, n: int) -> float:
    """Causal attention pairs of n new tokens after `start` cached ones."""
    return n * start + n * (n + 1) / 2


def shape_of(chunks: Iterable[tuple[int, int, bool]], experts: ExpertShape | None = None
             ) -> StepShape:
    """chunks: (start, n, decode) per sequence in the step (a decode of n > 1: n - 1 drafts)."""
    prefill = decode = context = verified = 0
    pairs = 0.0
    for start, n, is_decode in chunks:
        pairs += chunk_pairs(start, n)
        if is_decode:
            decode += 1
            verified += n - 1
        else:
            prefill += n
            context += start
    touched = experts.touched(prefill + decode + verified) if experts is not None else 0.0
    return StepShape(prefill, pairs, decode, touched, context, verified)


def add_chunk(shape: StepShape, start: int, n: int, experts: ExpertShape | None = None
              ) -> StepShape:
    """`shape` with one more prefill chunk."""
    tokens = shape.prefill_tokens + n
    touched = experts.touched(tokens + shape.decode_seqs + shape.verified_positions) \
        if experts is not None else 0.0
    return StepShape(tokens, shape.attention_pairs + chunk_pairs(start, n), shape.decode_seqs,
                     touched, shape.prefill_context + start, shape.verified_positions)


@dataclass(frozen=True)
class Coefficients:
    """Seconds per unit of each feature (natural units: s, s/token, s/pair, s/seq, s,
    s per cached token a prefill chunk reads)."""
    overhead_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_decode_s: float = 0.0
    per_expert_s: float = 0.0
    per_context_s: float = 0.0
    per_verified_s: float = 0.0

    def as_tuple(self) -> tuple[float, ...]:
        return (self.overhead_s, self.per_token_s, self.per_pair_s, self.per_decode_s,
                self.per_expert_s, self.per_context_s, self.per_verified_s)

    @classmethod
    def from_scaled(cls, theta: Sequence[float]) -> Coefficients:
        return cls(*(t * s for t, s in zip(theta, _SCALE)))

    def scaled(self) -> tuple[float, ...]:
        return tuple(c / s for c, s in zip(self.as_tuple(), _SCALE))

    def predict(self, shape: StepShape) -> float:
        """Seconds; a negative fitted term counts as 0, so more work never predicts less."""
        return sum(max(c, 0.0) * x for c, x in zip(self.as_tuple(), shape.raw()))

    def prefill_seconds(self, tokens: int, start: int = 0, chunk: int = 0) -> float:
        """A lone prompt's remaining prefill: `tokens` new after `start`, in steps of
        `chunk` tokens (0 = one step). Attention pairs do not depend on the chunking."""
        if tokens <= 0:
            return 0.0
        steps = 1 if chunk <= 0 else -(-tokens // chunk)
        c = [max(v, 0.0) for v in self.as_tuple()]
        # step k starts at start + k·chunk: the cached context the chunks read
        context = steps * start + (chunk * steps * (steps - 1) // 2 if steps > 1 else 0)
        return (steps * (c[0] + c[4]) + c[1] * tokens + c[2] * chunk_pairs(start, tokens)
                + c[5] * context)


def max_chunk(coef: Coefficients, base: StepShape, start: int, remaining: int,
              budget_s: float, experts: ExpertShape | None = None) -> int:
    """The largest n ≤ remaining such that the step `base` + a chunk of n tokens after
    `start` is predicted to take at most `budget_s` (0 when not even one token fits).

    Closed form first: without the experts term the chunk's cost is quadratic in n,
    c1·n + c2·(n·start + n(n+1)/2), so n0 solves it; the experts term only adds, so the answer
    is ≤ n0 and a binary search below n0 settles it when that term matters (a small batch).
    Every step calls this once per queued prompt: the search alone cost ~100 µs a call."""
    if remaining <= 0:
        return 0
    c = coef.as_tuple()
    c1, c2 = max(c[1], 0.0), max(c[2], 0.0)
    room = budget_s - coef.predict(base) - max(c[5], 0.0) * start   # the chunk's fixed read
    if room <= 0:
        return 0
    a, b = c2 / 2, c1 + c2 * (start + 0.5)
    if a > 0:
        n0 = (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
    else:
        n0 = room / b if b > 0 else float(remaining)
    n = int(min(max(n0, 0.0), remaining))

    def fits(k: int) -> bool:
        return coef.predict(add_chunk(base, start, k, experts)) <= budget_s

    while n < remaining and fits(n + 1):          # float rounding left one out
        n += 1
    if n > 0 and not fits(n):                     # the experts term: search below n0
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        n = lo
    return n


# ---- least squares with forgetting (pure) --------------------------------------------------

Matrix = tuple[tuple[float, ...], ...]
_RIDGE = 1e-3        # pull toward the last fit, in units of one step's information


def ewls_update(a: Matrix, b: Sequence[float], x: Sequence[float], y: float, lam: float
                ) -> tuple[Matrix, tuple[float, ...]]:
    """The exponentially weighted sufficient statistics after one row: A' = lam·A + x xᵀ,
    b' = lam·b + x y (the same estimator recursive least squares with forgetting tracks)."""
    n = len(x)
    return (tuple(tuple(lam * a[i][j] + x[i] * x[j] for j in range(n)) for i in range(n)),
            tuple(lam * b[i] + x[i] * y for i in range(n)))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    m = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out


def solve_nonneg(a: Matrix, b: Sequence[float], prior: Sequence[float],
                 ridge: float = _RIDGE) -> tuple[float, ...]:
    """argmin over θ ≥ 0 of θᵀAθ − 2bᵀθ + ridge·|θ − prior|²: the weighted fit, held at the
    prior (the last fit) in directions no recent step informs — so a feature unseen for an
    hour neither drifts nor winds up — and no term of a step costs negative time. Active set:
    a coefficient that solves negative is fixed at 0 and the rest re-solved (≤ n rounds)."""
    n = len(b)
    free = list(range(n))
    theta = [0.0] * n
    for _ in range(n):
        m = [[a[i][j] + (ridge if i == j else 0.0) for j in free] for i in free]
        v = [b[i] + ridge * max(prior[i], 0.0) for i in free]
        sol = _solve(m, v)
        if sol is None:
            return tuple(max(p, 0.0) for p in prior)
        theta = [0.0] * n
        for i, t in zip(free, sol):
            theta[i] = t
        neg = [i for i in free if theta[i] < 0]
        if not neg:
            break
        free = [i for i in free if i not in neg]
    return tuple(max(t, 0.0) for t in theta)


HUBER_K = 0.5       # relative error past which a step's weight falls off as K / error


def huber_weight(rel_err: float, k: float = HUBER_K) -> float:
    """A step's weight in the fit: 1 within `k` relative error, k / error beyond. A step
    slowed 4x by another process on the cores (measured on this 2-core machine: 200-token
    steps at 0.5 s instead of 0.13 s) then moves the fit an eighth as much as a full row, and
    it still follows a real change (every row keeps some weight, the rows agree)."""
    return 1.0 if rel_err <= k else k / rel_err


def quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


SOLVE_EVERY = 4     # steps between refits when nobody reads the fit (see CostModel)


class CostModel:
    """The fitted model one engine keeps: feed `observe(shape, seconds)` after each step.

    `ready` once `min_samples` steps were seen (until then the scheduler budgets in tokens).
    Prediction error is |predicted − actual| / actual of each step, predicted *before* that
    step updated the fit, over the last `window` steps.

    Every step updates the statistics; the fit itself (a small active-set solve in Python,
    ~35 us warm and ~150 us right after a decode step has flushed the caches) is redone when
    `coefficients` is read, or every SOLVE_EVERY steps: a scheduler that budgets by the model
    reads it each step and sees every step in it; without one (the token policy), observe's
    own error and Huber weight use a fit at most SOLVE_EVERY - 1 steps old."""

    def __init__(self, forgetting: float = 0.995, min_samples: int = 8, window: int = 1024,
                 prior: Coefficients | None = None) -> None:
        if not 0.5 <= forgetting <= 1.0:
            raise ValueError("forgetting must be in [0.5, 1]")
        self.forgetting = forgetting
        self.min_samples = min_samples
        n = len(FEATURES)
        self._a: Matrix = tuple(tuple(0.0 for _ in range(n)) for _ in range(n))
        self._b: tuple[float, ...] = (0.0,) * n
        self._theta = prior.scaled() if prior is not None else (0.0,) * n
        self.samples = 0
        self._errors: deque[float] = deque(maxlen=window)
        self._fit = Coefficients.from_scaled(self._theta)
        self._unsolved = 0          # steps observed since the last solve

    @property
    def ready(self) -> bool:
        return self.samples >= self.min_samples

    @property
    def coefficients(self) -> Coefficients:
        """The fit of every step observed so far."""
        if self._unsolved:
            self._solve()
        return self._fit

    def _solve(self) -> None:
        self._theta = solve_nonneg(self._a, self._b, self._theta)
        self._fit = Coefficients.from_scaled(self._theta)
        self._unsolved = 0

    def predict(self, shape: StepShape) -> float:
        return self.coefficients.predict(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        w, d = 1.0, seconds
        if self.ready:
            pred = self._fit.predict(shape)
            err = abs(pred - seconds) / seconds
            self._errors.append(err)
            w = huber_weight(err)
            if pred > 0:
                # relative to √(predicted·measured): ≈ the log error, which is symmetric —
                # dividing by the measured time alone biases the fit ~10% low on noisy steps
                d = math.sqrt(pred * seconds)
        # relative error (row / time), a robust (Huber) weight once fitted
        r = math.sqrt(w) / d
        x = [v * r for v in shape.features()]
        self._a, self._b = ewls_update(self._a, self._b, x, seconds * r, self.forgetting)
        self.samples += 1
        self._unsolved += 1
        if self._unsolved >= SOLVE_EVERY or not self.ready:
            self._solve()

    def reset_errors(self) -> None:
        """Start the error window afresh (e.g. after calibration, for a benchmark's run)."""
        self._errors.clear()

    def error_quantiles(self) -> tuple[float, float]:
        """(median, p90) of the recent relative prediction errors (0, 0 before any)."""
        errs = list(self._errors)
        return quantile(errs, 0.5), quantile(errs, 0.9)


# ---- what a node advertises, and the predictions made from it -------------------------------

def bucket_of(edges: Sequence[int], tokens: int) -> int:
    """Index of the length bucket of a prompt: edges (512, 4096, 32768) make 4 buckets,
    ≤512, ≤4096, ≤32768, more."""
    return bisect.bisect_left(edges, tokens)


@dataclass(frozen=True)
class AdvertisedCost:
    """A node's prefill cost state: its fitted coefficients and the prompt work queued per
    length bucket (tokens still to compute, and requests). `prefill_share` is the share of
    a step's time prefill gets (1 on a prefill node; ITL budget minus decodes on colocated);
    `chunk_tokens` its typical chunk (steps = tokens / chunk pay the overhead)."""
    coefficients: Coefficients
    bucket_edges: tuple[int, ...]
    queued_tokens: tuple[int, ...]
    queued_requests: tuple[int, ...]
    prefill_share: float = 1.0
    chunk_tokens: int = 0

    def bucket(self, tokens: int) -> int:
        return bucket_of(self.bucket_edges, tokens)


def queued_seconds(adv: AdvertisedCost, upto_bucket: int) -> float:
    """Predicted prefill time of the work queued in buckets 0..upto_bucket (they run before a
    new prompt of that bucket: shorter buckets first). A bucket's tokens are taken as
    requests of its mean length (their attention pairs follow from that)."""
    total = 0.0
    for b in range(min(upto_bucket + 1, len(adv.queued_tokens))):
        toks, reqs = adv.queued_tokens[b], max(adv.queued_requests[b], 1)
        if toks <= 0:
            continue
        each = toks / reqs
        total += reqs * adv.coefficients.prefill_seconds(int(math.ceil(each)), 0,
                                                         adv.chunk_tokens)
    return total


def predict_ttft(adv: AdvertisedCost, prompt_tokens: int) -> float:
    """Seconds until a new prompt of this length would have its first token on the node:
    the queued work of its bucket and the shorter ones, then its own prefill, at the share
    of each step that prefill gets."""
    own = adv.coefficients.prefill_seconds(prompt_tokens, 0, adv.chunk_tokens)
    share = min(max(adv.prefill_share, 0.05), 1.0)
    return (queued_seconds(adv, adv.bucket(prompt_tokens)) + own) / share
