"""Home Assistant's view of the Wyoming port: how soon the transcript follows the end of a
command, and how right it is.

    python -m bench.wyoming                     # the 40 test-other clips
    python -m bench.wyoming --match jfk --out wyoming-jfk

One ``whisperwire-server --wyoming-port`` subprocess (tiny.en, its defaults otherwise); each
clip is one transcription on a connection of its own, sent as Home Assistant's
``components/wyoming/stt.py`` sends it: ``transcribe``, ``audio-start``, 16 kHz 16-bit mono
chunks of 1024 samples paced in real time (a microphone), then ``--tail-silence-s`` of silence
(the silence that ends a command in Home Assistant's voice command segmenter, 0.7 s by
default), ``audio-stop``, and the answer read to ``transcript``.

Per clip and pooled: ``stop_to_transcript_s``, from ``audio-stop`` sent to ``transcript``
received (what a user waits for after speaking); the first ``transcript-chunk`` after the
start of the audio; the WER. In the same run, after the server has stopped (the two never
share the CPU), the baseline of a server that transcribes only after ``audio-stop``, as
wyoming-faster-whisper does: the same model decoding each whole clip offline in this process,
greedy and with 5 beams; its decode time is the least such a server would make the user wait.
Output: ``bench/results/wyoming.json`` (``--out``); the last line is the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient

from bench.accuracy_metrics import count_errors, percentile
from bench.corpus import ManifestRow, read_manifest
from bench.engine import RESULTS, load_speech, speech_dir, write_results
from bench.server_process import ServerProcess, free_port, http_ok

CHUNK_SAMPLES = 1024
RATE_HZ = 16_000
DEFAULT_SET = "librispeech_test-other/"
WAIT_S = 120.0


async def transcribe_paced(
    port: int, audio: np.ndarray[Any, np.dtype[np.float32]], tail_silence_s: float
) -> dict[str, Any]:
    """One command as Home Assistant streams it; its text and timings."""
    silence = np.zeros(int(tail_silence_s * RATE_HZ), np.float32)
    pcm = (np.clip(np.concatenate([audio, silence]), -1, 32767 / 32768) * 32768).astype("<i2")
    data = pcm.tobytes()
    step = CHUNK_SAMPLES * 2
    loop = asyncio.get_running_loop()
    async with AsyncTcpClient("127.0.0.1", port) as client:
        first_chunk: list[float] = []
        transcript: list[tuple[float, str]] = []

        async def read() -> None:
            while True:
                event = await asyncio.wait_for(client.read_event(), WAIT_S)
                if event is None:
                    raise ConnectionError("the server closed the connection")
                if event.type == "transcript-chunk" and not first_chunk:
                    first_chunk.append(loop.time())
                if Transcript.is_type(event.type):
                    transcript.append((loop.time(), Transcript.from_event(event).text))
                    return

        reader = asyncio.create_task(read())
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=RATE_HZ, width=2, channels=1).event())
        started = loop.time()
        for n, i in enumerate(range(0, len(data), step)):
            # Absolute times: a late chunk does not delay the ones after it.
            await asyncio.sleep(max(0.0, started + n * CHUNK_SAMPLES / RATE_HZ - loop.time()))
            chunk = AudioChunk(rate=RATE_HZ, width=2, channels=1, audio=data[i : i + step])
            await client.write_event(chunk.event())
        await client.write_event(AudioStop().event())
        stopped = loop.time()
        await reader
    arrived, text = transcript[0]
    return {
        "text": text,
        "stop_to_transcript_s": round(arrived - stopped, 3),
        "first_chunk_s": round(first_chunk[0] - started, 3) if first_chunk else None,
    }


async def serve_clips(
    rows: list[ManifestRow], tail_silence_s: float, server_args: list[str]
) -> list[dict[str, Any]]:
    port, wyoming_port = free_port(), free_port()
    cmd = [
        os.path.join(sys.prefix, "bin", "whisperwire-server"),
        *("--port", str(port), "--wyoming-port", str(wyoming_port)),
        *("--model", "tiny.en", "--log-level", "warning", *server_args),
    ]
    ready = f"http://127.0.0.1:{port}/readyz"
    log = RESULTS / "logs" / "wyoming_server.log"
    out = []
    async with ServerProcess("whisperwire", cmd, ready=lambda: http_ok(ready), log_path=log):
        for row in rows:
            got = await transcribe_paced(wyoming_port, load_speech(row.file), tail_silence_s)
            counts = count_errors(row.transcript, got["text"])
            out.append({"file": row.file, "ref_words": counts.ref_words, "errors": counts.errors})
            out[-1].update(got)
            print(json.dumps(out[-1]), flush=True)
    return out


def offline_baseline(rows: list[ManifestRow], beam_size: int) -> list[dict[str, Any]]:
    """Each whole clip decoded offline by the same model in this process: what a server that
    starts at ``audio-stop`` has to do before it can answer."""
    from server.core.engine_api import DecodeOptions
    from server.engine.engine import Engine, EngineConfig
    from server.engine.offline import transcribe_audio

    engine = Engine.load(EngineConfig())
    engine.warmup()
    out = []
    for row in rows:
        audio = load_speech(row.file)
        started = time.perf_counter()
        text = transcribe_audio(engine, audio, DecodeOptions(beam_size=beam_size)).text
        took = time.perf_counter() - started
        counts = count_errors(row.transcript, text)
        out.append(
            {"file": row.file, "errors": counts.errors, "ref_words": counts.ref_words, "s": took}
        )
    return out


def summary(records: list[dict[str, Any]], key: str) -> dict[str, Any]:
    errors = sum(r["errors"] for r in records)
    words = sum(r["ref_words"] for r in records)
    values = [r[key] for r in records if r.get(key) is not None]
    return {
        "wer": round(errors / words, 4) if words else None,
        f"{key}_p50": _round(percentile(values, 0.5)),
        f"{key}_p95": _round(percentile(values, 0.95)),
        f"{key}_max": _round(max(values, default=None)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--match", default=DEFAULT_SET, help="clips whose path contains this")
    parser.add_argument("--limit", type=int, default=0, help="the first N clips only")
    parser.add_argument("--tail-silence-s", type=float, default=0.7)
    parser.add_argument("--server-args", default="", help="more whisperwire-server flags")
    parser.add_argument("--out", default="wyoming")
    args = parser.parse_args(argv)
    rows = [
        r
        for r in read_manifest(speech_dir() / "manifest.tsv")
        if args.match in r.file and r.language == "en"
    ]
    if args.limit:
        rows = rows[: args.limit]
    if not rows:
        raise SystemExit(f"no English clip matches {args.match!r}")
    served = asyncio.run(serve_clips(rows, args.tail_silence_s, args.server_args.split()))
    greedy = offline_baseline(rows, beam_size=1)
    beam = offline_baseline(rows, beam_size=5)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "clips": len(rows),
        "match": args.match,
        "tail_silence_s": args.tail_silence_s,
        "server_args": args.server_args,
        "load_average": os.getloadavg()[0],
        "summary": {
            "wyoming": {
                **summary(served, "stop_to_transcript_s"),
                **summary(served, "first_chunk_s"),
            },
            "offline_after_stop_greedy": summary(greedy, "s"),
            "offline_after_stop_beam5": summary(beam, "s"),
        },
        "served": served,
        "offline_greedy": greedy,
        "offline_beam5": beam,
    }
    path = write_results(args.out, result)
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
