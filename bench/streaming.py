"""Streaming-core benchmark: the long recordings through ``Session`` in simulated real time.

    python -m bench.streaming          # or: make bench-streaming

Per recording: first-partial latency (speech onset to the first partial with a word), final
latency (arrival of each final minus the stream time of its last word), end-of-speech to
final, partial flicker (words shown in a partial and later changed), WER of the finals beside
offline ``transcribe_audio``. Writes ``bench/results/streaming.json``.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import time
from typing import Any

from bench.corpus import wer
from bench.engine import load_speech, speech_dir, summary, write_results
from bench.simulate import simulate
from server.engine.engine import Engine, EngineConfig
from server.engine.offline import transcribe_audio
from server.protocol.messages import FinalMessage, SpeechEndedMessage


def end_of_speech_to_final_s(events: list[Any]) -> list[float]:
    """For each speech_ended: time until the next final whose end is at or after it - 1 s."""
    out = []
    for k, e in enumerate(events):
        if isinstance(e.message, SpeechEndedMessage):
            for later in events[k:]:
                if (
                    isinstance(later.message, FinalMessage)
                    and later.message.end >= e.message.end - 1.0
                ):
                    out.append(later.at_s - e.message.end)
                    break
    return out


def _summary(samples_s: list[float]) -> dict[str, float]:
    return summary(samples_s) if samples_s else {}


def main() -> int:
    folder = speech_dir()
    with (folder / "manifest_long.tsv").open(newline="", encoding="utf-8") as fh:
        rows = [
            r
            for r in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
            if r["language"] == "en"
        ]
    engine = Engine.load(EngineConfig())
    engine.warmup()
    load_start = os.getloadavg()
    per_file: dict[str, Any] = {}
    for row in rows:
        audio = load_speech(row["file"])
        started = time.perf_counter()
        offline = transcribe_audio(engine, audio).text
        offline_s = time.perf_counter() - started
        result = simulate(engine, audio)
        changed, shown = result.flicker()
        per_file[row["file"]] = {
            "audio_s": round(result.audio_s, 2),
            "first_partial_latency_s": result.first_partial_latency_s(),
            "final_latency": _summary(result.final_latencies_s()),
            "end_of_speech_to_final": _summary(end_of_speech_to_final_s(result.events)),
            "decode": _summary(result.decode_s),
            "decodes": len(result.decode_s),
            "flicker_words_changed": changed,
            "flicker_words_shown": shown,
            "flicker_rate": round(changed / shown, 4) if shown else 0.0,
            "wer_streamed": round(wer(row["transcript"], result.text), 4),
            "wer_offline": round(wer(row["transcript"], offline), 4),
            "offline_s": round(offline_s, 2),
        }
        print(row["file"], json.dumps(per_file[row["file"]]), flush=True)
    data = {
        "recordings": per_file,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "engine": engine.config.__dict__,
    }
    path = write_results("streaming", data)
    firsts = [
        v["first_partial_latency_s"]
        for v in per_file.values()
        if v["first_partial_latency_s"] is not None
    ]
    finals = [v["final_latency"]["p50_ms"] for v in per_file.values() if v["final_latency"]]
    print(f"wrote {path}")
    print(
        json.dumps(
            {
                "first_partial_latency_s_median": statistics.median(firsts) if firsts else None,
                "final_latency_p50_ms_median": statistics.median(finals) if finals else None,
                "wer_streamed": {k: v["wer_streamed"] for k, v in per_file.items()},
                "wer_offline": {k: v["wer_offline"] for k, v in per_file.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
