"""Capacity sweep: N real-time clients into the real server, ours beside WhisperLive.

    python -m bench.capacity [--clients 1,2,3,4,6,8] [--seconds 60] [--no-peer]
    make bench-capacity   # BENCH_CAPACITY_ARGS="--clients 1,2 --seconds 20"

Each client streams different real speech at 1x in 100 ms frames (``bench.replay``): pieces of
the English long recordings of ``manifest_long.tsv`` cut at a pause every ``--seconds``, then
English clips of ``manifest.tsv`` joined with 1.5 s pauses, 3 s of silence after each. Each
server runs as a subprocess (``bench.server_process``), one after the other, ours with its
capacity limit off so the sweep measures past it (what its estimate said is recorded from
``/metrics``). Per N: final latency, end of speech to final, largest lag, time to first token,
WER, decode-worker busy fraction and mean batch, refused sessions, server CPU and RSS. Writes
``bench/results/capacity.json`` and ``capacity.png``; the last line printed is one JSON object
with ``max_streams_p95_final_le_2s`` and ``window_2s_ms_p50``.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
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
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus import wer
from bench.decoder import E2E_CLIP
from bench.engine import RESULTS, load_speech, speech_dir, timed, write_results
from bench.http_probe import http_get, metric_value
from bench.latency_audio import (
    Aligner,
    Float32Array,
    Stream,
    align_recording,
    clip_rows,
    long_recordings,
    speech_ends_s,
)
from bench.latency_metrics import SendLog, normalize_word, p50_p95_ms, stream_metrics
from bench.peer_whisperlive import PEER_VENV, PeerConfig, WhisperLiveAdapter, default_model_path
from bench.peer_whisperlive import server_command as peer_command
from bench.replay import Replay, TimedAdapter, WhisperwireAdapter, replay
from bench.server_process import ServerProcess, free_port, http_ok, port_open
from server.core.engine_api import DecodeRequest, Window
from server.engine.engine import Engine, EngineConfig
from server.protocol.audio import read_audio_file
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.capacity")

SUSTAINED_P95_S = 2.0  # a stream count is sustained while p95 final latency is at most this
DECODER_RESULTS = RESULTS / "decoder.json"  # bench-decoder's figures, when none is measured
PAUSE_SEARCH_S = 2.0  # a long recording is cut at the quietest 30 ms in this much before S
CUT_FRAME = 480  # 30 ms at 16 kHz


@dataclass(frozen=True)
class SweepConfig:
    """What the sweep replays and to whom."""

    counts: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    seconds: float = 60.0  # speech per client (a long recording is cut at a pause near it)
    pause_s: float = 1.5  # between joined clips
    tail_s: float = 3.0  # silence after each stream, so its last utterance ends in-stream
    peer: bool = True
    output_name: str = "capacity"  # bench/results/{output_name}.json and .png
    decode_lanes: int | None = None  # our server's --decode-lanes; None: its default (auto)
    # Ours: stream each of the largest N's streams alone too, so that every N's WER is held
    # against the same recordings streamed alone (#13's "within 1 point" target).
    alone: bool = True
    server_args: tuple[str, ...] = ()  # ours: further flags (``--speakers``)
    # A budgeted sweep (bench-gpu's): no larger N once one N is not sustained, since a larger
    # one would not be either and its run costs the most time.
    stop_after_unsustained: bool = False

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 1:
            raise ValueError("counts must be positive client counts")
        if self.seconds <= 0:
            raise ValueError("seconds must be > 0")


# --- audio ---------------------------------------------------------------------------------


def quiet_cut(audio: Float32Array, target_s: float) -> int:
    """Sample index in the quietest 30 ms of the ``PAUSE_SEARCH_S`` before ``target_s``: a
    pause, so no word is cut in two."""
    high = min(int(audio.shape[0]), round(target_s * SAMPLE_RATE_HZ))
    low = max(0, high - round(PAUSE_SEARCH_S * SAMPLE_RATE_HZ))
    frames = (high - low) // CUT_FRAME
    if frames < 1:
        return high
    energy = np.square(audio[low : low + frames * CUT_FRAME]).reshape(frames, CUT_FRAME).mean(1)
    return low + int(np.argmin(energy)) * CUT_FRAME + CUT_FRAME // 2


def piece_references(transcript: str, pieces: Sequence[Sequence[str]]) -> list[str]:
    """The reference transcript split like the audio: ``pieces`` are the offline words of
    consecutive pieces from the start of the recording.

    The reference words are aligned to the pieces' words (runs of at least two matching
    words anchor; a lone match of "the" can be anywhere). A piece's reference runs from its
    first anchor to the next piece's first anchor; the last piece's ends at its last anchor,
    since the recording goes on after it.
    """
    ref = transcript.split()
    hyp = [w for piece in pieces for w in piece]
    owner = [k for k, piece in enumerate(pieces) for _ in piece]
    matcher = difflib.SequenceMatcher(
        a=[normalize_word(w) for w in ref], b=[normalize_word(w) for w in hyp], autojunk=False
    )
    assigned: list[int | None] = [None] * len(ref)
    for block in matcher.get_matching_blocks():
        if block.size >= 2:
            for k in range(block.size):
                assigned[block.a + k] = owner[block.b + k]
    firsts = [next((i for i, a in enumerate(assigned) if a == k), None) for k in range(len(pieces))]
    out: list[str] = []
    for k, first in enumerate(firsts):
        if first is None:
            out.append("")
            continue
        if k == 0:
            first = 0  # words before the first anchor were misheard, not absent
        if k + 1 < len(pieces) and firsts[k + 1] is not None:
            end = firsts[k + 1]
        else:
            end = max(i for i, a in enumerate(assigned) if a == k) + 1
        out.append(" ".join(ref[first:end]))
    return out


def build_streams(config: SweepConfig, count: int) -> tuple[list[Stream], float | None]:
    """``count`` different streams and the 2 s window time, measured with the same engine on
    this machine now. The engine is let go before any server runs."""
    started = time.perf_counter()
    engine = Engine.load(EngineConfig())
    engine.warmup()
    window_ms = measure_window_2s_ms(engine)
    recordings = []
    for row in long_recordings():
        audio = read_audio_file(speech_dir() / row.file)
        cuts: list[tuple[int, int]] = []
        start = 0
        while len(cuts) < count and audio.shape[0] - start >= config.seconds * SAMPLE_RATE_HZ:
            end = quiet_cut(audio, start / SAMPLE_RATE_HZ + config.seconds)
            cuts.append((start, end))
            start = end
        recordings.append((row, audio, cuts))
    # Round robin over the recordings, so that a few clients already hear different voices;
    # each recording gives its first pieces, so only those are transcribed offline.
    order = [
        (r, k)
        for k in range(max((len(c) for _, _, c in recordings), default=0))
        for r, (_, _, cuts) in enumerate(recordings)
        if k < len(cuts)
    ][:count]
    pieces: dict[tuple[int, int], Stream] = {}
    tail = np.zeros(round(config.tail_s * SAMPLE_RATE_HZ), dtype=np.float32)
    for r, (row, audio, cuts) in enumerate(recordings):
        used = [(a, b) for k, (a, b) in enumerate(cuts) if (r, k) in order]
        aligned = [align_recording(engine, audio[a:b]) for a, b in used]
        refs = piece_references(row.transcript, [[w.word for w in al.words] for al in aligned])
        name = row.file.rsplit("/", 1)[-1].split(".")[0]
        for k, ((a, b), ref, al) in enumerate(zip(used, refs, aligned, strict=True)):
            audio_k = np.concatenate([audio[a:b], tail])
            pieces[r, k] = Stream(f"{name}@{a // SAMPLE_RATE_HZ}s", audio_k, ref, al.text, al.words)
    streams = [pieces[key] for key in order]
    clip_streams = count - len(streams)
    if clip_streams > 0:
        aligner = Aligner(engine)
        for k in range(clip_streams):
            # Every clip_streams-th clip from k: different clips per client.
            rows = clip_rows(config.seconds, start=k, step=clip_streams)
            streams.append(
                aligner.stream(f"clips{k}", rows, pause_s=config.pause_s, tail_s=config.tail_s)
            )
    logger.info("%d streams ready in %.1f s", len(streams), time.perf_counter() - started)
    del engine
    gc.collect()
    return streams, window_ms


def measure_window_2s_ms(engine: Engine) -> float:
    """Median ms to decode a 2 s window, as bench-decoder's ``window_2s_ms_p50`` does it
    (features, encoder, greedy tokens with word timestamps), in fewer runs."""
    audio = load_speech(E2E_CLIP)[: 2 * SAMPLE_RATE_HZ]

    def decode() -> None:
        engine.decode_windows([Window(engine.features(audio), DecodeRequest(2.0))])

    return round(statistics.median(timed(decode, repeats=5, budget_s=4.0)) * 1000.0, 1)


def window_2s_ms_p50(measured: float | None) -> tuple[float | None, str]:
    """This run's quick measurement; without one, bench-decoder's committed figure, which may
    come from another machine (its source says so)."""
    if measured is None and DECODER_RESULTS.is_file():
        data = json.loads(DECODER_RESULTS.read_text())
        return float(data["windows"]["2s"]["ours"]["p50_ms"]), str(
            DECODER_RESULTS.relative_to(RESULTS.parent.parent)
        )
    return measured, "measured by this run (5 decodes)"


# --- one stream ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamFigures:
    """What one stream saw, reduced to the sweep's figures (latencies in seconds)."""

    final_latencies_s: tuple[float, ...]  # per final: arrival - sent time of its last word
    largest_lag_s: float | None  # ours: the largest lag_s; the peer has no such field
    largest_text_lag_s: float  # audio sent - end of the latest text shown, at each message
    ttft_s: float | None
    # Per utterance: from when its last word's audio was sent to the final holding it
    # (``bench.latency_metrics``, as bench-latency measures it).
    end_of_speech_to_final_s: tuple[float, ...] = ()


