"""Streamed finals beside offline decoding, clip by clip: the accuracy harness of the commit
policy.

    python -m bench.accuracy                 # or: make bench-accuracy
    python -m bench.accuracy --limit 10 --no-long --set commit.min_right_context_s=1.2

Every English clip of ``manifest.tsv`` is streamed as its own session (and, unless
``--no-long``, each English long recording of ``manifest_long.tsv``) through ``Session`` in
simulated real time: audio arrives at 1x and each decode's measured wall time is charged to
the clock (``bench/simulate.py``), which is what a one-stream server sees. The same clip is
decoded offline with ``transcribe_audio`` (30 s windows). Per clip and pooled, per set:

- streamed WER, offline WER and their difference (the figure that matters);
- insertions at the end of the stream (words after the last reference word);
- final latency p50/p95: arrival of a final minus the stream time of its last word;
- first-partial latency: speech onset to the first partial or final with a word;
- flicker: words shown in a partial and later changed, over words shown.

``--server`` also streams every short clip as its own session at 1x through a real server
subprocess over WebSocket and reports that WER beside the simulated one, clip by clip: the
check that the simulation stands for the server.

``--set section.field=value`` overrides a field of ``StreamingConfig`` (``streaming.``) or of
the commit policy's config (``commit.``), so the trade-off table is one loop over flags.
Writes ``bench/results/accuracy.json`` (``--out NAME`` for another name); the last line printed
is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jiwer

from bench.engine import RESULTS, load_speech, speech_dir, write_results
from bench.replay import WhisperwireAdapter, replay
from bench.server_process import ServerProcess, free_port, http_ok
from bench.simulate import simulate
from server.config import StreamingConfig
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.policy import CommitConfig
from server.session import DecodeJob
from tests.helpers import normalize, read_manifest


@dataclasses.dataclass(frozen=True)
class Counts:
    """Word errors against one reference (after Whisper's English normaliser)."""

    ref_words: int
    substitutions: int
    deletions: int
    insertions: int
    trailing_insertions: int  # hypothesis words after the last reference word

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        return self.errors / self.ref_words if self.ref_words else 0.0


def count_errors(reference: str, hypothesis: str) -> Counts:
    ref, hyp = normalize(reference), normalize(hypothesis)
    if not ref:
        return Counts(0, 0, 0, len(hyp.split()), len(hyp.split()))
    out = jiwer.process_words(ref, hyp if hyp else "")
    trailing = 0
    n_ref = len(ref.split())
    for chunk in out.alignments[0]:
        if chunk.type == "insert" and chunk.ref_start_idx >= n_ref:
            trailing += chunk.hyp_end_idx - chunk.hyp_start_idx
    return Counts(
        n_ref, out.substitutions, out.deletions, out.insertions, trailing_insertions=trailing
    )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _overrides(pairs: list[str]) -> tuple[StreamingConfig, CommitConfig]:
    streaming: dict[str, Any] = {}
    commit: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        section, _, name = key.partition(".")
        target = {"streaming": streaming, "commit": commit}.get(section)
        if target is None or not name or not raw:
            raise SystemExit(f"--set takes streaming.FIELD=VALUE or commit.FIELD=VALUE; got {pair}")
        target[name] = json.loads(raw)
    base_commit = CommitConfig(**commit)
    return StreamingConfig(commit=base_commit, **streaming), base_commit


def _pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ref = sum(r["ref_words"] for r in rows)
    streamed = sum(r["errors_streamed"] for r in rows)
    offline = sum(r["errors_offline"] for r in rows)
    finals = [x for r in rows for x in r["final_latencies_s"]]
    firsts = [r["first_partial_s"] for r in rows if r["first_partial_s"] is not None]
    shown = sum(r["flicker_shown"] for r in rows)
    return {
        "clips": len(rows),
        "ref_words": ref,
        "wer_streamed": round(streamed / ref, 4) if ref else None,
        "wer_offline": round(offline / ref, 4) if ref else None,
        "wer_difference_points": round(100 * (streamed - offline) / ref, 2) if ref else None,
        "clips_worse": sum(r["errors_streamed"] > r["errors_offline"] for r in rows),
        "clips_better": sum(r["errors_streamed"] < r["errors_offline"] for r in rows),
        "trailing_insertions_streamed": sum(r["trailing_insertions_streamed"] for r in rows),
        "trailing_insertions_offline": sum(r["trailing_insertions_offline"] for r in rows),
        "final_latency_p50_s": _percentile(finals, 0.5),
        "final_latency_p95_s": _percentile(finals, 0.95),
        "first_partial_p50_s": _percentile(firsts, 0.5),
        "first_partial_p95_s": _percentile(firsts, 0.95),
        "flicker": round(sum(r["flicker_changed"] for r in rows) / shown, 4) if shown else 0.0,
        "decodes_per_audio_s": round(
            sum(r["decodes"] for r in rows) / sum(r["audio_s"] for r in rows), 3
        ),
        "decode_busy": round(
            sum(r["decode_s_total"] for r in rows) / sum(r["audio_s"] for r in rows), 3
        ),
    }


def modelled_cost_s(job: DecodeJob) -> float:
    """A decode's cost as a fixed part plus one growing with the window (about what
    bench-decoder measured for tiny.en on these CPUs): window positions, and so the text, are
    then the same on every run, whatever else the machine is doing."""
    return 0.1 + 0.05 * job.audio_s


def run_clip(
    engine: Engine,
    file: str,
    transcript: str,
    streaming: StreamingConfig,
    *,
    modelled: bool = False,
    offline_cache: dict[str, str] | None = None,
) -> dict[str, Any]:
    audio = load_speech(file)
    cache = offline_cache if offline_cache is not None else {}
    if file not in cache:
        cache[file] = transcribe_audio(engine, audio).text
    offline = cache[file]
    result = simulate(
        engine, audio, streaming=streaming, decode_cost_s=modelled_cost_s if modelled else None
    )
    s = count_errors(transcript, result.text)
    o = count_errors(transcript, offline)
    changed, shown = result.flicker()
    return {
        "file": file,
        "audio_s": round(result.audio_s, 2),
        "ref_words": s.ref_words,
        "errors_streamed": s.errors,
        "errors_offline": o.errors,
        "wer_streamed": round(s.wer, 4),
        "wer_offline": round(o.wer, 4),
        "trailing_insertions_streamed": s.trailing_insertions,
        "trailing_insertions_offline": o.trailing_insertions,
        "final_latencies_s": [round(x, 3) for x in result.final_latencies_s()],
        "first_partial_s": result.first_partial_latency_s(),
        "flicker_changed": changed,
        "flicker_shown": shown,
        "decodes": len(result.decode_s),
        "decode_s_total": round(sum(result.decode_s), 3),
        "streamed": result.text,
        "offline": offline,
    }


async def stream_through_server(clips: list[tuple[str, str]]) -> dict[str, str]:
    """Each clip as its own WebSocket session at 1x into a real server subprocess (the
    capacity limit off: one stream at a time anyway); the finals' text per clip."""
    port = free_port()
    cmd = [
        os.path.join(sys.prefix, "bin", "whisperwire-server"),
        *("--port", str(port), "--model", "tiny.en", "--log-level", "warning"),
    ]
    ready = f"http://127.0.0.1:{port}/readyz"
    texts: dict[str, str] = {}
    log = RESULTS / "logs" / "accuracy_server.log"
    async with ServerProcess("whisperwire", cmd, ready=lambda: http_ok(ready), log_path=log):
        for file, _ in clips:
            record = await replay(WhisperwireAdapter(f"ws://127.0.0.1:{port}"), load_speech(file))
            texts[file] = record.text
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="first N short clips only")
    parser.add_argument("--match", default="", help="only clips whose path contains this")
    parser.add_argument("--no-long", action="store_true", help="skip the long recordings")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON")
    parser.add_argument("--out", default="accuracy")
    parser.add_argument(
        "--modelled-cost",
        action="store_true",
        help="charge a modelled decode cost instead of the measured one (repeatable tuning)",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="also stream every short clip through a real server at 1x and report its WER "
        "beside the simulation's (the check that the two agree)",
    )
    parser.add_argument(
        "--offline-cache",
        type=Path,
        help="JSON file keeping offline transcripts between runs (they do not depend on --set)",
    )
    args = parser.parse_args(argv)
    streaming, commit = _overrides(args.set)

    folder = speech_dir()
    short = [r for r in read_manifest(folder / "manifest.tsv") if r.language == "en"]
    short = [r for r in short if args.match in r.file]
    if args.limit:
        short = short[: args.limit]
    long = (
        []
        if args.no_long
        else [r for r in read_manifest(folder / "manifest_long.tsv") if r.language == "en"]
    )
    cache: dict[str, str] = {}
    if args.offline_cache and args.offline_cache.is_file():
        cache = json.loads(args.offline_cache.read_text())
    engine = Engine.load(EngineConfig())
    engine.warmup()
    load_start = os.getloadavg()
    started = time.perf_counter()
    sets: dict[str, list[dict[str, Any]]] = {"short": [], "long": []}
    for name, rows in (("short", short), ("long", long)):
        for row in rows:
            clip = run_clip(
                engine,
                row.file,
                row.transcript,
                streaming,
                modelled=args.modelled_cost,
                offline_cache=cache,
            )
            sets[name].append(clip)
            print(
                f"{clip['wer_streamed']:7.3f} {clip['wer_offline']:7.3f} "
                f"{clip['errors_streamed'] - clip['errors_offline']:+4d}  {row.file}",
                flush=True,
            )
    if args.offline_cache:
        args.offline_cache.write_text(json.dumps(cache, indent=1))
    if args.server:
        served = asyncio.run(stream_through_server([(r.file, r.transcript) for r in short]))
        for clip, row in zip(sets["short"], short, strict=True):
            counts = count_errors(row.transcript, served[row.file])
            clip["served"] = served[row.file]
            clip["errors_served"] = counts.errors
            print(
                f"served {counts.wer:7.3f} simulated {clip['wer_streamed']:7.3f}  {row.file}",
                flush=True,
            )
    summary = {name: _pooled(rows) for name, rows in sets.items() if rows}
    if args.server and short:
        ref = summary["short"]["ref_words"]
        served_errors = sum(c["errors_served"] for c in sets["short"])
        summary["short"]["wer_served"] = round(served_errors / ref, 4)
        summary["short"]["clips_served_differs"] = sum(
            c["errors_served"] != c["errors_streamed"] for c in sets["short"]
        )
    by_source: dict[str, list[dict[str, Any]]] = {}
    for clip in sets["short"]:
        by_source.setdefault(clip["file"].split("/")[0], []).append(clip)
    data = {
        "summary": summary,
        "by_source": {k: _pooled(v) for k, v in sorted(by_source.items())},
        "clips": sets,
        "streaming": dataclasses.asdict(streaming),
        "commit": dataclasses.asdict(commit),
        "engine": dataclasses.asdict(engine.config),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
        "decode_cost": "modelled" if args.modelled_cost else "measured",
    }
    path = write_results(args.out, data)
    for name, figures in summary.items():
        print(name, json.dumps(figures))
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in summary.items()} | {"overrides": args.set}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
