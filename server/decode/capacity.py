"""How many real-time streams the decode lanes carry, from what their engine calls cost.

Pure: no asyncio, no MLX. The pipeline feeds it every engine call the lanes make; the app
asks it how many streams to admit.

**Cost model.** One engine call on ``n`` windows holding ``S`` seconds of audio in all is
taken to cost

    cost_s = fixed_s + per_window_s * n + per_audio_s * S

``fixed_s`` is what a call costs whatever it holds (one decode loop, as long as its longest
row, shared by all rows), ``per_window_s`` what each window adds (its encoder pass at the
minimum context, its prompt), ``per_audio_s`` what each second of audio adds (longer
contexts, more tokens). The three are fitted by least squares with non-negative coefficients
over the recent calls (``fit_cost``): a cost cannot shrink with more work, and non-negative
terms cannot cancel each other into a wild extrapolation. When the calls seen cannot tell two
terms apart (every call the same size: fixed and per-window cost are the same column), the fit
leaves out the fixed term, so more streams are predicted to cost in proportion: the cautious
side.

The history is kept per batch size, the last ``calls_per_size`` calls of each
(``CapacityModel``): the costs of large batches, seen only under load, must not be pushed out
by thousands of single-window calls when the load is gone, or the model would forget what
batching buys.

**Capacity.** A stream that keeps up is decoded once per round: its next window is queued as
soon as its last result is back. With ``N`` streams, a round is ``N`` windows of the typical
length (the median of the recent windows), in engine calls of at most ``max_batch_size``
(the scheduler batches more as the round fills the lanes, ``batch_size``), or one call a
window where batches do not pay on this machine (``planned_batch_size``: a CPU). The lanes take
those calls from one queue, side by side (each is a core of its own, and its calls are timed
as they ran, next to the others), so the round is shared among them. The capacity is the
largest ``N`` whose round fits in ``lanes * hop_s * admission_utilization``: ``hop_s`` is the
wait between two decodes of a stream that the cadence plans for at light load,
``admission_utilization`` how much of it (or how many of it: **Three budgets**) the admitted
streams' round may take. Counted lane by lane instead (each lane ``ceil(N / lanes)``
windows), the estimate moved in steps of the lane count: on two lanes, calls a few percent
dearer took it from 4 to 2, and refused the third stream of a machine that carries four.

**Three budgets.** ``utilization`` is the share of the hop a lane may plan to be busy at the
load it has (the rest absorbs bursts, loop-guard retries and other work on the same cores):
the scheduler's cadence (``stream_hop_s``) and batches (``batch_size``) keep within it.
Admission has a budget of its own (``admission_utilization``), and so has the line past
which the lanes are short of time (``comfort_utilization``); each gives a published estimate
(``streams``, ``comfortable_streams``). What limits the streams a machine carries is the
latency of their finals, and that is not the round of one window per stream per hop: as
streams are added, the cadence stretches every stream's hop (each decode then holds more new
audio), and eight streams on a 2-core CPU, whose round is 1.3-1.6 hops, still have their
finals within 2 s (bench-capacity). So the admission budget may pass the hop
(``server.config.ADMISSION_UTILIZATION``). Within the comfortable estimate, the lanes have
time for what a stream's latency can spare: closing decodes asked as beam searches run as
beam searches, and words settle with the full context; past it, closings are greedy and
words settle sooner (``Pipeline.past_comfort``). One budget for both made a choice between
refusing streams the machine carries and giving beam closings to streams that cannot afford
them: a budget low enough for beam closings refused half the streams the machine carries.

**What a real-time stream costs, not whatever calls happened.** Three things kept a burst of
clients sending faster than real time (``whisperwire stream --pace 0``) from being taken for
what a stream costs; before them, four such clients on a 2-core CPU moved the estimate from
8 to 2, and the next four real-time clients found two of them refused:

- *Catch-up is backlog.* A window decoded while its stream holds more audio than it (sent
  ahead of real time: a file at pace 0, a reconnect's replay; ``DecodeJob.catch_up_s``) is
  a whole stretch of speech at once, up to the window's cap, where a stream that keeps up
  decodes a window growing by a hop at a time: the median window went from 3-4 s to 5.4 s.
  Its call is timed while the server ingests, segments and computes features for audio at
  many times real time on the same cores (the same windows cost 1.4-1.7 times what they do
  at 1x). Such calls are counted (``catch_up_calls``), not fitted, and their windows are
  not typical.
- *Hysteresis.* Each published estimate (``HeldEstimate``) follows the fit's
  (``measured_streams``) one stream at a time, and only after ``settle_calls`` fitted calls
  in a row said it should: the seeds are rescaled to the level of the clients' calls
  (``seed_scale``), so a handful of calls would otherwise replace the whole estimate.
- *A floor and a ceiling from this machine* (``bound_by_calibration``,
  ``calibrated_bounds``): the startup calibration's own figure is the ceiling and
  ``FLOOR_SHARE`` of it the floor; an operator who measured the machine
  (``make bench-capacity``) pins the admission estimate with ``--capacity``
  (``set_bounds``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from server.config import MAX_ADMISSION_UTILIZATION

# Columns of the design matrix, in this order: windows, audio seconds, 1 (the fixed cost).
# Subsets are tried with the per-window term first: when two subsets fit equally well (the
# data cannot tell them apart), the first one wins, and attributing cost to windows rather
# than to the call is the cautious extrapolation to more streams.
_SUBSETS = ((0, 1, 2), (0, 1), (0, 2), (0,), (1, 2), (1,), (2,))
# Relative difference under which two predicted latencies are the same (CapacityModel.batch_size).
_TIE = 1e-9
# Least squares lands exact zeros a few ulps below 0; those are zeros, not negative costs.
_NEGATIVE_TOLERANCE = 1e-12
# A window whose stream holds more than this beyond it, received ahead of real time, is
# catch-up. A stream that keeps up holds at most the end-of-speech silence (up to 1 s after
# short speech, VadConfig.short_speech_end_silence_ms) past its closing decode, and the
# jitter of 100 ms frames; a reconnect replays seconds, a file at pace 0 all of itself.
CATCH_UP_S = 1.5
# Streams' windows are batched only where the calibration's batch cost less than this share
# of its windows decoded one by one (``CapacityModel.seed_batch``). A batch's first window
# waits for the whole call, and the cadence gains only what batching saves: by
# ``batch_size``'s own arithmetic a batch of two wins, on two lanes, only where it costs
# under 0.78 (four streams) to 0.86 (eight) of its windows alone. On a 2-core CPU a batch
# of two cost 1.07-1.12 times its two windows alone (four: 0.89), on a GPU about half.
BATCH_WORTH_SHARE = 0.9
# Windows alone that took less than this in all say nothing about batching: the timing is
# then scheduling noise (tiny.en's 4 s window takes tens of milliseconds on a GPU, hundreds
# on a CPU).
BATCH_VERDICT_MIN_S = 0.005
# The floor is this share of the calibration's estimate (CapacityModel.calibrated_bounds).
# Real-time streams' calls cost less than the speech seeds predict, so their fit says more
# streams than the seeds, not fewer (tests/capacity_calls.json holds such calls); a fit that
# says less than half the seeds' figure is taken for calls the server was disturbed in
# (another process on the cores, a stall), not for what the machine carries.
FLOOR_SHARE = 0.5


@dataclass(frozen=True)
class BatchCost:
    """One engine call as a decode lane timed it."""

    windows: int
    audio_s: float  # audio in all its windows, seconds
    cost_s: float  # wall time of the call

    def __post_init__(self) -> None:
        if self.windows < 1:
            raise ValueError(f"windows must be >= 1; got {self.windows}")
        if self.audio_s < 0 or self.cost_s < 0:
            raise ValueError("audio_s and cost_s must be >= 0")


@dataclass(frozen=True)
class CostFit:
    """``cost_s = fixed_s + per_window_s * windows + per_audio_s * audio_s`` (all >= 0)."""

    fixed_s: float
    per_window_s: float
    per_audio_s: float

    def batch_s(self, windows: int, audio_s: float) -> float:
        """Predicted wall time of one engine call."""
        return self.fixed_s + self.per_window_s * windows + self.per_audio_s * audio_s

    def round_s(self, streams: int, window_s: float, max_batch_size: int) -> float:
        """Predicted time to decode one window of ``window_s`` for each of ``streams``
        streams, in full batches of ``max_batch_size`` and one partial batch."""
        full, rest = divmod(streams, max_batch_size)
        cost = full * self.batch_s(max_batch_size, max_batch_size * window_s)
        if rest:
            cost += self.batch_s(rest, rest * window_s)
        return cost


def fit_cost(observations: Sequence[BatchCost]) -> CostFit | None:
    """Non-negative least squares fit of the cost model; None without observations.

    Non-negative least squares with three unknowns is solved exactly by trying every subset
    of the terms: the optimum is the unconstrained least-squares solution on its own support,
    so it is the best-fitting subset whose solution has no negative coefficient. Subsets the
    data cannot determine (a rank-deficient design) are skipped.
    """
    if not observations:
        return None
    design = np.array([(o.windows, o.audio_s, 1.0) for o in observations], dtype=np.float64)
    costs = np.array([o.cost_s for o in observations], dtype=np.float64)
    tolerance = 1e-12 * float(costs @ costs) + 1e-18
    best: tuple[float, tuple[int, ...], np.ndarray] | None = None
    for subset in _SUBSETS:
        columns = design[:, subset]
        coefficients, _, rank, _ = np.linalg.lstsq(columns, costs, rcond=None)
        if rank < len(subset) or np.any(coefficients < -_NEGATIVE_TOLERANCE):
            continue
        coefficients = np.maximum(coefficients, 0.0)
        residual = float(np.sum((columns @ coefficients - costs) ** 2))
        if best is None or residual < best[0] - tolerance:
            best = (residual, subset, coefficients)
    # The windows column alone always qualifies: rank 1 (windows >= 1), coefficient >= 0.
    assert best is not None
    full = [0.0, 0.0, 0.0]
    for column, value in zip(best[1], best[2], strict=True):
        full[column] = float(value)
    return CostFit(fixed_s=full[2], per_window_s=full[0], per_audio_s=full[1])


def streams_within(
    fit: CostFit,
    budget_s: float,
    window_s: float,
    max_batch_size: int,
    limit: int,
    lanes: int = 1,
) -> int:
    """The largest ``N`` in ``[0, limit]`` whose round fits: one window of ``window_s`` for
    each of ``N`` streams, in engine calls of at most ``max_batch_size`` (``CostFit.round_s``),
    shared by ``lanes`` lanes that take their calls from one queue, within ``budget_s`` of
    each lane's time: ``round_s <= lanes * budget_s``. The round's cost only grows with
    ``N`` (non-negative terms), so this is a bisection."""

    def fits(streams: int) -> bool:
        return fit.round_s(streams, window_s, max_batch_size) <= lanes * budget_s

    if fits(limit):
        return limit
    low, high = 0, limit  # fits(low) (0 streams cost nothing), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


class HeldEstimate:
    """A published stream count of ``CapacityModel``: one for admission, one for the line past
    which the lanes are short of time. It follows the measured figure for its own budget
    (``utilization``: how much of the hop its streams' round may take) one stream at a time,
    after ``settle_calls`` fitted calls in a row pointed the same way, within a floor and a
    ceiling."""

    def __init__(self, utilization: float) -> None:
        self.utilization = utilization
        self.floor: int | None = None  # set_bounds; None: 1
        self.ceiling: int | None = None  # set_bounds; None: no ceiling but the caller's limit
        self.bounds_source = "none"  # where the bounds came from, for /readyz
        self.held: int | None = None  # the published figure, once anything was measured
        # Fitted calls in a row whose measured figure was above (+) or below (-) the held one.
        self._pressure = 0

    @property
    def pinned(self) -> bool:
        return self.floor is not None and self.floor == self.ceiling

    def published(self, limit: int) -> int:
        """Between 1 and ``limit``; ``limit`` while nothing has been measured."""
        if self.held is None:
            return limit
        return max(1, min(limit, self.held))

    def set_bounds(self, floor: int, ceiling: int, source: str) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling; got {floor}, {ceiling}")
        self.floor, self.ceiling, self.bounds_source = floor, ceiling, source
        if self.held is not None or floor == ceiling:
            self.held = self.bounded(self.held if self.held is not None else ceiling)

    def bounded(self, streams: int) -> int:
        if self.ceiling is not None:
            streams = min(streams, self.ceiling)
        return max(streams, self.floor or 1)

    def restart(self, measured: int) -> None:
        """The calibration changed the model: start again from the measured figure."""
        self.held = self.bounded(measured)
        self._pressure = 0

    def follow(self, measured: int, settle_calls: int) -> None:
        """One fitted call: move one stream toward ``measured`` once ``settle_calls`` calls in
        a row pointed the same way."""
        target = self.bounded(measured)
        if self.held is None:
            self.held = target
            return
        if target == self.held:
            self._pressure = 0
            return
        step = 1 if target > self.held else -1
        self._pressure = self._pressure + step if self._pressure * step >= 0 else step
        if abs(self._pressure) >= settle_calls:
            self.held += step
            self._pressure = 0

    def describe_bounds(self, limit: int) -> str:
        if self.pinned:
            return f"pinned at {self.floor} by {self.bounds_source}"
        return f"held within {self.floor or 1}-{self.ceiling or limit} ({self.bounds_source})"


class CapacityModel:
    """The recent engine calls, the cost fitted to them, and the stream count it implies.

    ``seed`` takes calls timed at startup on the calibration's speech, ``observe`` the calls
    the lanes run for clients. The seeds ran on one lane while the others idled, the clients'
    calls run next to the other lanes and the ingest of every stream, so the seeds are
    trusted for the shape of the cost (what batching buys) and the clients' calls for its
    level: the seeds stay in the fit as a prior, scaled by how much dearer the clients' calls
    were than the seeds predicted. A few seeds weigh little once a batch size has
    ``calls_per_size`` calls measured, but they keep the fit determined while the clients'
    calls alone cannot tell its terms apart (one call, or all of one size).

    ``observe`` counts a call holding a catch-up window as backlog (``catch_up_calls``) and
    fits the others. Two published estimates follow the fit (``HeldEstimate``): ``admission``
    (``streams``: how many streams to admit) and ``comfort`` (``comfortable_streams``: how many
    the lanes carry with time to spare for beam closings). Not thread-safe: the event loop
    owns it.
    """

    def __init__(
        self,
        *,
        hop_s: float,
        utilization: float,
        admission_utilization: float,
        comfort_utilization: float,
        max_batch_size: int,
        calls_per_size: int = 32,
        recent_windows: int = 256,
        default_window_s: float = 4.0,
        settle_calls: int = 16,
    ) -> None:
        if hop_s <= 0:
            raise ValueError(f"hop_s must be > 0; got {hop_s}")
        for name, share, most in (
            ("utilization", utilization, 1.0),
            ("comfort_utilization", comfort_utilization, 1.0),
            ("admission_utilization", admission_utilization, MAX_ADMISSION_UTILIZATION),
        ):
            if not 0 < share <= most:
                raise ValueError(f"{name} must be in (0, {most:g}]; got {share}")
        if comfort_utilization > admission_utilization:
            raise ValueError(
                f"comfort_utilization ({comfort_utilization}) must not exceed "
                f"admission_utilization ({admission_utilization})"
            )
        if min(max_batch_size, calls_per_size, recent_windows, settle_calls) < 1:
            raise ValueError(
                "max_batch_size, calls_per_size, recent_windows and settle_calls must be >= 1"
            )
        if default_window_s <= 0:
            raise ValueError(f"default_window_s must be > 0; got {default_window_s}")
        self.hop_s = hop_s
        self.utilization = utilization  # the cadence's: stream_hop_s, batch_size
        self.admission = HeldEstimate(admission_utilization)
        self.comfort = HeldEstimate(comfort_utilization)
        self.lanes = 1  # decode lanes working side by side (the pipeline keeps it current)
        self.max_batch_size = max_batch_size
        self.default_window_s = default_window_s  # the typical window before any client's
        self._calls_per_size = calls_per_size
        self._seeds: list[BatchCost] = []
        self._seed_fit: CostFit | None = None
        self._by_size: dict[int, deque[BatchCost]] = {}
        self._windows: deque[float] = deque(maxlen=recent_windows)
        self._fit: CostFit | None = None
        self._stale = False
        self.settle_calls = settle_calls
        self.catch_up_calls = 0  # calls counted as backlog, not fitted
        # A calibrated batch's cost over its windows' alone (seed_batch); None: not timed.
        self.batch_ratio: float | None = None

    @property
    def estimates(self) -> tuple[HeldEstimate, HeldEstimate]:
        return self.admission, self.comfort

    def budget_s(self, estimate: HeldEstimate) -> float:
        """Each lane's share of the time the round of ``estimate``'s streams may take (the
        round may take ``lanes`` times this)."""
        return self.hop_s * estimate.utilization

    @property
    def admission_budget_s(self) -> float:
        return self.budget_s(self.admission)

    def seed(self, window_audio_s: Sequence[float], cost_s: float) -> None:
        """A call timed by the startup calibration: it informs the cost, not the typical
        window. The published estimates start from the seeds' (``measured_streams``)."""
        self._seeds.append(_call(window_audio_s, cost_s))
        self._seed_fit = fit_cost(self._seeds)
        self._restart()

    def seed_batch(self, alone_s: Sequence[float], together_s: float) -> None:
        """The calibration's batch (``together_s``) against its own windows decoded one by
        one (``alone_s``): where it saved less than ``1 - BATCH_WORTH_SHARE`` of their time,
        streams' windows are not batched (``planned_batch_size``), and the estimate's round
        is one call per stream. No verdict from windows under ``BATCH_VERDICT_MIN_S``."""
        if len(alone_s) < 2 or min(alone_s) <= 0 or together_s <= 0:
            raise ValueError("need two or more windows timed alone and a batch, all > 0 s")
        if sum(alone_s) < BATCH_VERDICT_MIN_S:
            return
        self.batch_ratio = together_s / sum(alone_s)
        self._restart()

    def _restart(self) -> None:
        """The calibration changed the model: the published estimates start again from the
        measured ones."""
        self._stale = True
        for estimate in self.estimates:
            estimate.restart(self.measured_streams(estimate=estimate))

    @property
    def planned_batch_size(self) -> int:
        """The largest batch of streams' windows this machine is worth: ``max_batch_size``,
        or 1 where the calibration's batch did not pay (``seed_batch``)."""
        if self.batch_ratio is not None and self.batch_ratio >= BATCH_WORTH_SHARE:
            return 1
        return self.max_batch_size

    def observe(
        self,
        window_audio_s: Sequence[float],
        cost_s: float,
        catch_up_s: Sequence[float] = (),
    ) -> bool:
        """A call a lane ran for clients, every window decoded by the one call;
        ``catch_up_s``: for each window, what its stream held beyond it that arrived ahead of
        real time (``DecodeJob.catch_up_s``; none given: all 0). Returns False for a call
        counted as backlog (a window over ``CATCH_UP_S``), True for one fitted."""
        call = _call(window_audio_s, cost_s)
        if catch_up_s and len(catch_up_s) != call.windows:
            raise ValueError(f"{len(catch_up_s)} catch_up_s for {call.windows} windows")
        if any(behind > CATCH_UP_S for behind in catch_up_s):
            self.catch_up_calls += 1
            return False
        if call.windows not in self._by_size:
            self._by_size[call.windows] = deque(maxlen=self._calls_per_size)
        self._by_size[call.windows].append(call)
        self._windows.extend(window_audio_s)
        self._stale = True
        for estimate in self.estimates:
            estimate.follow(self.measured_streams(estimate=estimate), self.settle_calls)
        return True

    def set_bounds(self, floor: int, ceiling: int, source: str) -> None:
        """Hold the admission estimate within ``[floor, ceiling]`` from now on (``source``
        says where they came from: an operator's ``--capacity``, a test)."""
        self.admission.set_bounds(floor, ceiling, source)

    def bound_by_calibration(self) -> None:
        """Bound each estimate that has no bounds yet (``--capacity`` set the admission
        estimate's) by the seeds' figure for its budget (``calibrated_bounds``)."""
        for estimate in self.estimates:
            bounds = self.calibrated_bounds(estimate)
            if bounds is not None and estimate.floor is None:
                estimate.set_bounds(*bounds, "startup calibration")

    def calibrated_bounds(self, estimate: HeldEstimate | None = None) -> tuple[int, int] | None:
        """The floor and ceiling the seeds alone imply for ``estimate`` (the admission one
        by default), each at least 1 (a window that alone overruns the budget is still
        served, late, as ``measured_streams`` says); None before any seed.

        The ceiling is the seeds' estimate: they decode speech as a stream's window holds it
        (``server.decode.calibration``), and the admission budget was set so that this figure
        is what the machine carries at final p95 <= 2 s
        (``server.config.ADMISSION_UTILIZATION``). The clients' calls may cost less (a
        re-decode guided by its previous result's tokens, speech slower than a reader's: the
        calls of eight real-time streams of bench-capacity's recordings fit 10 streams on
        tiny.en, 2-core CPU, where the seeds say 8, what ``make bench-capacity`` sustains
        there); the budget was
        set against the seeds' figure, so the estimate follows the clients' calls down from
        it, not above it. The floor is ``FLOOR_SHARE`` of the ceiling.
        """
        if self._seed_fit is None:
            return None
        estimate = estimate or self.admission
        window_s = self.default_window_s
        ceiling = max(1, self._streams_of(self._seed_fit, window_s, _UNBOUNDED, estimate))
        return max(1, math.floor(ceiling * FLOOR_SHARE)), ceiling

    @property
    def seed_scale(self) -> float:
        """How much dearer the clients' calls were than the seeds predicted (median ratio);
        1 before either exists."""
        if self._seed_fit is None:
            return 1.0
        seed_fit = self._seed_fit
        ratios = [
            call.cost_s / predicted
            for calls in self._by_size.values()
            for call in calls
            if (predicted := seed_fit.batch_s(call.windows, call.audio_s)) > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    @property
    def fit(self) -> CostFit | None:
        """The cost model fitted to the calls so far; None before the first."""
        if self._stale:
            measured = list(itertools.chain.from_iterable(self._by_size.values()))
            scale = self.seed_scale
            prior = [BatchCost(s.windows, s.audio_s, s.cost_s * scale) for s in self._seeds]
            self._fit = fit_cost(measured + prior)
            self._stale = False
        return self._fit

    @property
    def typical_window_s(self) -> float:
        """Median audio of the recent clients' windows (``default_window_s`` before any)."""
        return statistics.median(self._windows) if self._windows else self.default_window_s

    def streams(self, limit: int) -> int:
        """The admission estimate: real-time streams to admit, between 1 and ``limit``;
        ``limit`` while nothing has been measured (and no ``--capacity`` was given)."""
        return self.admission.published(limit)

    def comfortable_streams(self, limit: int) -> int:
        """The streams the lanes carry with time to spare (``comfort_utilization``), never
        more than are admitted; ``limit`` while nothing has been measured."""
        return min(self.comfort.published(limit), self.streams(limit))

    def measured_streams(self, limit: int = 1 << 16, estimate: HeldEstimate | None = None) -> int:
        """Streams whose rounds the lanes keep within ``estimate``'s budget (the admission
        one by default) by the fit as it stands, between 1 and ``limit``; ``limit`` while
        nothing has been measured.

        Never below 1: a machine too slow to keep even one stream within the hop still serves
        one, late, rather than refusing everyone.
        """
        fit = self.fit
        if fit is None:
            return limit
        estimate = estimate or self.admission
        return max(1, self._streams_of(fit, self.typical_window_s, limit, estimate))

    def _streams_of(self, fit: CostFit, window_s: float, limit: int, estimate: HeldEstimate) -> int:
        budget_s = self.budget_s(estimate)
        return streams_within(fit, budget_s, window_s, self.planned_batch_size, limit, self.lanes)

    def batch_size(self, streams: int) -> int:
        """How many windows an engine call may take with ``streams`` streams open: the batch
        that brings a word's final soonest, as measured, up to ``planned_batch_size`` (1 where
        the calibration's batch did not pay); that size before anything was measured.

        A word is final after the decode that gives it enough audio to its right: that decode
        starts up to one hop after the audio arrived (the hop the lanes sustain with that
        batch, ``stream_hop_s``) and takes one engine call of that batch. Larger batches
        shorten the hop (a call's fixed cost is shared) and lengthen the call (every window
        waits for all of them). On a CPU, where a batch of two costs two calls or more, two
        streams taking turns on a lane beat two batched together; with the decode-time binding
        of windows (``Session.refresh_job``) the one that waited for the lane is decoded up to
        the present, so the wait delays none of its words. Where a call costs about the same
        whatever it holds (a GPU), batches win. Ties go to the larger batch: less lane time.
        """
        fit = self.fit
        if fit is None or streams < 1:
            return self.planned_batch_size
        share = -(-streams // self.lanes)
        window_s = self.typical_window_s

        def final_s(size: int) -> float:
            together = min(size, share)
            call_s = fit.batch_s(together, together * window_s)
            return fit.round_s(share, window_s, size) / self.utilization + call_s

        costs = {size: final_s(size) for size in range(1, self.planned_batch_size + 1)}
        best = min(costs.values())
        return max(size for size, cost in costs.items() if cost <= best * (1 + _TIE))

    def stream_hop_s(self, streams: int) -> float:
        """How much new audio each of ``streams`` streams should gather between two decodes
        so that the lanes stay within ``utilization``: a lane's round of its share of them,
        in batches of ``batch_size``, as measured, divided by the share of time a lane may be
        busy. 0 before anything was measured (each stream then decodes at its own pace)."""
        fit = self.fit
        if fit is None or streams < 1:
            return 0.0
        share = -(-streams // self.lanes)
        round_s = fit.round_s(share, self.typical_window_s, self.batch_size(streams))
        return round_s / self.utilization

    def explain(self, limit: int) -> str:
        """How the published estimates were derived, in a line (``/readyz``, the log)."""
        held = self.streams(limit)
        if self.fit is None and not self.admission.pinned:
            return f"capacity {held}: nothing measured yet (max_sessions)"
        comfort = self.comfort
        return (
            f"capacity {held} real-time stream(s) on {self.lanes} lane(s), "
            f"{self.admission.describe_bounds(limit)}; measured now "
            f"{self.measured_streams(limit)}; beam closings within "
            f"{self.comfortable_streams(limit)} stream(s), {comfort.describe_bounds(limit)}, "
            f"measured now {self.measured_streams(limit, comfort)}: {self.describe()}; "
            f"{self.catch_up_calls} catch-up call(s) counted as backlog; {self._batching()}"
        )

    def _batching(self) -> str:
        if self.batch_ratio is None:
            return f"batches of up to {self.max_batch_size}"
        worth = f"the calibration's batch cost {self.batch_ratio:.2f} of its windows alone"
        if self.planned_batch_size == 1:
            return f"no batches ({worth})"
        return f"batches of up to {self.max_batch_size} ({worth})"

    def describe(self) -> str:
        """One line for the log: the fit and what it implies."""
        fit = self.fit
        if fit is None:
            return "no engine calls measured yet"
        window_s = self.typical_window_s
        return (
            f"{fit.fixed_s * 1000:.0f} ms + {fit.per_window_s * 1000:.0f} ms/window + "
            f"{fit.per_audio_s * 1000:.0f} ms/audio s; one {window_s:.1f} s window "
            f"{fit.batch_s(1, window_s) * 1000:.0f} ms; admission round budget "
            f"{self.admission_budget_s * 1000:.0f} ms ({self.admission.utilization:g} of the "
            f"{self.hop_s:g} s hop; beam closings within {self.comfort.utilization:g}, the "
            f"cadence plans {self.utilization:g})"
        )


_UNBOUNDED = 1 << 16  # a stream count no machine reaches: "no limit" for streams_within


def _call(window_audio_s: Sequence[float], cost_s: float) -> BatchCost:
    if not window_audio_s:
        raise ValueError("an engine call holds at least one window")
    if not math.isfinite(cost_s):
        raise ValueError(f"cost_s must be finite; got {cost_s}")
    return BatchCost(len(window_audio_s), float(sum(window_audio_s)), cost_s)