def our_figures(
    messages: Sequence[tuple[float, dict[str, Any]]],
    sends: SendLog,
    ttft_s: float | None,
    end_of_speech_to_final_s: tuple[float, ...] = (),
) -> StreamFigures:
    latencies: list[float] = []
    lags: list[float] = []
    text_lags: list[float] = []
    for wall, m in messages:
        if m["type"] not in ("partial", "final"):
            continue  # speech_started and the like carry no text
        lags.append(float(m["lag_s"]))
        text_lags.append(sends.audio_sent_by(wall) - float(m["end"]))
        if m["type"] == "final" and m["text"].strip():
            end_s = float(m["words"][-1]["end"]) if m["words"] else float(m["end"])
            latencies.append(wall - sends.sent_at(end_s))
    return StreamFigures(
        tuple(latencies),
        max(lags, default=0.0),
        max(text_lags, default=0.0),
        ttft_s,
        end_of_speech_to_final_s,
    )


def peer_figures(
    messages: Sequence[tuple[float, dict[str, Any]]],
    sends: SendLog,
    ttft_s: float | None,
    end_of_speech_to_final_s: tuple[float, ...] = (),
) -> StreamFigures:
    latencies: list[float] = []
    text_lags: list[float] = []
    kept_end = -math.inf
    for wall, m in messages:
        segments = m.get("segments") or []
        if not segments:
            continue
        text_lags.append(sends.audio_sent_by(wall) - max(float(s["end"]) for s in segments))
        for s in segments:
            # A completed segment is final the first time it is seen (the adapter's rule).
            if s.get("completed") and float(s["start"]) >= kept_end:
                kept_end = float(s["end"])
                latencies.append(wall - sends.sent_at(kept_end))
    return StreamFigures(
        tuple(latencies), None, max(text_lags, default=0.0), ttft_s, end_of_speech_to_final_s
    )


