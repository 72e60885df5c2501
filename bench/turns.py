"""Conversational turns through Deepgram Flux's endpoint (``/v2/listen``): how soon a turn's
end and its final transcript come after the last word, and how right they are.

    python -m bench.turns                  # or: make bench-turns
    python -m bench.turns --limit 10 --eot-threshold 0.6

Each test-other clip of ``manifest.tsv`` (read speech: one speaker's turn, ending in a pause) is
sent at 1x, followed by 2 s of silence, as its own ``/v2/listen`` stream into one
``whisperwire-server`` subprocess; ``--streams N`` runs N clips at once. Per clip: when the
``EndOfTurn`` arrived, minus the end of the turn's last word (its own word times: what a voice
agent waits from), its ``trigger`` (model or timeout), and the WER of its transcript; pooled,
p50 / p95 / p99 of that wait, the share of turns the model ended, WER, and the end-of-turn
decisions inside clips (an ``EndOfTurn`` before the clip's last word: a false end, the turn cut
inside the speaker's speech). Writes ``bench/results/turns.json`` (``--out NAME``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from bench.accuracy_metrics import count_errors
from bench.corpus import read_manifest
from bench.engine import RESULTS, load_speech, speech_dir, write_results
from bench.server_process import ServerProcess, free_port, http_ok
from server.protocol.formats import SAMPLE_RATE_HZ

RESULTS_LOG = "turns_server.log"
FRAME_S = 0.02  # 20 ms frames, as a telephony or WebRTC client sends them
TAIL_S = 2.0  # silence after each clip


async def one_clip(url: str, file: str, reference: str) -> dict[str, Any]:
    """Stream one clip at 1x; what its turns said and when."""
    audio = np.concatenate([load_speech(file), np.zeros(int(TAIL_S * SAMPLE_RATE_HZ), np.float32)])
    pcm = (np.clip(audio, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes()
    step = int(FRAME_S * SAMPLE_RATE_HZ) * 2
    turns: list[dict[str, Any]] = []
    async with connect(url, max_size=None) as ws:
        started = time.perf_counter()

        async def send() -> None:
            for k, offset in enumerate(range(0, len(pcm), step)):
                await ws.send(pcm[offset : offset + step])
                delay = started + (k + 1) * FRAME_S - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await ws.send(json.dumps({"type": "CloseStream"}))

        sender = asyncio.create_task(send())
        async for raw in ws:
            message = json.loads(raw)
            if message.get("type") == "TurnInfo" and message["event"] == "EndOfTurn":
                message["arrived_s"] = time.perf_counter() - started
                turns.append(message)
        await sender
    speech_s = len(audio) / SAMPLE_RATE_HZ - TAIL_S
    model_ends = [t for t in turns if t.get("trigger") == "model"]
    last = turns[-1] if turns else None
    last_word_s = max((w["end"] for t in turns for w in t["words"]), default=None)
    text = " ".join(t["transcript"] for t in turns)
    counts = count_errors(reference, text)
    return {
        "file": file,
        "speech_s": round(speech_s, 3),
        "turns": len(turns),
        "triggers": [t.get("trigger") for t in turns],
        # Turns the model ended before the clip's speech was over: a false end.
        "false_ends": sum(
            1 for t in model_ends[:-1] if t["words"] and t["words"][-1]["end"] < speech_s - 0.5
        ),
        "end_after_last_word_s": None
        if last is None or last_word_s is None
        else round(last["arrived_s"] - last_word_s, 3),
        "errors": counts.errors,
        "ref_words": counts.ref_words,
        "transcript": text,
    }


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = [
        r
        for r in read_manifest(speech_dir() / "manifest.tsv")
        if "test-other" in r.file and r.language == "en"
    ]
    if args.limit:
        rows = rows[: args.limit]
    port = free_port()
    cmd = [
        os.path.join(sys.prefix, "bin", "whisperwire-server"),
        *("--port", str(port), "--model", "tiny.en", "--log-level", "warning"),
        "--no-capacity-limit",
    ]
    query = f"model=flux-general-en&encoding=linear16&sample_rate={SAMPLE_RATE_HZ}"
    query += f"&eot_threshold={args.eot_threshold}&eot_timeout_ms={args.eot_timeout_ms}"
    url = f"ws://127.0.0.1:{port}/v2/listen?{query}"

    log = RESULTS / "logs" / RESULTS_LOG
    clips: list[dict[str, Any]] = []
    async with ServerProcess(
        "whisperwire", cmd, ready=lambda: http_ok(f"http://127.0.0.1:{port}/readyz"), log_path=log
    ):
        for k in range(0, len(rows), args.streams):
            batch = rows[k : k + args.streams]
            done = await asyncio.gather(*(one_clip(url, r.file, r.transcript) for r in batch))
            for clip in done:
                print(
                    json.dumps({key: clip[key] for key in clip if key != "transcript"}), flush=True
                )
            clips.extend(done)
    waits = [c["end_after_last_word_s"] for c in clips if c["end_after_last_word_s"] is not None]
    triggers = [t for c in clips for t in c["triggers"]]
    errors = sum(c["errors"] for c in clips)
    words = sum(c["ref_words"] for c in clips)
    return {
        "headline": {
            "streams": args.streams,
            "eot_threshold": args.eot_threshold,
            "end_of_turn_after_last_word_p50_s": _p(waits, 0.5),
            "p95_s": _p(waits, 0.95),
            "p99_s": _p(waits, 0.99),
            "mean_s": round(statistics.fmean(waits), 3) if waits else None,
            "turns_ended_by_model": round(triggers.count("model") / len(triggers), 3)
            if triggers
            else None,
            "false_ends": sum(c["false_ends"] for c in clips),
            "clips_with_more_than_one_turn": sum(1 for c in clips if c["turns"] > 1),
            "wer": round(errors / words, 4) if words else None,
        },
        "clips": clips,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="the first N clips only")
    parser.add_argument("--streams", type=int, default=1, help="clips streamed at once")
    parser.add_argument("--eot-threshold", type=float, default=0.7)
    parser.add_argument("--eot-timeout-ms", type=int, default=5000)
    parser.add_argument("--out", default="turns")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    data = asyncio.run(run(args))
    data["loadavg_start"] = load_start
    data["loadavg_end"] = os.getloadavg()
    path = write_results(args.out, data)
    print(json.dumps(data["headline"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
