"""The numpy token step (``server/engine/cpu_step.py``) against the MLX step it replaces on
the CPU: the same logits on real encoder outputs, and token-identical decodes of real
speech, alone and batched, with prompts and drafts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from server.core.engine_api import DecodeRequest, DecodeResult, Window
from server.engine import cpu_kernels
from server.engine.blas import import_mlx
from server.engine.cpu_step import CpuTokenStep, gelu
from server.engine.engine import Engine
from server.protocol.formats import SAMPLE_RATE_HZ

mx = import_mlx()

CLIPS = (
    ("misc_en/jfk.wav", 4.0),
    ("librispeech_test-clean/1089-134691-0001.wav", 5.4),
    ("ljspeech/LJ001-0011.wav", 2.5),
    ("librispeech_test-clean/61-70968-0000.wav", 4.9),
)


@contextmanager
def mlx_steps(engine: Engine) -> Iterator[None]:
    """Decode with the MLX token step, as a GPU or a build without OpenBLAS does."""
    step = engine.decoder._cpu_step
    engine.decoder._cpu_step = None
    try:
        yield
    finally:
        engine.decoder._cpu_step = step


def _windows(engine: Engine, speech_dir: Path) -> list[Window]:
    prompt = engine.encode_text(" We spoke about printing and old books.")
    out = []
    for i, (clip, seconds) in enumerate(CLIPS):
        audio = load_clip(speech_dir / clip)[: round(seconds * SAMPLE_RATE_HZ)]
        request = DecodeRequest(seconds, prompt=prompt if i % 2 else ())
        out.append(Window(engine.features(audio), request))
    return out


def _same(ours: DecodeResult, reference: DecodeResult) -> None:
    assert ours.sequence == reference.sequence
    assert ours.text == reference.text
    assert ours.stop_reason == reference.stop_reason
    assert ours.avg_logprob == pytest.approx(reference.avg_logprob, abs=1e-3)
    assert ours.no_speech_prob == pytest.approx(reference.no_speech_prob, abs=1e-4)
    assert [w.word for w in ours.words] == [w.word for w in reference.words]


def test_the_engine_steps_in_numpy_on_the_cpu(engine: Engine) -> None:
    assert engine.decoder._cpu_step is not None


def test_without_a_float32_projection_there_is_no_numpy_step(engine: Engine) -> None:
    assert CpuTokenStep.for_decoder(engine.loaded.model.decoder, None) is None


def test_gelu_is_the_cpu_kernel_in_numpy() -> None:
    x = np.linspace(-8.0, 8.0, 4001, dtype=np.float32)
    expected = np.array(cpu_kernels.gelu(mx.array(x)))
    np.testing.assert_allclose(gelu(x), expected, rtol=1e-6, atol=1e-7)


def test_a_step_gives_the_logits_of_the_mlx_step(engine: Engine, speech_dir: Path) -> None:
    decoder = engine.decoder
    assert decoder._cpu_step is not None
    windows = _windows(engine, speech_dir)[:2]
    feats = engine.encode([w.mel for w in windows])
    assert feats[0].shape[0] != feats[1].shape[0]  # rows with different audio lengths
    cross, cross_mask, lengths = decoder._cross(feats)
    caches = decoder._cache(2)
    prompt = [decoder.vocab.sot, *engine.encode_text(" And so my")]
    n = len(prompt)
    causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)[None, None]
    _, caches = decoder._blocks(
        mx.array([prompt, prompt], dtype=mx.int32),
        mx.array([list(range(n))] * 2, dtype=mx.int32),
        0,
        caches,
        mx.array(causal),
        cross,
        cross_mask,
    )
    valid = np.ones((2, engine.dims.n_text_ctx), dtype=np.bool_)
    valid[1, 2] = False  # a column row 1 does not see (a rejected draft token)
    tokens = np.array(engine.encode_text(" fellow")[:1] * 2, dtype=np.int32)
    positions = np.array([n, n], dtype=np.int32)
    decoder._cpu_step.begin(caches, n, cross, lengths)
    ours = decoder._cpu_step.forward([0, 1], tokens, positions, n, valid)
    mask = np.where(valid[:, None, None, : n + 1], 0.0, -np.inf).astype(np.float32)
    reference, _ = decoder._forward(
        mx.array(tokens[:, None]),
        mx.array(positions[:, None]),
        n,
        caches,
        mx.array(mask),
        cross,
        cross_mask,
    )
    assert ours.shape == reference.shape
    assert np.abs(ours - reference).max() < 1e-3 * np.abs(reference).max()
    assert list(ours.argmax(axis=1)) == list(reference.argmax(axis=1))
    # Row 1 stepped alone is row 1 of the pair.
    decoder._cpu_step.begin(caches, n, cross, lengths)
    alone = decoder._cpu_step.forward([1], tokens, positions, n, valid)
    np.testing.assert_allclose(alone[0], ours[1], rtol=1e-5, atol=1e-4)


def test_rows_on_one_audio_step_as_rows_with_a_copy_each(engine: Engine, speech_dir: Path) -> None:
    """A beam search's hypotheses share their audio (``rows_per_audio``): their
    cross-attention is one product over it, and gives each row the logits it gets with its
    own copy of the audio (as the hypotheses had before), which are the MLX step's."""
    decoder = engine.decoder
    step = decoder._cpu_step
    assert step is not None
    window = _windows(engine, speech_dir)[1]
    cross, _, lengths = decoder._cross(engine.encode([window.mel]))
    rows = 3
    copies = [(mx.repeat(k, rows, axis=0), mx.repeat(v, rows, axis=0)) for k, v in cross]
    prompt = [decoder.vocab.sot, *engine.encode_text(" For a full")]
    n = len(prompt)
    causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)[None, None]
    _, caches = decoder._blocks(
        mx.array([prompt] * rows, dtype=mx.int32),
        mx.array([list(range(n))] * rows, dtype=mx.int32),
        0,
        decoder._cache(rows),
        mx.array(causal),
        copies,
        None,
    )
    tokens = np.array(engine.encode_text(" hour he had")[:rows], dtype=np.int32)
    positions = np.full(rows, n, dtype=np.int32)
    valid = np.ones((rows, engine.dims.n_text_ctx), dtype=np.bool_)
    step.begin(caches, n, cross, lengths, rows_per_audio=rows)
    shared = step.forward(list(range(rows)), tokens, positions, n, valid)
    step.begin(caches, n, copies, lengths * rows)
    each = step.forward(list(range(rows)), tokens, positions, n, valid)
    np.testing.assert_allclose(shared, each, rtol=1e-5, atol=1e-4)
    reference, _ = decoder._forward(
        mx.array(tokens[:, None]), mx.array(positions[:, None]), n, caches, None, copies, None
    )
    assert np.abs(shared - reference).max() < 1e-3 * np.abs(reference).max()
    assert not np.allclose(shared[0], shared[1])  # rows fed different tokens differ


