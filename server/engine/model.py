"""The Whisper network in MLX: dimensions and modules, no decoding logic.

Parameter names follow mlx-examples / lightning-whisper-mlx, so their weight files load as
they are. Two things differ from those models because a streaming server needs them:
the encoder takes any number of mel frames up to 30 s (the positional table is sliced, not
asserted), and the decoder writes into a preallocated self-attention cache and reuses
cross-attention keys and values that were projected once per encoder output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import numpy.typing as npt

from server.engine import cpu_kernels

Activation = Callable[[mx.array], mx.array]
Attention = Callable[[mx.array, mx.array, mx.array, mx.array | None], mx.array]
# Below this many scores per head (queries x keys) the library's fused kernel is used: the
# numpy path's loop over heads costs more than it saves on a token step (1 x ~20: 0.05 ms
# against 0.02); the two are even near 1000 scores, and under 4096 both take under 0.6 ms.
CPU_ATTENTION_MIN_SCORES = 4096


@dataclass(frozen=True)
class ModelDimensions:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @property
    def is_multilingual(self) -> bool:
        return self.n_vocab >= 51865

    @property
    def num_languages(self) -> int:
        return self.n_vocab - 51765 - int(self.is_multilingual)


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> mx.array:
    """Whisper's fixed positional table for the encoder."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = mx.exp(-log_timescale_increment * mx.arange(channels // 2))
    scaled_time = mx.arange(length)[:, None] * inv_timescales[None, :]
    return mx.concatenate([mx.sin(scaled_time), mx.cos(scaled_time)], axis=1)


