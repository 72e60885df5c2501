"""The MLX engine on the real tiny.en model and real speech.

Full 30 s contexts cost about 2.5 s of encoder time each on our 2-core CPUs, so only the
accuracy and parity tests use them; the rest decode with the dynamic context policy.
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.corpus import ManifestRow, load_clip, normalize, wer
from server.core.engine_api import (
    DecodeInterrupted,
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    Window,
    interruptible,
)
from server.engine.blas import import_mlx
from server.engine.engine import Engine
from server.engine.features import N_FRAMES
from server.engine.lightning import module as lightning_module
from server.protocol.formats import SAMPLE_RATE_HZ
from tests.helpers import HARD_SPEECH, Float32Array, hard_clips

logger = logging.getLogger("tests.test_engine")

LS_TEST = "librispeech_misc/lightning-whisper-mlx_ls_test.wav"
# Clean read speech, measured with this suite's clip selection: 8 errors in 249 reference
# words, WER 3.2% (tiny.en, float32, full 30 s contexts). The bound leaves room for about four
# more errors, which covers a word flipping on another BLAS kernel, but not a real regression:
# a broken timestamp rule or mel frontend costs tens of points.
WER_BOUND = 0.05
# test-other, one clip per chapter: 20 errors in 112 words, 17.9% (2609-156975-0002 alone has
# 12 of them: a fast reader tiny.en garbles). Room for about four more errors, as above.
HARD_WER_BOUND = 0.22
PARITY_CLIPS = (
    LS_TEST,
    "misc_en/jfk.wav",
    "librispeech_test-clean/1089-134686-0001.wav",
    "pocketsphinx_testdata/cards_002.wav",
)
BATCH_CLIPS = (
    "misc_en/jfk.wav",
    "librispeech_test-clean/1089-134686-0000.wav",  # 10.4 s: a longer context than the rest
    "ljspeech/LJ001-0011.wav",
    "pocketsphinx_testdata/goforward.wav",
)
TIMESTAMP_TOLERANCE_S = 0.02  # one encoder position


def wer_clips(manifest: list[ManifestRow]) -> list[ManifestRow]:
    """lightning-whisper-mlx's test clip plus, per clean source folder, the two longest
    English clips of at most 12 s: a full-context decode costs the same encoder time for 2 s
    as for 12 s, so longer clips give more words per second of test time."""
    by_folder: dict[str, list[ManifestRow]] = defaultdict(list)
    for row in manifest:
        folder = row.file.split("/")[0]
        if (
            row.language == "en"
            and row.seconds <= 12
            and row.file != LS_TEST
            and folder != HARD_SPEECH
        ):
            by_folder[folder].append(row)
    chosen = [r for r in manifest if r.file == LS_TEST]
    for folder in sorted(by_folder):
        chosen += sorted(by_folder[folder], key=lambda r: -r.seconds)[:2]
    return chosen


def window(engine: Engine, audio: Float32Array, frames: int | None = None, **kw: Any) -> Window:
    return Window(
        engine.features(audio, frames), DecodeRequest(audio.shape[0] / SAMPLE_RATE_HZ, **kw)
    )


# --- accuracy ----------------------------------------------------------------------------------


def _pooled_wer(
    offline_text: Callable[[Path], str], speech_dir: Path, clips: list[ManifestRow]
) -> float:
    refs, hyps = [], []
    for row in clips:
        text = offline_text(speech_dir / row.file)
        refs.append(row.transcript)
        hyps.append(text)
        logger.info("%.3f %s: %r", wer(row.transcript, text), row.file, text)
    words = sum(len(normalize(r).split()) for r in refs)
    overall = wer(refs, hyps)
    print(f"\ntiny.en WER over {len(clips)} clips ({words} words): {overall:.2%}")
    return overall


def test_wer_of_tiny_en_on_clean_english(
    offline_text: Callable[[Path], str], speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    clips = wer_clips(manifest)
    assert clips[0].file == LS_TEST and len(clips) >= 11
    assert not any(r.file.startswith(HARD_SPEECH) for r in clips)
    assert _pooled_wer(offline_text, speech_dir, clips) <= WER_BOUND


def test_wer_of_tiny_en_on_hard_english(
    offline_text: Callable[[Path], str], speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    clips = hard_clips(manifest)
    assert len(clips) == 4  # one per chapter
    assert _pooled_wer(offline_text, speech_dir, clips) <= HARD_WER_BOUND


# --- parity with lightning-whisper-mlx ----------------------------------------------------------


@dataclass(frozen=True)
class Parity:
    mel: Float32Array
    audio_s: float
    reference: list[int]  # lightning-whisper-mlx's tokens, timestamps included
    ours: DecodeResult


@pytest.fixture(scope="session")
def parity(engine: Engine, speech_dir: Path) -> dict[str, Parity]:
    """Reference and our greedy decode of each parity clip on the same full-context mel."""
    mx = import_mlx()
    whisper, decoding = lightning_module("whisper"), lightning_module("decoding")
    ref = whisper.Whisper(whisper.ModelDimensions(**engine.dims.__dict__), mx.float32)
    weights = mx.load(str(engine.loaded.source / "weights.safetensors"))
    ref.load_weights(list(weights.items()), strict=False)
    opts = decoding.DecodingOptions(language="en", fp16=False, without_timestamps=False)
    out = {}
    for clip in PARITY_CLIPS:
        audio = load_clip(speech_dir / clip)
        mel = engine.features(audio, N_FRAMES)
        result = decoding.decode(ref, mx.array(mel), opts)
        audio_s = audio.shape[0] / SAMPLE_RATE_HZ
        ours = engine.decode_windows(
            [Window(mel, DecodeRequest(audio_s, DecodeOptions(word_timestamps=False)))]
        )[0]
        out[clip] = Parity(mel, audio_s, [int(t) for t in result.tokens], ours)
    return out


# The parity fixture loads the reference model and decodes every parity clip (tens of seconds on
# a busy 2-core machine): its tests stay on one pytest-xdist worker, and it lives for the
# session, so it is built once (module-scoped, it was built again each time that worker came
# back to this module from another: three times, 20 s each, in `make test`).
with_parity = pytest.mark.xdist_group("lightning-parity")


@with_parity
@pytest.mark.parametrize("clip", PARITY_CLIPS)
def test_greedy_tokens_equal_lightning_reference(
    engine: Engine, parity: dict[str, Parity], clip: str
) -> None:
    p = parity[clip]
    eot, tb = engine.vocab.eot, engine.vocab.timestamp_begin
    assert list(p.ours.tokens) == [t for t in p.reference if t < eot]
    assert p.ours.stop_reason == StopReason.EOT
    # TextSpan boundaries are the reference's timestamp tokens, pair by pair, up to the end
    # of the audio: our decoder forbids timestamps past the real audio, the reference does not
    # (it ends cards_002, 1.96 s long, at <|2.00|>).
    stamps = [round((t - tb) * 0.02, 2) for t in p.reference if t >= tb]
    inside = len([x for x in stamps if x <= p.audio_s])
    ours = [round(x, 2) for s in p.ours.spans for x in (s.start_s, s.end_s) if x >= 0]
    assert ours[:inside] == stamps[:inside]


@with_parity
def test_forced_prefix_continues_to_the_same_tokens(
    engine: Engine, parity: dict[str, Parity]
) -> None:
    p = parity[LS_TEST]
    full = [t for t in p.reference if t < engine.vocab.eot]
    half = tuple(full[: len(full) // 2])
    forced = engine.decode_windows(
        [Window(p.mel, DecodeRequest(p.audio_s, DecodeOptions(word_timestamps=False), prefix=half))]
    )[0]
    assert list(forced.tokens) == full
    assert forced.n_generated < len(full)  # the prefix was forced, not sampled again


# --- no speech --------------------------------------------------------------------------------


def _noise(rms: float, seconds: float = 2.0) -> Float32Array:
    rng = np.random.default_rng(7)
    return (rng.standard_normal(round(seconds * SAMPLE_RATE_HZ)) * rms).astype(np.float32)


@pytest.mark.parametrize(
    "rms",
    [
        pytest.param(0.0, id="digital-silence"),
        pytest.param(0.003, id="noise-50dBFS"),
        pytest.param(0.01, id="noise-40dBFS"),
    ],
)
def test_silence_and_low_noise_give_no_text(engine: Engine, rms: float) -> None:
    result = engine.decode_windows([window(engine, _noise(rms))])[0]
    assert result.text.strip() == "" or result.stop_reason == StopReason.NO_SPEECH, (
        result.text,
        result.no_speech_prob,
        result.avg_logprob,
    )
    assert not result.is_speech or result.text.strip() == ""


# --- batching ---------------------------------------------------------------------------------


def test_batched_decode_equals_per_stream_decode(engine: Engine, speech_dir: Path) -> None:
    audio = [load_clip(speech_dir / c) for c in BATCH_CLIPS]
    prompt = engine.encode_text(" We spoke about printing and old books.")
    extras: list[dict[str, Any]] = [
        {},
        {"prompt": prompt},
        {"prefix": engine.encode_text(" It is of the")},
        {"prompt": prompt[:4], "prefix": engine.encode_text(" Go")},
    ]
    windows = [window(engine, a, **kw) for a, kw in zip(audio, extras, strict=True)]
    assert len({w.mel.shape[0] for w in windows}) > 1  # rows with different audio contexts
    singles = [engine.decode_windows([w])[0] for w in windows]
    batched = engine.decode_windows(windows)
    for one, many in zip(singles, batched, strict=True):
        assert many.tokens == one.tokens
        assert many.text == one.text
        assert many.stop_reason == one.stop_reason
        assert one.text.strip()
    assert batched[2].tokens[:4] == engine.encode_text(" It is of the")


# --- interruption -----------------------------------------------------------------------------


@pytest.mark.parametrize("beam_size", [1, 5])
def test_an_interrupted_decode_stops_at_its_next_step_and_the_next_decode_is_whole(
    engine: Engine, speech_dir: Path, beam_size: int
) -> None:
    """A lane interrupts a decode nobody waits for (``interruptible``): greedy and beam
    search alike stop at the first step after the request, raising ``DecodeInterrupted``, and
    leave the engine's caches fit for the next call, which decodes as if nothing happened."""
    audio = load_clip(speech_dir / "librispeech_test-other/3331-159605-0000.wav")[
        : 8 * SAMPLE_RATE_HZ
    ]
    options = DecodeOptions(beam_size=beam_size)
    windows = [window(engine, audio, options=options)]
    whole = engine.decode_windows(windows)[0]
    assert whole.n_steps > 10
    checks = 0

    def after_five_checks() -> bool:
        nonlocal checks
        checks += 1
        return checks > 5

    with interruptible(after_five_checks), pytest.raises(DecodeInterrupted):
        engine.decode_windows(windows)
    assert checks == 6  # once after the encoder, then once per step: it stopped when asked
    again = engine.decode_windows(windows)[0]
    assert again.tokens == whole.tokens and again.words == whole.words
    with interruptible(lambda: False):
        assert engine.decode_windows(windows)[0].tokens == whole.tokens


