"""Soak: many long streams of real speech into the real server, watching errors, memory, lag.

    python -m bench.soak [--quick] [--clients 16] [--client-s 300] [--long-s 3600] [--pace 0.5]
    make soak

The server is the real CLI (``whisperwire-server``, tiny.en) in a subprocess, so its memory can
be sampled on its own (psutil, once a second). The clients are the real WebSocket client
(``client.stream.stream_audio``) in this process, each streaming a concatenation of the English
clips of ``shared/speech`` (0.5 s of silence between clips, a different order per client)
faster than real time (``--pace 0.5``: twice real time). Three phases, one after the other:

1. warm-up: two short streams, so the allocator, the batch shapes and the caches settle; the
   server's RSS once they are done is the baseline;
2. ``--clients`` streams of ``--client-s`` seconds each, at once;
3. one stream of ``--long-s`` seconds.

Reported per phase: errors (error messages and failed streams; must be 0), audio that went
missing (sent but not received, or speech neither transcribed nor reported as failed, from
each ``done``; must be 0), final latency p50 / p95 / max (arrival of a final minus when the
audio at its end was sent), the largest ``lag_s`` the server reported, and the WER of the
finals against the reference transcripts. Overall: server RSS after warm-up, its peak, and its
growth (RSS with no session open at the end minus the baseline; target < 50 MB), and whether
the server then exited 0 on SIGTERM. Writes ``bench/results/soak.json`` (``soak-quick.json``
with ``--quick``) and prints a summary.

``--quick`` (2 clients x 30 s, one 2-minute stream) smoke-tests the whole path in about two
minutes; the full run takes about an hour on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.corpus import load_clip, read_manifest, wer
from bench.engine import speech_dir, write_results
from client.stream import StreamFailed, stream_audio
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import DoneMessage, ErrorMessage, FinalMessage, ServerMessage

REPO = Path(__file__).resolve().parents[1]
GAP_S = 0.5  # silence between clips, so the VAD ends a segment between them
CHUNK_S = 0.1  # the client's frame length
WIRE_ROUNDING_S = 0.002  # three millisecond-rounded times in a sum differ by at most 1.5 ms
RSS_GROWTH_TARGET_MB = 50.0
SETTLE_S = 3.0  # idle time before an RSS reading that should not include sessions
STARTUP_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- audio


@dataclass(frozen=True)
class Clip:
    audio: np.ndarray
    transcript: str


def english_clips() -> list[Clip]:
    """Every English recording with a transcript, short and long."""
    speech = speech_dir()
    rows = [r for r in read_manifest(speech / "manifest.tsv") if r.language == "en"]
    long_manifest = speech / "manifest_long.tsv"
    if long_manifest.is_file():
        rows += [r for r in read_manifest(long_manifest) if r.language == "en"]
    return [Clip(load_clip(speech / r.file), r.transcript) for r in rows]


def build_stream(clips: list[Clip], seconds: float, first: int) -> tuple[bytes, str]:
    """About ``seconds`` of clips (whole clips, starting with clip ``first``, in manifest
    order and round again) as 16 kHz pcm_s16le, and the joined reference transcript."""
    gap = np.zeros(round(GAP_S * SAMPLE_RATE_HZ), dtype=np.float32)
    parts: list[np.ndarray] = []
    refs: list[str] = []
    total = 0.0
    k = first
    while total < seconds:
        clip = clips[k % len(clips)]
        parts += [clip.audio, gap]
        refs.append(clip.transcript)
        total += clip.audio.shape[0] / SAMPLE_RATE_HZ + GAP_S
        k += 1
    return pcm_s16le_bytes(np.concatenate(parts)), " ".join(refs)


class PcmSource:
    """An ``AudioSource`` over 16 kHz pcm_s16le bytes in memory, in ``CHUNK_S`` chunks."""

    def __init__(self, pcm: bytes) -> None:
        self._pcm = pcm
        self._chunk = round(CHUNK_S * SAMPLE_RATE_HZ) * 2
        self._stopped = False

    @property
    def audio_format(self) -> AudioFormat:
        return AudioFormat(SAMPLE_RATE_HZ, "pcm_s16le")

    @property
    def live(self) -> bool:
        return False

    async def chunks(self) -> AsyncIterator[bytes]:
        for offset in range(0, len(self._pcm), self._chunk):
            if self._stopped:
                return
            yield self._pcm[offset : offset + self._chunk]

    def stop(self) -> None:
        self._stopped = True


# --------------------------------------------------------------------------- the server


class ServerProcess:
    """``whisperwire-server`` in a subprocess: its URL, its RSS, its log, its exit."""

    def __init__(self, process: asyncio.subprocess.Process, url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log
        self.ps = psutil.Process(process.pid)
        self._drain: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, log: Path, max_sessions: int) -> ServerProcess:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "server.serve.cli", "--port", "0"),
            *("--max-sessions", str(max_sessions), "--max-batch-size", "16"),
            "--no-capacity-limit",  # the soak overloads the server on purpose
            *("--log-level", "info"),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None
        log.parent.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        url = ""
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT_S):
                while not url:
                    line = (await process.stderr.readline()).decode()
                    if not line:
                        raise SystemExit("the server exited before listening:\n" + "".join(lines))
                    lines.append(line)
                    if "listening on " in line:  # logged once the model is warm
                        url = line.rsplit("listening on ", 1)[1].strip()
        except BaseException:
            process.kill()
            await process.wait()
            raise
        log.write_text("".join(lines))
        server = cls(process, url, log)
        server._drain = asyncio.create_task(server._keep_log())
        return server

    async def _keep_log(self) -> None:
        assert self.process.stderr is not None
        with self.log_path.open("a") as fh:
            while line := await self.process.stderr.readline():
                fh.write(line.decode())

    def rss_mb(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    async def stop(self) -> int:
        """SIGTERM, then the exit status."""
        self.process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.process.wait(), 120)
        if self._drain is not None:
            await self._drain
        return code


@dataclass
class RssSampler:
    """The server's RSS once a second, labelled with the phase running."""

    server: ServerProcess
    phase: str = "idle"
    samples: list[tuple[float, str, float]] = field(default_factory=list)  # (t_s, phase, MB)

    async def run(self) -> None:
        started = time.perf_counter()
        while True:
            with contextlib.suppress(psutil.Error):
                self.samples.append(
                    (round(time.perf_counter() - started, 1), self.phase, self.server.rss_mb())
                )
            await asyncio.sleep(1.0)

    def peak(self, phase: str | None = None) -> float:
        return max((mb for _, p, mb in self.samples if phase in (None, p)), default=0.0)


