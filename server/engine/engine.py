"""The engine facade the pipeline and the offline CLI use: features, encode, decode.

``Engine.decode_windows`` takes windows from any number of streams, encodes those with the
same audio context together, and decodes all of them in one lockstep batch.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import numpy.typing as npt

from server.core.engine_api import DecodeRequest, DecodeResult, Window, stop_if_interrupted
from server.core.long_form import check_temperatures, needs_fallback
from server.engine.beam import search
from server.engine.blas import set_blas_threads, set_numpy_blas_threads
from server.engine.decoder import StreamingDecoder, Vocabulary
from server.engine.features import (
    FRAMES_PER_SECOND,
    N_FRAMES,
    N_SAMPLES,
    log_mel_spectrogram,
)
from server.engine.lightning import module as lightning_module
from server.engine.store import DEFAULT_MODEL, LoadedModel, load_model
from server.protocol.errors import DecodeError
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("server.engine")

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # registry name or folder
    dtype: str | None = None  # None: float16 on a GPU, float32 on CPU
    quantize_bits: int | None = None  # 4 or 8: MLX affine quantization of linear layers
    quantize_group_size: int = 64
    min_context_s: float = 3.0  # shorter: more loops and changed words (bench-decoder table)
    context_margin_s: float = 1.0  # padding encoded after the real audio
    context_step_s: float = 1.0  # contexts are rounded up to this, so windows batch together
    # A window whose decode hit a loop guard is decoded again with the first of these contexts
    # that is longer than its own (none: it keeps its result): a short context's loops are the
    # usual cause. Streamed, about one decode in twelve falls back, most of them from 3-4 s
    # contexts; 10 s alone cost those 2.5-3x an ordinary decode (bench/README.md, "A cheaper
    # fallback"). 10 s fixes the loops of short contexts where 30 s costs 2.7 s of encoder.
    fallback_contexts_s: tuple[float, ...] = (5.0, 10.0)
    blas_threads: int = 1  # OpenBLAS threads on CPU; more spin and starve the other stages
    # GELU, attention and softmax from ``cpu_kernels`` on the CPU backend in float32, in the
    # encoder, the decoder's prefill and word alignment (encoder 1.4x faster at 10 s, a
    # prefill over a prompt 1.2x); the library's own functions elsewhere.
    cpu_kernels: bool = True

    def __post_init__(self) -> None:
        if self.quantize_bits not in (None, 4, 8):
            raise ValueError(f"quantize_bits must be 4, 8 or None; got {self.quantize_bits}")
        if not 0 < self.min_context_s <= 30:
            raise ValueError("min_context_s must be in (0, 30]")
        if self.blas_threads < 1:
            raise ValueError("blas_threads must be >= 1")
        contexts = self.fallback_contexts_s
        if not all(0 < c <= 30 for c in contexts) or list(contexts) != sorted(set(contexts)):
            raise ValueError("fallback_contexts_s must be increasing, each in (0, 30]")
        if self.context_margin_s < 0 or self.context_step_s <= 0:
            raise ValueError("context_margin_s must be >= 0 and context_step_s > 0")


AUTO_LANES_MAX = 8  # each lane holds a copy of the model


def computes_on_cpu() -> bool:
    """Whether engine calls run on this process's CPU cores (MLX's CPU backend), not a GPU."""
    return bool(mx.default_device() == mx.cpu)


def default_decode_lanes() -> int:
    """Decode lanes to run by default: one per core this process may use on the CPU backend
    (each lane's engine calls keep one core busy on one BLAS thread), at most
    ``AUTO_LANES_MAX``; one on a GPU, which the lanes would only share."""
    if not computes_on_cpu():
        return 1
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(cores, AUTO_LANES_MAX))


def pad_to_full(mel: Float32Array, frames: int = N_FRAMES) -> Float32Array:
    """Extend a policy-length mel to ``frames`` (default 30 s). Its last frame is pure padding
    (the context always ends at least ``context_margin_s`` after the audio), and every padding
    frame has the same value, so repeating it equals computing the padded spectrogram again."""
    tail = np.repeat(mel[-1:], max(0, frames - mel.shape[0]), axis=0)
    return np.concatenate([mel, tail])


def _trim_heap() -> None:
    """Return free heap pages to the OS (glibc only; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        logger.debug("malloc_trim is not available")


class Engine:
    """One loaded model, its tokenizer and its streaming decoder. Not thread-safe: one
    decode lane (its thread, or a child process of its own) owns it."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.dims = loaded.dims
        model = loaded.model
        model.use_cpu_kernels(
            config.cpu_kernels and mx.default_device() == mx.cpu and loaded.dtype == "float32"
        )
        if config.quantize_bits is not None:
            nn.quantize(model, group_size=config.quantize_group_size, bits=config.quantize_bits)
            mx.eval(model.parameters())
        else:
            model.decoder.prepare_projection()
        tokenizer_mod = lightning_module("tokenizer")
        tok = tokenizer_mod.get_tokenizer(
            self.dims.is_multilingual, num_languages=self.dims.num_languages
        )
        self.vocab = Vocabulary.from_tokenizer(tok, self.dims.is_multilingual)
        self.decoder = StreamingDecoder(model, self.vocab, getattr(mx, loaded.dtype))
        self.decoder.set_alignment_heads(loaded.alignment_heads)

    @classmethod
    def load(cls, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        set_blas_threads(config.blas_threads)
        set_numpy_blas_threads(config.blas_threads)  # the numpy token step's products
        loaded = load_model(config.model, dtype=config.dtype)
        logger.info(
            "loaded %s (%s) from %s in %.2f s",
            loaded.name,
            loaded.dtype,
            loaded.source,
            loaded.load_s,
        )
        return cls(loaded, config)

    @property
    def name(self) -> str:
        return self.loaded.name

    # -- text ---------------------------------------------------------------------------
    def encode_text(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self.vocab.tokenizer.encode(text))

    def decode_text(self, tokens: tuple[int, ...] | list[int]) -> str:
        return self.vocab.text(tokens)

    # -- audio --------------------------------------------------------------------------
    def context_frames(self, audio_s: float) -> int:
        """Mel frames to encode for ``audio_s`` of audio: the dynamic context policy."""
        c = self.config
        seconds = max(c.min_context_s, audio_s + c.context_margin_s)
        seconds = math.ceil(seconds / c.context_step_s - 1e-9) * c.context_step_s
        frames = round(min(seconds, 30.0) * FRAMES_PER_SECOND)
        return min(N_FRAMES, frames + frames % 2)

    def fallback_frames(self, frames: int) -> int | None:
        """Mel frames of the context a guarded window of ``frames`` is decoded again with:
        the first fallback context longer than its own, or None."""
        for seconds in self.config.fallback_contexts_s:
            target = min(N_FRAMES, round(seconds * FRAMES_PER_SECOND))
            if target > frames:
                return target
        return None

    def features(self, audio: Float32Array, frames: int | None = None) -> Float32Array:
        """Log-mel of ``audio`` padded with silence to ``frames`` (default: the policy)."""
        n = int(audio.shape[0])
        if n > N_SAMPLES:
            raise ValueError(f"a window holds at most 30 s; got {n / SAMPLE_RATE_HZ:.2f} s")
        frames = frames or self.context_frames(n / SAMPLE_RATE_HZ)
        # One extra hop of zeros so the last frame sees the same padding as Whisper's 30 s pad.
        target = frames * (N_SAMPLES // N_FRAMES) + N_SAMPLES // N_FRAMES
        mel = log_mel_spectrogram(audio, self.dims.n_mels, padding=max(0, target - n))
        return mel[:frames]

    def encode(self, mels: list[Float32Array]) -> list[mx.array]:
        """Encoder output per mel; equal lengths are batched together."""
        out: list[mx.array | None] = [None] * len(mels)
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(mels):
            groups.setdefault(int(m.shape[0]), []).append(i)
        dtype = self.decoder.dtype
        for _, idx in sorted(groups.items()):
            batch = mx.array(np.stack([mels[i] for i in idx])).astype(dtype)
            feats = self.loaded.model.encoder(batch)
            mx.eval(feats)
            for j, i in enumerate(idx):
                out[i] = feats[j]
        return [o for o in out if o is not None]

    def decode_windows(self, windows: list[Window]) -> list[DecodeResult]:
        """Encode and decode windows from any number of streams in one batch."""
        if not windows:
            return []
        try:
            feats = self.encode([w.mel for w in windows])
            stop_if_interrupted()
            requests = [w.request for w in windows]
            results = self.decode_encoded(requests, feats)
            retry: list[tuple[int, int]] = []
            for i, (r, w) in enumerate(zip(results, windows, strict=True)):
                if r.stop_reason.looped and (f := self.fallback_frames(w.mel.shape[0])):
                    retry.append((i, f))
            if retry:
                # A short audio context is the usual cause of loops; decode those windows
                # again with a longer one (the fallback context, or 30 s as Whisper sees it).
                # The looped decode's own output is the draft: it saw the same audio, and
                # verification drops the loop.
                longer = self.encode([pad_to_full(windows[i].mel, f) for i, f in retry])
                again = self.decode_encoded(
                    [replace(requests[i], draft=results[i].sequence) for i, _ in retry], longer
                )
                for (i, _), r in zip(retry, again, strict=True):
                    results[i] = r
            return results
        except (RuntimeError, ValueError, IndexError) as exc:
            raise DecodeError(f"decode of {len(windows)} window(s) failed: {exc}") from exc

    def transcribe_window(
        self, audio: Float32Array, request: DecodeRequest, temperatures: tuple[float, ...]
    ) -> tuple[DecodeResult, float]:
        """A long-form window (at most 30 s, at full context) decoded at the first of
        ``temperatures`` whose result needs no fallback (else at the last one), and that
        temperature. The audio is encoded once for all of them."""
        check_temperatures(temperatures)
        feats = self.encode([self.features(audio, N_FRAMES)])
        options = request.options
        result: DecodeResult | None = None
        for t in temperatures:
            opts = replace(options, temperature=t, beam_size=1 if t > 0 else options.beam_size)
            result = self.decode_encoded([replace(request, options=opts)], feats)[0]
            if not needs_fallback(result, opts):
                return result, t
            logger.debug(
                "window at temperature %.1f: %s, avg logprob %.2f",
                t,
                result.stop_reason,
                result.avg_logprob,
            )
        assert result is not None
        return result, temperatures[-1]

    def decode_encoded(
        self, requests: list[DecodeRequest], feats: list[mx.array]
    ) -> list[DecodeResult]:
        """Decode requests over their encoder outputs: greedy ones in one lockstep batch,
        searched ones (beam search, sampling) one by one."""
        searched = [i for i, r in enumerate(requests) if r.options.searches]
        if not searched:
            return self.decoder.decode(requests, feats)
        greedy = [i for i in range(len(requests)) if i not in searched]
        results: dict[int, DecodeResult] = {}
        if greedy:
            decoded = self.decoder.decode([requests[i] for i in greedy], [feats[i] for i in greedy])
            results.update(zip(greedy, decoded, strict=True))
        found = search(self.decoder, [requests[i] for i in searched], [feats[i] for i in searched])
        results.update(zip(searched, found, strict=True))
        return [results[i] for i in range(len(requests))]

    def release_memory(self) -> None:
        """Give back memory a burst of streams took: the decoder's batch-sized caches, MLX's
        buffer cache, and heap pages the allocator kept (glibc ``malloc_trim``). The next
        decode allocates what it needs again (a few MB for one stream)."""
        self.decoder.release_caches()
        clear = getattr(mx, "clear_cache", None)
        if clear is not None:
            clear()
        _trim_heap()

    def warmup(self) -> float:
        """Run each code path once so the first client pays no first-call costs."""
        started = time.perf_counter()
        rng = np.random.default_rng(0)
        noise = (rng.standard_normal(SAMPLE_RATE_HZ * 2) * 0.01).astype(np.float32)
        mel = self.features(noise)
        self.decode_windows(
            [
                Window(mel, DecodeRequest(2.0)),
                Window(mel, DecodeRequest(2.0, prefix=self.encode_text(" Hello"))),
            ]
        )
        return time.perf_counter() - started
