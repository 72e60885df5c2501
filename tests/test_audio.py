from __future__ import annotations

import random
import struct
import wave
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import soxr

from bench.phone_line import band_pass, g711_encode, phone_line
from server.protocol.audio import PcmDecoder, pcm_s16le_bytes, read_audio_file
from server.protocol.errors import AudioFormatError, FrameTooLargeError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from tests.helpers import encode_audio


def _raw_wav(path: Path) -> npt.NDArray[np.float32]:
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE_HZ)
        data = w.readframes(w.getnframes())
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


@pytest.fixture
def speech(speech_dir: Path) -> npt.NDArray[np.float32]:
    return _raw_wav(speech_dir / "librispeech_test-clean" / "1089-134686-0000.wav")


def _decoder(rate: int = SAMPLE_RATE_HZ, encoding: str = "pcm_s16le") -> PcmDecoder:
    return PcmDecoder(AudioFormat(sample_rate_hz=rate, encoding=encoding), max_frame_bytes=1 << 20)


def _random_frames(blob: bytes, width: int, rng: random.Random) -> list[bytes]:
    frames, pos = [], 0
    while pos < len(blob):
        n = rng.randint(0, 700) * width
        frames.append(blob[pos : pos + n])
        pos += n
    return frames


# --- PcmDecoder: formats and validation -----------------------------------------------------


def test_s16le_round_trip_is_exact() -> None:
    ints = np.array([-32768, -12345, -1, 0, 1, 12345, 32767], dtype="<i2")
    out = _decoder().decode(ints.tobytes())
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ints.astype(np.float32) / 32768.0)
    assert pcm_s16le_bytes(out) == ints.tobytes()


def test_f32le_round_trip() -> None:
    values = np.array([-1.0, -0.5, 0.0, 1e-6, 0.25, 1.0], dtype="<f4")
    out = _decoder(encoding="pcm_f32le").decode(values.tobytes())
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, values)