@pytest.mark.parametrize("batch", [1, 2, 4], ids=["one-row", "two-rows", "four-rows"])
def test_decodes_are_token_identical_to_the_mlx_steps(
    engine: Engine, speech_dir: Path, batch: int
) -> None:
    windows = _windows(engine, speech_dir)
    groups = [windows[i : i + batch] for i in range(0, len(windows), batch)]
    with mlx_steps(engine):
        reference = [r for g in groups for r in engine.decode_windows(g)]
    ours = [r for g in groups for r in engine.decode_windows(g)]
    assert all(r.text for r in reference)
    for a, b in zip(ours, reference, strict=True):
        _same(a, b)
    # Right drafts on even rows, another clip's output on odd ones: the steps begin at
    # different cache columns per row.
    drafts = [reference[i if i % 2 == 0 else (i + 1) % len(windows)] for i in range(len(windows))]
    drafted = [
        replace(w, request=replace(w.request, draft=d.sequence))
        for w, d in zip(windows, drafts, strict=True)
    ]
    groups = [drafted[i : i + batch] for i in range(0, len(drafted), batch)]
    spec = [r for g in groups for r in engine.decode_windows(g)]
    for a, b in zip(spec, reference, strict=True):
        _same(a, b)


def test_a_first_decode_starts_in_numpy_and_decodes_as_on_mlx(
    engine: Engine, speech_dir: Path
) -> None:
    # No earlier text, no forced prefix, no draft: the prefill is <|startoftranscript|>
    # alone, one numpy step. Two such rows with different audio lengths, then one.
    windows = [
        replace(w, request=replace(w.request, prompt=())) for w in _windows(engine, speech_dir)
    ][:2]
    for group in (windows, windows[1:]):
        with mlx_steps(engine):
            reference = engine.decode_windows(group)
        ours = engine.decode_windows(group)
        for a, b in zip(ours, reference, strict=True):
            _same(a, b)
            assert a.n_steps == b.n_steps