# --- one server ----------------------------------------------------------------------------


def server_command() -> list[str]:
    """Our server's command: the installed ``whisperwire-server``, or the module it runs where
    the package is only on ``PYTHONPATH`` (a lent GPU machine, bench/gpu_lease.sh)."""
    script = os.path.join(sys.prefix, "bin", "whisperwire-server")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "server.serve.cli"]


class Contender:
    """One server of the sweep: how to start it and how to speak to it."""

    def __init__(
        self,
        name: str,
        peer: PeerConfig | None,
        decode_lanes: int | None = None,
        extra_args: Sequence[str] = (),
        model: str = "tiny.en",
    ) -> None:
        self.name = name
        self.peer = peer
        self.decode_lanes = decode_lanes
        self.extra_args = tuple(extra_args)  # ours: further server flags
        self.model = model  # ours: --model
        self.port = free_port()

    def process(self) -> ServerProcess:
        log = RESULTS / "logs" / f"capacity_{self.name}.log"
        if self.peer is None:
            cmd = [
                *server_command(),
                *("--port", str(self.port), "--model", self.model, "--log-level", "info"),
                "--no-capacity-limit",  # the sweep measures past the estimate
                *(() if self.decode_lanes is None else ("--decode-lanes", str(self.decode_lanes))),
                *self.extra_args,
            ]
            ready_url = f"http://127.0.0.1:{self.port}/readyz"
            return ServerProcess(self.name, cmd, ready=lambda: http_ok(ready_url), log_path=log)
        cmd, env = peer_command(self.peer, self.port)
        return ServerProcess(
            self.name,
            cmd,
            ready=lambda: port_open("127.0.0.1", self.port),
            env=env,
            log_path=log,
        )

    def adapter(self, *, warmup: bool = False) -> TimedAdapter:
        url = f"ws://127.0.0.1:{self.port}"
        if self.peer is None:
            return TimedAdapter(WhisperwireAdapter(url))
        # The warm-up only needs the peer's model loaded, not a settled transcript.
        return TimedAdapter(
            WhisperLiveAdapter(url, replace(self.peer, quiet_s=1.0) if warmup else self.peer)
        )

    def figures(self, adapter: TimedAdapter, record: Replay, stream: Stream) -> StreamFigures:
        # Time to first token and end of speech to final as bench-latency measures them: from
        # the reference's first word, and from each utterance's last.
        timeline = stream_metrics(
            stream.words,
            record.observations,
            record.sends,
            speech_ends_s=speech_ends_s(stream.audio),
        )
        reduce = our_figures if self.peer is None else peer_figures
        return reduce(
            adapter.messages, record.sends, timeline.ttft_s, timeline.end_of_speech_to_final_s
        )

    async def scrape(self) -> dict[str, float]:
        """Our server's counters that the sweep reads (empty for the peer)."""
        if self.peer is not None:
            return {}
        _, _, body = await http_get(f"http://127.0.0.1:{self.port}/metrics")
        page = body.decode()
        refused = sum(
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("whisperwire_sessions_refused_total{")
        )
        names = (
            "whisperwire_decode_seconds_total",
            "whisperwire_decode_batch_size_sum",
            "whisperwire_decode_batch_size_count",
            "whisperwire_capacity_streams",
            "whisperwire_capacity_measured_streams",
            "whisperwire_capacity_comfortable_streams",
            "whisperwire_capacity_window_seconds",
            "whisperwire_decode_lanes",
        )
        return {name: metric_value(page, name) for name in names} | {"refused": refused}


