"""GELU and softmax for MLX's CPU backend, built from multiply-adds that ``mx.compile`` fuses.

MLX's CPU ``exp``, ``erf`` and ``tanh`` run at about 12-25 ns an element on these x86_64
machines (scalar library calls), while a fused chain of multiply-adds runs at about 1-2 ns.
The encoder evaluates GELU over every (frame, 1536) activation and softmax over every
(head, frame, frame) score (the decoder's prefill and word alignment over every token), so
on a 10 s window those two functions took 150 of the encoder's 250 ms
(bench/results/decoder.json has the parts). These versions agree with the exact functions to
a few float32 ulps, which ``tests/test_cpu_kernels.py`` checks against ``math.erf`` and
float64 ``exp``. Attention, the largest softmax, runs in numpy instead (see ``attention``).

``mx.compile`` needs a C++ compiler on the CPU backend; without one MLX evaluates the same
graph op by op: slower, not different.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# erf(x) = x * P(x^2) / Q(x^2) on |x| <= ERF_CLAMP: a weighted least-squares rational fit
# (Sanathanan-Koerner iteration, then Lawson reweighting) to math.erf on 4000 Chebyshev
# points of [0, ERF_CLAMP]; 1.6e-8 in float64, 4.1e-7 evaluated in float32.
ERF_P = (
    1.12837901986706,
    0.19297143850848078,
    0.05308419357167016,
    0.003876276272643279,
    0.00028749045982499086,
    2.0308700570515187e-06,
)
ERF_Q = (
    1.0,
    0.5043481231048358,
    0.11516698769505164,
    0.015188254498386646,
    0.0011897366983303222,
    3.803136754932463e-05,
)
# Beyond this erf rounds to +-1 in float32.
ERF_CLAMP = 3.925

# 2^f on |f| <= 0.5: least-squares fit of relative error on 2000 Chebyshev points; 1.9e-9.
EXP2_C = (
    1.000000000592316,
    0.6931472056112569,
    0.24022646607372647,
    0.05550328974001012,
    0.009618519590913688,
    0.001339986991244802,
    0.00015337585110010023,
)
LOG2_E = 1.4426950408889634
# exp(x) for x below this is under 2^-126: returned as 2^-126, which no softmax row can see.
EXP2_MIN = -126.0


def _horner(x: mx.array, coefficients: tuple[float, ...]) -> mx.array:
    out = x * coefficients[-1] + coefficients[-2]
    for c in reversed(coefficients[:-2]):
        out = out * x + c
    return out


def erf(x: mx.array) -> mx.array:
    xc = mx.clip(x, -ERF_CLAMP, ERF_CLAMP)
    y = xc * xc
    # The fit overshoots 1 by an ulp near the clamp; GELU's tail needs exactly +-1 there.
    return mx.clip(xc * _horner(y, ERF_P) / _horner(y, ERF_Q), -1.0, 1.0)


def _gelu(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + erf(x * 0.7071067811865476))


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) for x <= 0 as a mantissa polynomial and the int32 bits of its power of two."""
    z = mx.maximum(x * LOG2_E, EXP2_MIN)
    n = mx.round(z)
    return _horner(z - n, EXP2_C), (n.astype(mx.int32) + 127) << 23


# ``mx.view`` cannot be traced without shapes, so the bits are reinterpreted outside; the
# row maximum is subtracted outside too: a broadcast operand makes the fused kernel slower
# than the library ``exp``.
_exp_parts_fused = mx.compile(_exp_parts, shapeless=True)


def _unnormalized_softmax(x: mx.array) -> mx.array:
    mantissa, bits = _exp_parts_fused(x - mx.max(x, axis=-1, keepdims=True))
    return mantissa * mx.view(bits, mx.float32)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis."""
    e = _unnormalized_softmax(x)
    return e / mx.sum(e, axis=-1, keepdims=True)


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None
) -> mx.array:
    """Attention of (batch, time, state) queries over head-major (batch, head, time,
    state / head) keys and values, with an additive mask (0 or -inf; every row keeps one key)
    that broadcasts to (batch, head, time, keys) as in MLX; returns (batch, time, state).

    All of it in numpy, one (batch row, head) at a time: the (time, time) scores of one head
    stay in cache between the products, the exponentials and the sums, and numpy's float32
    ``exp`` is vectorised (about 0.5 ns an element here, where MLX's is a scalar call). The
    rows are normalised after multiplying by the values, on (time, 64) instead of
    (time, time). A block of a 20 s window took 22 ms this way, against 64 with the scores
    in MLX and the exponentials in numpy, and 102 in the library's kernel.
    """
    n_head, head = k.shape[1], k.shape[3]
    queries = np.array(q, dtype=np.float32) * np.float32(scale)
    keys, values = np.array(k, dtype=np.float32), np.array(v, dtype=np.float32)
    masks = None
    if mask is not None:
        masks = np.array(mask, dtype=np.float32)
        masks = masks.reshape((1,) * (4 - masks.ndim) + masks.shape)  # (batch, head, q, k)
    out = np.empty(queries.shape, dtype=np.float32)
    for b in range(queries.shape[0]):
        for h in range(n_head):
            cols = slice(h * head, (h + 1) * head)
            scores = queries[b, :, cols] @ keys[b, h].T
            if masks is not None:
                scores += masks[min(b, masks.shape[0] - 1), min(h, masks.shape[1] - 1)]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
            out[b, :, cols] = (scores @ values[b, h]) / total
    return mx.array(out)


gelu = mx.compile(_gelu, shapeless=True)
