"""Server metrics: counters, gauges and histograms rendered in Prometheus text format (0.0.4).

Every update happens on the event loop thread (the decode lanes hand their timings back to the
loop with their results), so nothing here takes a lock. ``Metrics`` holds one instance of each
metric the server exports; ``Metrics.render()`` is what ``GET /metrics`` returns.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Decode calls take tens of milliseconds on a GPU and seconds on a busy CPU.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    # repr: the shortest text that reads back as the same float ("0.025", not 0.025000000000000001)
    return str(int(value)) if value == int(value) and abs(value) < 1e15 else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> list[str]:
        return self.header() + self.samples()


class Counter(_Metric):
    """A monotonically growing total, optionally split by labels."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text)
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def inc(self, amount: float = 1.0, *labelvalues: str) -> None:
        """Add ``amount`` (>= 0) to the series named by ``labelvalues``."""
        if amount < 0:
            raise ValueError(f"a counter only grows; got {amount}")
        if len(labelvalues) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}; got {labelvalues}")
        self._values[labelvalues] = self._values.get(labelvalues, 0.0) + amount

    def value(self, *labelvalues: str) -> float:
        """The current total of one series (0 when it was never incremented)."""
        return self._values.get(labelvalues, 0.0)

    def samples(self) -> list[str]:
        return [
            f"{self.name}{_labels(self.labelnames, key)} {_format_value(v)}"
            for key, v in sorted(self._values.items())
        ]


