"""Accelerator benchmark: the engine and the served capacity in its device's dtype, on MLX's
default device.

    python -m bench.gpu            # or: make bench-gpu
    python -m bench.gpu --models tiny.en --capacity-clients 1 --budget-s 60   # a short check

Written for a GPU (the CUDA build of MLX, ``mlx-cuda-13``, or Apple silicon), where the engine
runs in float16; on a CPU it runs too, in float32. Per model of ``--models`` (tiny.en, base and
turbo-shaped):
- the model's load (CTranslate2 conversion included) and first-call warm-up;
- one window end to end (log-mel, encoder, greedy tokens, word times) for 1-30 s of speech,
  and beam 5 at 2 s and 5 s, with the decoder steps each took and why it stopped;
- throughput: distinct 5 s windows of different clips decoded as one batch of 1-64 (each row
  is one stream's re-decode, as the scheduler batches them): the batch's wall time and audio
  seconds per wall second;
- accuracy, real weights only: each short English clip decoded offline (``transcribe_audio``,
  greedy and beam 5) in the device's dtype and in float32 on the same device: WER per source
  folder, and how many clips read the same in both dtypes.

``turbo-shaped`` is large-v3-turbo's shape (32 encoder and 4 decoder layers, 1280 wide, 128 mel
bands, its 51866-token vocabulary and tokenizer) with seeded random weights, built on the spot
by ``bench.checkpoints`` into a temporary folder: no real large weights reach these machines.
Random weights emit random tokens, so its decodes run until the token cap (8 + 12 per second
of audio) or a loop guard stops them, and a looped short window is decoded again at a longer
context, as a real model's would be: its figures are the cost of the longest decodes a window
can take, and it has no accuracy.

Then the capacity sweep of ``bench.capacity`` against our server in a subprocess, once per
model of ``--capacity-models`` (tiny.en and base): N clients streaming real speech at 1x
(``--capacity-seconds`` each) for each N of ``--capacity-clients``, stopping at the first N
whose final latency p95 passes 2 s; ``max_streams_p95_final_le_2s`` is the largest N within it.

The sections share ``--budget-s`` (each its planned share of what is left when it starts) and
stop starting new measurements once their share is spent, saying so. Writes
``bench/results/<output>.json``; the last line printed is one JSON object with the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.capacity import (
    Contender,
    SweepConfig,
    build_streams,
    sweep_server,
)
from bench.capacity import (
    table as capacity_table,
)
from bench.checkpoints import shape, write_mlx
from bench.corpus import load_clip, read_manifest, wer
from bench.engine import (
    LONG_CLIP,
    RESULTS,
    Float32Array,
    speech_dir,
    summary,
    timed,
    write_results,
)
from bench.latency_audio import Stream
from server.core.engine_api import DecodeOptions, DecodeRequest, DecodeResult, Window
from server.engine.blas import check_blas, import_mlx
from server.engine.engine import Engine, EngineConfig
from server.engine.model import ModelDimensions
from server.engine.offline import transcribe_audio
from server.engine.store import available_models, default_dtype, load_model
from server.protocol.errors import WhisperwireError
from server.protocol.formats import SAMPLE_RATE_HZ

logger = logging.getLogger("bench.gpu")

TURBO = "turbo-shaped"  # large-v3-turbo's shape with seeded random weights, built on the spot
TURBO_SHAPE = "large-v3-turbo"
MODELS = ("tiny.en", "base", TURBO)
CAPACITY_MODELS = ("tiny.en", "base")
# Doubling twice per step: four runs reach 64 streams, where a GPU's batches are still cheap;
# the sweep stops at the first N that is not sustained.
CAPACITY_CLIENTS = (1, 4, 16, 64)
CAPACITY_SECONDS = 10.0  # speech per client: a run of N takes about this plus 3 s of tail

WINDOW_SECONDS = (1, 2, 5, 10, 30)
BEAM_SECONDS = (2, 5)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
BATCH_WINDOW_S = 5
MAX_CLIP_S = 30.0  # one offline window: what the accuracy section decodes

# Planned seconds of each section (a real model's, turbo-shaped's, one capacity sweep's): on a
# GPU they add up to about the default budget; any other budget is shared in these ratios.
PLANNED_S = {"model": 65.0, TURBO: 90.0, "capacity": 100.0}
# A model section's share of its time, in order: windows, throughput, accuracy (the rest).
SHARES = (0.2, 0.3, 0.5)
TURBO_SHARES = (0.45, 0.55)  # windows, throughput: random weights have no accuracy


@dataclass
class Deadline:
    """When a section must stop starting new measurements."""

    ends_at: float

    def left_s(self) -> float:
        return self.ends_at - time.perf_counter()

    def section(self, share: float, later: float) -> Deadline:
        """A section's ``share`` of the time left now, beside the ``later`` shares of the
        sections after it: what one section leaves unspent goes to those after it."""
        now = time.perf_counter()
        left = max(0.0, self.ends_at - now)
        return Deadline(now + left * share / (share + later))


def parse_models(text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """A comma-separated model list ("none" or "" for none); ValueError names the allowed."""
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"unknown model {', '.join(unknown)}; choose from {', '.join(allowed)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a model is named twice in {text!r}")
    return names


def parse_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(x) for x in text.split(",") if x.strip())
    if not counts or min(counts) < 1 or list(counts) != sorted(set(counts)):
        raise ValueError(f"client counts must be increasing positive numbers; got {text!r}")
    return counts


def device_info(mx: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "mlx": getattr(mx, "__version__", "?"),
        "default_device": str(mx.default_device()),
        "cuda": bool(mx.cuda.is_available()),
        "metal": bool(mx.metal.is_available()),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if info["cuda"]:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]
        try:
            shown = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True)
            info["gpu"] = shown.stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError) as exc:
            info["gpu"] = f"nvidia-smi failed: {exc}"
    return info


# --- one model -------------------------------------------------------------------------------


def build_turbo(
    folder: Path,
    dtype: str,
    *,
    n_audio_layer: int | None = None,
    n_text_layer: int | None = None,
) -> ModelDimensions:
    """large-v3-turbo's shape with seeded random weights in ``dtype``, in mlx-community's
    layout in ``folder`` (the layer counts cut down where asked: the tests' size)."""
    dims = shape(TURBO_SHAPE, n_audio_layer=n_audio_layer, n_text_layer=n_text_layer)
    write_mlx(folder, dims, dtype=dtype)
    return dims


def load_turbo(
    dtype: str,
    out: dict[str, Any],
    *,
    n_audio_layer: int | None = None,
    n_text_layer: int | None = None,
) -> Engine:
    """Build turbo-shaped in a temporary folder and load it; its build time and dimensions
    go into ``out``. The folder goes once the weights are in memory."""
    folder = Path(tempfile.mkdtemp(prefix="whisperwire-turbo-shaped-"))
    try:
        started = time.perf_counter()
        dims = build_turbo(folder, dtype, n_audio_layer=n_audio_layer, n_text_layer=n_text_layer)
        out["build_s"] = round(time.perf_counter() - started, 2)
        out["dims"] = dims.__dict__
        loaded = load_model(str(folder), dtype=dtype)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out["random_weights"] = True
    out["note"] = (
        "large-v3-turbo's shape with seeded random weights, built on the spot: decodes run "
        "until the token cap (8 + 12 per audio second) or a loop guard stops them (steps and "
        "stop per window; a looped short window is decoded again at a longer context); "
        "no accuracy"
    )
    return Engine(loaded, EngineConfig(model=str(folder), dtype=dtype))


def bench_windows(engine: Engine, repeats: int, deadline: Deadline) -> dict[str, Any]:
    """One window end to end per length and beam: its times, text, steps and stop."""
    audio = load_clip(speech_dir() / LONG_CLIP)
    cases = [(s, 1) for s in WINDOW_SECONDS] + [(s, 5) for s in BEAM_SECONDS]
    out: dict[str, Any] = {}
    for seconds, beam in cases:
        label = f"{seconds}s" if beam == 1 else f"{seconds}s_beam{beam}"
        if deadline.left_s() <= 0:
            out[label] = "skipped: out of time"
            continue
        window = audio[: seconds * SAMPLE_RATE_HZ]
        request = DecodeRequest(float(seconds), DecodeOptions(beam_size=beam))

        def decode(window: Float32Array = window, request: DecodeRequest = request) -> DecodeResult:
            return engine.decode_windows([Window(engine.features(window), request)])[0]

        times = timed(decode, repeats=repeats, min_repeats=1, budget_s=min(8.0, deadline.left_s()))
        result = decode()
        out[label] = {
            **summary(times),
            "steps": result.n_steps,
            "stop": str(result.stop_reason),
            "text": result.text,
        }
        logger.info("window %s: %s", label, out[label])
    return out


def batch_windows(n: int) -> list[Float32Array]:
    """``n`` distinct 5 s windows: the start of each clip long enough, then its later 5 s
    stretches; where those are too few (the lent machine carries only test-other and
    test-clean: 49), the stretches halfway between them, overlapping as a stream's
    re-decodes do."""
    rows = [r for r in read_manifest(speech_dir() / "manifest.tsv") if r.language == "en"]
    rows.sort(key=lambda r: (-r.seconds, r.file))
    size = BATCH_WINDOW_S * SAMPLE_RATE_HZ
    audios = [load_clip(speech_dir() / r.file) for r in rows if r.seconds >= BATCH_WINDOW_S]
    windows: list[Float32Array] = []
    for first in (0, size // 2):
        offset = first
        while len(windows) < n:
            fitting = [a[offset : offset + size] for a in audios if len(a) >= offset + size]
            if not fitting:
                break
            windows.extend(fitting[: n - len(windows)])
            offset += size
    if len(windows) < n:
        raise SystemExit(f"the speech folder holds fewer than {n} distinct 5 s windows")
    return windows


def bench_throughput(
    engine: Engine, batches: tuple[int, ...], repeats: int, deadline: Deadline
) -> dict[str, Any]:
    windows = batch_windows(max(batches))
    out: dict[str, Any] = {"window_s": BATCH_WINDOW_S}
    for batch in batches:
        if deadline.left_s() <= 0:
            out[f"b{batch}"] = "skipped: out of time"
            continue
        chosen = windows[:batch]
        steps: list[int] = []

        def decode(chosen: list[Float32Array] = chosen, steps: list[int] = steps) -> None:
            results = engine.decode_windows(
                [Window(engine.features(a), DecodeRequest(float(BATCH_WINDOW_S))) for a in chosen]
            )
            steps.append(max(r.n_steps for r in results))

        times = timed(decode, repeats=repeats, min_repeats=1, budget_s=min(8.0, deadline.left_s()))
        stats = summary(times)
        out[f"b{batch}"] = {
            **stats,
            "audio_s_per_s": round(batch * BATCH_WINDOW_S / (stats["p50_ms"] / 1000.0), 1),
            "max_steps": max(steps),  # the batch's longest row: the lockstep's length
        }
        logger.info("batch %d: %s", batch, out[f"b{batch}"])
    return out


def bench_accuracy(engines: dict[str, Engine], deadline: Deadline) -> dict[str, Any]:
    """Offline WER per source folder, per dtype and search; clips whose text the dtypes share."""
    rows = [
        r
        for r in read_manifest(speech_dir() / "manifest.tsv")
        if r.language == "en" and r.seconds <= MAX_CLIP_S
    ]
    rows.sort(key=lambda r: ("test-other" not in r.file, r.file))  # the hard clips first
    searches = {"greedy": None, "beam5": DecodeOptions(word_timestamps=False, beam_size=5)}
    texts: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)  # (dtype, search) -> texts
    done: list[str] = []
    for row in rows:
        if deadline.left_s() <= 0:
            break
        audio = load_clip(speech_dir() / row.file)
        for dtype, engine in engines.items():
            for search, options in searches.items():
                texts[(dtype, search)][row.file] = transcribe_audio(engine, audio, options).text
        done.append(row.file)
    refs = {r.file: r.transcript for r in rows}
    folders = sorted({f.split("/")[0] for f in done})
    out: dict[str, Any] = {"clips": len(done), "of": len(rows), "wer": {}, "same_text": {}}
    for (dtype, search), got in texts.items():
        for folder in folders:
            files = [f for f in done if f.startswith(folder + "/")]
            wer_pct = 100 * wer([refs[f] for f in files], [got[f] for f in files])
            out["wer"].setdefault(folder, {})[f"{dtype}_{search}"] = round(wer_pct, 2)
    if len(engines) == 2:
        low, high = list(engines)
        for search in searches:
            same = sum(texts[(low, search)][f] == texts[(high, search)][f] for f in done)
            out["same_text"][search] = f"{same}/{len(done)}"
    out["texts"] = {f"{d}_{s}": got for (d, s), got in texts.items()}
    logger.info("accuracy: %s", {k: out[k] for k in ("clips", "wer", "same_text")})
    return out


@dataclass(frozen=True)
class ModelRun:
    """What one model's section measures, from bench.gpu's flags."""

    repeats: int = 10
    batches: tuple[int, ...] = BATCHES
    float32: bool = True  # the accuracy section's float32 engine beside the device's dtype
    # turbo-shaped's (encoder, decoder) layer counts; None: its own (32, 4). The tests cut it.
    turbo_layers: tuple[int, int] | None = None


def load_engine(name: str, dtype: str, run: ModelRun, out: dict[str, Any]) -> Engine:
    """One model of ``--models`` loaded in ``dtype`` (turbo-shaped built first); its load
    time (and turbo-shaped's build) go into ``out``."""
    if name == TURBO:
        encoder, decoder = run.turbo_layers or (None, None)
        engine = load_turbo(dtype, out, n_audio_layer=encoder, n_text_layer=decoder)
    else:
        engine = Engine.load(EngineConfig(model=name, dtype=dtype))
    out["load_s"] = round(engine.loaded.load_s, 2)
    return engine


def measure_model(
    name: str, engine: Engine, run: ModelRun, deadline: Deadline, out: dict[str, Any]
) -> dict[str, Any]:
    """A loaded model's windows, batches and (real weights only) accuracy, into ``out``."""
    shares = TURBO_SHARES if name == TURBO else SHARES
    out["windows"] = bench_windows(
        engine, run.repeats, deadline.section(shares[0], sum(shares[1:]))
    )
    repeats = max(3, run.repeats // 2)
    out["throughput"] = bench_throughput(
        engine, run.batches, repeats, deadline.section(shares[1], sum(shares[2:]))
    )
    if name == TURBO:
        out["accuracy"] = "none: random weights"
        return out
    dtype = engine.loaded.dtype
    engines = {dtype: engine}
    if dtype != "float32" and run.float32:
        engines["float32"] = Engine.load(EngineConfig(model=name, dtype="float32"))
    out["accuracy"] = bench_accuracy(engines, deadline)
    return out


def bench_model(name: str, dtype: str, run: ModelRun, deadline: Deadline) -> dict[str, Any]:
    """One model's load, warm-up, windows, batches and (real weights only) accuracy."""
    out: dict[str, Any] = {}
    engine = load_engine(name, dtype, run, out)
    out["warmup_s"] = round(engine.warmup(), 2)
    logger.info("%s: %s", name, out)
    return measure_model(name, engine, run, deadline, out)


def release_device_memory() -> None:
    """Drop the engines a section left behind and MLX's buffer cache, so the next model (and
    the capacity sweep's server, another process on the same GPU) start with free memory."""
    gc.collect()
    clear = getattr(import_mlx(), "clear_cache", None)
    if clear is not None:
        clear()


# --- capacity --------------------------------------------------------------------------------

BuildStreams = Callable[[SweepConfig, int], tuple[list[Stream], float | None]]
Sweep = Callable[..., Coroutine[Any, Any, dict[str, Any]]]


def bench_capacity(
    models: Sequence[str],
    counts: tuple[int, ...],
    seconds: float,
    deadline: Deadline,
    *,
    build: BuildStreams = build_streams,
    sweep: Sweep = sweep_server,
    swept: Callable[[dict[str, Any]], None] = lambda out: None,
) -> dict[str, Any]:
    """bench.capacity's sweep of our server per model, on the same streams (built, aligned
    and their 2 s window timed with tiny.en, as bench-capacity does), within ``deadline``:
    each model's sweep its share of what is left when it starts. ``swept`` is handed the
    section's figures so far after each model's sweep."""
    config = SweepConfig(
        counts=counts,
        seconds=seconds,
        peer=False,
        alone=False,  # streaming each stream alone again would double the run
        output_name="gpu",
        stop_after_unsustained=True,
    )
    out: dict[str, Any] = {"config": asdict(config), "servers": {}, "skipped": {}}
    if deadline.left_s() <= 0:
        out["skipped"] = {m: "out of time" for m in models}
        return out
    streams, window_ms = build(config, max(counts))
    out["streams"] = {s.name: round(s.seconds, 1) for s in streams}
    out["window_2s_ms_p50"] = window_ms
    out["window_2s_model"] = "tiny.en"
    for k, model in enumerate(models):
        part = deadline.section(1.0, float(len(models) - k - 1))
        if part.left_s() <= 0:
            out["skipped"][model] = "out of time"
            continue
        who = Contender(model, None, model=model)
        try:
            out["servers"][model] = asyncio.run(sweep(who, streams, config, deadline=part.ends_at))
        except (RuntimeError, TimeoutError, OSError) as exc:
            # A server that would not start (its log says why): the next model may, and an
            # unattended run on a lent machine should bring back what it can.
            logger.error("capacity %s failed", model, exc_info=True)
            out["skipped"][model] = f"failed: {exc!r}"
            continue
        logger.info("capacity %s: %s", model, out["servers"][model]["max_streams_p95_final_le_2s"])
        swept(out)
    return out


# --- report ----------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    dev = results["device"]
    lines = [f"{results['dtype']} on {dev.get('gpu') or dev['default_device']} (MLX {dev['mlx']})"]
    for name, res in results["models"].items():
        if not isinstance(res, dict):
            lines += ["", f"{name}: {res}"]
            continue
        built = f", built in {res['build_s']:.1f} s (random weights)" if "build_s" in res else ""
        lines += [
            "",
            f"{name}: load {res['load_s']:.1f} s, warm-up {res['warmup_s']:.1f} s{built}",
            "window          p50 ms   p95 ms   steps",
        ]
        for label, row in res["windows"].items():
            if isinstance(row, dict):
                lines.append(
                    f"{label:<14} {row['p50_ms']:>7.1f}  {row['p95_ms']:>7.1f}  {row['steps']:>6}"
                )
            else:
                lines.append(f"{label:<14} {row}")
        lines += ["", f"batch of {BATCH_WINDOW_S} s windows   p50 ms   audio s/s"]
        for label, row in res["throughput"].items():
            if isinstance(row, dict):
                lines.append(f"{label:<24} {row['p50_ms']:>7.1f}  {row['audio_s_per_s']:>9.1f}")
            elif label != "window_s":
                lines.append(f"{label:<24} {row}")
        acc = res.get("accuracy")
        if isinstance(acc, dict):
            lines += ["", f"offline WER %, {acc['clips']} of {acc['of']} clips"]
            for folder, by in acc["wer"].items():
                cells = "  ".join(f"{k} {v:.2f}" for k, v in sorted(by.items()))
                lines.append(f"{folder:<26} {cells}")
            if acc["same_text"]:
                lines.append(f"same text in both dtypes: {acc['same_text']}")
    capacity = results.get("capacity")
    if capacity:
        lines += ["", "capacity: N real-time streams into our server (final p95 within 2 s)"]
        if capacity["servers"]:
            lines.append(capacity_table(capacity))
        for model, data in capacity["servers"].items():
            lines.append(
                f"{model}: sustained {data['max_streams_p95_final_le_2s']}; skipped "
                f"{data['skipped'] or 'none'}"
            )
        for model, why in capacity["skipped"].items():
            lines.append(f"{model}: skipped, {why}")
    return "\n".join(lines)


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The run's few figures, per model: 2 s window, best throughput, test-other WER, and
    the streams sustained."""
    out: dict[str, Any] = {
        "device": results["device"].get("gpu") or results["device"]["default_device"],
        "dtype": results["dtype"],
    }
    for name, res in results["models"].items():
        if not isinstance(res, dict):
            continue
        window = res["windows"].get("2s")
        acc = res.get("accuracy")
        out[name] = {
            "window_2s_ms_p50": window["p50_ms"] if isinstance(window, dict) else None,
            "best_audio_s_per_s": max(
                (r["audio_s_per_s"] for r in res["throughput"].values() if isinstance(r, dict)),
                default=None,
            ),
            "wer_test_other": acc["wer"].get("librispeech_test-other")
            if isinstance(acc, dict)
            else None,
        }
    for model, data in (results.get("capacity") or {}).get("servers", {}).items():
        out.setdefault(model, {})["max_streams_p95_final_le_2s"] = data[
            "max_streams_p95_final_le_2s"
        ]
    out["wall_s"] = results["wall_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)

    def models_of(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
        def parse(text: str) -> tuple[str, ...]:
            try:
                return parse_models(text, allowed)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        return parse

    def counts(text: str) -> tuple[int, ...]:
        try:
            return parse_counts(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--models",
        type=models_of([*available_models(), TURBO]),
        default=MODELS,
        help=f"comma-separated (default {','.join(MODELS)}; a registry name or {TURBO})",
    )
    parser.add_argument(
        "--capacity-models",
        type=models_of(available_models()),
        default=CAPACITY_MODELS,
        help=f"models the capacity sweep serves (default {','.join(CAPACITY_MODELS)}; none)",
    )
    parser.add_argument(
        "--capacity-clients",
        type=counts,
        default=CAPACITY_CLIENTS,
        help=f"client counts (default {','.join(map(str, CAPACITY_CLIENTS))})",
    )
    parser.add_argument(
        "--capacity-seconds", type=float, default=CAPACITY_SECONDS, help="speech per client"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per figure")
    parser.add_argument("--budget-s", type=float, default=450.0, help="time for the whole run")
    parser.add_argument("--max-batch", type=int, default=max(BATCHES), help="largest batch")
    parser.add_argument("--output", default="gpu", help="results name in bench/results")
    parser.add_argument(
        "--no-float32", action="store_true", help="skip the float32 comparison in accuracy"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.perf_counter()
    whole = Deadline(started + args.budget_s)
    check_blas()
    mx = import_mlx()
    dtype = default_dtype()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device_info(mx),
        "dtype": dtype,
        "budget_s": args.budget_s,
        "models": {},
    }
    logger.info("%s", results)
    run = ModelRun(
        repeats=args.repeats,
        batches=tuple(b for b in BATCHES if b <= args.max_batch),
        float32=not args.no_float32,
    )
    plans = [PLANNED_S[TURBO if m == TURBO else "model"] for m in args.models]
    plans += [PLANNED_S["capacity"] * len(args.capacity_models)] if args.capacity_models else []

    def save_partial(capacity: dict[str, Any] | None = None) -> None:
        # After each section: a run stopped by its command's timeout still brings back the
        # sections it finished.
        if capacity is not None:
            results["capacity"] = capacity
        write_results(args.output, results | {"partial": True})

    for k, name in enumerate(args.models):
        deadline = whole.section(plans[k], sum(plans[k + 1 :]))
        if deadline.left_s() <= 0:
            results["models"][name] = "skipped: out of time"
            continue
        try:
            results["models"][name] = bench_model(name, dtype, run, deadline)
        except (RuntimeError, ValueError, OSError, WhisperwireError) as exc:
            # MLX reports a failed kernel or allocation as RuntimeError/ValueError: the other
            # models and the capacity sweep still run.
            logger.error("%s failed", name, exc_info=True)
            results["models"][name] = f"failed: {exc!r}"
        release_device_memory()
        save_partial()
    if args.capacity_models:
        results["capacity"] = bench_capacity(
            args.capacity_models,
            args.capacity_clients,
            args.capacity_seconds,
            whole,
            swept=save_partial,
        )
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results(args.output, results)
    print(report(results))
    print(f"\nwrote {path.relative_to(RESULTS.parent.parent)} in {results['wall_s']:.0f} s")
    print(json.dumps(headline(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
