"""The ``whisperwire`` command against a real server (tiny.en) on real speech clips.

The server runs in this process on the session's event loop (the ``server_url`` fixture);
the command runs as a real subprocess (the installed ``whisperwire`` entry point), so exit
statuses, standard output and standard error are exactly what a user sees. Files are streamed
with ``--pace 0``: as fast as the server takes them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import sys
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soxr

from tests.helpers import ManifestRow, load_clip, pcm_frames, wer

pytestmark = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 120.0  # a bound for one stream on the real model on a busy 2-core machine
MAX_WER_CLIP = 0.35  # one short clip, streamed: a word or two wrong is allowed
JFK = "misc_en/jfk.wav"  # 11 s, with pauses between phrases: several finals
LIBRI_JSONL = "librispeech_test-clean/1089-134691-0001.wav"  # 5.4 s
LIBRI_STDIN = "librispeech_test-clean/1089-134691-0000.wav"  # 2.1 s
LJ_44K = "ljspeech/LJ001-0011.wav"  # 4.5 s, resampled to 44.1 kHz by the test
SRT_TIME = r"(\d{2}):(\d{2}):(\d{2}),(\d{3})"
SRT_CUE = re.compile(rf"(\d+)\n{SRT_TIME} --> {SRT_TIME}\n(\S[^\n]*)")


def whisperwire_command() -> list[str]:
    """The installed entry point next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("whisperwire")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "client.cli"]


@dataclass(frozen=True)
class Run:
    status: int
    stdout: str
    stderr: str


async def whisperwire(*args: str, stdin: bytes | None = None) -> Run:
    """Run ``whisperwire ARGS`` to completion (bounded by ``WAIT_S``) without blocking the
    event loop the server runs on."""
    proc = await asyncio.create_subprocess_exec(
        *whisperwire_command(),
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), WAIT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())


def stream_url(server_url: str) -> str:
    return server_url + "/v1/stream"


def reference(manifest: list[ManifestRow], file: str) -> str:
    return next(row.transcript for row in manifest if row.file == file)


@dataclass(frozen=True)
class Cue:
    index: int
    start_s: float
    end_s: float
    text: str


def parse_srt(text: str) -> list[Cue]:
    """SubRip cues; fails the test on a block that is not ``N``, ``times`` and one text line."""
    cues = []
    for block in text.strip("\n").split("\n\n"):
        found = SRT_CUE.fullmatch(block)
        assert found is not None, f"not an SRT cue: {block!r}"
        index, *times, cue_text = found.groups()
        h0, m0, s0, ms0, h1, m1, s1, ms1 = (int(t) for t in times)
        start = h0 * 3600 + m0 * 60 + s0 + ms0 / 1000
        end = h1 * 3600 + m1 * 60 + s1 + ms1 / 1000
        cues.append(Cue(int(index), start, end, cue_text))
    return cues


# --------------------------------------------------------------------------- file formats