class Gauge(_Metric):
    """A value that goes up and down; either set directly or read from a function."""

    kind = "gauge"

    def __init__(
        self, name: str, help_text: str, function: Callable[[], float] | None = None
    ) -> None:
        super().__init__(name, help_text)
        self._value = 0.0
        self._function = function

    def set(self, value: float) -> None:
        """Set the value (ignored while a function is set)."""
        self._value = value

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount``."""
        self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        """Subtract ``amount``."""
        self._value -= amount

    def set_function(self, function: Callable[[], float] | None) -> None:
        """Read the value from ``function`` at render time (None: back to the set value)."""
        self._function = function

    @property
    def value(self) -> float:
        """The current value."""
        return self._function() if self._function is not None else self._value

    def samples(self) -> list[str]:
        return [f"{self.name} {_format_value(self.value)}"]


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets:
            raise ValueError("a histogram needs at least one bucket")
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        # bisect_left: a value equal to a bound belongs to that bucket (le = less or equal).
        self._counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) for each bucket, +Inf last."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self._counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def samples(self) -> list[str]:
        lines = [
            f'{self.name}_bucket{{le="{_format_value(bound)}"}} {n}'
            for bound, n in self.cumulative()
        ]
        lines.append(f"{self.name}_sum {_format_value(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Metrics:
    """Everything the server exports. One instance per server, shared by app and pipeline."""

    def __init__(self) -> None:
        self.ready = Gauge("whisperwire_ready", "1 once the model is loaded and warmed up")
        self.draining = Gauge(
            "whisperwire_draining",
            "1 once a shutdown began: new sessions are refused while the open ones finish",
        )
        self.sessions_active = Gauge(
            "whisperwire_sessions_active", "Streaming sessions open right now"
        )
        self.sessions_total = Counter(
            "whisperwire_sessions_total", "Streaming sessions accepted since start"
        )
        self.sessions_refused = Counter(
            "whisperwire_sessions_refused_total",
            "Connections refused, by reason (server_full: at max_sessions; capacity: at the "
            "capacity estimate; draining: shutting down; unauthorized, forbidden_origin, "
            "not_ready: loading the model or shutting down; bad_request: an OpenAI or "
            "Deepgram option refused at the handshake)",
            ("reason",),
        )
        self.audio_received_s = Counter(
            "whisperwire_audio_received_seconds_total", "Seconds of audio received from clients"
        )
        self.decode_latency_s = Histogram(
            "whisperwire_decode_latency_seconds",
            "Wall time of one batched engine call (encode and decode)",
            LATENCY_BUCKETS_S,
        )
        self.batch_size = Histogram(
            "whisperwire_decode_batch_size",
            "Windows decoded together per engine call",
            BATCH_SIZE_BUCKETS,
        )
        self.queue_depth = Gauge(
            "whisperwire_decode_queue_depth", "Windows waiting for a decode lane"
        )
        self.decode_lanes = Gauge(
            "whisperwire_decode_lanes",
            "Decode lanes able to decode now (each runs one engine call at a time, on a core)",
        )
        self.decode_s = Counter(
            "whisperwire_decode_seconds_total",
            "Wall time the decode lanes spent in the engine, summed over lanes",
        )
        self.decoded_audio_s = Counter(
            "whisperwire_decoded_audio_seconds_total",
            "Seconds of audio in decoded windows (windows overlap: audio is decoded repeatedly)",
        )
        self.realtime_factor = Gauge(
            "whisperwire_decode_realtime_factor",
            "Decode wall time over audio seconds in the window, for the last engine call",
        )
        self.stream_lag_s = Gauge(
            "whisperwire_stream_lag_seconds",
            "Largest backlog of speech received but not yet decoded, over open sessions",
        )
        self.errors = Counter(
            "whisperwire_errors_total", "Error messages sent to clients, by code", ("code",)
        )
        self.file_requests = Counter(
            "whisperwire_file_requests_total",
            "Uploaded recordings answered (POST /v1/audio/transcriptions, /v1/listen), by HTTP "
            "status",
            ("status",),
        )
        self.file_audio_s = Counter(
            "whisperwire_file_audio_seconds_total", "Seconds of uploaded audio transcribed"
        )
        self.capacity_streams = Gauge(
            "whisperwire_capacity_streams",
            "Streams the decode lanes are estimated to keep in real time (at most max_sessions)",
        )
        self.capacity_headroom_streams = Gauge(
            "whisperwire_capacity_headroom_streams",
            "Capacity estimate minus open sessions (negative: more are open, with the limit off "
            "or after the estimate fell)",
        )
        # How the estimate was derived (server.decode.capacity): it follows the measured figure
        # with hysteresis, between the floor and the ceiling.
        self.capacity_measured_streams = Gauge(
            "whisperwire_capacity_measured_streams",
            "Streams the cost fitted to the recent real-time engine calls implies now",
        )
        self.capacity_floor_streams = Gauge(
            "whisperwire_capacity_floor_streams",
            "The least the capacity estimate may say (startup calibration, or --capacity)",
        )
        self.capacity_ceiling_streams = Gauge(
            "whisperwire_capacity_ceiling_streams",
            "The most the capacity estimate may say (startup calibration, or --capacity; at "
            "most max_sessions)",
        )
        self.capacity_admission_budget_s = Gauge(
            "whisperwire_capacity_admission_budget_seconds",
            "The time a decode lane's round of its share of the admitted streams may take "
            "(--capacity-hop-s times --admission-utilization)",
        )
        self.capacity_comfortable_streams = Gauge(
            "whisperwire_capacity_comfortable_streams",
            "Streams the decode lanes carry with time to spare (--comfort-utilization): past "
            "it, closing decodes asked as a beam search run greedy",
        )
        self.capacity_window_s = Gauge(
            "whisperwire_capacity_window_seconds",
            "Typical audio of a real-time stream's window (median of the recent ones)",
        )
        self.capacity_window_cost_s = Gauge(
            "whisperwire_capacity_window_cost_seconds",
            "Fitted wall time of one engine call on one typical window",
        )
        self.capacity_catch_up_calls = Counter(
            "whisperwire_capacity_catch_up_calls_total",
            "Engine calls on windows of streams sent ahead of real time, counted as backlog "
            "and left out of the estimate",
        )
        self.decodes_superseded = Counter(
            "whisperwire_decodes_superseded_total",
            "Decodes in flight whose result was dropped: an utterance's closing decode started "
            "on a spare lane instead of waiting for them",
        )
        self.decodes_interrupted = Counter(
            "whisperwire_decodes_interrupted_total",
            "Engine calls stopped on their lane because nobody waited for their result any "
            "more: a replaced or dropped decode, a stale search, a client that left",
        )
        self.rules_fired = Counter(
            "whisperwire_stream_rules_fired_total",
            "Streaming rules that fired in finished sessions, by rule (server/core/rules.py); "
            "final:WHY counts words made final by each path",
            ("rule",),
        )
        self.beam_searches = Counter(
            "whisperwire_beam_searches_total",
            "Closing decodes run as a beam search",
        )
        self.beam_searches_made_greedy = Counter(
            "whisperwire_beam_searches_made_greedy_total",
            "Closing decodes asked as a beam search and run greedy: more streams open than "
            "the comfortable estimate (whisperwire_capacity_comfortable_streams) and the lanes "
            "leave room for",
        )

    def all(self) -> list[_Metric]:
        """Every metric, in the order they are rendered."""
        return [
            self.ready,
            self.draining,
            self.sessions_active,
            self.sessions_total,
            self.sessions_refused,
            self.audio_received_s,
            self.decode_latency_s,
            self.batch_size,
            self.queue_depth,
            self.decode_lanes,
            self.decode_s,
            self.decoded_audio_s,
            self.realtime_factor,
            self.stream_lag_s,
            self.errors,
            self.file_requests,
            self.file_audio_s,
            self.capacity_streams,
            self.capacity_headroom_streams,
            self.capacity_measured_streams,
            self.capacity_floor_streams,
            self.capacity_ceiling_streams,
            self.capacity_admission_budget_s,
            self.capacity_comfortable_streams,
            self.capacity_window_s,
            self.capacity_window_cost_s,
            self.capacity_catch_up_calls,
            self.decodes_superseded,
            self.decodes_interrupted,
            self.rules_fired,
            self.beam_searches,
            self.beam_searches_made_greedy,
        ]

    def observe_batch(self, size: int, elapsed_s: float, audio_s: float) -> None:
        """Record one engine call: ``size`` windows holding ``audio_s`` seconds in total."""
        self.batch_size.observe(size)
        self.decode_latency_s.observe(elapsed_s)
        self.decode_s.inc(elapsed_s)
        self.decoded_audio_s.inc(audio_s)
        if audio_s > 0:
            self.realtime_factor.set(elapsed_s / audio_s)

    def render(self) -> str:
        """All metrics in Prometheus text exposition format."""
        lines: list[str] = []
        for metric in self.all():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