async def warm_up(who: Contender, stream: Stream) -> None:
    """One 5 s stream as fast as it goes: WhisperLive loads its model on the first client."""
    await replay(who.adapter(warmup=True), stream.audio[: 5 * SAMPLE_RATE_HZ], pace=0.0)


async def run_count(
    who: Contender, server: ServerProcess, streams: Sequence[Stream], n: int
) -> dict[str, Any]:
    """N clients at once; the figures of the run."""
    used = streams[:n]
    before = await who.scrape()
    since = time.perf_counter()
    adapters = [who.adapter() for _ in used]
    done = await asyncio.gather(
        # An overloaded server drains its backlog after the audio ends: allow for it.
        *(
            replay(a, s.audio, pace=1.0, close_timeout_s=max(120.0, 5 * s.seconds))
            for a, s in zip(adapters, used, strict=True)
        ),
        return_exceptions=True,
    )
    until = time.perf_counter()
    after = await who.scrape()
    wall_s = until - since
    entry: dict[str, Any] = {"clients": n, "wall_s": round(wall_s, 1)}
    failed = [r for r in done if isinstance(r, BaseException)]
    # Figures only after every stream ended: computing them blocks the event loop.
    kept = [
        (s, a, r) for s, a, r in zip(used, adapters, done, strict=True) if isinstance(r, Replay)
    ]
    figures = [who.figures(a, r, s) for s, a, r in kept]
    finals = [x for f in figures for x in f.final_latencies_s]
    ttft = [f.ttft_s for f in figures if f.ttft_s is not None]
    lags = [f.largest_lag_s for f in figures if f.largest_lag_s is not None]
    entry |= {
        "audio_s_per_client": round(statistics.fmean(s.seconds for s in used), 1),
        "final_latency": p50_p95_ms(finals),
        "largest_lag_s": round(max(lags), 3) if lags else None,
        "largest_text_lag_s": round(max((f.largest_text_lag_s for f in figures), default=0.0), 3),
        "ttft": p50_p95_ms(ttft),
        "end_of_speech_to_final": p50_p95_ms(
            [x for f in figures for x in f.end_of_speech_to_final_s]
        ),
        # Each utterance end, per stream in order: with a few per stream, the p95 is their
        # largest, and which utterance it was tells why.
        "end_of_speech_to_final_s_each": {
            s.name: [round(x, 3) for x in f.end_of_speech_to_final_s]
            for (s, _, _), f in zip(kept, figures, strict=True)
        },
        # Every final's latency, per stream in order: the few that make the p95, and where.
        "final_latency_s_each": {
            s.name: [round(x, 3) for x in f.final_latencies_s]
            for (s, _, _), f in zip(kept, figures, strict=True)
        },
        "wer": round(wer([s.transcript for s, _, _ in kept], [r.text for _, _, r in kept]), 4)
        if kept
        else None,
        "texts": {s.name: r.text for s, _, r in kept},
        # The offline transcription of the same audio: the WER streaming is held against.
        "offline_wer": round(wer([s.transcript for s in used], [s.offline_text for s in used]), 4),
        "failed": len(failed),
        "errors": sorted({repr(e)[:200] for e in failed}),
    }
    entry |= resources(server, since, until)
    if before:
        delta = {k: after[k] - before[k] for k in before}
        entry |= {
            # Busy as a share of all lanes (one core each); lane_seconds_per_s is the sum.
            "decode_lanes": int(after["whisperwire_decode_lanes"]),
            "decode_busy": round(
                delta["whisperwire_decode_seconds_total"]
                / wall_s
                / max(1.0, after["whisperwire_decode_lanes"]),
                3,
            ),
            "decode_lane_seconds_per_s": round(
                delta["whisperwire_decode_seconds_total"] / wall_s, 3
            ),
            "mean_batch": round(
                delta["whisperwire_decode_batch_size_sum"]
                / max(1.0, delta["whisperwire_decode_batch_size_count"]),
                2,
            ),
            "refused": int(delta["refused"]),
            "capacity_estimate_before": int(before["whisperwire_capacity_streams"]),
            "capacity_estimate_after": int(after["whisperwire_capacity_streams"]),
            # What the clients' calls alone said at the end, and the window it assumed.
            "capacity_measured_after": int(after["whisperwire_capacity_measured_streams"]),
            "capacity_window_s_after": round(after["whisperwire_capacity_window_seconds"], 2),
            # The streams within which closings are beam searches (Pipeline.past_comfort).
            "capacity_comfortable_after": int(after["whisperwire_capacity_comfortable_streams"]),
        }
    else:
        # WhisperLive has no metrics: a refused client is one it answered with WAIT or ERROR.
        entry["refused"] = sum("WhisperLive" in repr(e) for e in failed)
    p95 = entry["final_latency"]["p95_ms"]
    entry["sustained"] = not failed and p95 is not None and p95 <= SUSTAINED_P95_S * 1000.0
    return entry