async def test_text_output_and_stats(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    run = await whisperwire(
        "stream",
        str(speech_dir / JFK),
        "--url",
        stream_url(server_url),
        "--pace",
        "0",
        "--format",
        "text",
        "--stats",
    )
    assert run.status == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines and all(line.strip() == line and line for line in lines), run.stdout
    assert wer(reference(manifest, JFK), " ".join(lines)) <= MAX_WER_CLIP, run.stdout
    # --stats goes to stderr, after the stream; stdout holds the transcript only.
    ttft = re.search(r"^time to first token: (\d+\.\d+) s$", run.stderr, re.M)
    latency = re.search(
        r"^final latency over (\d+) final\(s\): median (\d+\.\d+) s, p95 (\d+\.\d+) s",
        run.stderr,
        re.M,
    )
    rtf = re.search(
        r"^audio: (\d+\.\d+) s sent in (\d+\.\d+) s \(real-time factor (\d+\.\d+)\)$",
        run.stderr,
        re.M,
    )
    assert ttft and latency and rtf, run.stderr
    assert 0 < float(ttft[1]) < WAIT_S
    assert int(latency[1]) == len(lines)  # one latency per final with text
    assert 0 < float(latency[2]) <= float(latency[3]) < WAIT_S
    assert float(rtf[1]) == pytest.approx(11.0, abs=0.1)  # all of jfk.wav was sent
    assert float(rtf[3]) == pytest.approx(float(rtf[2]) / float(rtf[1]), abs=0.01)


async def test_jsonl_output_is_every_message(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    run = await whisperwire(
        "stream",
        str(speech_dir / LIBRI_JSONL),
        "--url",
        stream_url(server_url),
        "--pace",
        "0",
        "--format",
        "jsonl",
    )
    assert run.status == 0, run.stderr
    messages = [json.loads(line) for line in run.stdout.splitlines()]
    assert all(isinstance(m["type"], str) and "audio_received_s" in m for m in messages)
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "ready" and kinds[-1] == "done", kinds
    assert "final" in kinds, kinds
    assert messages[0]["model"] == "tiny.en" and messages[0]["sample_rate"] == 16000
    received = [m["audio_received_s"] for m in messages]
    assert received == sorted(received), received  # the server's clock only moves forward
    assert messages[-1]["audio_received_s"] == pytest.approx(5.415, abs=0.11)
    finals = [m for m in messages if m["type"] == "final"]
    assert messages[-1]["segments"] == len(finals)
    text = " ".join(f["text"] for f in finals)
    assert wer(reference(manifest, LIBRI_JSONL), text) <= MAX_WER_CLIP, text


async def test_srt_output_has_ordered_numbered_cues(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    run = await whisperwire(
        "stream",
        str(speech_dir / JFK),
        "--url",
        stream_url(server_url),
        "--pace",
        "0",
        "--format",
        "srt",
    )
    assert run.status == 0, run.stderr
    cues = parse_srt(run.stdout)
    # jfk.wav pauses for 0.15 s after "... can do for you": the server cuts two segments there.
    assert len(cues) >= 2, run.stdout
    assert [c.index for c in cues] == list(range(1, len(cues) + 1))
    assert all(c.start_s <= c.end_s for c in cues), cues
    assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(cues)), cues
    assert cues[0].start_s >= 0 and cues[-1].end_s <= 11.0 + 0.01, cues
    text = " ".join(c.text for c in cues)
    assert wer(reference(manifest, JFK), text) <= MAX_WER_CLIP, run.stdout


# --------------------------------------------------------------------------- sources


async def test_raw_pcm_on_stdin(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    pcm = b"".join(pcm_frames(load_clip(speech_dir / LIBRI_STDIN)))
    run = await whisperwire(
        "stream",
        "-",
        "--sample-rate",
        "16000",
        "--url",
        stream_url(server_url),
        "--pace",
        "0",
        "--format",
        "text",
        stdin=pcm,
    )
    assert run.status == 0, run.stderr
    assert wer(reference(manifest, LIBRI_STDIN), run.stdout) <= MAX_WER_CLIP, run.stdout


async def test_a_44_1_khz_file_is_resampled(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow], tmp_path: Path
) -> None:
    audio = load_clip(speech_dir / LJ_44K)
    upsampled = soxr.resample(audio, 16000, 44100, quality="HQ")
    path = tmp_path / "clip_44k.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes((np.clip(upsampled, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes())
    run = await whisperwire(
        "stream",
        str(path),
        "--url",
        stream_url(server_url),
        "--pace",
        "0",
        "--format",
        "jsonl",
    )
    assert run.status == 0, run.stderr
    messages = [json.loads(line) for line in run.stdout.splitlines()]
    # The client converts to the 16 kHz the server expects; the length of the audio is kept
    # (played at the wrong rate it would be 2.76 times longer).
    assert messages[0]["sample_rate"] == 16000
    assert messages[-1]["type"] == "done"
    assert messages[-1]["audio_received_s"] == pytest.approx(len(audio) / 16000, abs=0.11)
    text = " ".join(m["text"] for m in messages if m["type"] == "final")
    assert wer(reference(manifest, LJ_44K), text) <= MAX_WER_CLIP, text


# --------------------------------------------------------------------------- failures


async def test_no_server_at_the_port_exits_1_with_one_line(speech_dir: Path) -> None:
    # A bound socket that does not listen: connecting is refused, and no one else gets the port.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        url = f"ws://127.0.0.1:{port}/v1/stream"
        run = await whisperwire("stream", str(speech_dir / JFK), "--url", url, "--pace", "0")
    assert run.status == 1
    assert run.stdout == ""
    assert (
        run.stderr
        == f"whisperwire: error: cannot connect to {url}: is whisperwire-server running?\n"
    )


async def test_wrong_path_exits_1_with_the_servers_reason(
    server_url: str, speech_dir: Path
) -> None:
    url = server_url + "/v1/nope"
    run = await whisperwire("stream", str(speech_dir / JFK), "--url", url, "--pace", "0")
    assert run.status == 1
    assert run.stdout == ""
    assert run.stderr == (
        f"whisperwire: error: {url} refused the connection: HTTP 404: not found: /v1/nope\n"
    )


async def test_retries_take_a_count_and_0_turns_reconnecting_off() -> None:
    from client.cli import build_parser
    from client.reconnect import RetryPolicy

    parser = build_parser()
    assert parser.parse_args(["stream", "x.wav"]).retries == RetryPolicy().max_retries
    assert parser.parse_args(["stream", "x.wav", "--retries", "0"]).retries == 0
    assert parser.parse_args(["listen", "--retries", "9"]).retries == 9
    with pytest.raises(SystemExit):
        parser.parse_args(["stream", "x.wav", "--retries", "-1"])
