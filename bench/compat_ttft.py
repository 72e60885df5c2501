"""Time to first text through each API of one server: protocol v1, OpenAI Realtime
transcription and Deepgram live (``docs/compat.md``), on the same clip at 1x pace.

    python -m bench.compat_ttft [--clip FILE] [--runs N]

One in-process server with tiny.en; after a warm-up stream, each API streams the clip in
100 ms frames in real time (then 1 s of silence), through the vendors' own clients for the
vendor APIs, one API after the other. TTFT is the time from sending the first audio frame to
receiving the first text: v1's first ``partial`` or ``final`` with words, OpenAI's first
transcription delta (which carries finals only), Deepgram's first ``Results`` with a
transcript (interim). The first final of each is recorded too (v1 ``final``, OpenAI delta,
Deepgram ``is_final``), with the transcript's word error rate. Writes
``bench/results/compat-ttft.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import soxr
from deepgram import AsyncDeepgramClient
from deepgram.environment import DeepgramClientEnvironment
from deepgram.listen.v1.types.listen_v1results import ListenV1Results
from openai import AsyncOpenAI
from websockets.asyncio.client import connect

from bench.corpus import load_clip, read_manifest, wer
from bench.engine import speech_dir, write_results
from server.config import ServerConfig
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer

CLIP = "librispeech_test-clean/1089-134686-0000.wav"  # 10.4 s, one speaker, no long pause
FRAME_S = 0.1
TRAILING_SILENCE_S = 1.0
OPENAI_RATE_HZ = 24_000
APIS = ("v1", "openai", "deepgram")


@dataclass
class Run:
    """What one API's client saw, in seconds from its first audio frame."""

    api: str
    ttft_s: float | None = None
    first_final_s: float | None = None
    text: list[str] = field(default_factory=list)
    wer: float | None = None


class Clock:
    """Seconds since the first frame, and the pacing of frames at 1x."""

    def __init__(self) -> None:
        self.start = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def paced(self, frames: list[Any], send: Callable[[Any], Awaitable[None]]) -> None:
        self.start = time.perf_counter()
        for i, frame in enumerate(frames):
            await asyncio.sleep(max(0.0, i * FRAME_S - self.now()))
            await send(frame)


def note_text(run: Run, clock: Clock, *, final: bool) -> None:
    if run.ttft_s is None:
        run.ttft_s = clock.now()
    if final and run.first_final_s is None:
        run.first_final_s = clock.now()


async def stream_v1(base: str, audio: np.ndarray) -> Run:
    run, clock = Run("v1"), Clock()
    pcm = pcm_s16le_bytes(audio)
    step = int(FRAME_S * SAMPLE_RATE_HZ) * 2
    frames = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    async with connect(base + "/v1/stream") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"

        async def send() -> None:
            await clock.paced(frames, ws.send)
            await ws.send('{"type": "end"}')

        sender = asyncio.create_task(send())
        async for raw in ws:
            message = json.loads(raw)
            if message["type"] in ("partial", "final") and message["text"].strip():
                note_text(run, clock, final=message["type"] == "final")
                if message["type"] == "final":
                    run.text.append(message["text"])
        await sender
    return run


async def stream_openai(base: str, audio: np.ndarray) -> Run:
    run, clock = Run("openai"), Clock()
    resampled = np.asarray(soxr.resample(audio, SAMPLE_RATE_HZ, OPENAI_RATE_HZ), np.float32)
    pcm = pcm_s16le_bytes(resampled)
    step = int(FRAME_S * OPENAI_RATE_HZ) * 2
    frames = [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)]
    client = AsyncOpenAI(base_url="http" + base.removeprefix("ws") + "/v1", api_key="unused")
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        assert json.loads(await conn.recv_bytes())["type"] == "session.created"

        async def append(chunk: str) -> None:
            await conn.input_audio_buffer.append(audio=chunk)

        sender = asyncio.create_task(clock.paced(frames, append))
        started = completed = 0
        while not (sender.done() and started and completed == started):
            event = json.loads(await conn.recv_bytes())
            kind = event["type"]
            started += kind == "input_audio_buffer.speech_started"
            if kind == "conversation.item.input_audio_transcription.delta":
                note_text(run, clock, final=True)
            if kind == "conversation.item.input_audio_transcription.completed":
                completed += 1
                run.text.append(event["transcript"])
        await sender
    return run


