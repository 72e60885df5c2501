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
soon as its last result is back. With ``N`` streams on ``lanes`` lanes, each lane's round is
``ceil(N / lanes)`` windows of the typical length (the median of the recent windows), decoded
in engine calls of at most ``max_batch_size``; the lanes run their rounds side by side (each
is a core of its own, and its calls are timed as they ran, next to the others). The capacity
is the largest ``N`` whose lane round fits in ``hop_s * utilization``: ``hop_s`` is the
longest a stream may wait between two decodes, ``utilization`` the share of it a lane may plan
to be busy (the rest absorbs bursts, loop-guard retries and other work on the same cores).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Columns of the design matrix, in this order: windows, audio seconds, 1 (the fixed cost).
# Subsets are tried with the per-window term first: when two subsets fit equally well (the
# data cannot tell them apart), the first one wins, and attributing cost to windows rather
# than to the call is the cautious extrapolation to more streams.
_SUBSETS = ((0, 1, 2), (0, 1), (0, 2), (0,), (1, 2), (1,), (2,))
# Relative difference under which two predicted latencies are the same (CapacityModel.batch_size).
_TIE = 1e-9
# Least squares lands exact zeros a few ulps below 0; those are zeros, not negative costs.
_NEGATIVE_TOLERANCE = 1e-12


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
    fit: CostFit, budget_s: float, window_s: float, max_batch_size: int, limit: int
) -> int:
    """The largest ``N`` in ``[0, limit]`` whose round (``CostFit.round_s``) fits in
    ``budget_s``. The round's cost only grows with ``N`` (non-negative terms), so this is a
    bisection."""
    if fit.round_s(limit, window_s, max_batch_size) <= budget_s:
        return limit
    low, high = 0, limit  # round_s(low) fits (0 streams cost nothing), round_s(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        if fit.round_s(middle, window_s, max_batch_size) <= budget_s:
            low = middle
        else:
            high = middle
    return low


class CapacityModel:
    """The recent engine calls, the cost fitted to them, and the stream count it implies.

    ``seed`` takes calls timed at startup on synthetic windows, ``observe`` the calls the
    lanes run for clients. The synthetic windows are low-level noise, which decodes
    fewer tokens than speech (9 against 19 for a 4 s window of tiny.en), so the seeds are
    trusted for the shape of the cost (what batching buys) and the clients' calls for its
    level: the seeds stay in the fit as a prior, scaled by how much dearer the clients' calls
    were than the seeds predicted. A few seeds weigh little once a batch size has
    ``calls_per_size`` calls measured, but they keep the fit determined while the clients'
    calls alone cannot tell its terms apart (one call, or all of one size). Not thread-safe:
    the event loop owns it.
    """

    def __init__(
        self,
        *,
        hop_s: float,
        utilization: float,
        max_batch_size: int,
        calls_per_size: int = 32,
        recent_windows: int = 256,
        default_window_s: float = 4.0,
    ) -> None:
        if hop_s <= 0:
            raise ValueError(f"hop_s must be > 0; got {hop_s}")
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1]; got {utilization}")
        if max_batch_size < 1 or calls_per_size < 1 or recent_windows < 1:
            raise ValueError("max_batch_size, calls_per_size and recent_windows must be >= 1")
        if default_window_s <= 0:
            raise ValueError(f"default_window_s must be > 0; got {default_window_s}")
        self.hop_s = hop_s
        self.utilization = utilization
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

    @property
    def budget_s(self) -> float:
        """The time one round of every stream may take."""
        return self.hop_s * self.utilization

    def seed(self, window_audio_s: Sequence[float], cost_s: float) -> None:
        """A call timed on synthetic windows: it informs the cost, not the typical window."""
        self._seeds.append(_call(window_audio_s, cost_s))
        self._seed_fit = fit_cost(self._seeds)
        self._stale = True

    def observe(self, window_audio_s: Sequence[float], cost_s: float) -> None:
        """A call a lane ran for clients, every window decoded by the one call."""
        call = _call(window_audio_s, cost_s)
        if call.windows not in self._by_size:
            self._by_size[call.windows] = deque(maxlen=self._calls_per_size)
        self._by_size[call.windows].append(call)
        self._windows.extend(window_audio_s)
        self._stale = True

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
        """Streams the lanes keep within the hop, between 1 and ``limit``; ``limit`` while
        nothing has been measured.

        Never below 1: a machine too slow to keep even one stream within the hop still serves
        one, late, rather than refusing everyone.
        """
        fit = self.fit
        if fit is None:
            return limit
        per_lane = streams_within(
            fit, self.budget_s, self.typical_window_s, self.max_batch_size, limit
        )
        return max(1, min(limit, per_lane * self.lanes))

    def batch_size(self, streams: int) -> int:
        """How many windows an engine call may take with ``streams`` streams open: the batch
        that brings a word's final soonest, as measured; ``max_batch_size`` before anything
        was measured.

        A word is final after the decode that gives it enough audio to its right: that decode
        starts up to one hop after the audio arrived (the hop the lanes sustain with that
        batch, ``stream_hop_s``) and takes one engine call of that batch. Larger batches
        shorten the hop (a call's fixed cost is shared) and lengthen the call (every window
        waits for all of them). On a CPU, where a batch of two costs nearly two calls, two
        streams taking turns on a lane beat two batched together; with the decode-time binding
        of windows (``Session.refresh_job``) the one that waited for the lane is decoded up to
        the present, so the wait delays none of its words. Where a call costs about the same
        whatever it holds (a GPU), batches win. Ties go to the larger batch: less lane time.
        """
        fit = self.fit
        if fit is None or streams < 1:
            return self.max_batch_size
        share = -(-streams // self.lanes)
        window_s = self.typical_window_s

        def final_s(size: int) -> float:
            together = min(size, share)
            call_s = fit.batch_s(together, together * window_s)
            return fit.round_s(share, window_s, size) / self.utilization + call_s

        costs = {size: final_s(size) for size in range(1, self.max_batch_size + 1)}
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

    def describe(self) -> str:
        """One line for the log: the fit and what it implies."""
        fit = self.fit
        if fit is None:
            return "no engine calls measured yet"
        window_s = self.typical_window_s
        return (
            f"{fit.fixed_s * 1000:.0f} ms + {fit.per_window_s * 1000:.0f} ms/window + "
            f"{fit.per_audio_s * 1000:.0f} ms/audio s; one {window_s:.1f} s window "
            f"{fit.batch_s(1, window_s) * 1000:.0f} ms; round budget {self.budget_s * 1000:.0f} ms"
        )


def _call(window_audio_s: Sequence[float], cost_s: float) -> BatchCost:
    if not window_audio_s:
        raise ValueError("an engine call holds at least one window")
    if not math.isfinite(cost_s):
        raise ValueError(f"cost_s must be finite; got {cost_s}")
    return BatchCost(len(window_audio_s), float(sum(window_audio_s)), cost_s)
