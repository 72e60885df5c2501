"""The fused GELU, softmax and attention against exact float64 references, and the encoder
with them against the encoder with the library's functions, on real speech."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.corpus import load_clip
from server.engine.blas import import_mlx
from server.engine.engine import Engine

mx = import_mlx()

from server.engine import cpu_kernels  # noqa: E402  (after the BLAS preload)


def _float64_erf(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(float(v)) for v in x.ravel()]).reshape(x.shape)


def test_erf_matches_math_erf_within_a_few_ulps() -> None:
    x = np.linspace(-9.0, 9.0, 200_001, dtype=np.float32)
    got = np.array(cpu_kernels.erf(mx.array(x))).astype(np.float64)
    err = np.abs(got - _float64_erf(x))
    # The library's own float32 erf is 4.0e-7 off on this grid.
    assert err.max() < 5e-7, f"max error {err.max():.2e} at x={x[err.argmax()]}"
    assert got[0] == -1.0 and got[-1] == 1.0
    assert np.all(np.diff(got[::1000]) >= 0), "erf must not decrease"


def test_gelu_matches_the_exact_gelu() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 3, 50_000), [0.0, -30.0, 30.0, 1e-6]]).astype(np.float32)
    want = 0.5 * x.astype(np.float64) * (1 + _float64_erf(x / math.sqrt(2)))
    got = np.array(cpu_kernels.gelu(mx.array(x))).astype(np.float64)
    assert np.abs(got - want).max() <= 5e-7 * np.abs(x).max() + 1e-7
    assert got[-4] == 0.0 and got[-3] == 0.0 and got[-2] == pytest.approx(30.0)


@pytest.mark.parametrize("shape", [(3, 7), (1, 6, 150, 150), (2, 6, 40, 550)])
def test_softmax_rows_match_float64(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x = (rng.normal(0, 6, shape)).astype(np.float32)
    x.reshape(-1, shape[-1])[0, :] = -200.0  # one row far below exp's range, still uniform
    e = np.exp(x - x.max(-1, keepdims=True).astype(np.float64))
    want = e / e.sum(-1, keepdims=True)
    got = np.array(cpu_kernels.softmax(mx.array(x))).astype(np.float64)
    # Rounding x - max to float32 alone costs ~2.5e-6 (the library's softmax is as far off).
    np.testing.assert_allclose(got, want, rtol=5e-6, atol=1e-10)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def _time_major(x: mx.array) -> mx.array:
    """(batch, head, time, d) -> (batch, time, head * d): the queries ``attention`` takes."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def _time_major_np(x: np.ndarray) -> np.ndarray:
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def test_attention_matches_the_fused_library_kernel() -> None:
    rng = np.random.default_rng(2)
    q, k, v = (mx.array(rng.normal(0, 1, (2, 6, 300, 64)).astype(np.float32)) for _ in range(3))
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
    got = np.array(cpu_kernels.attention(_time_major(q), k, v, 0.125))
    assert np.abs(got - _time_major_np(want)).max() < 1e-5


def test_masked_attention_matches_the_fused_library_kernel() -> None:
    rng = np.random.default_rng(4)
    q = mx.array(rng.normal(0, 1, (2, 6, 40, 64)).astype(np.float32))
    k, v = (mx.array(rng.normal(0, 1, (2, 6, 90, 64)).astype(np.float32)) for _ in range(2))
    # Causal over the last 40 keys, and the second row's first 30 keys masked (left padding).
    mask = np.zeros((2, 1, 40, 90), dtype=np.float32)
    mask[:, 0, np.triu(np.ones((40, 90), dtype=bool), 51)] = -np.inf
    mask[1, 0, :, :30] = -np.inf
    m = mx.array(mask)
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m))
    got = np.array(cpu_kernels.attention(_time_major(q), k, v, 0.125, m))
    assert np.abs(got - _time_major_np(want)).max() < 1e-5


def test_a_mask_of_any_rank_broadcasts_as_in_the_library_kernel() -> None:
    """The word alignment masks with a (time, time) causal mask, the batched prefill with a
    (batch, 1, 1, keys) padding mask: each broadcasts over what it leaves out."""
    rng = np.random.default_rng(6)
    q, k, v = (mx.array(rng.normal(0, 1, (2, 6, 30, 64)).astype(np.float32)) for _ in range(3))
    causal = np.triu(np.full((30, 30), -np.inf, dtype=np.float32), 1)
    padding = np.zeros((2, 1, 1, 30), dtype=np.float32)
    padding[1, 0, 0, 20:] = -np.inf
    for mask in (causal, padding, causal[None, None]):
        m = mx.array(mask)
        want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m))
        got = np.array(cpu_kernels.attention(_time_major(q), k, v, 0.125, m))
        assert np.abs(got - _time_major_np(want)).max() < 1e-5, mask.shape


def test_encoder_output_unchanged_on_real_speech(engine: Engine, speech_dir: Path) -> None:
    """The kernels change the encoder's output by float32 rounding only: the same features
    within 1e-5 of their scale on a real 10 s window (batched with a 3 s one)."""
    audio = load_clip(speech_dir / "misc_en/jfk.wav")
    mels = [engine.features(audio[: 10 * 16_000]), engine.features(audio[: 2 * 16_000])]
    encoder = engine.loaded.model.encoder
    before = encoder.cpu_kernels_enabled
    try:
        encoder.use_cpu_kernels(False)
        library = [np.array(o) for o in engine.encode(mels)]
        encoder.use_cpu_kernels(True)
        ours = [np.array(o) for o in engine.encode(mels)]
    finally:
        encoder.use_cpu_kernels(before)
    for a, b in zip(library, ours, strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() < 1e-5 * np.abs(a).max()


def test_decodes_unchanged_on_real_speech(engine: Engine, speech_dir: Path) -> None:
    """Encoder, prefill, steps and word alignment with the kernels give the library path's
    tokens and word times, batched rows with prompts included."""
    from server.core.engine_api import DecodeRequest, Window

    prompt = engine.encode_text(" We spoke about printing and old books.")
    windows = []
    for clip, seconds in (("misc_en/jfk.wav", 6.0), ("ljspeech/LJ001-0011.wav", 3.5)):
        audio = load_clip(speech_dir / clip)[: round(seconds * 16_000)]
        windows.append(Window(engine.features(audio), DecodeRequest(seconds, prompt=prompt)))
    model = engine.loaded.model
    before = model.encoder.cpu_kernels_enabled
    try:
        model.use_cpu_kernels(False)
        library = engine.decode_windows(windows)
        model.use_cpu_kernels(True)
        ours = engine.decode_windows(windows)
    finally:
        model.use_cpu_kernels(before)
    for a, b in zip(library, ours, strict=True):
        assert a.text.strip() and a.tokens == b.tokens and a.stop_reason == b.stop_reason
        assert [w.word for w in a.words] == [w.word for w in b.words]
        for x, y in zip(a.words, b.words, strict=True):
            assert abs(x.start_s - y.start_s) <= 0.02 and abs(x.end_s - y.end_s) <= 0.02
            assert abs(x.probability - y.probability) < 1e-3
