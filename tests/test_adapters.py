"""``TurnSession``'s ``Settled`` marker on real speech and real webrtcvad, the scripted engine
decoding: it follows every final of the speech closed before it, and no later speech's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from server.adapters import AdapterEvent, Settled, TurnSession
from server.audio import pcm_s16le_bytes
from server.config import StreamingConfig
from server.engine_api import DecodeResult, Window
from server.formats import SAMPLE_RATE_HZ
from server.messages import (
    DoneMessage,
    FinalMessage,
    FlushMessage,
    ServerMessage,
    SpeechEndedMessage,
)
from server.session import DecodeJob
from tests.helpers import ScriptedEngine, load_clip

PAUSED_CLIPS = (  # two utterances with a second of silence between them
    "librispeech_test-clean/1089-134691-0000.wav",
    "misc_en/arctic_a0024.wav",
)
LONG_CLIP = "ljspeech/long/LJ001-0001_to_0032.concat.wav"


class EarlyEndEngine(ScriptedEngine):
    """Hears only the first 4 s of a longer window, as Whisper may end a long window at a
    sentence end although speech follows: the session cuts and decodes the rest again."""

    def _result(self, window: Window) -> DecodeResult:
        full = super()._result(window)
        words = tuple(w for w in full.words if w.end_s <= 4.0)
        return dataclasses.replace(
            full, words=words, tokens=tuple(t for w in words for t in w.tokens)
        )


def _decode(engine: ScriptedEngine, job: DecodeJob) -> DecodeResult:
    return engine.decode_windows([Window(engine.features(job.audio), job.request)])[0]


def _drive(
    session: TurnSession,
    engine: ScriptedEngine,
    frames: Sequence[bytes | str],
    *,
    held_frames: int = 0,
) -> list[ServerMessage]:
    """Feed ``frames`` the way ``StreamDriver`` does (events, then a job, then events), each
    decode answered at once, then ``end``. The first job waits for ``held_frames`` more frames,
    as a decode of a stream that fell behind would."""
    events: list[ServerMessage] = []
    held: DecodeJob | None = None
    waiting = held_frames

    def advance() -> None:
        nonlocal held, waiting
        events.extend(session.events_to_send())
        while not session.busy and (job := session.next_job()) is not None:
            events.extend(session.events_to_send())
            if waiting > 0 and held is None:
                held = job
                return
            session.receive_result(job, _decode(engine, job))
            events.extend(session.events_to_send())
        events.extend(session.events_to_send())

    for frame in [*frames, '{"type": "end"}']:
        if isinstance(frame, str):
            session.receive_text(frame)
        else:
            session.receive_audio(frame)
        if held is not None:
            waiting -= 1
            if waiting <= 0 or isinstance(frame, str):
                job, held, waiting = held, None, 0
                session.receive_result(job, _decode(engine, job))
        advance()
    assert isinstance(events[-1], (DoneMessage, Settled)), events[-3:]
    return events


def _check_settled(events: list[ServerMessage], *, closes: int = 0) -> int:
    """Every close (end of speech, or one of ``closes`` flushes) is followed by Settled or
    done, and no final of the speech a Settled covered comes after it. Returns the markers."""
    settled_until = -1.0  # stream time up to which every closed segment is finished
    closed_at: list[float] = []
    unsettled = closes
    markers = 0
    for event in events:
        if isinstance(event, SpeechEndedMessage):
            closed_at.append(event.end)
            unsettled += 1
        elif isinstance(event, FinalMessage):
            assert event.start >= settled_until - 1e-6, (event, settled_until)
        elif isinstance(event, Settled):
            markers += 1
            if closed_at:
                settled_until = max(settled_until, *closed_at)
            unsettled = 0
        elif isinstance(event, DoneMessage):
            unsettled = 0
    assert unsettled == 0
    return markers


def _frames(audio: np.ndarray, chunk_s: float = 0.1) -> list[bytes]:
    pcm = pcm_s16le_bytes(audio)
    step = int(chunk_s * SAMPLE_RATE_HZ) * 2
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


def test_each_pause_is_settled_after_its_finals(speech_dir: Path) -> None:
    silence = np.zeros(SAMPLE_RATE_HZ, dtype=np.float32)
    parts = [load_clip(speech_dir / f) for f in PAUSED_CLIPS]
    audio = np.concatenate([parts[0], silence, parts[1], silence])
    events = _drive(TurnSession("pauses"), ScriptedEngine(), _frames(audio))
    ends = [e for e in events if isinstance(e, SpeechEndedMessage)]
    assert len(ends) >= 2
    assert _check_settled(events) >= len(ends)
    # The marker comes with the closing decode's finals, not with the next speech.
    first_settled = next(i for i, e in enumerate(events) if isinstance(e, Settled))
    first_final = next(i for i, e in enumerate(events) if isinstance(e, FinalMessage))
    assert first_final < first_settled < events.index(ends[1])


def test_a_flush_is_settled_after_the_flushed_finals(speech_dir: Path) -> None:
    frames: list[bytes | str] = list(
        _frames(load_clip(speech_dir / LONG_CLIP)[: 6 * SAMPLE_RATE_HZ])
    )
    frames.insert(30, FlushMessage().to_json())  # at 3 s, in mid speech
    events = _drive(TurnSession("flush"), ScriptedEngine(), frames)
    _check_settled(events, closes=1)
    first_settled = next(i for i, e in enumerate(events) if isinstance(e, Settled))
    before = [e for e in events[:first_settled] if isinstance(e, FinalMessage)]
    after = [e for e in events[first_settled:] if isinstance(e, FinalMessage)]
    assert before and after
    assert max(f.end for f in before) <= 3.0 + 1e-6 <= min(f.start for f in after) + 1e-6


def test_speech_decoded_again_after_an_early_end_is_not_settled_too_soon(
    speech_dir: Path,
) -> None:
    audio = np.concatenate(
        [
            load_clip(speech_dir / LONG_CLIP)[: 12 * SAMPLE_RATE_HZ],
            np.zeros(2 * SAMPLE_RATE_HZ, dtype=np.float32),
        ]
    )
    engine = EarlyEndEngine()
    events = _drive(TurnSession("early"), engine, [pcm_s16le_bytes(audio)])  # all at once
    _check_settled(events)
    closing = [e for e in events if isinstance(e, (FinalMessage, Settled))]
    assert isinstance(closing[-1], Settled)


def test_a_stream_far_behind_is_settled_only_when_caught_up(speech_dir: Path) -> None:
    """While a decode is in flight 12 s of speech and a pause arrive: the closed segment is
    then decoded in pieces capped at the longest window, which are not closing decodes."""
    streaming = StreamingConfig(max_window_s=9.0, clause_cut_s=9.0)
    audio = np.concatenate(
        [
            load_clip(speech_dir / LONG_CLIP)[: 12 * SAMPLE_RATE_HZ],
            np.zeros(SAMPLE_RATE_HZ, dtype=np.float32),
            load_clip(speech_dir / PAUSED_CLIPS[0]),
        ]
    )
    frames = _frames(audio)
    events = _drive(
        TurnSession("behind", streaming=streaming), ScriptedEngine(), frames, held_frames=130
    )
    assert any(isinstance(e, SpeechEndedMessage) for e in events)
    _check_settled(events)


def test_adapter_events_are_empty_partials_to_v1() -> None:
    event = Settled(audio_received_s=1.5)
    assert isinstance(event, AdapterEvent)
    assert event.to_json() == (
        '{"type":"partial","segment_id":-1,"text":"","start":0.0,"end":0.0,"audio_received_s":1.5}'
    )