def resources(server: ServerProcess, since: float, until: float) -> dict[str, float | None]:
    assert server.sampler is not None
    samples = server.sampler.samples(since, until)
    if not samples:
        return {"cpu_percent_mean": None, "rss_mb_max": None}
    return {
        "cpu_percent_mean": round(statistics.fmean(s.cpu_percent for s in samples), 1),
        "rss_mb_max": round(max(s.rss_bytes for s in samples) / 2**20, 1),
    }


def why_not_run(
    config: SweepConfig, runs: Sequence[dict[str, Any]], longest_s: float, deadline: float | None
) -> str | None:
    """Why a sweep starts no further N (its runs so far, the next N's longest stream, the
    ``perf_counter`` time it must end by); None when it goes on."""
    if config.stop_after_unsustained and runs and not runs[-1]["sustained"]:
        return "a smaller N was not sustained"
    if deadline is not None and time.perf_counter() + longest_s > deadline:
        return "out of time"
    return None


async def sweep_server(
    who: Contender,
    streams: Sequence[Stream],
    config: SweepConfig,
    *,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Every N of ``config.counts`` against one server. With a ``deadline`` (a
    ``perf_counter`` time), an N whose longest stream would end past it is not started, and
    neither is any after it: ``skipped`` says which and why."""
    out: dict[str, Any] = {"runs": [], "skipped": {}}
    async with who.process() as server:
        out["startup_s"] = round(server.startup_s, 2)
        await warm_up(who, streams[0])
        if who.peer is None:
            out["capacity_estimate_at_start"] = int(
                (await who.scrape())["whisperwire_capacity_streams"]
            )
        for k, n in enumerate(config.counts):
            longest_s = max(s.seconds for s in streams[:n])
            why = why_not_run(config, out["runs"], longest_s, deadline)
            if why is not None:
                out["skipped"] = {str(m): why for m in config.counts[k:]}
                break
            entry = await run_count(who, server, streams, n)
            out["runs"].append(entry)
            logger.info("%s with %d client(s): %s", who.name, n, json.dumps(entry))
        if config.alone and who.peer is None:
            out["alone"] = await stream_alone(who, server, streams[: max(config.counts)], out)
            for entry in out["runs"]:
                entry |= against_alone(entry, streams, out["alone"])
    sustained = [r["clients"] for r in out["runs"] if r["sustained"]]
    out["max_streams_p95_final_le_2s"] = max(sustained, default=0)
    return out


async def stream_alone(
    who: Contender, server: ServerProcess, streams: Sequence[Stream], out: dict[str, Any]
) -> dict[str, str]:
    """Each stream's transcript streamed with no other client (the N = 1 run's where it has
    one, else a run of its own)."""
    texts: dict[str, str] = {}
    for entry in out["runs"]:
        if entry["clients"] == 1:
            texts |= entry["texts"]
    for stream in streams:
        if stream.name not in texts:
            entry = await run_count(who, server, [stream], 1)
            logger.info("%s alone: %s", stream.name, json.dumps(entry))
            texts |= entry["texts"]
    return texts


def against_alone(
    entry: dict[str, Any], streams: Sequence[Stream], alone: dict[str, str]
) -> dict[str, Any]:
    """The run's WER over its streams beside the same streams' WER alone, in points."""
    together = [s for s in streams if s.name in entry["texts"] and s.name in alone]
    if not together:
        return {"wer_alone": None, "wer_vs_alone_points": None}
    references = [s.transcript for s in together]
    run = wer(references, [entry["texts"][s.name] for s in together])
    by_itself = wer(references, [alone[s.name] for s in together])
    return {
        "wer_alone": round(by_itself, 4),
        "wer_vs_alone_points": round(100 * (run - by_itself), 2),
    }


# --- report --------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display: the benchmark runs headless
    import matplotlib.pyplot as plt  # after use(): the backend must be chosen first

    colors = {"ours": "tab:blue", "peer": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for who, data in results["servers"].items():
        runs = [r for r in data["runs"] if r["final_latency"]["p95_ms"] is not None]
        counts = [r["clients"] for r in runs]
        left.plot(
            counts,
            [r["final_latency"]["p95_ms"] / 1000 for r in runs],
            "o-",
            color=colors[who],
            label=who,
        )
        if who == "ours":
            right.plot(
                counts,
                [r["largest_lag_s"] for r in runs],
                "o-",
                color=colors[who],
                label="ours: largest lag_s",
            )
        right.plot(
            counts,
            [r["largest_text_lag_s"] for r in runs],
            "s--",
            color=colors[who],
            label=f"{who}: largest text lag",
        )
    left.axhline(SUSTAINED_P95_S, color="red", linestyle=":", label="2 s")
    left.set_xlabel("clients streaming at 1x")
    left.set_ylabel("final latency p95 (s)")
    left.set_title("Final latency p95")
    right.set_xlabel("clients streaming at 1x")
    right.set_ylabel("seconds behind the audio")
    right.set_title("Largest lag")
    for ax in (left, right):
        ax.set_xticks(list(results["config"]["counts"]))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'server':6} {'N':>3} {'final p50':>9} {'p95':>7} {'lag':>6} {'ttft p50':>8} "
        f"{'p95':>6} {'eos>final p50':>13} {'p95':>6} {'wer':>6} {'alone':>6} {'busy':>5} "
        f"{'batch':>5} {'est':>4} {'cpu%':>5} {'rss MB':>7} {'refused':>7}"
    ]

    def cell(v: Any, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if v is None else f"{v * scale:.{digits}f}"

    for who, data in results["servers"].items():
        for r in data["runs"]:
            # The peer reports no lag: its text lag stands in (see bench/README.md).
            lag = r["largest_lag_s"] if r["largest_lag_s"] is not None else r["largest_text_lag_s"]
            final = r["final_latency"]
            # Runs recorded before it was measured have no end of speech to final.
            eos = r.get("end_of_speech_to_final", {})
            lines.append(
                f"{who:6} {r['clients']:>3} {cell(final['p50_ms'], 1e-3):>9} "
                f"{cell(final['p95_ms'], 1e-3):>7} {cell(lag):>6} "
                f"{cell(r['ttft']['p50_ms'], 1e-3):>8} {cell(r['ttft']['p95_ms'], 1e-3):>6} "
                f"{cell(eos.get('p50_ms'), 1e-3):>13} {cell(eos.get('p95_ms'), 1e-3):>6} "
                f"{cell(r['wer'], 1, 3):>6} "
                f"{cell(r.get('wer_alone'), 1, 3):>6} "
                f"{cell(r.get('decode_busy')):>5} {cell(r.get('mean_batch')):>5} "
                f"{r.get('capacity_estimate_after', '-')!s:>4} "
                f"{cell(r['cpu_percent_mean'], 1, 0):>5} {cell(r['rss_mb_max'], 1, 0):>7} "
                f"{r['refused']:>7}"
            )
    return "\n".join(lines)


async def run(config: SweepConfig) -> dict[str, Any]:
    streams, measured_ms = build_streams(config, max(config.counts))
    results: dict[str, Any] = {
        "config": asdict(config),
        "streams": {s.name: round(s.seconds, 1) for s in streams},
        "loadavg_start": os.getloadavg(),
        "servers": {},
    }
    contenders = [Contender("ours", None, config.decode_lanes, config.server_args)]
    if config.peer:
        if (PEER_VENV / "bin" / "python").is_file():
            peer = PeerConfig(model_path=default_model_path())
            results["peer_config"] = asdict(peer)
            contenders.append(Contender("peer", peer))
        else:
            results["peer_missing"] = "the WhisperLive peer is not installed: run `make peer`"
            logger.warning("%s; measuring ours only", results["peer_missing"])
    for who in contenders:
        results["servers"][who.name] = await sweep_server(who, streams, config)
    results["loadavg_end"] = os.getloadavg()
    window_ms, source = window_2s_ms_p50(measured_ms)
    results["window_2s_ms_p50"] = window_ms
    results["window_2s_source"] = source
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--clients", default="1,2,3,4,6,8", help="comma-separated client counts")
    parser.add_argument("--seconds", type=float, default=60.0, help="speech per client")
    parser.add_argument("--no-peer", action="store_true", help="measure our server only")
    parser.add_argument(
        "--no-alone", action="store_true", help="skip streaming each stream alone (ours)"
    )
    parser.add_argument(
        "--decode-lanes", type=int, default=None, help="our server's lanes (default: its auto)"
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="further flags for our server, space-separated (e.g. '--speakers')",
    )
    parser.add_argument(
        "--output", default="capacity", help="results name in bench/results (default %(default)s)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = SweepConfig(
        counts=tuple(int(x) for x in args.clients.split(",")),
        seconds=args.seconds,
        peer=not args.no_peer,
        alone=not args.no_alone,
        output_name=args.output,
        decode_lanes=args.decode_lanes,
        server_args=tuple(args.server_args.split()),
    )
    started = time.perf_counter()
    results = asyncio.run(run(config))
    results["wall_s"] = round(time.perf_counter() - started, 1)
    png = plot(results, RESULTS / f"{config.output_name}.png")
    results["plot"] = str(png.relative_to(RESULTS.parent.parent))
    path = write_results(config.output_name, results)
    print(table(results))
    if "peer_missing" in results:
        print(f"NOTE: {results['peer_missing']}; WhisperLive was not measured")
    print(f"wrote {path} and {png} in {results['wall_s']:.0f} s")
    servers = results["servers"]
    headline: dict[str, Any] = {
        "max_streams_p95_final_le_2s": servers["ours"]["max_streams_p95_final_le_2s"],
        "peer_max_streams_p95_final_le_2s": servers.get("peer", {}).get(
            "max_streams_p95_final_le_2s"
        ),
        "capacity_estimate_at_start": servers["ours"].get("capacity_estimate_at_start"),
        "largest_wer_vs_alone_points": max(
            (
                r["wer_vs_alone_points"]
                for r in servers["ours"]["runs"]
                if r.get("wer_vs_alone_points") is not None
            ),
            default=None,
        ),
        "window_2s_ms_p50": results["window_2s_ms_p50"],
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
