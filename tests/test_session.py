"""The streaming core with the real model, real webrtcvad and real speech.

Recordings are streamed through ``Session`` in simulated real time (decode time is charged to
the clock, see ``bench/simulate.py``), and the finals are held against the offline transcript.
"""

from __future__ import annotations

import csv
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from bench.simulate import SimulationResult, simulate
from server.audio import pcm_s16le_bytes
from server.config import SAMPLE_RATE_HZ, StreamingConfig
from server.engine.offline import transcribe_audio
from server.errors import AudioFormatError, FrameTooLargeError, ProtocolError
from server.messages import (
    DoneMessage,
    FinalMessage,
    PartialMessage,
    SpeechStartedMessage,
)
from server.session import DecodeJob, Session
from tests.helpers import load_clip, normalize, wer

if TYPE_CHECKING:
    from server.engine.engine import Engine

WER_MARGIN = 0.02  # streamed finals may be at most 2 points (absolute) worse than offline


def modelled_decode_cost_s(job: DecodeJob) -> float:
    """What a decode costs tiny.en on our 2-core CPUs (encoder at >= 10 s context plus
    tokens), as a model rather than a measurement, so window positions and text are the same
    on every run."""
    return 0.5 + 0.04 * job.audio_s


def _long_english(speech_dir: Path) -> list[str]:
    with (speech_dir / "manifest_long.tsv").open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["file"] for r in rows if r["language"] == "en"]


def _assert_finals_are_append_only(result: SimulationResult) -> None:
    finals = result.finals
    ids = [f.segment_id for f in finals]
    assert ids == list(range(len(ids))), "segment ids must start at 0 and only grow"
    for a, b in pairwise(finals):
        assert b.start >= a.start - 1e-6, "finals go forward in stream time"
    for f in finals:
        assert f.text.strip()
        assert f.words, "finals carry word timings"
        assert f.start <= f.end


def _doubled_at_boundaries(result: SimulationResult, offline: str) -> list[str]:
    """Words repeated across consecutive finals that the offline transcript does not repeat."""
    reference = normalize(offline).split()
    ref_pairs = {(a, b) for a, b in pairwise(reference)}
    doubled = []
    finals = [normalize(f.text).split() for f in result.finals]
    for left, right in pairwise(finals):
        if left and right and left[-1] == right[0] and (left[-1], right[0]) not in ref_pairs:
            doubled.append(left[-1])
    return doubled


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1])
def test_long_recordings_stream_as_well_as_offline(
    engine: Engine, speech_dir: Path, index: int
) -> None:
    files = _long_english(speech_dir)
    if index >= len(files):
        pytest.skip("fewer English long recordings than expected")
    audio = load_clip(speech_dir / files[index])
    offline = transcribe_audio(engine, audio).text
    result = simulate(engine, audio, decode_cost_s=modelled_decode_cost_s)
    streamed = result.text
    offline_vs_stream = wer(offline, streamed)
    print(f"{files[index]}: streamed-vs-offline WER {offline_vs_stream:.3f}")
    with (speech_dir / "manifest_long.tsv").open(newline="", encoding="utf-8") as fh:
        reference = next(
            r["transcript"]
            for r in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
            if r["file"] == files[index]
        )
    wer_offline = wer(reference, offline)
    wer_stream = wer(reference, streamed)
    print(f"WER offline {wer_offline:.3f} streamed {wer_stream:.3f}")
    assert wer_stream <= wer_offline + WER_MARGIN
    _assert_finals_are_append_only(result)
    assert _doubled_at_boundaries(result, offline) == []
    done = [e.message for e in result.events if isinstance(e.message, DoneMessage)]
    assert len(done) == 1 and done[0].segments == len(result.finals)
    assert done[0].audio_received_s == pytest.approx(audio.shape[0] / SAMPLE_RATE_HZ, abs=0.02)


def test_short_clip_gives_partials_then_finals(engine: Engine, speech_dir: Path) -> None:
    audio = load_clip(speech_dir / "misc_en" / "jfk.wav")
    result = simulate(engine, audio)
    kinds = [type(e.message) for e in result.events]
    assert kinds[0] is SpeechStartedMessage
    assert PartialMessage in kinds
    assert kinds.index(PartialMessage) < kinds.index(FinalMessage)
    assert (
        wer(
            "And so my fellow Americans, ask not what your country can do for you, "
            "ask what you can do for your country.",
            result.text,
        )
        <= 0.1
    )
    partial_texts = [
        (e.message.segment_id, e.message.text)
        for e in result.events
        if isinstance(e.message, PartialMessage)
    ]
    assert all(a != b for a, b in pairwise(partial_texts)), (
        "identical partials are never sent twice in a row"
    )
    for e in result.events:
        assert e.message.audio_received_s <= audio.shape[0] / SAMPLE_RATE_HZ + 1e-6


