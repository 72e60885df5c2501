"""Uploaded audio files decoded with PyAV (server/protocol/media.py): the formats people
upload, made from real speech, come back as the same speech at 16 kHz mono; what is no audio
is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from server.protocol.formats import SAMPLE_RATE_HZ
from server.protocol.media import MediaError, decode_media
from tests.helpers import UPLOAD_FORMATS, encode_audio


@pytest.mark.parametrize("suffix", sorted(UPLOAD_FORMATS))
def test_each_upload_format_decodes_to_the_same_speech(speech_dir: Path, suffix: str) -> None:
    speech = load_clip(speech_dir / "misc_en/jfk.wav")
    decoded = decode_media(encode_audio(speech, suffix))
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    # Codecs pad the start (encoder delay) and the end by up to a few frames.
    assert abs(decoded.shape[0] - speech.shape[0]) < 0.1 * SAMPLE_RATE_HZ
    # The same waveform, once aligned for the codec's delay: correlation near 1.
    lag = _delay(speech, decoded)
    assert 0 <= lag < 0.1 * SAMPLE_RATE_HZ
    n = min(decoded.shape[0] - lag, speech.shape[0])
    assert float(np.corrcoef(speech[:n], decoded[lag : lag + n])[0, 1]) > 0.95, suffix


def _delay(original: np.ndarray, decoded: np.ndarray) -> int:  # type: ignore[type-arg]
    """Samples by which ``decoded`` lags ``original`` (the peak of their cross-correlation)."""
    size = 1 << int(np.ceil(np.log2(original.shape[0] + decoded.shape[0])))
    spectrum = np.fft.rfft(decoded, size) * np.conj(np.fft.rfft(original, size))
    correlation = np.fft.irfft(spectrum, size)
    lag = int(np.argmax(correlation))
    return lag if lag < size // 2 else lag - size


def test_a_path_is_read_like_bytes(speech_dir: Path) -> None:
    path = speech_dir / "misc_en/jfk.wav"
    assert np.array_equal(decode_media(path), decode_media(path.read_bytes()))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"this is a text file, not audio\n" * 20, "could not be decoded"),
        (b"\x00" * 4096, "could not be decoded"),
    ],
)
def test_what_is_no_audio_is_refused_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(MediaError, match=reason):
        decode_media(data)


def test_a_file_cut_short_gives_the_speech_it_holds(speech_dir: Path) -> None:
    """An upload cut off mid-stream (a dropped connection while recording) still holds the
    speech before the cut: that is decoded, as FFmpeg does, not refused."""
    speech = load_clip(speech_dir / "misc_en/jfk.wav")
    mp3 = encode_audio(speech, "mp3")
    decoded = decode_media(mp3[: len(mp3) // 2])
    assert 0.4 * speech.shape[0] < decoded.shape[0] < 0.6 * speech.shape[0]


def test_a_recording_over_the_limit_is_refused(speech_dir: Path) -> None:
    speech = load_clip(speech_dir / "misc_en/jfk.wav")
    with pytest.raises(MediaError, match="longer than the 5 s"):
        decode_media(encode_audio(speech, "flac"), max_duration_s=5.0)
