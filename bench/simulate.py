"""Stream a recording through a Session in simulated real time, decode time charged to the clock.

Audio arrives at 1x real time; while a decode runs, the clock advances by the decode's wall
time, so the audio that arrives meanwhile is fed before the next decode -- exactly what a
single-stream server would see. Used by the streaming-core tests and the latency benchmark.

With ``spare_lane`` the session also has a second decode lane to itself, as one stream has on
a server with two lanes: its background beam searches (``Session.next_search_job``) run there,
each result handed back once its own cost has passed on the clock, beside the decodes.

With a speaker encoder (``speakers``; the session's ``StreamingConfig.speakers`` enabled), the
session's speaker jobs run as soon as it hands them out, and their time is charged to the
clock too: a server runs them beside the decodes, so this is the slower bound.

With ``wire`` the session gets that audio as a client sends it (say 8 kHz mu-law from a
phone line) instead of ``audio`` as 16 kHz s16le, at the same pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from server.config import StreamingConfig, VadConfig
from server.core.engine_api import DecodeResult, Window
from server.core.session import DecodeJob, Session, SessionEvent
from server.core.speakers import SpeakerEmbedder
from server.core.vad import FrameClassifier, FrameVoicing
from server.engine.engine import Engine
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import AudioFormat
from server.protocol.messages import (
    FinalMessage,
    PartialMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
)

CHUNK_S = 0.02


@dataclass
class TimedEvent:
    at_s: float  # simulated wall clock, seconds since the stream started
    message: SessionEvent


@dataclass
class SimulationResult:
    events: list[TimedEvent] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    embed_s: list[float] = field(default_factory=list)  # speaker encoder calls
    search_s: list[float] = field(default_factory=list)  # background searches (spare_lane)
    audio_s: float = 0.0

    @property
    def finals(self) -> list[FinalMessage]:
        return [e.message for e in self.events if isinstance(e.message, FinalMessage)]

    @property
    def text(self) -> str:
        return " ".join(f.text for f in self.finals)

    def first_partial_latency_s(self) -> float | None:
        """Speech onset (first speech_started.start) to the first partial or final with a word."""
        onset = next(
            (e.message.start for e in self.events if isinstance(e.message, SpeechStartedMessage)),
            None,
        )
        first = next(
            (
                e.at_s
                for e in self.events
                if isinstance(e.message, (PartialMessage, FinalMessage)) and e.message.text.strip()
            ),
            None,
        )
        return None if onset is None or first is None else first - onset

    def final_latencies_s(self) -> list[float]:
        """For each final: when it arrived minus the stream time of its last word's end."""
        return [e.at_s - e.message.end for e in self.events if isinstance(e.message, FinalMessage)]

    def end_of_speech_to_final_s(self) -> list[float]:
        """Per utterance: when the final holding its last word arrived, minus the stream time
        of that word's end (the turn-end latency a voice agent waits for)."""
        return [arrived - word_end for arrived, word_end in utterance_last_words(self.events)]

    def word_final_latencies_s(self) -> list[float]:
        """For each final word: when its final arrived minus the stream time of its end. The
        per-final figure counts only a final's last word; this one also counts the words a
        final held back (a policy that commits late shows here)."""
        return [
            e.at_s - w.end
            for e in self.events
            if isinstance(e.message, FinalMessage)
            for w in e.message.words
        ]

    def flicker(self) -> tuple[int, int]:
        """(words shown in a partial and later changed, words shown in partials in all)."""
        changed = shown = 0
        previous: list[str] = []
        for e in self.events:
            m = e.message
            if isinstance(m, PartialMessage):
                words = m.text.split()
                shown += len(words)
                common = 0
                for a, b in zip(previous, words, strict=False):
                    if a.strip(".,?!").lower() != b.strip(".,?!").lower():
                        break
                    common += 1
                changed += (
                    len(previous) - common
                    if len(words) < len(previous) or common < len(previous)
                    else 0
                )
                previous = words
            elif isinstance(m, FinalMessage):
                previous = []
        return changed, shown


