"""The torch-free speaker encoder against resemblyzer's own, on real speech.

``tests/fixtures/speaker_embeddings.json`` holds d-vectors computed once with the reference
implementation (resemblyzer 0.1.4 on torch 2.13.0+cpu, librosa 0.11.0, numpy 2.4.6, Python
3.11), rounded to 6 decimals, for four shared clips of four readers: each clip's embedding
after resemblyzer's ``preprocess_wav`` (volume raised, long silences cut), and on the raw
clip with its partials. Produced in a throwaway virtualenv, never in the project's::

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install --no-deps torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/refvenv/bin/pip install filelock typing-extensions sympy networkx jinja2 fsspec
    /tmp/refvenv/bin/pip install --no-deps resemblyzer==0.1.4
    /tmp/refvenv/bin/pip install 'librosa>=0.9.1' webrtcvad scipy numpy soundfile
    /tmp/refvenv/bin/python tests/fixtures/speaker_reference/make_fixture.py \\
        ../shared/speech > tests/fixtures/speaker_embeddings.json

(the CPU-only torch wheel came from the machine's local wheel folder; the PyPI one pulls
CUDA). The script reads each WAV as int16 / 32768, as ``bench.corpus.load_clip`` does, and
calls ``VoiceEncoder("cpu").embed_utterance`` on ``preprocess_wav(wav)`` and on ``wav``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from server.core.speakers import WINDOW_SAMPLES
from server.speakers.encoder import (
    PARTIAL_SAMPLES,
    SpeakerEncoder,
    mel_filters,
    mel_spectrogram,
    normalize_volume,
    partial_slices,
    preprocess_wav,
)

FIXTURE = Path(__file__).parent / "fixtures" / "speaker_embeddings.json"
# The fixture is rounded to 1e-6; float32 through three LSTM layers adds about as much.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def encoder() -> SpeakerEncoder:
    return SpeakerEncoder.load()


@pytest.fixture(scope="module")
def reference() -> list[dict[str, object]]:
    clips: list[dict[str, object]] = json.loads(FIXTURE.read_text())["clips"]
    return clips


def test_the_window_the_core_plans_is_the_networks_partial() -> None:
    assert WINDOW_SAMPLES == PARTIAL_SAMPLES


def test_preprocessing_cuts_the_same_samples_as_resemblyzer(
    speech_dir: Path, reference: list[dict[str, object]]
) -> None:
    for clip in reference:
        wav = load_clip(speech_dir / str(clip["file"]))
        assert preprocess_wav(wav).size == clip["preprocessed_samples"], clip["file"]


def test_embeddings_match_resemblyzer_on_preprocessed_speech(
    encoder: SpeakerEncoder, speech_dir: Path, reference: list[dict[str, object]]
) -> None:
    for clip in reference:
        wav = preprocess_wav(load_clip(speech_dir / str(clip["file"])))
        embedding, _ = encoder.embed_utterance(wav)
        expected = np.array(clip["preprocessed"], dtype=np.float32)
        np.testing.assert_allclose(embedding, expected, atol=TOLERANCE, err_msg=str(clip["file"]))


def test_partials_match_resemblyzer_on_raw_speech(
    encoder: SpeakerEncoder, speech_dir: Path, reference: list[dict[str, object]]
) -> None:
    for clip in reference:
        wav = load_clip(speech_dir / str(clip["file"]))
        embedding, partials = encoder.embed_utterance(wav)
        expected = np.array(clip["raw_partials"], dtype=np.float32)
        assert partials.shape == expected.shape, clip["file"]
        np.testing.assert_allclose(partials, expected, atol=TOLERANCE, err_msg=str(clip["file"]))
        np.testing.assert_allclose(embedding, np.array(clip["raw"]), atol=TOLERANCE)


def test_windows_tell_two_readers_apart(encoder: SpeakerEncoder, speech_dir: Path) -> None:
    """Streaming windows (volume raised per window, pauses kept): two clips of one reader
    are closer than clips of two readers."""
    a1 = load_clip(speech_dir / "librispeech_test-other/367-130732-0002.wav")
    a2 = load_clip(speech_dir / "librispeech_test-other/367-130732-0003.wav")
    b = load_clip(speech_dir / "ljspeech/LJ001-0003.wav")

    def mean(wav: np.ndarray) -> np.ndarray:
        v = encoder.embed_windows(wav, list(range(0, wav.size - PARTIAL_SAMPLES, 6400))).mean(0)
        return v / np.linalg.norm(v)

    same = float(mean(a1) @ mean(a2))
    other = float(mean(a1) @ mean(b))
    assert same > 0.8 and other < 0.7, (same, other)


def test_a_window_past_the_audio_is_zero_padded(encoder: SpeakerEncoder, speech_dir: Path) -> None:
    wav = load_clip(speech_dir / "ljspeech/LJ001-0002.wav")[:16_000]
    padded = np.zeros(PARTIAL_SAMPLES, dtype=np.float32)
    padded[: wav.size] = wav
    np.testing.assert_allclose(
        encoder.embed_windows(wav, [0]), encoder.embed_windows(padded, [0]), atol=1e-6
    )


def test_mel_filters_have_slaney_area_normalisation() -> None:
    filters = mel_filters()
    assert filters.shape == (40, 201)
    # Slaney normalisation: each triangle's area in Hz is 1 (weights x 40 Hz bins).
    areas = filters.sum(axis=1) * (16_000 / 400)
    np.testing.assert_allclose(areas, 1.0, rtol=0.08)


def test_mel_frames_are_centred(speech_dir: Path) -> None:
    wav = load_clip(speech_dir / "ljspeech/LJ001-0002.wav")
    assert mel_spectrogram(wav).shape == (1 + wav.size // 160, 40)


def test_volume_is_raised_never_lowered(speech_dir: Path) -> None:
    quiet = load_clip(speech_dir / "ljspeech/LJ001-0002.wav") * np.float32(0.01)
    raised = normalize_volume(quiet)
    target = 32767.0 * 10 ** (-30 / 20)
    assert np.sqrt(np.mean((raised * 32767.0) ** 2)) == pytest.approx(target, rel=1e-3)
    np.testing.assert_array_equal(normalize_volume(raised * 4), raised * 4)


def test_partial_slices_follow_resemblyzer() -> None:
    # 2.4 s at 1.3 partials a second: frames 0-160 and 77-237; the second is 50% audio.
    assert partial_slices(38_400) == [slice(0, 160), slice(77, 237)]
    assert partial_slices(8_000) == [slice(0, 160)]
    with pytest.raises(ValueError):
        partial_slices(8_000, rate_hz=0.1)
