"""Front-end and model levers for telephone speech, tried fast: offline decodes, no streaming.

    python -m bench.phone_levers                          # every lever
    python -m bench.phone_levers --lever range_6 --lever fill_floor_6

The 40 LibriSpeech test-other clips of ``manifest.tsv`` go through the telephone line of
``bench/phone_line.py`` (300-3400 Hz, 8 kHz, G.711 mu-law), are decoded by the server's own
``PcmDecoder`` and transcribed offline (``transcribe_audio``, greedy, as ``bench.telephony``'s
``phone_offline``). Each lever changes one thing on the way from the line to the model and is
compared with ``phone`` (the line as the server hears it today) by the paired bootstrap of
``bench.telephony``; a lever that changes the front end is also run on the 16 kHz clips, as it
would be if it were applied there, to show what it costs where it does not belong.

Levers (``--lever``; default all):

- ``wide`` / ``phone``: the 16 kHz clips and the line, unchanged (the gap to close);
- ``band_only`` / ``linear_8k``: the band-pass alone at 16 kHz, and band-pass plus 8 kHz with
  no companding (where the loss comes from: the band, the rate, or mu-law's quantisation);
- ``high_cut_only`` / ``low_cut_only``: only the 3.4 kHz low-pass, only the 300 Hz high-pass;
- ``range_D``: the log-mel floor ``D`` decades below the maximum instead of Whisper's 8;
- ``fill_floor_D``: only the mel bands the line leaves empty (below 300 Hz, above 3.4 kHz)
  raised to ``D`` decades below the maximum, on the frames that hold audio;
- ``fill_high_6``: as ``fill_floor_D`` above 3.4 kHz only, 6.2 decades down (the median
  noise floor of test-other's 16 kHz recordings above 3.4 kHz);
- ``hf_noise``: white noise above 3.6 kHz added to the audio at that same level (a noise floor
  with a noise's texture, not a flat band);
- ``fill_profile``: the empty bands filled frame by frame with the average wideband envelope
  (each band's median level relative to the in-band mean, measured on the corpus's other
  English clips, not on test-other);
- ``tilt_6db``: +6 dB rising from 1 kHz to 3.4 kHz in the log-mel;
- ``fold_20db``: spectral folding, the 0.3-3.4 kHz band mirrored into 4.6-7.7 kHz 20 dB down
  (the oldest bandwidth extension there is: upsampling without the image filter);
- ``dither``: triangular dither of one mu-law step at the signal's level added on decode;
- ``prompt``: a neutral punctuated sentence as the initial prompt;
- ``beam5``: a 5-beam search instead of greedy decoding (what utterance finals use);
- ``base_phone`` / ``base_wide``: the multilingual ``base`` model on the line and at 16 kHz.

Writes ``bench/results/phone_levers.json`` (``--out``) after every lever; a lever already in
that file is not run again (``--fresh`` runs everything).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np
import soxr

from bench.corpus import ManifestRow, read_manifest
from bench.engine import RESULTS, Float32Array, load_speech, speech_dir, write_results
from bench.phone_line import PHONE_BAND_HZ, PHONE_RATE_HZ, band_pass, phone_line
from bench.telephony import LAW, clip_row, decode_line, hard_rows, paired_bootstrap
from server.core.engine_api import DecodeOptions
from server.core.long_form import LongForm
from server.engine import engine as engine_module
from server.engine import features
from server.engine.engine import Engine, EngineConfig
from server.protocol import g711
from server.protocol.formats import SAMPLE_RATE_HZ

PROFILE_FOLDERS = ("librispeech_test-clean/", "librispeech_dev-clean/", "ljspeech/")
NEUTRAL_PROMPT = "Hello, thank you for calling. Yes, I can hear you well."
MelEdit = Callable[[Float32Array, int], Float32Array]  # log10 mel, audio frames -> log10 mel


@dataclasses.dataclass
class Clip:
    row: ManifestRow
    wide: Float32Array  # 16 kHz as recorded
    line: bytes  # the telephone line's G.711 bytes at 8 kHz
    heard: Float32Array  # the line as the server hears it: 16 kHz float32


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str
    source: str = "phone"  # phone, wide, band_only, linear_8k, fold_20db, dither
    mel_edit: MelEdit | None = None
    range_decades: float = features.DYNAMIC_RANGE_DECADES
    prompt: str = ""
    model: str = "tiny.en"
    beam_size: int = 1
    front_end: bool = False  # also run on the 16 kHz clips, as ``<name>@wide``


@lru_cache(maxsize=1)
def empty_bands(n_mels: int = 80) -> np.ndarray:
    """The mel bands whose filter lies wholly outside the telephone band."""
    filters = features.mel_filters(n_mels)
    hz = np.arange(filters.shape[1]) * SAMPLE_RATE_HZ / features.N_FFT
    low, high = PHONE_BAND_HZ
    out = np.array([hz[row > 0].max() <= low or hz[row > 0].min() >= high for row in filters])
    return out


def in_bands(n_mels: int = 80) -> np.ndarray:
    filters = features.mel_filters(n_mels)
    hz = np.arange(filters.shape[1]) * SAMPLE_RATE_HZ / features.N_FFT
    low, high = PHONE_BAND_HZ
    return np.array([hz[row > 0].min() >= low and hz[row > 0].max() <= high for row in filters])


def fill_floor(decades: float) -> MelEdit:
    def edit(log_spec: Float32Array, frames: int) -> Float32Array:
        out = log_spec.copy()
        bands = empty_bands(log_spec.shape[1])
        floor = log_spec.max() - decades
        out[:frames, bands] = np.maximum(out[:frames, bands], floor)
        return out

    return edit


@lru_cache(maxsize=1)
def wideband_profile() -> np.ndarray:
    """Each mel band's median level relative to the frame's in-band mean, over the voiced
    frames (in-band mean within 3 decades of the clip's loudest) of the profile clips."""
    folder = speech_dir()
    rows = [r for r in read_manifest(folder / "manifest.tsv") if r.file.startswith(PROFILE_FOLDERS)]
    inside = in_bands()
    offsets = []
    for row in rows:
        log_spec = features.log10_mel(load_speech(row.file))
        mean = log_spec[:, inside].mean(axis=1)
        voiced = mean > mean.max() - 3.0
        offsets.append(log_spec[voiced] - mean[voiced, None])
    return np.asarray(np.median(np.concatenate(offsets), axis=0))


def fill_profile(log_spec: Float32Array, frames: int) -> Float32Array:
    out = log_spec.copy()
    bands = empty_bands(log_spec.shape[1])
    mean = log_spec[:frames, in_bands(log_spec.shape[1])].mean(axis=1)
    target = mean[:, None] + wideband_profile()[None, bands]
    out[:frames, bands] = np.maximum(out[:frames, bands], target)
    return out


def fill_high(decades: float) -> MelEdit:
    """Only the empty bands above the telephone band raised to ``decades`` below the max."""

    def edit(log_spec: Float32Array, frames: int) -> Float32Array:
        out = log_spec.copy()
        filters = features.mel_filters(log_spec.shape[1])
        hz = np.arange(filters.shape[1]) * SAMPLE_RATE_HZ / features.N_FFT
        high = np.array([hz[row > 0].min() >= PHONE_BAND_HZ[1] for row in filters])
        out[:frames, high] = np.maximum(out[:frames, high], log_spec.max() - decades)
        return out

    return edit


def hf_noise(audio: Float32Array, below_max_decades: float) -> Float32Array:
    """``audio`` with white noise above 3.6 kHz added, its mel level in those bands
    ``below_max_decades`` under the log-mel maximum: a wideband recording's noise floor."""
    rng = np.random.default_rng(0)
    noise = filtered(
        rng.standard_normal(audio.size).astype(np.float32), 3600.0, SAMPLE_RATE_HZ / 2 - 100
    )
    filters = features.mel_filters(80)
    hz = np.arange(filters.shape[1]) * SAMPLE_RATE_HZ / features.N_FFT
    high = np.array([hz[row > 0].min() >= 3700.0 for row in filters])
    target = features.log10_mel(audio).max() - below_max_decades
    level = float(np.median(features.log10_mel(noise)[:, high]))
    gain = 10 ** ((target - level) / 2)
    return np.asarray(audio + gain * noise, dtype=np.float32)


def tilt(db: float, start_hz: float = 1000.0) -> MelEdit:
    def edit(log_spec: Float32Array, frames: int) -> Float32Array:
        filters = features.mel_filters(log_spec.shape[1])
        hz = np.arange(filters.shape[1]) * SAMPLE_RATE_HZ / features.N_FFT
        centre = (filters * hz).sum(axis=1) / filters.sum(axis=1)
        top = PHONE_BAND_HZ[1]
        gain = np.clip((centre - start_hz) / (top - start_hz), 0.0, 1.0) * db / 10.0
        gain[centre > top] = 0.0
        out = log_spec.copy()
        out[:frames] += gain.astype(np.float32)
        return out

    return edit


def fold(line: bytes, gain_db: float) -> Float32Array:
    """The line at 16 kHz with its image above 4 kHz kept ``gain_db`` down."""
    at_8k = g711.decode(line, LAW)
    base = np.asarray(soxr.resample(at_8k, PHONE_RATE_HZ, SAMPLE_RATE_HZ, quality="HQ"))
    stuffed = np.zeros(at_8k.size * 2, dtype=np.float32)
    stuffed[::2] = 2 * at_8k  # zero-stuffing: baseband plus its mirror image about 4 kHz
    image = stuffed - band_pass_low(stuffed)
    out = base[: image.size] + 10 ** (gain_db / 20) * image[: base.size]
    return np.asarray(out, dtype=np.float32)


def band_pass_low(x: np.ndarray) -> np.ndarray:
    """``x`` low-passed at 4 kHz (the image removed), same length, no delay."""
    taps = 511
    n = np.arange(taps) - (taps - 1) / 2
    h = 0.5 * np.sinc(0.5 * n) * np.kaiser(taps, 8.6)
    return np.convolve(x, h, mode="same")


def filtered(audio: Float32Array, low_hz: float, high_hz: float) -> Float32Array:
    """``audio`` band-passed to ``low_hz``-``high_hz`` (phone_line's filter, either edge)."""
    taps = 1023
    n = np.arange(taps) - (taps - 1) / 2
    low, high = low_hz / SAMPLE_RATE_HZ, high_hz / SAMPLE_RATE_HZ
    ideal = 2 * high * np.sinc(2 * high * n) - 2 * low * np.sinc(2 * low * n)
    h = ideal * np.kaiser(taps, 8.6)
    return np.asarray(np.convolve(audio, h, mode="same"), dtype=np.float32)


def dither(line: bytes) -> Float32Array:
    """The line decoded with triangular dither one mu-law step wide at each sample's level."""
    at_8k = g711.decode(line, LAW)
    # A mu-law step at magnitude m is about (m + bias) / 16 in 16-bit units (4 bits per segment).
    step = (np.abs(at_8k) * 32768 + 132) / 16 / 32768
    rng = np.random.default_rng(0)
    noise = (rng.random(at_8k.size) - rng.random(at_8k.size)) * step
    noisy = np.asarray(at_8k + noise, dtype=np.float32)
    return np.asarray(soxr.resample(noisy, PHONE_RATE_HZ, SAMPLE_RATE_HZ, quality="HQ"))


def audio_for(lever: Lever, clip: Clip, wide: bool) -> Float32Array:
    if wide or lever.source == "wide":
        return clip.wide
    if lever.source == "band_only":
        return band_pass(clip.wide)
    if lever.source == "linear_8k":
        narrow = soxr.resample(band_pass(clip.wide), SAMPLE_RATE_HZ, PHONE_RATE_HZ, quality="VHQ")
        return np.asarray(
            soxr.resample(narrow, PHONE_RATE_HZ, SAMPLE_RATE_HZ, quality="HQ"), dtype=np.float32
        )
    if lever.source == "high_cut_only":
        return filtered(clip.wide, 0.0, PHONE_BAND_HZ[1])
    if lever.source == "low_cut_only":
        return filtered(clip.wide, PHONE_BAND_HZ[0], SAMPLE_RATE_HZ / 2)
    if lever.source == "hf_noise":
        return hf_noise(clip.heard, 6.2)
    if lever.source == "fold_20db":
        return fold(clip.line, -20.0)
    if lever.source == "dither":
        return dither(clip.line)
    return clip.heard


@contextmanager
def front_end(lever: Lever) -> Iterator[None]:
    """The engine's log-mel with the lever's edit and floor (a module name, swapped here to
    try the lever before it is built into the server)."""
    name = "log_mel_spectrogram"
    saved = getattr(engine_module, name)

    def log_mel(audio: Float32Array, n_mels: int = 80, padding: int = 0) -> Float32Array:
        log_spec = features.log10_mel(audio, n_mels, padding)
        if lever.mel_edit is not None:
            log_spec = lever.mel_edit(log_spec, -(-audio.shape[0] // features.HOP_LENGTH))
        return features.scale_log_mel(log_spec, lever.range_decades)

    setattr(engine_module, name, log_mel)
    try:
        yield
    finally:
        setattr(engine_module, name, saved)


LEVERS = (
    Lever("phone"),
    Lever("wide", source="wide"),
    Lever("band_only", source="band_only"),
    Lever("linear_8k", source="linear_8k"),
    Lever("high_cut_only", source="high_cut_only"),
    Lever("low_cut_only", source="low_cut_only"),
    Lever("range_7", range_decades=7.0, front_end=True),
    Lever("range_6", range_decades=6.0, front_end=True),
    Lever("range_5", range_decades=5.0, front_end=True),
    Lever("fill_floor_6", mel_edit=fill_floor(6.0), front_end=True),
    Lever("fill_floor_5", mel_edit=fill_floor(5.0), front_end=True),
    Lever("fill_high_6", mel_edit=fill_high(6.2), front_end=True),
    Lever("hf_noise", source="hf_noise"),
    Lever("fill_profile", mel_edit=fill_profile, front_end=True),
    Lever("tilt_6db", mel_edit=tilt(6.0), front_end=True),
    Lever("fold_20db", source="fold_20db"),
    Lever("dither", source="dither"),
    Lever("prompt", prompt=NEUTRAL_PROMPT, front_end=True),
    Lever("beam5", beam_size=5, front_end=True),
    Lever("base_phone", model="base"),
    Lever("base_wide", source="wide", model="base"),
)


def transcribe(
    engine: Engine, audio: Float32Array, prompt: tuple[int, ...], beam_size: int = 1
) -> str:
    """``transcribe_audio``'s long-form decode (greedy unless ``beam_size`` > 1), with
    ``prompt`` before the audio."""
    options = DecodeOptions(word_timestamps=False, beam_size=beam_size)
    loop = LongForm(audio, options, prompt=prompt)
    while (job := loop.next_window()) is not None:
        loop.take(*engine.transcribe_window(job.audio, job.request, job.temperatures))
    return loop.transcript().text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [lever.name for lever in LEVERS]
    parser.add_argument("--lever", action="append", choices=names, help="default: all")
    parser.add_argument("--limit", type=int, default=0, help="first N test-other clips only")
    parser.add_argument("--no-wide", action="store_true", help="skip the levers' 16 kHz runs")
    parser.add_argument("--fresh", action="store_true", help="run levers already in --out")
    parser.add_argument("--out", default="phone_levers")
    args = parser.parse_args(argv)

    clips = []
    for row in hard_rows(args.limit):
        wide = load_speech(row.file)
        line = phone_line(wide, LAW)
        clips.append(Clip(row, wide, line, decode_line(line)))

    path = RESULTS / f"{args.out}.json"
    data: dict[str, Any] = {} if args.fresh or not path.exists() else json.loads(path.read_text())
    data.setdefault("clips", {})
    data.setdefault("summary", {})
    engines: dict[str, Engine] = {}

    def engine_for(model: str) -> Engine:
        if model not in engines:
            engines[model] = Engine.load(EngineConfig(model=model))
            engines[model].warmup()
        return engines[model]

    def measure(name: str, lever: Lever, wide: bool) -> None:
        if name in data["clips"] and len(data["clips"][name]) == len(clips):
            return
        engine = engine_for(lever.model)
        prompt = engine.encode_text(" " + lever.prompt.strip()) if lever.prompt else ()
        started = time.perf_counter()
        out = []
        with front_end(lever):
            for clip in clips:
                text = transcribe(engine, audio_for(lever, clip, wide), prompt, lever.beam_size)
                out.append(clip_row(clip.row, text))
        data["clips"][name] = out
        errors = sum(r["errors"] for r in out)
        words = sum(r["ref_words"] for r in out)
        entry: dict[str, Any] = {
            "errors": errors,
            "ref_words": words,
            "wer": round(errors / words, 4),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        base_name = "wide" if wide else "phone"
        if name != base_name and base_name in data["clips"]:
            base = data["clips"][base_name]
            entry["points_vs_" + base_name] = round(
                100 * (errors - sum(r["errors"] for r in base)) / words, 2
            )
            entry["bootstrap_ci_points"] = list(paired_bootstrap(base, out))
            entry["better_clips"] = sum(
                o["errors"] < b["errors"] for b, o in zip(base, out, strict=True)
            )
            entry["worse_clips"] = sum(
                o["errors"] > b["errors"] for b, o in zip(base, out, strict=True)
            )
        data["summary"][name] = entry
        data["loadavg"] = os.getloadavg()
        write_results(args.out, data)
        print(f"{name:20s} {json.dumps(entry)}", flush=True)

    chosen = [lever for lever in LEVERS if not args.lever or lever.name in args.lever]
    for lever in (LEVERS[0], LEVERS[1], *chosen):
        measure(lever.name, lever, wide=False)
        if lever.front_end and not args.no_wide:
            measure(f"{lever.name}@wide", lever, wide=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
