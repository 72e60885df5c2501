"""Capacity: N clients streaming real speech at 1x into one in-process server.

    python -m bench.capacity [--clients 1,2,4] [--seconds 40]   # or: make bench-capacity

Each client streams a different concatenation of English clips from ``shared/speech`` (0.5 s
of silence between clips) paced in real time through the real WebSocket client. Reports per
N: final latency (arrival of a final minus when the audio at its end was sent) median / p95,
mean decode batch size, decode-worker busy fraction and WER of the finals. Writes
``bench/results/capacity.json``. A stream count is sustained when p95 final latency <= 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine import speech_dir, write_results
from client.sources import FileSource
from client.stream import stream_audio
from server.app import WhisperwireServer
from server.config import PipelineConfig, ServerConfig
from server.engine.engine import Engine, EngineConfig
from tests.helpers import load_clip, read_manifest, wer

SUSTAINED_P95_S = 2.0


def make_streams(n: int, seconds: float, folder: Path) -> list[tuple[Path, str]]:
    speech = speech_dir()
    rows = [
        r
        for r in read_manifest(speech / "manifest.tsv")
        if r.language == "en" and 3 < r.seconds < 12
    ]
    out = []
    gap = np.zeros(8000, dtype=np.float32)
    for i in range(n):
        parts: list[np.ndarray] = []
        refs: list[str] = []
        total, j = 0.0, i
        while total < seconds:
            row = rows[j % len(rows)]
            j += n
            parts += [load_clip(speech / row.file), gap]
            refs.append(row.transcript)
            total += row.seconds + 0.5
        audio = np.concatenate(parts)
        path = folder / f"stream{n}_{i}.wav"
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes((np.clip(audio, -1, 0.99997) * 32768).astype("<i2").tobytes())
        out.append((path, " ".join(refs)))
    return out


async def run(counts: list[int], seconds: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with WhisperwireServer(
        lambda: Engine.load(EngineConfig()),
        server=ServerConfig(port=0, max_sessions=64),
        pipeline=PipelineConfig(max_batch_size=16),
    ) as server:
        metrics = server.metrics
        with tempfile.TemporaryDirectory() as tmp:
            for n in counts:
                streams = make_streams(n, seconds, Path(tmp))
                b_sum, b_count = metrics.batch_size.sum, metrics.batch_size.count
                busy0 = metrics.decode_s.value()
                started = time.perf_counter()
                outcomes = await asyncio.gather(
                    *(
                        stream_audio(
                            f"{server.url}/v1/stream", FileSource(p), pace=1.0, done_timeout_s=900
                        )
                        for p, _ in streams
                    )
                )
                wall = time.perf_counter() - started
                lat = sorted(x for o in outcomes for x in o.stats.final_latencies_s)
                p95 = lat[round(0.95 * (len(lat) - 1))] if lat else float("nan")
                ttft = [o.stats.ttft_s for o in outcomes if o.stats.ttft_s is not None]
                entry = {
                    "clients": n,
                    "audio_s_per_client": round(outcomes[0].stats.audio_s, 2),
                    "wall_s": round(wall, 2),
                    "finals": len(lat),
                    "final_latency_p50_s": round(statistics.median(lat), 3) if lat else None,
                    "final_latency_p95_s": round(p95, 3),
                    "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
                    "mean_batch": round(
                        (metrics.batch_size.sum - b_sum)
                        / max(1, metrics.batch_size.count - b_count),
                        2,
                    ),
                    "decode_busy": round((metrics.decode_s.value() - busy0) / wall, 3),
                    "wer": round(wer([r for _, r in streams], [o.text for o in outcomes]), 4),
                    "sustained": bool(lat) and p95 <= SUSTAINED_P95_S,
                }
                results[str(n)] = entry
                print(json.dumps(entry), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,2,4", help="comma-separated client counts")
    parser.add_argument("--seconds", type=float, default=40.0, help="audio per client")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.clients.split(",")]
    load_start = os.getloadavg()
    results = asyncio.run(run(counts, args.seconds))
    sustained = [int(k) for k, v in results.items() if v["sustained"]]
    data = {
        "runs": results,
        "max_sustained_streams": max(sustained) if sustained else 0,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    print(f"wrote {write_results('capacity', data)}")
    print(json.dumps({"max_sustained_streams": data["max_sustained_streams"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