# --------------------------------------------------------------------------- the clients


@dataclass
class StreamReport:
    sent_s: float
    reference: str
    text: str = ""
    errors: list[str] = field(default_factory=list)
    lags_s: list[float] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    done: DoneMessage | None = None

    @property
    def missing_s(self) -> float:
        """Audio sent but not received, plus speech neither transcribed nor reported failed."""
        if self.done is None:
            return self.sent_s
        d = self.done
        gaps = [self.sent_s - d.audio_received_s]
        if d.transcribed_s is not None and d.failed_s is not None:
            gaps.append(d.speech_s - d.transcribed_s - d.failed_s)
        # Wire times are rounded to milliseconds: a difference within that is not audio.
        return sum(g for g in gaps if g > WIRE_ROUNDING_S)


async def one_stream(url: str, pcm: bytes, reference: str, pace: float) -> StreamReport:
    report = StreamReport(sent_s=len(pcm) / 2 / SAMPLE_RATE_HZ, reference=reference)

    def on_message(message: ServerMessage) -> None:
        if isinstance(message, ErrorMessage):
            report.errors.append(f"{message.code}: {message.message}")
        elif isinstance(message, FinalMessage) and message.lag_s is not None:
            report.lags_s.append(message.lag_s)

    try:
        result = await stream_audio(
            f"{url}/v1/stream",
            PcmSource(pcm),
            pace=pace,
            on_message=on_message,
            done_timeout_s=3600,
        )
    except StreamFailed as exc:
        report.errors.append(f"stream failed: {exc}")
        return report
    report.text = result.text
    report.done = result.done
    report.latencies_s = list(result.stats.final_latencies_s)
    return report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def phase_summary(name: str, reports: list[StreamReport], wall_s: float) -> dict[str, Any]:
    latencies = [x for r in reports for x in r.latencies_s]
    lags = [x for r in reports for x in r.lags_s]
    audio_s = sum(r.sent_s for r in reports)
    with_text = [r for r in reports if r.reference.strip()]
    return {
        "phase": name,
        "streams": len(reports),
        "audio_s_per_stream": round(audio_s / max(1, len(reports)), 1),
        "wall_s": round(wall_s, 1),
        "speed_x_realtime": round(audio_s / len(reports) / wall_s, 2) if reports else None,
        "errors": sum(len(r.errors) for r in reports),
        "error_samples": [e for r in reports for e in r.errors][:5],
        "missing_audio_s": round(sum(r.missing_s for r in reports), 3),
        "finals": len(latencies),
        "final_latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "final_latency_p95_s": round(percentile(latencies, 0.95), 3) if latencies else None,
        "final_latency_max_s": round(max(latencies), 3) if latencies else None,
        "max_lag_s": round(max(lags), 3) if lags else None,
        "wer": round(wer([r.reference for r in with_text], [r.text for r in with_text]), 4)
        if with_text
        else None,
    }


