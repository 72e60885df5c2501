"""The streaming core of one client: audio and control messages in, events and decode jobs out.

No asyncio, sockets or MLX here. The caller makes typed calls (``configure``, ``feed_audio``,
``flush``, ``end``), takes decode work from ``next_job`` and hands results back to
``receive_result``; events come out of ``events_to_send``: protocol v1's server messages, and
``Settled`` when all speech closed so far is final. No wire format is parsed here: each API's
adapter turns its client's messages into these calls. Every piece of state about the client
lives on this object and the units it holds.

How text is produced:
- The audio is decoded, kept and segmented by webrtcvad into utterances (``ingest.py``);
  each utterance has a window, the audio since its last cut (``utterance.py``,
  ``windows.py``).
- The decode desk (``desk.py``) hands out the window's decodes when the planner
  (``planner.py``) says one is due; words already final in the window are forced as the
  decoder's prefix, so each decode only proposes the tail after them (``tail.py``).
- Each result is folded in (``results.py``): the commit policy (``policy.py``) makes final the
  words decodes agree on, the finals strategy (``finals.py``) says whether they go out at once
  or with the rest of the utterance, and the cut rules (``cuts.py``) start a new window after
  final words, whose text becomes the prompt (``transcript.py``). Background searches
  (``searches.py``) let a long utterance's closing decode hear only its tail.
- At the end of speech, on ``flush`` and on ``end``, the window is decoded once more and
  everything left is final.

The session is the front door: it routes each call to those units. Each rule has a name, a
switch and a counter (``rules.py``, ``rule_counts``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from server.config import StreamingConfig, VadConfig
from server.core.desk import DecodeDesk
from server.core.emitter import SessionEvent, Settled
from server.core.engine_api import DecodeResult
from server.core.ingest import AudioIngest
from server.core.jobs import DecodeJob, Float32Array, basis_of
from server.core.planner import IDLE, DecodePlanner, Load
from server.core.results import MAX_DECODE_FAILURES, ResultFolder
from server.core.rules import RuleCounts
from server.core.searches import settle
from server.core.settings import (
    END_OF_SPEECH_MS_RANGE,
    MAX_SPEECH_PAD_MS,
    StreamSettings,
    nearest_end_of_speech_ms,
    resolve,
    stream_configs,
)
from server.core.speakers import EmbedJob, SpeakerTracker
from server.core.transcript import Transcript
from server.core.turn_desk import TurnDesk
from server.core.turns import TurnConfig, TurnJob
from server.core.utterance import Utterance
from server.core.vad import FrameClassifier, FrameVoicing, SpeechEnded, SpeechStarted, VadEvent
from server.core.windows import Windows
from server.protocol.errors import ProtocolError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import SpeechEndedMessage, SpeechStartedMessage

__all__ = [
    "END_OF_SPEECH_MS_RANGE",
    "MAX_DECODE_FAILURES",
    "MAX_SPEECH_PAD_MS",
    "DecodeJob",
    "Load",
    "Session",
    "SessionEvent",
    "Settled",
    "StreamSettings",
    "TurnConfig",
    "TurnJob",
    "nearest_end_of_speech_ms",
]

logger = logging.getLogger("server.core.session")


class Session:
    """One client's stream. Not thread-safe; the pipeline calls it from the event loop."""

    def __init__(
        self,
        session_id: str,
        *,
        audio_format: AudioFormat | None = None,
        streaming: StreamingConfig | None = None,
        vad: VadConfig | None = None,
        multilingual: bool = False,
        frame_classifier: FrameClassifier | None = None,
        frame_voicing: Callable[[], FrameVoicing] | None = None,
    ) -> None:
        """``frame_classifier``: webrtcvad's verdict on each frame; None: webrtcvad itself (the
        recorded-case tests replay a real run's verdicts). ``frame_voicing``: makes another
        detector for the stream (Silero's, ``server.turns.silero_vad.SileroVoicing``)."""
        self.session_id = session_id
        self._server_streaming = streaming or StreamingConfig()
        self._server_vad = vad or VadConfig()
        self.multilingual = multilingual
        self.log = logging.LoggerAdapter(logger, {"session_id": session_id})
        self.rule_counts = RuleCounts()
        self._audio = AudioIngest(
            AudioFormat(),
            self._server_vad,
            max_frame_bytes=self._server_streaming.max_frame_bytes,
            classifier=frame_classifier,
            voicing=frame_voicing,
        )
        text = Transcript(self._server_streaming, self.rule_counts, self.log)
        self._windows = Windows(self._audio, text, self.rule_counts, self.log)
        self._desk = DecodeDesk(session_id, self._windows, self.rule_counts)
        self._results = ResultFolder(self._windows)
        self._embedding: EmbedJob | None = None  # the speaker encoder's job in flight
        self._next_embed_id = 0
        # Conversational turns, when the stream's settings ask for them:
        self._turns = TurnDesk(
            session_id,
            self._audio,
            self._windows,
            take=self._ready_events,
            end_speech_at_pause=self._end_speech_at_pause,
        )
        self._windows.also_keep = self._turns.keep_from
        self._audio_started = False
        self._ended = False
        self._done = False
        self._apply_settings(
            StreamSettings(
                audio_format=audio_format or AudioFormat(),
                language=self._server_streaming.language,
                task=self._server_streaming.task,
            )
        )

    # -- properties ----------------------------------------------------------------------
    @property
    def audio_received_s(self) -> float:
        return self._audio.seconds_in

    @property
    def done(self) -> bool:
        """True once ``end`` was processed, every word finalised and ``done`` emitted."""
        return self._done and not self._windows.text.emit.waiting_for_labels

    @property
    def labels_speakers(self) -> bool:
        """Whether this stream's finals carry speaker labels (``configure``)."""
        return self._speakers is not None

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def busy(self) -> bool:
        return self._desk.in_flight is not None

    @property
    def settings(self) -> StreamSettings:
        """The stream's settings in effect (``configure``)."""
        return self._settings

    @property
    def audio_format(self) -> AudioFormat:
        return self._settings.audio_format

    @property
    def language(self) -> str | None:
        """The language asked for; None: detected per utterance (``LanguageTracker``)."""
        return self._settings.language

    @property
    def lag_s(self) -> float:
        """Speech received that no finished decode has covered yet: how far this stream's
        text is behind its audio."""
        return self._windows.lag_s

    # -- settings --------------------------------------------------------------------------
    def resolve(self, settings: StreamSettings) -> StreamSettings:
        """``settings`` as they would take effect on this model: an English-only model
        transcribes English (no detection, no translation). Raises ProtocolError."""
        return resolve(
            settings,
            multilingual=self.multilingual,
            speakers_enabled=self._server_streaming.speakers.enabled,
        )

    def configure(self, settings: StreamSettings) -> None:
        """Change the stream's settings, before its first audio. Raises ProtocolError."""
        if self._audio_started:
            raise ProtocolError("config must come before the first audio frame")
        if self._ended:
            raise ProtocolError("config after end")
        self._apply_settings(settings)

    def _apply_settings(self, settings: StreamSettings) -> None:
        self._settings = self.resolve(settings)
        self.streaming, self.vad_config = stream_configs(
            self._settings, self._server_streaming, self._server_vad
        )
        self._audio.configure(
            self._settings.audio_format,
            self.vad_config,
            max_frame_bytes=self.streaming.max_frame_bytes,
        )
        wanted = self._settings.speakers
        if wanted is None:
            wanted = self.streaming.speakers.enabled
        self._speakers = SpeakerTracker(self.streaming.speakers) if wanted else None
        planner = DecodePlanner(self.streaming, self.rule_counts)
        self._windows.text.streaming = self.streaming
        self._windows.configure(self.streaming, planner, self.language, self._speakers)
        self._desk.configure(self.streaming, planner, self._settings.task)
        self._results.configure(self.streaming, planner)
        self._turns.configure(self._settings.turns)

    # -- audio in --------------------------------------------------------------------------
    def feed_audio(self, data: bytes) -> None:
        """Accept audio bytes in the stream's format. Raises a StreamError subclass."""
        if self._ended:
            raise ProtocolError("audio after end", close_code=1008)
        events = self._audio.receive(data)
        self._audio_started = self._audio_started or len(data) > 0
        self._on_audio(events)

    def flush(self) -> None:
        """Close the speech heard so far: its words all become final (then ``Settled``), and
        speech still going on goes on in a new utterance. Raises ProtocolError after ``end``."""
        if self._ended:
            raise ProtocolError("flush after end")
        vad = self._audio.vad
        if vad.in_speech and vad.tentative_end is not None:
            # In a pause (a client's VAD ends the turn there: Deepgram's Finalize, OpenAI's
            # commit): the speech ends where the pause began, as the endpoint would end it, so
            # the closing decode begun in the pause (speculative_closing) is its final.
            self._end_speech_at_pause()
        else:
            self._windows.close_open(self._audio.end, reopen=vad.in_speech)
        self._windows.unsettled = True
        self._windows.settle_if_closed_finished()

    def end(self, *, by_server: bool = False) -> None:
        """The stream ends: everything left becomes final, then ``done``. Raises
        ProtocolError when it was ended already.

        ``by_server``: the server ends it (shutdown, drain, a limit), and a client that goes
        on does so from its last final words. Cut inside speech, the closing decode then
        commits nothing placed at the audio's very end, where no audio is under a word."""
        if self._ended:
            raise ProtocolError("end sent twice")
        self._on_audio(self._audio.finish_decoding())
        utterances = self._windows.utterances
        in_speech = self._audio.vad.in_speech and self._audio.vad.tentative_end is None
        if by_server and utterances and in_speech:
            utterances[-1].cut_in_speech = True
        # A stream that ends in a pause after speech: with a beam-searched closing decode the
        # utterance ends where the endpoint would have ended it, so the guess begun in the pause
        # closes it (a second beam search over the whole utterance would follow). A greedy
        # closing decode of the rest is cheap and hears the audio to the end, which reads
        # better.
        at_pause = self.streaming.closing_beam_size > 1
        for event in self._audio.finish_speech(at_pause=at_pause):
            self._on_vad(event)
        self._windows.close_open(self._audio.end, reopen=False)
        # Ended only now: the flush can release a speculative closing decode that finishes
        # the last utterance, and ``done`` must not go out before the ``Settled`` owed here.
        self._ended = True
        # The speaker's words so far end their turn (a client that closes the stream asks for
        # them, as with ForceEndTurn): none is left without an EndOfTurn.
        self._turns.decide("manual")
        self._windows.unsettled = True
        self._windows.settle_if_closed_finished()
        self._turns.end_if_final()
        self._maybe_done()

    def _on_audio(self, events: list[VadEvent]) -> None:
        for event in events:
            self._on_vad(event)
        self._windows.trim()
        self._turns.follow_audio()

    def _on_vad(self, event: VadEvent) -> None:
        now_s = self.audio_received_s
        windows = self._windows
        if isinstance(event, SpeechStarted):
            self._turns.speech(ended_at=None)
            start = max(event.start_sample, self._audio.buffer.start)
            windows.open(start)
            windows.text.emit.add(SpeechStartedMessage(start / SAMPLE_RATE_HZ, now_s))
        elif isinstance(event, SpeechEnded):
            self._turns.speech(ended_at=event.end_sample)
            windows.text.emit.add(SpeechEndedMessage(event.end_sample / SAMPLE_RATE_HZ, now_s))
            windows.close_open(event.end_sample, reopen=False)
            windows.unsettled = True
            first = windows.first
            if first is not None and first.speculation is not None:
                self._release_speculation(first)

    # -- speaker jobs ----------------------------------------------------------------------
    def next_speaker_job(self) -> EmbedJob | None:
        """The next windows for the speaker encoder (``SpeakerEmbedder``), or None: none due,
        one in flight, or no speaker labels on this stream."""
        if self._speakers is None or self._embedding is not None:
            return None
        planned = self._speakers.plan(self._audio.end)
        if planned is None:
            return None
        start, end, starts = planned
        start = max(start, self._audio.buffer.start)
        job = EmbedJob(
            session_id=self.session_id,
            job_id=self._next_embed_id,
            audio=self._audio.slice(start, min(end, self._audio.end)),
            start=start,
            starts=tuple(s - start for s in starts),
        )
        self._next_embed_id += 1
        self._embedding = job
        self._windows.trim()
        return job

    def receive_embeddings(self, job: EmbedJob, vectors: Float32Array | None) -> None:
        """The speaker encoder's vectors for ``job``'s windows, in order; None: it failed
        (those windows teach nothing, and the words under them take what is known)."""
        if self._speakers is None or job is not self._embedding:
            self.log.warning("embeddings for unknown job %d ignored", job.job_id)
            return
        self._embedding = None
        if vectors is None:
            self.log.warning("speaker encoder failed for job %d", job.job_id)
        self._speakers.receive([job.start + s for s in job.starts], vectors)

    # -- decode jobs -----------------------------------------------------------------------
    def next_job(self, load: Load = IDLE) -> DecodeJob | None:
        """The next window to decode, or None (one job per session is in flight at most).
        ``load``: the server's, as the scheduler sees it (``Load``)."""
        job = self._desk.next_job(load, self._release_speculation)
        self._maybe_done()
        return job

    def supersede_job(self, load: Load = IDLE) -> DecodeJob | None:
        """The utterance's closing decode, to start now in place of the decode in flight, or
        None (``DecodeDesk.supersede``). The caller drops the job in flight."""
        job = self._desk.supersede(load, self._release_speculation)
        self._maybe_done()
        return job

    def refresh_job(self, job: DecodeJob, load: Load = IDLE) -> DecodeJob:
        """``job``, still waiting for a decode lane, over the audio that arrived meanwhile
        (``DecodeDesk.refresh``): a stream that waited for a lane is decoded up to the
        present. The result of either settles the job."""
        return self._desk.refresh(job, load)

    def receive_result(self, job: DecodeJob, result: DecodeResult) -> None:
        """Fold one decode result into the stream's text and emit events."""
        taken = self._desk.take(job)
        if taken is None:
            self.log.warning("result for unknown job %d ignored", job.job_id)
            return
        self._results.fold(taken, result)
        self._maybe_done()

    def receive_failure(self, job: DecodeJob, error: Exception) -> None:
        """A decode failed: tell the client; the window is retried (``ResultFolder.fail``)."""
        taken = self._desk.take(job)
        if taken is None:
            return
        self._results.fail(taken, error)
        self._maybe_done()

    def _release_speculation(self, utt: Utterance) -> None:
        """Fold in the held speculative result: the closing decode when the utterance ended
        where it did, else an ordinary re-decode of the window (speech went on, or a flush or
        the stream's end closed it elsewhere; the closing decode then follows)."""
        assert utt.speculation is not None and self._desk.in_flight is None
        job, result = utt.speculation
        utt.speculation = None
        self._desk.in_flight = job
        self.receive_result(job, result)

    # -- background searches ---------------------------------------------------------------
    def next_search_job(self, load: Load = IDLE) -> DecodeJob | None:
        """A beam search of the open utterance's window so far, for a decode lane that no
        stream needs (``Pipeline.spare_lane``), or None (``searches.py``). It runs beside the
        stream's own decodes and changes nothing until two of them agree."""
        return self._desk.next_search(load)

    @property
    def search_stale(self) -> bool:
        """A background search is in flight whose result cannot count any more. The driver
        drops it (``drop_search``), and the pipeline frees its lane."""
        return self._desk.search_stale

    def drop_search(self) -> None:
        """The background search in flight was cancelled: the next may start."""
        self._desk.search_in_flight = None

    def receive_search(self, job: DecodeJob, result: DecodeResult | None) -> None:
        """Fold in a background beam search; None: it failed. Words two searches of the
        window agree on are held at the stream's next job."""
        if not self._desk.take_search(job):
            return
        utt = self._windows.first
        if result is None or utt is None or utt.basis != basis_of(job):
            return
        settle(utt, job, self._windows.tail_words(job, result), self.streaming)

    # -- events out ------------------------------------------------------------------------
    def _maybe_done(self) -> None:
        if (
            self._ended
            and not self._done
            and not self._windows.utterances
            and self._desk.in_flight is None
        ):
            self._done = True
            self._windows.text.emit.done(self.audio_received_s, self._audio.end)

    def events_to_send(self) -> list[SessionEvent]:
        """Messages produced since the last call, in order. With speaker labels, a final
        waits (and what follows it) until its words' speakers are known. With turns, each
        turn event follows the event that made it (``TurnDesk``)."""
        return self._turns.drain()

    def _ready_events(self) -> list[SessionEvent]:
        tracker = self._speakers
        # After the end, once every window was heard, nothing more can be learnt.
        all_heard = (
            tracker is not None and self._ended and self._embedding is None and tracker.all_planned
        )
        return self._windows.text.emit.take(tracker, all_heard=all_heard)

    # -- conversational turns --------------------------------------------------------------
    def configure_turns(self, config: TurnConfig) -> None:
        """New turn thresholds, at any time (Deepgram Flux's ``Configure``); the stream must
        have asked for turns (``StreamSettings.turns``). Raises ProtocolError."""
        self._turns.require()
        self._turns.configure(config)
        self._settings = dataclasses.replace(self._settings, turns=config)

    def next_turn_job(self) -> TurnJob | None:
        """The pause heard now, for the turn model, when one is due (``turns.py``), or None."""
        return self._turns.next_job()

    def receive_turn_score(self, job: TurnJob, probability: float | None) -> None:
        """The turn model's probability that ``job``'s pause ends the turn; None: it failed
        (the turn then ends at its timeout)."""
        self._turns.receive_score(job, probability)
        self._maybe_done()

    def force_end_turn(self) -> None:
        """End the turn now (Deepgram Flux's ``ForceEndTurn``): its speech so far becomes final,
        then ``EndOfTurn``. Raises ProtocolError."""
        self._turns.require()
        self._turns.decide("manual")
        self.flush()
        self._turns.end_if_final()

    def _end_speech_at_pause(self) -> None:
        """The speech heard ends where its pause began (a turn ended there)."""
        for event in self._audio.finish_speech(at_pause=True):
            self._on_vad(event)