def split_heads(x: mx.array, n_head: int) -> mx.array:
    """(batch, time, state) -> (batch, head, time, state / head)."""
    b, t, d = x.shape
    return x.reshape(b, t, n_head, d // n_head).transpose(0, 2, 1, 3)


def attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    """Scaled dot-product attention of (batch, time, state) queries over head-major keys and
    values (batch, head, time, state / head).

    Keys and values are kept head-major (the decoder's caches and cross-attention projections
    are stored that way): on CPU, transposing them for every token step cost 3-4x the
    attention itself.
    """
    b, t_q, d = q.shape
    n_head, head = k.shape[1], k.shape[3]
    out = mx.fast.scaled_dot_product_attention(
        split_heads(q, n_head), k, v, scale=head**-0.5, mask=mask
    )
    return out.transpose(0, 2, 1, 3).reshape(b, t_q, d)


def attention_cpu(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    """``attention`` by ``cpu_kernels`` (2-4 times as fast on the CPU backend from a 6 s
    window up) where there are enough scores to pay for its loop over heads, by the
    library's kernel otherwise."""
    t_q = q.shape[1]
    if t_q * k.shape[2] < CPU_ATTENTION_MIN_SCORES:
        return attention(q, k, v, mask)
    return cpu_kernels.attention(q, k, v, k.shape[3] ** -0.5, mask)


def attention_weights(
    q: mx.array, k: mx.array, mask: mx.array | None, softmax: Activation
) -> mx.array:
    """Softmax attention weights (batch, head, t_q, t_k) over head-major keys; used only for
    word alignment."""
    head = k.shape[3]
    qk = (split_heads(q, k.shape[1]) @ k.transpose(0, 1, 3, 2)) * head**-0.5
    if mask is not None:
        qk = qk + mask
    return softmax(qk.astype(mx.float32))


def _library_softmax(x: mx.array) -> mx.array:
    return mx.softmax(x, axis=-1)


def _contiguous(x: mx.array) -> mx.array:
    """A row-major copy of a transposed view (``mx.contiguous`` came with MLX 0.24)."""
    if hasattr(mx, "contiguous"):
        return mx.contiguous(x)
    return mx.array(np.ascontiguousarray(np.array(x)))


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        if cross_attention:
            self.cross_attn = MultiHeadAttention(n_state, n_head)
            self.cross_attn_ln = nn.LayerNorm(n_state)
        n_mlp = n_state * 4
        self.mlp1 = nn.Linear(n_state, n_mlp)
        self.mlp2 = nn.Linear(n_mlp, n_state)
        self.mlp_ln = nn.LayerNorm(n_state)
        # Leading underscores: functions, not parameters (see ``use_cpu_kernels``).
        self._gelu: Activation = nn.gelu
        self._attend: Attention = attention
        self._softmax: Activation = _library_softmax

    def use_cpu_kernels(self, enabled: bool) -> None:
        self._gelu = cpu_kernels.gelu if enabled else nn.gelu
        self._attend = attention_cpu if enabled else attention
        self._softmax = cpu_kernels.softmax if enabled else _library_softmax

    def mlp(self, x: mx.array) -> mx.array:
        return self.mlp2(self._gelu(self.mlp1(self.mlp_ln(x))))

    def encode(self, x: mx.array) -> mx.array:
        """Encoder block: full self-attention, no cache."""
        h = self.attn_ln(x)
        a = self.attn
        k, v = split_heads(a.key(h), a.n_head), split_heads(a.value(h), a.n_head)
        x = x + a.out(self._attend(a.query(h), k, v, None))
        return x + self.mlp(x)

    def decode(
        self,
        x: mx.array,
        cache_k: mx.array,
        cache_v: mx.array,
        offset: int,
        self_mask: mx.array | None,
        cross_k: mx.array,
        cross_v: mx.array,
        cross_mask: mx.array | None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Decoder block over new tokens written at ``offset`` of a preallocated cache.

        Returns the block output and the updated cache arrays.
        """
        a = self.attn
        h = self.attn_ln(x)
        t = x.shape[1]
        cache_k[:, :, offset : offset + t, :] = split_heads(a.key(h), a.n_head)
        cache_v[:, :, offset : offset + t, :] = split_heads(a.value(h), a.n_head)
        keys = cache_k[:, :, : offset + t, :]
        values = cache_v[:, :, : offset + t, :]
        x = x + a.out(self._attend(a.query(h), keys, values, self_mask))
        c = self.cross_attn
        q = c.query(self.cross_attn_ln(x))
        x = x + c.out(self._attend(q, cross_k, cross_v, cross_mask))
        return x + self.mlp(x), cache_k, cache_v

    def decode_full(
        self,
        x: mx.array,
        mask: mx.array,
        cross_k: mx.array,
        cross_v: mx.array,
        want_cross_weights: bool,
    ) -> tuple[mx.array, mx.array | None]:
        """Decoder block over a whole sequence without a cache (the word-alignment pass)."""
        x, q = self._self_then_cross_query(x, mask)
        weights = attention_weights(q, cross_k, None, self._softmax) if want_cross_weights else None
        x = x + self.cross_attn.out(self._attend(q, cross_k, cross_v, None))
        return x + self.mlp(x), weights

    def cross_weights(self, x: mx.array, mask: mx.array, cross_k: mx.array) -> mx.array:
        """Only the cross-attention weights of ``decode_full``: for the last layer the
        alignment reads, whose output nothing uses."""
        _, q = self._self_then_cross_query(x, mask)
        return attention_weights(q, cross_k, None, self._softmax)

    def _self_then_cross_query(self, x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        """Masked self-attention over the whole sequence, then the cross-attention queries."""
        a = self.attn
        h = self.attn_ln(x)
        k, v = split_heads(a.key(h), a.n_head), split_heads(a.value(h), a.n_head)
        x = x + a.out(self._attend(a.query(h), k, v, mask))
        return x, self.cross_attn.query(self.cross_attn_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels: int, n_ctx: int, n_state: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        # Leading underscore: MLX does not treat it as a parameter, so it is neither saved
        # nor loaded; it is recomputed exactly. CTranslate2 stores it rounded to float16; the
        # exact one changes activations slightly but not the transcripts (measured; the notes
        # are in the workspace's shared/docs/MODELS.md, outside this repository).
        self._positional_embedding = sinusoids(n_ctx, n_state)
        self.blocks = [ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)]
        self.ln_post = nn.LayerNorm(n_state)
        self._gelu: Activation = nn.gelu

    def use_cpu_kernels(self, enabled: bool) -> None:
        """GELU and attention from ``cpu_kernels`` (float32 on the CPU backend) instead of
        the library's, whose ``erf`` and ``exp`` are scalar there."""
        self._gelu = cpu_kernels.gelu if enabled else nn.gelu
        for block in self.blocks:
            block.use_cpu_kernels(enabled)

    @property
    def cpu_kernels_enabled(self) -> bool:
        return self._gelu is cpu_kernels.gelu

    def __call__(self, mel: mx.array) -> mx.array:
        """(batch, frames, n_mels) -> (batch, ceil(frames / 2), n_state); frames <= 3000."""
        x = self._gelu(self.conv1(mel))
        x = self._gelu(self.conv2(x))
        n_ctx = x.shape[1]
        if n_ctx > self._positional_embedding.shape[0]:
            raise ValueError(f"audio context {n_ctx} exceeds {self._positional_embedding.shape[0]}")
        x = x + self._positional_embedding[:n_ctx].astype(x.dtype)
        for block in self.blocks:
            x = block.encode(x)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self, n_vocab: int, n_ctx: int, n_state: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = mx.zeros((n_ctx, n_state))
        self.blocks = [
            ResidualAttentionBlock(n_state, n_head, cross_attention=True) for _ in range(n_layer)
        ]
        self.ln = nn.LayerNorm(n_state)
        # A (state, vocab) copy of the tied embedding: a row-vector times a contiguous matrix
        # streams memory in order, which halves the per-token cost of the output projection on
        # CPU (it reads the whole 51864 x state matrix for every token).
        self._projection: mx.array | None = None

    def use_cpu_kernels(self, enabled: bool) -> None:
        """As ``AudioEncoder.use_cpu_kernels``; a token step keeps the library's attention
        (see ``CPU_ATTENTION_MIN_SCORES``), the prefill and the alignment pass use ours."""
        for block in self.blocks:
            block.use_cpu_kernels(enabled)

    def prepare_projection(self) -> None:
        """Make the contiguous output projection; a quantized embedding keeps its own
        (``as_linear`` reads the packed weights, a float copy would undo the saving)."""
        if isinstance(self.token_embedding, nn.QuantizedEmbedding):
            self._projection = None
            return
        weight = self.token_embedding.weight
        self._projection = _contiguous(weight.T)
        mx.eval(self._projection)

    def cross_kv(self, audio: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Project encoder output to each layer's cross-attention keys and values, once,
        head-major and contiguous (see ``attention``)."""
        out = []
        for b in self.blocks:
            c = b.cross_attn
            k = _contiguous(split_heads(c.key(audio), c.n_head))
            v = _contiguous(split_heads(c.value(audio), c.n_head))
            out.append((k, v))
        return out

    def logits(self, x: mx.array) -> mx.array:
        if self._projection is not None:
            return self.ln(x) @ self._projection
        return self.token_embedding.as_linear(self.ln(x))  # tied output projection

    def projection_array(self) -> npt.NDArray[np.float32] | None:
        """The output projection as a numpy view of the same memory (no copy), for a CPU
        matrix-vector product; None when quantized or not in float32."""
        p = self._projection
        if p is None or p.dtype != mx.float32:
            return None
        return np.asarray(memoryview(p))  # type: ignore[arg-type]  # mlx arrays are buffers


class Whisper(nn.Module):
    def __init__(self, dims: ModelDimensions) -> None:
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(
            dims.n_mels, dims.n_audio_ctx, dims.n_audio_state, dims.n_audio_head, dims.n_audio_layer
        )
        self.decoder = TextDecoder(
            dims.n_vocab, dims.n_text_ctx, dims.n_text_state, dims.n_text_head, dims.n_text_layer
        )

    def use_cpu_kernels(self, enabled: bool) -> None:
        self.encoder.use_cpu_kernels(enabled)
        self.decoder.use_cpu_kernels(enabled)

    def quantize_layers(self, group_size: int, bits: int, wanted: Callable[[str], bool]) -> None:
        """Swap the linear and embedding layers whose parameter path ``wanted`` accepts for
        MLX affine-quantized ones, so a quantized checkpoint (mlx-community's ``-4bit``,
        ``-8bit``, ``-q4`` repos) loads into them."""
        nn.quantize(
            self,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda path, m: hasattr(m, "to_quantized") and wanted(path),
        )
