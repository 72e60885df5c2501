from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest

from bench.corpus import find_speech_dir, load_clip
from bench.turn_model import LONG_RECORDING, lj_turn_cuts
from server.protocol.errors import ModelFormatError, ModelNotFoundError
from server.protocol.formats import SAMPLE_RATE_HZ
from server.turns.onnx import SMART_TURN_FILE, packaged_model
from server.turns.smart_turn import (
    N_FRAMES,
    N_MELS,
    WINDOW_SAMPLES,
    SmartTurn,
    SmartTurnConfig,
    last_window,
    smart_turn_features,
)


def _speech_dir() -> Path:
    found = find_speech_dir()
    if found is None:
        pytest.skip("real speech recordings (shared/speech) not found")
    return found


@pytest.fixture(scope="module")
def model() -> SmartTurn:
    return SmartTurn()


def _reference_features() -> ModuleType:
    """pipecat's numpy copy of transformers' WhisperFeatureExtractor, the preprocessing Smart
    Turn v3 was trained with, loaded from its file (pipecat's __init__ is a framework)."""
    path = packaged_model(SMART_TURN_FILE).parents[1] / "_whisper_features.py"
    spec = importlib.util.spec_from_file_location("smart_turn_reference_features", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("clip", "seconds"),
    [
        ("ljspeech/LJ001-0002.wav", None),  # 1.9 s: padded at the start
        ("ljspeech/LJ001-0001.wav", None),  # 9.7 s: its last 8 s
        (LONG_RECORDING, 30.0),  # a window that starts mid-word
    ],
)
def test_features_match_the_reference_whisper_feature_extractor(
    clip: str, seconds: float | None
) -> None:
    audio = load_clip(_speech_dir() / clip)
    if seconds is not None:
        audio = audio[: round(seconds * SAMPLE_RATE_HZ)]
    reference = _reference_features().compute_whisper_log_mel_features(
        last_window(audio), do_normalize=True
    )
    ours = smart_turn_features(audio)
    assert ours.shape == reference.shape == (N_MELS, N_FRAMES)
    assert ours.dtype == np.float32
    # float32 rounding only: the features span about 2 units.
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_last_window_keeps_the_end_and_pads_the_start() -> None:
    short = np.arange(1, 11, dtype=np.float32)
    padded = last_window(short)
    assert padded.size == WINDOW_SAMPLES
    assert not padded[:-10].any()
    np.testing.assert_array_equal(padded[-10:], short)
    long = np.arange(WINDOW_SAMPLES + 5, dtype=np.float32)
    np.testing.assert_array_equal(last_window(long), long[5:])


def test_sentence_ends_score_higher_than_mid_sentence_pauses(model: SmartTurn) -> None:
    """LJ Speech's clip boundaries in its joined recording, each followed by 200 ms of the
    recording's own quiet (bench/turn_model.py): the 12 ends of sentences against the 17
    pauses inside sentences (after a word or a comma)."""
    cuts = lj_turn_cuts(_speech_dir())
    ends = [model.score(c.audio) for c in cuts if c.kind == "sentence_end"]
    mids = [model.score(c.audio) for c in cuts if c.kind == "mid_sentence"]
    assert len(ends) >= 10 and len(mids) >= 10
    assert all(0.0 <= s <= 1.0 for s in ends + mids)
    assert statistics.fmean(ends) > statistics.fmean(mids) + 0.25, (ends, mids)
    # Every sentence end is called complete, even at the default eot_threshold of 0.7.
    assert min(ends) >= 0.7, ends
    # Pauses inside clauses and at commas: the model calls many of those on read speech
    # complete too (falling pitch at a clause's end); those it calls incomplete are clearly so.
    low = [s for s in mids if s < 0.5]
    assert len(low) >= len(mids) // 3, mids
    assert statistics.median(ends) > statistics.median(mids), (ends, mids)


def test_inside_a_sentence_the_score_rises_as_the_pause_goes_on(model: SmartTurn) -> None:
    """At a sentence end the model is sure at once; inside a sentence ("... by a similar
    process | produced the block books") it grows surer as the pause goes on, so where in a
    pause the model is asked matters."""
    cuts = {c.clip: c for c in lj_turn_cuts(_speech_dir())}
    mid = cuts["ljspeech/LJ001-0003.wav"]
    end = cuts["ljspeech/LJ001-0002.wav"]
    speech, tone = mid.audio[:-3200], mid.audio[-3200:]
    longer = [model.score(np.concatenate([speech, np.tile(tone, k)])) for k in (0, 1, 3)]
    assert longer[0] < 0.5 and longer[0] < longer[2], longer
    assert model.score(end.audio[:-3200]) > 0.9


def test_silence_and_short_audio_score_without_error(model: SmartTurn) -> None:
    for audio in (np.zeros(0, np.float32), np.zeros(SAMPLE_RATE_HZ, np.float32)):
        assert 0.0 <= model.score(audio) <= 1.0


def test_bad_audio_is_refused_in_the_scorers_terms(model: SmartTurn) -> None:
    with pytest.raises(ValueError, match="1-D"):
        model.score(np.zeros((2, 100), np.float32))
    bad: npt.NDArray[np.float32] = np.zeros(100, np.float32)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        model.score(bad)
    with pytest.raises(ValueError, match="80, 800"):
        model.score_features(np.zeros((80, 700), np.float32))


def test_config_is_validated_and_a_missing_or_broken_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="threads"):
        SmartTurnConfig(threads=0)
    missing = tmp_path / "absent.onnx"
    with pytest.raises(ModelNotFoundError, match=r"absent\.onnx"):
        SmartTurn(SmartTurnConfig(model_path=missing))
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    with pytest.raises(ModelFormatError, match=r"broken\.onnx"):
        SmartTurn(SmartTurnConfig(model_path=broken))


def test_a_configured_path_is_the_file_loaded(model: SmartTurn) -> None:
    again = SmartTurn(SmartTurnConfig(model_path=model.path, threads=2))
    audio = load_clip(_speech_dir() / "ljspeech/LJ001-0016.wav")
    assert again.path == model.path
    assert again.score(audio) == pytest.approx(model.score(audio), abs=1e-4)
