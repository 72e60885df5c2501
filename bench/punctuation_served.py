"""``bench.punctuation`` through a real server, several recordings at once.

    python -m bench.punctuation_served --streams 4 --max-s 120
    python -m bench.punctuation_served --streams 1 --modes words --only ljspeech

The simulation (``bench.punctuation``) streams one recording at a time at a modelled decode
cost, so its text is the same on every run; a server carrying four streams on two cores
decodes each less often, and under load its closing decodes run greedy, so what its captions
read like is measured here. Each recording is its own v1 WebSocket session at 1x into one
``whisperwire-server`` subprocess per finals mode (``--finals MODE``, the capacity limit off so
that every stream asked for is served), ``--streams`` of them open at once. Per recording and
pooled, the same marks, errors and words after the last reference word as ``bench.punctuation``
counts, beside the same offline decode (shared through ``--offline-cache``), and final latency
p95 as the client saw it. Writes ``bench/results/punctuation-served.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.accuracy import ServedClip, stream_through_server
from bench.engine import RESULTS, Float32Array, load_speech, write_results
from bench.punctuation import (
    CHAPTERS,
    DEFAULT_OFFLINE,
    MODES,
    NOPAUSE,
    error_fields,
    marks_row,
    nopause_recording,
    p95,
    pooled,
    pooled_line,
    recording_line,
    recordings,
)
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol.formats import SAMPLE_RATE_HZ

Recording = tuple[str, Float32Array, str]  # (name, audio, reference: "" where cut short)


def load_recordings(max_s: float, only: Sequence[str]) -> list[Recording]:
    """The long English recordings and the no-pause chapter, each but the test-other
    chapters cut to its first ``max_s`` seconds (named ``NAME[:Ns]``, no reference), as
    ``bench.punctuation`` cuts them, so the two share offline texts."""
    out: list[Recording] = []
    for name, reference, long, _ in recordings(short=False):
        if not long or (only and not any(s in name for s in only)):
            continue
        if name == NOPAUSE:
            audio, reference = nopause_recording()
        else:
            audio = load_speech(name)
        if max_s and audio.shape[0] > max_s * SAMPLE_RATE_HZ and not name.startswith(CHAPTERS):
            audio = audio[: round(max_s * SAMPLE_RATE_HZ)]
            name, reference = f"{name}[:{max_s:g}s]", ""
        out.append((name, audio, reference))
    return out


def served_row(name: str, clip: ServedClip, reference: str, offline: str) -> dict[str, Any]:
    """One recording as served: the row ``bench.punctuation.pooled`` sums."""
    row: dict[str, Any] = {
        "name": name,
        "long": True,
        **error_fields(reference, clip.text, offline),
        "final_p95_s": p95(clip.final_latencies_s),
        "text": clip.text,
        "offline_text": offline,
        "reference_text": reference,
    }
    row.update(marks_row(clip.text, offline, reference))
    return row


def offline_texts(items: Sequence[Recording], path: Path) -> dict[str, str]:
    """The offline decode of each recording, from ``path`` (``bench.punctuation``'s cache),
    decoding (and adding) those it lacks."""
    texts: dict[str, str] = json.loads(path.read_text()) if path.is_file() else {}
    missing = [(name, audio) for name, audio, _ in items if name not in texts]
    if missing:
        engine = Engine.load(EngineConfig())
        for name, audio in missing:
            texts[name] = transcribe_audio(engine, audio).text
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(texts, indent=1))
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="recordings streamed at once")
    parser.add_argument("--modes", default=",".join(MODES), help="finals: utterance, words")
    parser.add_argument("--max-s", type=float, default=120.0, help="as bench.punctuation's")
    parser.add_argument("--only", default="", help="comma-separated substrings of names to run")
    parser.add_argument("--server-args", default="", help="further server flags, space-separated")
    parser.add_argument("--offline-cache", type=Path, default=DEFAULT_OFFLINE)
    parser.add_argument("--out", default="punctuation-served")
    args = parser.parse_args(argv)
    if args.streams < 1:
        parser.error(f"--streams must be 1 or more, got {args.streams}")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown finals {', '.join(unknown)}; choose from {', '.join(MODES)}")
    items = load_recordings(args.max_s, [s for s in args.only.split(",") if s])
    offline = offline_texts(items, args.offline_cache)
    load_start = os.getloadavg()
    started = time.perf_counter()
    runs: dict[str, Any] = {}
    for mode in modes:
        server_args = ["--finals", mode, *args.server_args.split()]
        clips = [(name, audio) for name, audio, _ in items]
        served = asyncio.run(stream_through_server(clips, server_args, streams=args.streams))
        rows = [served_row(n, served[n], ref, offline[n]) for n, _, ref in items]
        for row in rows:
            print(f"{mode:9s} {recording_line(row['name'], row)}", flush=True)
        runs[mode] = {"pooled": pooled(rows), "recordings": rows}
        print(f"{mode:9s} {pooled_line(runs[mode]['pooled'])}", flush=True)
    write_results(
        args.out,
        {
            "streams": args.streams,
            "max_s": args.max_s,
            "server_args": args.server_args,
            "runs": runs,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "wall_s": round(time.perf_counter() - started, 1),
        },
    )
    print(f"wrote {RESULTS / args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
