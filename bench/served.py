"""Short clips through a real server at 1x, and nothing else: the served half of
``bench.accuracy --server`` without its simulation and offline references.

    python -m bench.served                          # the 40 test-other clips, v1 default
    python -m bench.served --server-args="--finals words" --out served-words

Each clip is its own WebSocket session into one ``whisperwire-server`` subprocess
(``bench.accuracy.stream_through_server``), timed as ``bench.accuracy.served_clip`` times it.
Pooled: WER, final latency p95, end of speech to final p50 / p95, first word p50 / p95 and
flicker. About 8 minutes for the 40 test-other clips, against 25 or more for the whole
harness: the run to repeat when a change moves decode timing, which the simulation does not
model (one job per stream there, decoded while no audio arrives). Output:
``bench/results/served.json`` (``--out``): ``summary`` and per clip ``clips``; the last line
is the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from typing import Any

from bench.accuracy import ServedClip, stream_through_server
from bench.accuracy_metrics import count_errors, percentile
from bench.corpus import ManifestRow, read_manifest
from bench.engine import load_speech, speech_dir, write_results


def clip_record(row: ManifestRow, got: ServedClip) -> dict[str, Any]:
    """One clip as served: its errors against the transcript, text and timings."""
    counts = count_errors(row.transcript, got.text)
    return {
        "file": row.file,
        "ref_words": counts.ref_words,
        "errors": counts.errors,
        "text": got.text,
        "final_latencies_s": [round(x, 3) for x in got.final_latencies_s],
        "end_of_speech_to_final_s": [round(x, 3) for x in got.end_of_speech_to_final_s],
        "first_partial_s": got.first_partial_s,
        "flicker": list(got.flicker),
    }


def pool(clips: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The clips' records pooled: errors over reference words, latencies over every final,
    turn end and clip, flicker over every word shown in a partial."""
    errors = sum(c["errors"] for c in clips)
    ref_words = sum(c["ref_words"] for c in clips)
    finals = [x for c in clips for x in c["final_latencies_s"]]
    turn_ends = [x for c in clips for x in c["end_of_speech_to_final_s"]]
    firsts = [c["first_partial_s"] for c in clips if c["first_partial_s"] is not None]
    changed = sum(c["flicker"][0] for c in clips)
    shown = sum(c["flicker"][1] for c in clips)
    return {
        "clips": len(clips),
        "ref_words": ref_words,
        "errors": errors,
        "wer": round(errors / ref_words, 4) if ref_words else None,
        "final_latency_p95_s": percentile(finals, 0.95),
        "end_of_speech_to_final_p50_s": percentile(turn_ends, 0.5),
        "end_of_speech_to_final_p95_s": percentile(turn_ends, 0.95),
        "first_partial_p50_s": percentile(firsts, 0.5),
        "first_partial_p95_s": percentile(firsts, 0.95),
        "flicker": round(changed / shown, 4) if shown else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default="test-other", help="clips whose path contains this")
    parser.add_argument(
        "--server-args", default="", help="flags for the server, space-separated (--finals words)"
    )
    parser.add_argument("--streams", type=int, default=1, help="clips streamed at once")
    parser.add_argument("--out", default="served")
    args = parser.parse_args(argv)
    if args.streams < 1:
        parser.error(f"--streams must be 1 or more, got {args.streams}")
    folder = speech_dir()
    rows = [
        r
        for r in read_manifest(folder / "manifest.tsv")
        if r.language == "en" and args.match in r.file
    ]
    if not rows:
        parser.error(f"no English clip of manifest.tsv matches {args.match!r}")
    server_args = tuple(args.server_args.split())
    audio = [(r.file, load_speech(r.file)) for r in rows]
    served = asyncio.run(stream_through_server(audio, server_args, streams=args.streams))
    clips = [clip_record(r, served[r.file]) for r in rows]
    summary = {"server_args": list(server_args), "streams": args.streams, **pool(clips)}
    path = write_results(args.out, {"summary": summary, "clips": clips})
    print(f"wrote {path}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