# --- word timestamps --------------------------------------------------------------------------


@pytest.mark.parametrize("clip", ["misc_en/jfk.wav", "ljspeech/LJ001-0011.wav"])
def test_word_timestamps_are_ordered_inside_the_window_and_spell_the_text(
    engine: Engine, speech_dir: Path, clip: str
) -> None:
    w = window(engine, load_clip(speech_dir / clip))
    result = engine.decode_windows([w])[0]
    words = result.words
    assert len(words) >= 5
    assert "".join(x.word for x in words) == result.text
    assert sum(len(x.tokens) for x in words) == len(result.tokens)
    for prev, cur in itertools.pairwise(words):
        assert cur.start_s >= prev.end_s - 1e-9
    for x in words:
        assert 0.0 <= x.start_s <= x.end_s <= w.request.audio_s + TIMESTAMP_TOLERANCE_S
        assert 0.0 <= x.probability <= 1.0
    # The words cover the speech, not a corner of the window.
    assert words[-1].end_s >= 0.5 * w.request.audio_s


# Two LJ Speech recordings read one after the other, with no gap added: where the first ends
# is known to the sample, so the words' times can be held against it. Together 19 s, over 64
# tokens: the alignment pass attends over them with ``cpu_kernels`` (CPU_ATTENTION_MIN_SCORES).
JOINED = ("ljspeech/LJ001-0014.wav", "ljspeech/LJ001-0015.wav")


