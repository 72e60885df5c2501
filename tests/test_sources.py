"""Audio sources: chunking, reassembly, stdin reading, and the microphone's missing-module error."""

from __future__ import annotations

import io
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from client.sources import FileSource, MicrophoneSource, SourceError, StdinSource
from server.protocol.audio import pcm_s16le_bytes, read_audio_file
from server.protocol.formats import AudioFormat

SPEECH = Path(__file__).resolve().parents[2] / "shared" / "speech"
JFK = SPEECH / "misc_en" / "jfk.wav"


async def _collect(source: FileSource | StdinSource) -> list[bytes]:
    return [chunk async for chunk in source.chunks()]


def _write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())


@pytest.mark.skipif(not JFK.is_file(), reason="shared speech clips not present")
async def test_file_chunks_reassemble_to_the_files_samples() -> None:
    source = FileSource(JFK, chunk_ms=100)
    chunks = await _collect(source)
    expected = pcm_s16le_bytes(read_audio_file(JFK))
    assert b"".join(chunks) == expected
    assert all(len(c) == 3200 for c in chunks[:-1])  # 100 ms of 16 kHz s16le
    assert 0 < len(chunks[-1]) <= 3200
    assert source.audio_format == AudioFormat(16000, "pcm_s16le")
    assert source.duration_s == pytest.approx(len(expected) / 32000)
    assert not source.live


async def test_file_source_chunk_size_and_short_last_chunk(tmp_path: Path) -> None:
    samples = (np.arange(16000 + 123) % 2000 - 1000).astype(np.int16)
    path = tmp_path / "ramp.wav"
    _write_wav(path, samples)
    chunks = await _collect(FileSource(path, chunk_ms=250))
    assert [len(c) for c in chunks] == [8000, 8000, 8000, 8000, 246]
    assert b"".join(chunks) == samples.astype("<i2").tobytes()


async def test_file_source_stop_ends_early(tmp_path: Path) -> None:
    path = tmp_path / "silence.wav"
    _write_wav(path, np.zeros(16000, dtype=np.int16))
    source = FileSource(path)
    got = []
    async for chunk in source.chunks():
        got.append(chunk)
        source.stop()
    assert len(got) == 1


def test_missing_file_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such audio file"):
        FileSource(tmp_path / "nope.wav")


def test_undecodable_file_is_a_source_error(tmp_path: Path) -> None:
    path = tmp_path / "noise.wav"
    path.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(SourceError, match="cannot read"):
        FileSource(path)


async def test_stdin_source_reads_raw_pcm_unconverted() -> None:
    pcm = bytes(range(256)) * 40  # 10240 bytes of arbitrary s16le
    source = StdinSource(8000, "pcm_s16le", chunk_ms=100, stream=io.BytesIO(pcm))
    chunks = await _collect(source)
    assert [len(c) for c in chunks] == [1600] * 6 + [640]  # 100 ms at 8 kHz s16le is 1600 B
    assert b"".join(chunks) == pcm
    assert source.audio_format == AudioFormat(8000, "pcm_s16le")


async def test_stdin_source_f32_drops_a_trailing_partial_sample() -> None:
    pcm = np.linspace(-1, 1, 4800, dtype="<f4").tobytes() + b"\x01\x02"
    source = StdinSource(48000, "pcm_f32le", chunk_ms=20, stream=io.BytesIO(pcm))
    chunks = await _collect(source)
    assert all(len(c) % 4 == 0 for c in chunks)
    assert b"".join(chunks) == pcm[:-2]


class _TrickleReader(io.RawIOBase):
    """A pipe that returns at most a few bytes per read, as pipes may."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data = data
        self._step = step

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1, /) -> bytes:
        n = min(self._step, len(self._data)) if size < 0 else min(size, self._step)
        out, self._data = self._data[:n], self._data[n:]
        return out


async def test_stdin_source_fills_chunks_from_short_reads() -> None:
    pcm = bytes(7000)
    source = StdinSource(16000, "pcm_s16le", 100, stream=_TrickleReader(pcm, 333))
    chunks = await _collect(source)
    assert [len(c) for c in chunks] == [3200, 3200, 600]


def test_stdin_source_refuses_a_bad_format() -> None:
    with pytest.raises(ValueError, match="sample_rate must be between"):
        StdinSource(4000, "pcm_s16le", stream=io.BytesIO())
    with pytest.raises(ValueError, match="encoding must be one of"):
        StdinSource(16000, "opus", stream=io.BytesIO())


def test_microphone_without_sounddevice_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes `import sounddevice` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "sounddevice", None)
    with pytest.raises(SourceError) as info:
        MicrophoneSource()
    message = str(info.value)
    assert "sounddevice" in message
    assert "pip install 'whisperwire[mic]'" in message
    assert "\n" not in message


def test_listen_without_sounddevice_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from client.cli import main

    monkeypatch.setitem(sys.modules, "sounddevice", None)
    assert main(["listen"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "whisperwire[mic]" in err