@pytest.mark.parametrize("kind", ["silence", "noise"])
def test_silence_and_noise_give_no_text(engine: Engine, kind: str) -> None:
    rng = np.random.default_rng(7)
    n = SAMPLE_RATE_HZ * 8
    audio = (
        np.zeros(n, dtype=np.float32)
        if kind == "silence"
        else (rng.standard_normal(n) * 0.05).astype(np.float32)
    )
    result = simulate(engine, audio)
    assert result.finals == []
    assert not any(isinstance(e.message, PartialMessage) and e.message.text for e in result.events)


def test_speech_between_silences_is_found_and_transcribed(engine: Engine, speech_dir: Path) -> None:
    clip = load_clip(speech_dir / "librispeech_test-clean" / "1089-134691-0001.wav")
    gap = np.zeros(SAMPLE_RATE_HZ * 2, dtype=np.float32)
    result = simulate(engine, np.concatenate([gap, clip, gap, clip, gap]))
    starts = [e.message for e in result.events if isinstance(e.message, SpeechStartedMessage)]
    assert len(starts) == 2
    expected = "FOR A FULL HOUR HE HAD PACED UP AND DOWN WAITING BUT HE COULD WAIT NO LONGER"
    assert wer(f"{expected} {expected}", result.text) <= 0.15


def _session(engine: Engine, **streaming: object) -> Session:
    return Session("t", engine, streaming=StreamingConfig(**streaming))  # type: ignore[arg-type]


def test_flush_finalises_and_keeps_the_session_open(engine: Engine, speech_dir: Path) -> None:
    session = _session(engine)
    clip = load_clip(speech_dir / "librispeech_test-clean" / "1089-134691-0000.wav")
    session.receive_audio(pcm_s16le_bytes(clip))
    session.receive_text('{"type": "flush"}')
    finals = _drain(engine, session)
    assert "wait no longer" in normalize(" ".join(f.text for f in finals))
    assert not session.done
    session.receive_audio(pcm_s16le_bytes(clip))
    session.receive_text('{"type": "end"}')
    more = _drain(engine, session)
    assert session.done
    assert "wait no longer" in normalize(" ".join(f.text for f in more))
    assert [f.segment_id for f in finals + more] == list(range(len(finals + more)))


def _drain(engine: Engine, session: Session) -> list[FinalMessage]:
    from server.engine.engine import Window

    finals: list[FinalMessage] = []
    while True:
        finals += [m for m in session.events_to_send() if isinstance(m, FinalMessage)]
        job = session.next_job()
        if job is None:
            return finals
        result = engine.decode_windows(
            [Window(engine.features(job.audio), job.audio_s, job.options, job.prompt, job.prefix)]
        )[0]
        session.receive_result(job, result)


def test_protocol_rules(engine: Engine) -> None:
    session = _session(engine, max_frame_bytes=1000)
    session.receive_text('{"type": "config", "sample_rate": 8000}')
    session.receive_audio(b"\x00\x00" * 80)
    with pytest.raises(ProtocolError, match="before the first audio"):
        session.receive_text('{"type": "config", "sample_rate": 16000}')
    with pytest.raises(AudioFormatError):
        session.receive_audio(b"\x00" * 3)
    with pytest.raises(FrameTooLargeError):
        session.receive_audio(b"\x00" * 1002)
    with pytest.raises(ProtocolError):
        session.receive_text("{not json")
    session.receive_text('{"type": "end"}')
    with pytest.raises(ProtocolError) as info:
        session.receive_audio(b"\x00\x00")
    assert info.value.close_code == 1008
    assert session.done
    done = [m for m in session.events_to_send() if isinstance(m, DoneMessage)]
    assert done and done[0].audio_received_s == pytest.approx(0.01)


def test_english_only_model_refuses_other_languages(engine: Engine) -> None:
    session = _session(engine)
    with pytest.raises(ProtocolError, match="English-only"):
        session.receive_text('{"type": "config", "language": "de"}')