def test_word_timestamps_put_each_recordings_words_on_its_side_of_the_join(
    engine: Engine, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    refs = {r.file: r.transcript for r in manifest}
    first, second = (load_clip(speech_dir / name) for name in JOINED)
    join_s = first.shape[0] / SAMPLE_RATE_HZ
    result = engine.decode_windows([window(engine, np.concatenate([first, second]))])[0]
    before = "".join(w.word for w in result.words if (w.start_s + w.end_s) / 2 < join_s)
    after = "".join(w.word for w in result.words if (w.start_s + w.end_s) / 2 >= join_s)
    assert wer(refs[JOINED[0]], before) <= 0.15, (before, join_s, result.words)
    assert wer(refs[JOINED[1]], after) <= 0.15, (after, join_s, result.words)
    last = max(w.end_s for w in result.words if (w.start_s + w.end_s) / 2 < join_s)
    assert abs(last - join_s) < 0.6, (last, join_s)  # the reader's last word ends at the join
    # A spoken word takes time. The alignment squeezes the odd short one to nothing (1 of 55
    # here); attending past each token, as a broadcast mask did, squeezed 9.
    spoken = [w for w in result.words if any(c.isalnum() for c in w.word)]
    squeezed = [w.word for w in spoken if w.end_s - w.start_s < 0.01]
    assert len(result.tokens) > 64
    assert len(squeezed) <= len(spoken) // 20, (squeezed, result.words)


def test_released_memory_is_allocated_again_on_the_next_decode(
    engine: Engine, speech_dir: Path
) -> None:
    audio = load_clip(speech_dir / "misc_en/jfk.wav")[: 3 * SAMPLE_RATE_HZ]
    window = Window(
        engine.features(audio), DecodeRequest(3.0, DecodeOptions(word_timestamps=False))
    )
    before = engine.decode_windows([window, window, window])[0]
    engine.release_memory()
    assert engine.decoder._cache_batch == 0  # the batch-3 caches are gone
    after = engine.decode_windows([window])[0]
    assert after.tokens == before.tokens
