"""A text-decoder token step on the CPU: numpy over ``cblas_sgemv`` and ``cblas_sgemm``.

MLX hands every float32 matmul to ``cblas_sgemm``, which packs the whole weight matrix even
for a single row: a 384 x 1536 layer takes 110-250 us there, against 50 us as a
matrix-vector product. A token step of tiny is 32 such products and about 150 dispatches:
12-13 ms a token on our CPUs as MLX ran it. The same arithmetic as
``ResidualAttentionBlock.decode``, with the same GELU (the erf of ``cpu_kernels``), run as
one ``sgemv`` per row and weight, in place on the model's weights, takes 8-9 ms with the
output projection (4-5 ms of it: 80 MB read per row). Rows that have finished are skipped.
From ``GEMM_MIN_ROWS`` rows up each layer and the projection are one ``cblas_sgemm`` of the
OpenBLAS MLX is given instead, which beats MLX at every batch size (its step also masks and
attends over the whole preallocated cache) and numpy's own OpenBLAS at few rows. Rows on the
same audio (a beam search's hypotheses) attend to it in one product, reading it once.

The prefill stays on MLX (but for a lone <|startoftranscript|>, which is a step); ``begin``
copies the self-attention keys and values it wrote and views the cross-attention ones, so
each step only appends its own column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import numpy.typing as npt

from server.engine import cpu_kernels
from server.engine.blas import (
    CBLAS_NO_TRANS,
    CBLAS_ROW_MAJOR,
    CBLAS_TRANS,
    sgemm,
    sgemv,
    vector_matrix,
)
from server.engine.model import TextDecoder

F32 = npt.NDArray[np.float32]
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, as the model's layers use
# From this many rows up one ``cblas_sgemm`` per layer beats a sgemv per row (2-4 rows:
# within the noise of each other; a beam of 5 over 20 s: 2.04 s against 2.58 with numpy's).
GEMM_MIN_ROWS = 2


def _numpy(a: mx.array) -> F32:
    """A float32 numpy copy of an MLX array (weights are copied once, at load)."""
    return np.array(a.astype(mx.float32), dtype=np.float32)


def _view(a: mx.array) -> F32:
    """The memory of an evaluated, row-contiguous float32 MLX array, without a copy."""
    return np.asarray(memoryview(a))  # type: ignore[arg-type]  # mlx arrays are buffers


def _horner(x: F32, coefficients: tuple[float, ...]) -> F32:
    out = x * np.float32(coefficients[-1]) + np.float32(coefficients[-2])
    for c in reversed(coefficients[:-2]):
        out = out * x + np.float32(c)
    return out


def gelu(x: F32) -> F32:
    """``cpu_kernels.gelu`` in numpy: the same rational erf, in float32."""
    xc = np.clip(x * np.float32(0.7071067811865476), -cpu_kernels.ERF_CLAMP, cpu_kernels.ERF_CLAMP)
    y = xc * xc
    erf = np.clip(xc * _horner(y, cpu_kernels.ERF_P) / _horner(y, cpu_kernels.ERF_Q), -1.0, 1.0)
    out: F32 = np.float32(0.5) * x * (np.float32(1.0) + erf)
    return out


def softmax(x: F32) -> F32:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    out: F32 = e / e.sum(axis=-1, keepdims=True)
    return out


@dataclass(frozen=True)
class _LayerNorm:
    weight: F32
    bias: F32

    def __call__(self, x: F32) -> F32:
        d = x - x.mean(axis=-1, keepdims=True)
        var = (d * d).mean(axis=-1, keepdims=True)
        out: F32 = d / np.sqrt(var + np.float32(LAYER_NORM_EPS)) * self.weight + self.bias
        return out


def _rows_times(
    gemm: Callable[..., None], x: F32, matrix: F32, *, transposed: bool, bias: F32 | None = None
) -> F32:
    """``x @ matrix`` (``matrix`` (in, out)), or ``x @ matrix.T`` where ``transposed``
    (``matrix`` (out, in)), plus ``bias``: one ``cblas_sgemm`` on C-contiguous memory."""
    rows = np.ascontiguousarray(x, dtype=np.float32)
    m, k = rows.shape
    n = matrix.shape[0] if transposed else matrix.shape[1]
    out = np.empty((m, n), dtype=np.float32)
    if bias is not None:
        out[:] = bias
    gemm(
        CBLAS_ROW_MAJOR,
        CBLAS_NO_TRANS,
        CBLAS_TRANS if transposed else CBLAS_NO_TRANS,
        m,
        n,
        k,
        1.0,
        rows.ctypes.data,
        k,
        matrix.ctypes.data,
        k if transposed else n,
        0.0 if bias is None else 1.0,
        out.ctypes.data,
        n,
    )
    return out


class _Linear:
    """``x @ weight.T + bias`` on the layer's own (out, in) weight memory, no copy: one
    ``cblas_sgemv`` per row, or one ``cblas_sgemm`` from ``GEMM_MIN_ROWS`` rows up."""

    def __init__(
        self, layer: nn.Linear, gemv: Callable[..., None], gemm: Callable[..., None]
    ) -> None:
        self.matrix = _view(layer.weight)
        if self.matrix.dtype != np.float32 or not self.matrix.flags["C_CONTIGUOUS"]:
            self.matrix = np.ascontiguousarray(_numpy(layer.weight))
        self.bias = _numpy(layer.bias) if "bias" in layer else None
        self.n_out, self.n_in = self.matrix.shape
        self._pointer = self.matrix.ctypes.data
        self._gemv = gemv
        self._gemm = gemm

    def __call__(self, x: F32) -> F32:
        """(rows, in) -> (rows, out)."""
        rows = np.ascontiguousarray(x, dtype=np.float32)
        if rows.shape[0] >= GEMM_MIN_ROWS:
            return _rows_times(self._gemm, rows, self.matrix, transposed=True, bias=self.bias)
        out = np.empty((rows.shape[0], self.n_out), dtype=np.float32)
        if self.bias is not None:
            out[:] = self.bias
        beta = 0.0 if self.bias is None else 1.0
        for i in range(rows.shape[0]):
            self._gemv(
                CBLAS_ROW_MAJOR,
                CBLAS_NO_TRANS,
                self.n_out,
                self.n_in,
                1.0,
                self._pointer,
                self.n_in,
                rows[i].ctypes.data,
                1,
                beta,
                out[i].ctypes.data,
                1,
            )
        return out


@dataclass(frozen=True)
class _Block:
    attn_ln: _LayerNorm
    query: _Linear
    key: _Linear
    value: _Linear
    out: _Linear
    cross_ln: _LayerNorm
    cross_query: _Linear  # cross-attention keys and values come projected (``begin``)
    cross_out: _Linear
    mlp_ln: _LayerNorm
    mlp1: _Linear
    mlp2: _Linear


class CpuTokenStep:
    """Token steps of one decode call: ``begin`` after the prefill, then ``forward`` per
    step. Holds the self-attention caches of the rows it steps; the MLX caches the prefill
    wrote are left as they were (the next prefill overwrites what it reads)."""

    def __init__(
        self,
        decoder: TextDecoder,
        projection: F32,
        gemv: Callable[..., None],
        gemm: Callable[..., None],
    ) -> None:
        def norm(layer: nn.LayerNorm) -> _LayerNorm:
            return _LayerNorm(_numpy(layer.weight), _numpy(layer.bias))

        def linear(layer: nn.Linear) -> _Linear:
            return _Linear(layer, gemv, gemm)

        self._blocks = [
            _Block(
                attn_ln=norm(b.attn_ln),
                query=linear(b.attn.query),
                key=linear(b.attn.key),
                value=linear(b.attn.value),
                out=linear(b.attn.out),
                cross_ln=norm(b.cross_attn_ln),
                cross_query=linear(b.cross_attn.query),
                cross_out=linear(b.cross_attn.out),
                mlp_ln=norm(b.mlp_ln),
                mlp1=linear(b.mlp1),
                mlp2=linear(b.mlp2),
            )
            for b in decoder.blocks
        ]
        self._ln = norm(decoder.ln)
        self._embedding = _view(decoder.token_embedding.weight)
        self._positions = _numpy(decoder.positional_embedding)
        self._projection = projection
        self._gemm = gemm
        self._n_head = decoder.blocks[0].attn.n_head
        self._keys: list[F32] = []
        self._values: list[F32] = []
        self._cross: list[tuple[list[F32], list[F32]]] = []
        self._audio_of_row: list[int] = []

    @classmethod
    def for_decoder(cls, decoder: TextDecoder, projection: F32 | None) -> CpuTokenStep | None:
        """A step for this decoder, or None where it does not apply (no float32 projection
        on the CPU, or no OpenBLAS to run matrix-vector products)."""
        gemv, gemm = sgemv(), sgemm()
        if projection is None or gemv is None or gemm is None:
            return None
        return cls(decoder, projection, gemv, gemm)

    def begin(
        self,
        caches: list[tuple[mx.array, mx.array]],
        columns: int,
        cross: list[tuple[mx.array, mx.array]],
        lengths: list[int],
        rows_per_audio: int = 1,
    ) -> None:
        """Take over after a prefill that wrote ``columns`` columns of ``caches`` (none:
        the steps start at column 0) for rows over ``lengths`` audio entries of ``cross``,
        ``rows_per_audio`` consecutive rows each (a beam search's hypotheses share their
        audio); each row's cross-attention reads only its own audio positions."""
        rows = len(lengths) * rows_per_audio
        self._audio_of_row = [r // rows_per_audio for r in range(rows)]
        mx.eval(caches, cross)
        n_ctx, state = self._positions.shape
        shape = (rows, self._n_head, n_ctx, state // self._n_head)
        self._keys = [np.empty(shape, np.float32) for _ in self._blocks]
        self._values = [np.empty(shape, np.float32) for _ in self._blocks]
        self._cross = []
        for k, v in cross:
            ks, vs = _view(k), _view(v)
            self._cross.append(
                (
                    [ks[i, :, :n] for i, n in enumerate(lengths)],
                    [vs[i, :, :n] for i, n in enumerate(lengths)],
                )
            )
        if not columns:
            return
        for keys, values, (k, v) in zip(self._keys, self._values, caches, strict=True):
            keys[:, :, :columns] = np.array(k[:rows, :, :columns], dtype=np.float32)
            values[:, :, :columns] = np.array(v[:rows, :, :columns], dtype=np.float32)

    def reorder(self, parents: list[int], columns: int) -> None:
        """Row j's cache becomes a copy of row ``parents[j]``'s first ``columns`` columns (the
        hypotheses of a beam search that live on)."""
        n = len(parents)
        if parents == list(range(n)):
            return
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[:n, :, :columns] = keys[parents, :, :columns]
            values[:n, :, :columns] = values[parents, :, :columns]

    def forward(
        self,
        rows: list[int],
        tokens: npt.NDArray[np.int32],
        positions: npt.NDArray[np.int32],
        column: int,
        valid: npt.NDArray[np.bool_],
    ) -> F32:
        """Logits (len(rows), vocab) after feeding each listed row its token at its
        position, written at cache ``column``. ``tokens``, ``positions`` and ``valid`` are
        indexed by row; a row attends to the columns ``valid`` allows it, and this one."""
        h = self._n_head
        n = len(rows)
        # Consecutive rows (one row, or all of them) as a slice: views, not copies of caches.
        sel: slice | list[int] = rows
        if rows == list(range(rows[0], rows[0] + n)):
            sel = slice(rows[0], rows[0] + n)
        x = self._embedding[tokens[sel]] + self._positions[positions[sel]]
        allowed = valid[sel, : column + 1].copy()
        allowed[:, column] = True
        self_bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf))[:, None, :]
        by_audio: dict[int, list[int]] = {}
        for j, i in enumerate(rows):
            by_audio.setdefault(self._audio_of_row[i], []).append(j)
        groups = list(by_audio.items())
        for block, keys, values, (cross_k, cross_v) in zip(
            self._blocks, self._keys, self._values, self._cross, strict=True
        ):
            y = block.attn_ln(x)
            keys[sel, :, column] = block.key(y).reshape(n, h, -1)
            values[sel, :, column] = block.value(y).reshape(n, h, -1)
            q = block.query(y).reshape(n, h, -1, 1)
            scale = np.float32(q.shape[2] ** -0.5)
            k_used, v_used = keys[sel, :, : column + 1], values[sel, :, : column + 1]
            weights = softmax((k_used @ q)[..., 0] * scale + self_bias)
            x = x + block.out((weights[:, :, None, :] @ v_used).reshape(n, -1))
            cross_q = block.cross_query(block.cross_ln(x)).reshape(n, h, -1)
            mixed = np.empty_like(x)
            for audio, js in groups:
                # The rows on one audio as one product: its keys and values are read once.
                heads = cross_q[js].transpose(1, 0, 2)
                w = softmax((heads @ cross_k[audio].transpose(0, 2, 1)) * scale)
                mixed[js] = (w @ cross_v[audio]).transpose(1, 0, 2).reshape(len(js), -1)
            x = x + block.cross_out(mixed)
            x = x + block.mlp2(gelu(block.mlp1(block.mlp_ln(x))))
        hidden = self._ln(x)
        if n >= GEMM_MIN_ROWS:
            return _rows_times(self._gemm, hidden, self._projection, transposed=False)
        logits = vector_matrix(hidden, self._projection)
        assert logits is not None  # the step exists only where sgemv does
        return logits