async def run_phase(
    name: str,
    server: ServerProcess,
    sampler: RssSampler,
    streams: list[tuple[bytes, str]],
    pace: float,
) -> dict[str, Any]:
    sampler.phase = name
    started = time.perf_counter()
    reports = await asyncio.gather(*(one_stream(server.url, p, r, pace) for p, r in streams))
    wall = time.perf_counter() - started
    sampler.phase = "idle"
    summary = phase_summary(name, list(reports), wall)
    summary["rss_peak_mb"] = round(sampler.peak(name), 1)
    print(json.dumps(summary), flush=True)
    return summary


async def run(args: argparse.Namespace) -> dict[str, Any]:
    clips = english_clips()
    log = REPO / "bench" / "results" / "logs" / ("soak-quick.log" if args.quick else "soak.log")
    server = await ServerProcess.start(log, max_sessions=max(32, args.clients + 4))
    sampler = RssSampler(server)
    sampling = asyncio.create_task(sampler.run())
    phases: list[dict[str, Any]] = []
    try:
        rss_ready = server.rss_mb()
        warmup = [build_stream(clips, args.warmup_s, 3 * i) for i in range(2)]
        phases.append(await run_phase("warmup", server, sampler, warmup, args.pace))
        await asyncio.sleep(SETTLE_S)
        rss_warm = server.rss_mb()
        many = [build_stream(clips, args.client_s, 7 * i) for i in range(args.clients)]
        phases.append(await run_phase("clients", server, sampler, many, args.pace))
        del many
        long = [build_stream(clips, args.long_s, 0)]
        phases.append(await run_phase("long", server, sampler, long, args.pace))
        await asyncio.sleep(SETTLE_S)
        rss_end = server.rss_mb()
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        exit_code = await server.stop()
    measured = [p for p in phases if p["phase"] != "warmup"]
    growth = rss_end - rss_warm
    return {
        "quick": args.quick,
        "pace": args.pace,
        "phases": phases,
        "errors": sum(p["errors"] for p in measured),
        "missing_audio_s": round(sum(p["missing_audio_s"] for p in measured), 3),
        "rss_ready_mb": round(rss_ready, 1),
        "rss_after_warmup_mb": round(rss_warm, 1),
        "rss_peak_mb": round(sampler.peak(), 1),
        "rss_end_mb": round(rss_end, 1),
        "rss_growth_mb": round(growth, 1),
        "rss_growth_ok": growth < RSS_GROWTH_TARGET_MB,
        "server_exit_code": exit_code,
        "rss_samples": sampler.samples[:: max(1, len(sampler.samples) // 600)],
        "server_log": str(log.relative_to(REPO)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 x 30 s and one 2-minute stream")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams (phase 2)")
    parser.add_argument("--client-s", type=float, default=300.0, help="audio per client")
    parser.add_argument("--long-s", type=float, default=3600.0, help="the long stream's audio")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="each warm-up stream")
    parser.add_argument(
        "--pace", type=float, default=0.5, help="1 is real time, 0.5 twice as fast (default)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.client_s, args.long_s, args.warmup_s = 2, 30.0, 120.0, 15.0
    load_start = os.getloadavg()
    data = asyncio.run(run(args))
    data["loadavg_start"] = load_start
    data["loadavg_end"] = os.getloadavg()
    path = write_results("soak-quick" if args.quick else "soak", data)
    ok = data["errors"] == 0 and data["missing_audio_s"] == 0 and data["rss_growth_ok"]
    ok = ok and data["server_exit_code"] == 0
    print(
        f"soak {'passed' if ok else 'FAILED'}: errors {data['errors']}, missing audio "
        f"{data['missing_audio_s']} s, RSS {data['rss_after_warmup_mb']} MB after warm-up, "
        f"peak {data['rss_peak_mb']} MB, growth {data['rss_growth_mb']} MB "
        f"(target < {RSS_GROWTH_TARGET_MB:g}), server exit {data['server_exit_code']}"
    )
    for p in data["phases"]:
        print(
            f"  {p['phase']:>8}: {p['streams']} x {p['audio_s_per_stream']} s in "
            f"{p['wall_s']} s, final latency p50 {p['final_latency_p50_s']} / p95 "
            f"{p['final_latency_p95_s']} / max {p['final_latency_max_s']} s, max lag "
            f"{p['max_lag_s']} s, WER {p['wer']}"
        )
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