def test_f32le_out_of_range_is_clipped() -> None:
    values = np.array([-3.0, -1.5, 0.5, 1.0001, 7.0], dtype="<f4")
    out = _decoder(encoding="pcm_f32le").decode(values.tobytes())
    np.testing.assert_array_equal(out, np.array([-1.0, -1.0, 0.5, 1.0, 1.0], dtype=np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_f32le_nan_and_inf_are_rejected(bad: float) -> None:
    values = np.array([0.1, bad, 0.2], dtype="<f4")
    with pytest.raises(AudioFormatError, match="NaN or infinite"):
        _decoder(encoding="pcm_f32le").decode(values.tobytes())


def test_empty_frame_returns_empty() -> None:
    out = _decoder(rate=44_100).decode(b"")
    assert out.dtype == np.float32
    assert out.size == 0


def test_partial_sample_is_rejected_with_a_clear_message() -> None:
    with pytest.raises(AudioFormatError) as info:
        _decoder().decode(b"\x00" * 1001)
    assert "1001 bytes is not a whole number of 2-byte pcm_s16le samples" in str(info.value)
    assert info.value.close_code == 1003
    with pytest.raises(AudioFormatError, match="4-byte pcm_f32le"):
        _decoder(encoding="pcm_f32le").decode(b"\x00" * 6)


def test_one_byte_off_frames_are_rejected() -> None:
    blob = pcm_s16le_bytes(np.linspace(-0.5, 0.5, 100, dtype=np.float32))
    dec = _decoder()
    with pytest.raises(AudioFormatError):
        dec.decode(blob[:51])
    # A rejected frame is not counted as accepted.
    assert dec.samples_in == 0


def test_oversize_frame_is_rejected() -> None:
    dec = PcmDecoder(AudioFormat(), max_frame_bytes=1000)
    dec.decode(b"\x00" * 1000)
    with pytest.raises(FrameTooLargeError) as info:
        dec.decode(b"\x00" * 1002)
    assert "1002" in str(info.value)
    assert "1000" in str(info.value)
    assert info.value.close_code == 1009


@pytest.mark.parametrize("encoding", ["pcm_s16le", "pcm_f32le"])
def test_whole_sample_frames_of_any_length_reassemble_exactly(
    encoding: str, speech: npt.NDArray[np.float32]
) -> None:
    clip = speech[:40_000]
    if encoding == "pcm_s16le":
        blob, width = pcm_s16le_bytes(clip), 2
    else:
        blob, width = clip.astype("<f4").tobytes(), 4
    dec = _decoder(encoding=encoding)
    frames = _random_frames(blob, width, random.Random(7))
    assert any((len(f) // width) % 2 for f in frames)  # odd sample counts really occur
    out = np.concatenate([dec.decode(f) for f in frames] + [dec.flush()])
    np.testing.assert_array_equal(out, clip)
    assert dec.samples_in == clip.size
    assert dec.seconds_in == pytest.approx(clip.size / SAMPLE_RATE_HZ)


def test_decode_after_flush_is_rejected() -> None:
    dec = _decoder(rate=48_000)
    dec.decode(b"\x00\x00" * 480)
    dec.flush()
    with pytest.raises(AudioFormatError, match="flushed"):
        dec.decode(b"\x00\x00")
    assert dec.flush().size == 0


# --- PcmDecoder: G.711 ------------------------------------------------------------------------


@pytest.mark.parametrize("law", ["mulaw", "alaw"])
def test_g711_at_16k_keeps_the_speech(law: str, speech: npt.NDArray[np.float32]) -> None:
    blob = g711_encode(speech, law)
    assert len(blob) == speech.size  # one byte per sample
    dec = _decoder(encoding=law)
    # Any frame length is whole samples: no byte of G.711 can be half a sample.
    out = np.concatenate([dec.decode(f) for f in _random_frames(blob, 1, random.Random(7))])
    assert dec.samples_in == speech.size
    noise = out - speech
    snr_db = 10 * np.log10(float(np.sum(speech**2)) / float(np.sum(noise**2)))
    assert snr_db > 30, snr_db  # G.711's companding noise is about 38 dB below speech


@pytest.mark.parametrize("law", ["mulaw", "alaw"])
def test_phone_line_at_8k_comes_out_at_16k(law: str, speech: npt.NDArray[np.float32]) -> None:
    blob = phone_line(speech, law)
    dec = _decoder(rate=8_000, encoding=law)
    pieces = [dec.decode(f) for f in _random_frames(blob, 1, random.Random(8))]
    out = np.concatenate([*pieces, dec.flush()])
    assert dec.seconds_in == pytest.approx(speech.size / SAMPLE_RATE_HZ, abs=1e-3)
    assert abs(out.size - speech.size) <= 3
    n = min(out.size, speech.size)
    # The line kept 300-3400 Hz; compare that band of the original.
    corr = float(np.corrcoef(out[:n], band_pass(speech)[:n])[0, 1])
    assert corr > 0.98, corr


def test_g711_frames_split_anywhere_decode_the_same() -> None:
    blob = bytes(range(256)) * 40
    whole = _decoder(rate=8_000, encoding="alaw")
    split = _decoder(rate=8_000, encoding="alaw")
    expected = np.concatenate([whole.decode(blob), whole.flush()])
    frames = _random_frames(blob, 1, random.Random(3))
    got = np.concatenate([*(split.decode(f) for f in frames), split.flush()])
    np.testing.assert_array_equal(got, expected)


# --- PcmDecoder: resampling --------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_resampling_real_speech_to_16k(rate: int, speech: npt.NDArray[np.float32]) -> None:
    source = np.asarray(soxr.resample(speech, SAMPLE_RATE_HZ, rate, quality="HQ"), np.float32)
    blob = pcm_s16le_bytes(source)
    dec = _decoder(rate=rate)
    pieces = [dec.decode(f) for f in _random_frames(blob, 2, random.Random(rate))]
    tail = dec.flush()
    assert tail.size > 0  # the resampler really held samples back
    out = np.concatenate([*pieces, tail])
    assert dec.samples_in == source.size
    assert abs(out.size - speech.size) <= 3
    n = min(out.size, speech.size)
    if rate == 8_000:
        # Telephone-band input lost everything above 4 kHz; compare the band it kept.
        reference = soxr.resample(soxr.resample(speech, SAMPLE_RATE_HZ, rate), rate, SAMPLE_RATE_HZ)
        reference = np.asarray(reference, np.float32)[:n]
    else:
        reference = speech[:n]
    corr = float(np.corrcoef(out[:n], reference)[0, 1])
    assert corr > 0.99, corr


def test_flush_delivers_the_resampler_tail() -> None:
    dec = _decoder(rate=48_000)
    tone = np.sin(2 * np.pi * 440 * np.arange(4800) / 48_000).astype(np.float32) * 0.5
    head = dec.decode(pcm_s16le_bytes(tone))
    assert head.size < 1600  # some output is still inside the filter
    tail = dec.flush()
    assert head.size + tail.size == 1600
    assert np.abs(tail).max() > 0.1  # real signal, not just padding


def test_16k_input_is_not_delayed() -> None:
    dec = _decoder()
    out = dec.decode(pcm_s16le_bytes(np.full(160, 0.25, dtype=np.float32)))
    assert out.size == 160
    assert dec.flush().size == 0


def test_pcm_s16le_bytes_clips_and_silences_nan() -> None:
    blob = pcm_s16le_bytes(np.array([2.0, -2.0, np.nan, 0.5], dtype=np.float32))
    assert struct.unpack("<4h", blob) == (32767, -32768, 0, 16384)


# --- read_audio_file ---------------------------------------------------------------------------


def test_read_real_16bit_wav_matches_raw_samples(speech_dir: Path) -> None:
    path = speech_dir / "misc_en" / "jfk.wav"
    out = read_audio_file(path)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, _raw_wav(path))


def _write_wav(
    path: Path, tag: int, channels: int, rate: int, bits: int, data: bytes, extensible: bool
) -> None:
    block = channels * bits // 8
    fmt = struct.pack(
        "<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * block, block, bits
    )
    if extensible:
        guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + guid_tail
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"LIST" + struct.pack("<I", 5) + b"INFOx\x00"  # odd chunk: needs its pad byte
    chunks += b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)


def test_read_24bit_wav(tmp_path: Path) -> None:
    ints = np.array([-(2**23), -1, 0, 1, 4_000_000, 2**23 - 1], dtype=np.int32)
    data = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
    path = tmp_path / "24bit.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(3)
        w.setframerate(SAMPLE_RATE_HZ)
        w.writeframes(data)
    out = read_audio_file(path)
    np.testing.assert_allclose(out, ints / 2**23, atol=1e-7)


@pytest.mark.parametrize("extensible", [False, True])
def test_read_float32_wav(tmp_path: Path, extensible: bool) -> None:
    values = np.array([0.0, 0.5, -0.25, 0.999, -1.0], dtype="<f4")
    path = tmp_path / "float.wav"
    _write_wav(path, 3, 1, SAMPLE_RATE_HZ, 32, values.tobytes(), extensible)
    np.testing.assert_array_equal(read_audio_file(path), values)


def test_read_stereo_float_wav_downmixes_and_resamples(
    tmp_path: Path, speech: npt.NDArray[np.float32]
) -> None:
    clip = speech[:32_000]
    at_48k = np.asarray(soxr.resample(clip, SAMPLE_RATE_HZ, 48_000), np.float32)
    stereo = np.stack([at_48k * 0.5, at_48k * 1.5], axis=1).astype("<f4")
    path = tmp_path / "stereo48k.wav"
    _write_wav(path, 3, 2, 48_000, 32, stereo.tobytes(), extensible=False)
    out = read_audio_file(path)
    assert abs(out.size - clip.size) <= 2
    n = min(out.size, clip.size)
    assert float(np.corrcoef(out[:n], clip[:n])[0, 1]) > 0.99


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.wav"
    with pytest.raises(FileNotFoundError, match=r"nope\.wav"):
        read_audio_file(missing)


def test_other_formats_are_read_by_pyav(tmp_path: Path, speech: npt.NDArray[np.float32]) -> None:
    path = tmp_path / "speech.flac"
    path.write_bytes(encode_audio(speech, "flac"))
    out = read_audio_file(path)
    n = min(out.size, speech.size)
    assert abs(out.size - speech.size) < 1600
    assert float(np.corrcoef(out[:n], speech[:n])[0, 1]) > 0.99


def test_a_file_that_is_no_audio_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "song.mp3"
    path.write_bytes(b"ID3\x04\x00" + bytes(200))
    with pytest.raises(ValueError, match="could not be decoded") as info:
        read_audio_file(path)
    assert "song.mp3" in str(info.value)