async def stream_deepgram(base: str, audio: np.ndarray) -> Run:
    run, clock = Run("deepgram"), Clock()
    pcm = pcm_s16le_bytes(audio)
    step = int(FRAME_S * SAMPLE_RATE_HZ) * 2
    frames = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    http = "http" + base.removeprefix("ws")
    environment = DeepgramClientEnvironment(base=http, production=base, agent=base, agent_rest=http)
    client = AsyncDeepgramClient(api_key="unused", environment=environment)
    async with client.listen.v1.connect(
        model="nova-3",
        encoding="linear16",
        sample_rate=str(SAMPLE_RATE_HZ),
        interim_results="true",
        punctuate="true",
    ) as socket:

        async def send() -> None:
            await clock.paced(frames, socket.send_media)
            await socket.send_close_stream()

        sender = asyncio.create_task(send())
        async for message in socket:
            if isinstance(message, ListenV1Results):
                transcript = message.channel.alternatives[0].transcript
                if transcript:
                    note_text(run, clock, final=bool(message.is_final))
                    if message.is_final:
                        run.text.append(transcript)
        await sender
    return run


STREAMS = {"v1": stream_v1, "openai": stream_openai, "deepgram": stream_deepgram}


async def measure(clip: str, runs: int) -> dict[str, Any]:
    from server.engine.engine import Engine, EngineConfig

    folder = speech_dir()
    reference = next(r.transcript for r in read_manifest(folder / "manifest.tsv") if r.file == clip)
    silence = np.zeros(int(TRAILING_SILENCE_S * SAMPLE_RATE_HZ), np.float32)
    audio = np.concatenate([load_clip(folder / clip), silence])
    engine = Engine.load(EngineConfig())
    config = ServerConfig(host="127.0.0.1", port=0, capacity_limit=False)
    loadavg_start = os.getloadavg()
    async with WhisperwireServer(lambda: engine, server=config) as server:
        await stream_v1(server.url, audio[: 3 * SAMPLE_RATE_HZ])  # warm-up, not recorded
        results: dict[str, list[Run]] = {api: [] for api in APIS}
        for _ in range(runs):
            for api in APIS:
                run = await STREAMS[api](server.url, audio)
                run.wer = round(wer(reference, " ".join(run.text)), 4)
                results[api].append(run)
    summary = {}
    for api, api_runs in results.items():
        ttft = [r.ttft_s for r in api_runs if r.ttft_s is not None]
        final = [r.first_final_s for r in api_runs if r.first_final_s is not None]
        summary[api] = {
            "ttft_s": round(statistics.median(ttft), 3) if ttft else None,
            "first_final_s": round(statistics.median(final), 3) if final else None,
            "wer": api_runs[-1].wer,
        }
    return {
        "clip": clip,
        "clip_s": round(audio.shape[0] / SAMPLE_RATE_HZ - TRAILING_SILENCE_S, 3),
        "pace": 1.0,
        "frame_s": FRAME_S,
        "runs": runs,
        "summary": summary,
        "streams": {api: [asdict(r) for r in api_runs] for api, api_runs in results.items()},
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", default=CLIP, help="a file of the speech folder's manifest")
    parser.add_argument("--runs", type=int, default=1, help="streams per API (median reported)")
    args = parser.parse_args()
    results = asyncio.run(measure(args.clip, args.runs))
    path = write_results("compat-ttft", results)
    print(f"{'API':10} {'TTFT s':>8} {'first final s':>14} {'WER':>6}")
    for api, row in results["summary"].items():
        ttft, final = row["ttft_s"], row["first_final_s"]
        print(
            f"{api:10} {ttft if ttft is not None else '-':>8} "
            f"{final if final is not None else '-':>14} {row['wer']:>6}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
