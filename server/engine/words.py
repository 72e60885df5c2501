"""Word timestamps from cross-attention: the alignment heads' weights, smoothed, then DTW.

Whisper's approach (openai/whisper ``timing.py``), written for NumPy with a vectorised DTW
row recurrence so that a streaming server can afford it on every decode.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from server.core.engine_api import WordTiming
from server.engine.features import AUDIO_TOKENS_PER_SECOND

FloatArray = npt.NDArray[np.float32]
MEDIAN_FILTER_WIDTH = 7  # frames; Whisper's default smoothing of attention rows


def median_filter(x: FloatArray, width: int) -> FloatArray:
    """Median over the last axis with reflect padding (odd ``width``)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.median(windows, axis=-1).astype(np.float32)


def dtw(cost: FloatArray) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Monotonic alignment path through ``cost`` (tokens x frames) from corner to corner.

    Each row is solved in one vectorised pass: with a_j = x_j + min(diag, up) the row obeys
    c_j = min(a_j, x_j + c_{j-1}), i.e. c = S + cummin(a - S) with S the running sum of x.
    """
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    # 0 diagonal, 1 up (next token, same frame), 2 left (same token, next frame)
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    trace[0, 1:] = 2
    trace[1:, 0] = 1
    for i in range(1, n + 1):
        x = cost[i - 1].astype(np.float64)
        diag, up = acc[i - 1, :-1], acc[i - 1, 1:]
        a = x + np.minimum(diag, up)
        s = np.cumsum(x)
        best = s + np.minimum.accumulate(a - s)
        from_left = best < a
        acc[i, 1:] = best
        trace[i, 1:] = np.where(from_left, 2, np.where(diag <= up, 0, 1))
    i, j = n, m
    tokens: list[int] = []
    frames: list[int] = []
    while i > 0 or j > 0:
        tokens.append(i - 1)
        frames.append(j - 1)
        move = trace[i, j]
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return np.array(tokens[::-1], dtype=np.int64), np.array(frames[::-1], dtype=np.int64)


def align_words(
    weights: FloatArray,
    words: list[tuple[str, list[int]]],
    token_probs: list[float],
    n_frames: int,
) -> list[WordTiming]:
    """Word times from alignment-head attention over the text tokens.

    ``weights`` is (heads, text tokens + 1, audio positions) for the text tokens followed by
    end-of-text; ``n_frames`` is how many audio positions hold real audio.
    """
    if not words:
        return []
    w = weights[:, :, :n_frames]
    mean = w.mean(axis=-2, keepdims=True)
    std = w.std(axis=-2, keepdims=True) + 1e-8
    w = median_filter((w - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = w.mean(axis=0)
    text_idx, time_idx = dtw(-matrix)
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / AUDIO_TOKENS_PER_SECOND
    lengths = [len(toks) for _, toks in words]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    out: list[WordTiming] = []
    for k, (text, toks) in enumerate(words):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        start = float(jump_times[min(lo, len(jump_times) - 1)])
        end = float(jump_times[min(hi, len(jump_times) - 1)])
        probs = token_probs[lo:hi]
        out.append(
            WordTiming(
                word=text,
                tokens=tuple(toks),
                start_s=round(start, 3),
                end_s=round(max(end, start), 3),
                probability=float(np.mean(probs)) if probs else 0.0,
            )
        )
    return out