def utterance_last_words(events: Sequence[TimedEvent]) -> list[tuple[float, float]]:
    """Per utterance (a speech_started to its speech_ended) that has final words: when the
    final holding its last word arrived (``at_s``), and that word's end in stream time. The
    simulation and a real server's messages (``bench.accuracy``) time turn ends alike."""
    out: list[tuple[float, float]] = []
    start = 0.0
    for e in events:
        if isinstance(e.message, SpeechStartedMessage):
            start = e.message.start
        elif isinstance(e.message, SpeechEndedMessage):
            end = e.message.end
            last = [
                (f.at_s, w.end)
                for f in events
                if isinstance(f.message, FinalMessage)
                for w in f.message.words
                if start <= w.start < end
            ]
            if last:
                out.append(max(last, key=lambda x: x[1]))
    return out


def simulate(
    engine: Engine,
    audio: npt.NDArray[np.float32],
    *,
    streaming: StreamingConfig | None = None,
    vad: VadConfig | None = None,
    session_id: str = "sim",
    decode_cost_s: Callable[[DecodeJob], float] | None = None,
    speakers: SpeakerEmbedder | None = None,
    spare_lane: bool = False,
    decoder: Callable[[DecodeJob], DecodeResult] | None = None,
    on_session: Callable[[Session], object] | None = None,
    frame_classifier: FrameClassifier | None = None,
    frame_voicing: Callable[[], FrameVoicing] | None = None,
    wire: tuple[AudioFormat, bytes] | None = None,
) -> SimulationResult:
    """Stream ``audio`` through a fresh session; see the module docstring.

    ``decode_cost_s`` replaces the measured wall time of each decode with a modelled cost, so
    that window positions -- and therefore the text -- are the same on every run (tests).
    ``decoder``: decodes a job in place of ``engine`` (a cache of recorded results, which
    ``bench.ablation`` replays); its time counts only where no modelled cost is given.
    ``on_session``: called with the session once it is done (its rule counters).
    ``frame_classifier``, ``frame_voicing``: the VAD's verdicts (``Session``); None: webrtcvad's.
    ``wire``: the format and bytes the session is fed instead of ``audio``.
    """
    fmt, data = wire if wire is not None else (AudioFormat(), pcm_s16le_bytes(audio))
    session = Session(
        session_id,
        audio_format=fmt,
        streaming=streaming,
        vad=vad,
        multilingual=engine.dims.is_multilingual,
        frame_classifier=frame_classifier,
        frame_voicing=frame_voicing,
    )
    rate, width = fmt.sample_rate_hz, fmt.bytes_per_sample
    total = len(data) // width  # samples at the client's rate
    result = SimulationResult(audio_s=total / rate)
    chunk = int(CHUNK_S * rate)
    clock = 0.0
    fed = 0
    ended = False
    search: tuple[DecodeJob, DecodeResult, float] | None = None  # on the spare lane

    def decode(job: DecodeJob) -> tuple[DecodeResult, float]:
        started = time.perf_counter()
        if decoder is not None:
            decoded = decoder(job)
        else:
            decoded = engine.decode_windows([Window(engine.features(job.audio), job.request)])[0]
        spent = time.perf_counter() - started
        return decoded, spent if decode_cost_s is None else decode_cost_s(job)

    while not session.done:
        while fed < total and fed < clock * rate:
            session.feed_audio(data[fed * width : (fed + chunk) * width])
            fed += chunk
        if fed >= total and not ended:
            session.end()
            ended = True
        for m in session.events_to_send():
            result.events.append(TimedEvent(clock, m))
        if speakers is not None:
            while (embed := session.next_speaker_job()) is not None:
                started = time.perf_counter()
                vectors = speakers.embed_windows(embed.audio, list(embed.starts))
                spent = time.perf_counter() - started
                result.embed_s.append(spent)
                clock += spent
                session.receive_embeddings(embed, vectors)
            for m in session.events_to_send():
                result.events.append(TimedEvent(clock, m))
        if search is not None and search[2] <= clock:
            session.receive_search(search[0], search[1])
            search = None
        if search is not None and session.search_stale:
            session.drop_search()  # as the server's driver does: its lane is interrupted
            search = None
        if spare_lane and search is None and (background := session.next_search_job()):
            decoded, spent = decode(background)
            result.search_s.append(spent)
            search = (background, decoded, clock + spent)
        job = session.next_job()
        if job is None:
            if ended and not session.done and not session.busy:
                raise RuntimeError("session is stuck: ended, idle, but not done")
            clock += CHUNK_S
            continue
        decoded, spent = decode(job)
        result.decode_s.append(spent)
        clock += spent
        session.receive_result(job, decoded)
        for m in session.events_to_send():
            result.events.append(TimedEvent(clock, m))
    if on_session is not None:
        on_session(session)
    return result
