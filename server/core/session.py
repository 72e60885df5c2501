"""The streaming core of one client: audio and control messages in, events and decode jobs out.

No asyncio, sockets or MLX here. The caller makes typed calls (``configure``, ``feed_audio``,
``flush``, ``end``), takes decode work from ``next_job`` and hands results back to
``receive_result``; events come out of ``events_to_send``: protocol v1's server messages, and
``Settled`` when all speech closed so far is final. No wire format is parsed here: each API's
adapter turns its client's messages into these calls. Every piece of state about the client
lives on this object.

How text is produced:
- webrtcvad splits the stream into utterances (``vad.py``); each has a window, the audio since
  its last cut (``utterance.py``).
- The planner (``planner.py``) says when the window is decoded again and how; words already
  final in the window are forced as the decoder's prefix, so each decode only proposes the
  tail after them (``tail.py`` cleans it).
- The commit policy (``policy.py``) makes final the words that decodes agree on; the finals
  strategy (``finals.py``) says whether they go out at once or with the rest of the utterance.
  Every word that becomes final goes through ``_commit``, which counts why.
- The cut rules (``cuts.py``) start a new window after final words; final text before a cut
  is the prompt. Background searches (``searches.py``) let a long utterance's closing decode
  hear only its tail.
- At the end of speech, on ``flush`` and on ``end``, the window is decoded once more and
  everything left is final.

The session is the front door: it routes calls to those units and applies their decisions.
Each rule has a name, a switch and a counter (``rules.py``, ``rule_counts``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

from server.config import StreamingConfig, VadConfig
from server.core.agreement import Word
from server.core.cuts import (
    Cut,
    cut_point,
    hears_more,
    sentence_cut,
    skipped_speech_s,
    stalled_tail_cut,
    unheard_tail_cut,
)
from server.core.emitter import Clock, SessionEvent, Settled
from server.core.engine_api import DecodeResult, StopReason
from server.core.finals import finals_for
from server.core.ingest import AudioIngest
from server.core.jobs import DecodeJob, Float32Array, basis_of
from server.core.language import LanguageTracker
from server.core.planner import IDLE, DecodePlanner, Load
from server.core.policy import CommitConfig, CommitPolicy
from server.core.rules import RuleCounts
from server.core.searches import (
    held_cut_point,
    holdable,
    rest_after_held,
    search_due,
    settle,
)
from server.core.settings import (
    END_OF_SPEECH_MS_RANGE,
    MAX_SPEECH_PAD_MS,
    StreamSettings,
    nearest_end_of_speech_ms,
    resolve,
    stream_configs,
)
from server.core.speakers import EmbedJob, SpeakerTracker
from server.core.tail import tail_words
from server.core.transcript import Language, Transcript
from server.core.utterance import UnforcedRetry, Utterance
from server.core.vad import SpeechEnded, SpeechStarted
from server.protocol.errors import ProtocolError
from server.protocol.formats import SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import ErrorMessage, SpeechEndedMessage, SpeechStartedMessage

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
    "nearest_end_of_speech_ms",
]

logger = logging.getLogger("server.core.session")

# Per utterance, before its remaining audio is given up with an error: one passing failure
# must not lose the words of a window, nor may a window that always fails be retried forever.
MAX_DECODE_FAILURES = 3


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
    ) -> None:
        self.session_id = session_id
        self._server_streaming = streaming or StreamingConfig()
        self._server_vad = vad or VadConfig()
        self.multilingual = multilingual
        self.log = logging.LoggerAdapter(logger, {"session_id": session_id})
        self.rule_counts = RuleCounts()
        self._detector: LanguageTracker | None = None
        self._text = Transcript(self._server_streaming, self.rule_counts, self.log)
        self._settings = StreamSettings(
            audio_format=audio_format or AudioFormat(),
            language=self._server_streaming.language,
            task=self._server_streaming.task,
        )
        self._apply_settings(self._settings)
        self._embedding: EmbedJob | None = None  # the speaker encoder's job in flight
        self._next_embed_id = 0
        self._utterances: deque[Utterance] = deque()
        self._unsettled = False  # speech was closed and a Settled is owed for it
        self._next_job_id = 0
        self._in_flight: DecodeJob | None = None
        self._search_in_flight: DecodeJob | None = None  # a background beam search
        self._audio_started = False
        self._ended = False
        self._done = False

    # -- properties ----------------------------------------------------------------------
    @property
    def audio_received_s(self) -> float:
        return self._audio.seconds_in

    @property
    def done(self) -> bool:
        """True once ``end`` was processed, every word finalised and ``done`` emitted."""
        return self._done and not self._text.emit.waiting_for_labels

    @property
    def labels_speakers(self) -> bool:
        """Whether this stream's finals carry speaker labels (``configure``)."""
        return self._speakers is not None

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def busy(self) -> bool:
        return self._in_flight is not None

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
    def _detecting(self) -> LanguageTracker | None:
        """The session's language tracker when it detects its language (made on first use,
        after the client's config has settled the language)."""
        if self.language is not None:
            return None
        if self._detector is None:
            self._detector = LanguageTracker(self.streaming.detection)
        return self._detector

    @property
    def lag_s(self) -> float:
        """Speech received that no finished decode has covered yet (the window in flight
        counts as not covered): how far this stream's text is behind its audio."""
        behind = 0
        for utt in self._utterances:
            end = utt.end if utt.end is not None else self._audio.end
            behind += max(0, end - max(utt.heard_to, utt.window_start))
        return behind / SAMPLE_RATE_HZ

    # -- input ---------------------------------------------------------------------------
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
        audio_format, limit = self._settings.audio_format, self.streaming.max_frame_bytes
        if not hasattr(self, "_audio"):
            self._audio = AudioIngest(audio_format, self.vad_config, max_frame_bytes=limit)
        else:
            self._audio.configure(audio_format, self.vad_config, max_frame_bytes=limit)
        self._text.streaming = self.streaming
        self._detector = None
        wanted = self._settings.speakers
        if wanted is None:
            wanted = self.streaming.speakers.enabled
        self._speakers = SpeakerTracker(self.streaming.speakers) if wanted else None
        self._planner = DecodePlanner(self.streaming, self.rule_counts)
        self._finals = finals_for(self.streaming)

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
        self._close_open_utterance(self._audio.end, reopen=self._audio.vad.in_speech)
        self._unsettled = True
        self._settle_if_closed_finished()

    def end(self, *, by_server: bool = False) -> None:
        """The stream ends: everything left becomes final, then ``done``. Raises
        ProtocolError when it was ended already.

        ``by_server``: the server ends it (shutdown, drain, a limit), and a client that goes
        on does so from its last final words. Cut inside speech, the closing decode then
        commits nothing placed at the audio's very end, where no audio is under a word."""
        if self._ended:
            raise ProtocolError("end sent twice")
        self._on_audio(self._audio.finish_decoding())
        in_speech = self._audio.vad.in_speech and self._audio.vad.tentative_end is None
        if by_server and self._utterances and in_speech:
            self._utterances[-1].cut_in_speech = True
        # A stream that ends in a pause after speech: with a beam-searched closing decode the
        # utterance ends where the endpoint would have ended it, so the guess begun in the pause
        # closes it (a second beam search over the whole utterance would follow). A greedy
        # closing decode of the rest is cheap and hears the audio to the end, which reads
        # better.
        at_pause = self.streaming.closing_beam_size > 1
        for event in self._audio.finish_speech(at_pause=at_pause):
            self._on_vad(event)
        self._close_open_utterance(self._audio.end, reopen=False)
        # Ended only now: the flush can release a speculative closing decode that finishes
        # the last utterance, and ``done`` must not go out before the ``Settled`` owed here.
        self._ended = True
        self._unsettled = True
        self._settle_if_closed_finished()
        self._maybe_done()

    def _on_audio(self, events: list[SpeechStarted | SpeechEnded]) -> None:
        for event in events:
            self._on_vad(event)
        self._trim()

    def _on_vad(self, event: SpeechStarted | SpeechEnded) -> None:
        now_s = self.audio_received_s
        if isinstance(event, SpeechStarted):
            start = max(event.start_sample, self._audio.buffer.start)
            self._open_utterance(start)
            self._text.emit.add(SpeechStartedMessage(start / SAMPLE_RATE_HZ, now_s))
        else:
            self._text.emit.add(SpeechEndedMessage(event.end_sample / SAMPLE_RATE_HZ, now_s))
            self._close_open_utterance(event.end_sample, reopen=False)
            self._unsettled = True
            if self._utterances and self._utterances[0].speculation is not None:
                self._release_speculation(self._utterances[0])

    def _open_utterance(self, start: int) -> None:
        self._utterances.append(
            Utterance.starting_at(start, CommitPolicy(self._commit_config()), self.language)
        )
        if self._speakers is not None:
            self._speakers.open_utterance(start)

    def _commit_config(self) -> CommitConfig:
        """The commit policy's config, with the first commit due by half the smallest window
        cap at the latest: a window cut at its cap before anything was agreed commits its
        words unchecked (``_cut_at_cap``)."""
        c = self.streaming
        cap_s = self._planner.window_cap_s(crowded=True)
        return dataclasses.replace(c.commit, min_window_s=min(c.commit.min_window_s, cap_s / 2))

    def _close_open_utterance(self, end: int, *, reopen: bool) -> None:
        if self._utterances and self._utterances[-1].end is None:
            utt = self._utterances[-1]
            utt.end = max(end, utt.window_start)
            self._text.emit.account.speech += utt.end - utt.start
            if self._speakers is not None:
                self._speakers.close_utterance(utt.end)
            if reopen:
                self._open_utterance(end)

    def _trim(self) -> None:
        if self._utterances:
            keep_from = self._utterances[0].window_start
        else:
            keep_from = self._audio.idle_keep_from
        if self._speakers is not None:
            needed = self._speakers.keep_from()
            if needed is not None:
                keep_from = min(keep_from, needed)
        self._audio.trim(keep_from)

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
        self._trim()
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

    # -- decode jobs ---------------------------------------------------------------------
    def next_job(self, load: Load = IDLE) -> DecodeJob | None:
        """The next window to decode, or None (one job per session is in flight at most).
        ``load``: the server's, as the scheduler sees it (``Load``)."""
        while self._in_flight is None and self._utterances:
            utt = self._utterances[0]
            if utt.agreed is not None:
                self._hold_agreed(utt)
            if utt.speculation is not None:
                if (
                    utt.end is None
                    and self._audio.vad.tentative_end == utt.speculation[0].end_sample
                ):
                    return None  # the silence goes on: the endpoint decides
                self._release_speculation(utt)
                continue
            speculative = self._speculative_end(utt, load.crowded)
            if speculative is not None:
                utt.speculated_to = speculative
                self.rule_counts.fired("speculative_closing")
                return self._dispatch(utt, speculative, closing=True, load=load, speculative=True)
            end = utt.end if utt.end is not None else self._audio.end
            if utt.end is None and not self._planner.due(utt, end, load):
                return None
            end, closing = self._within_cap(utt, end, load.crowded)
            if end > utt.window_start:
                return self._dispatch(utt, end, closing=closing, load=load)
            # Nothing left to decode (a flush at a window's end leaves an empty utterance): it
            # may have been the last thing ``done`` waited for.
            self._finish_utterance_if_closed(utt, decoded=True)
            self._maybe_done()
        return None

    def _within_cap(self, utt: Utterance, end: int, crowded: bool) -> tuple[int, bool]:
        """The end of the next decode of ``utt`` up to ``end``, cut first when the window
        outgrew its cap (rule ``window_cap``); and whether it is the closing decode."""
        closing = utt.end is not None
        if end <= self._planner.window_cap(utt, crowded):
            return end, closing
        self._cut_at_cap(utt, self._planner.window_cap(utt, crowded))
        end = utt.end if closing and utt.end is not None else self._audio.end
        end = min(end, self._planner.window_cap(utt, crowded))
        return end, closing and end == utt.end

    def _dispatch(
        self, utt: Utterance, end: int, *, closing: bool, load: Load, speculative: bool = False
    ) -> DecodeJob:
        """Make the decode of ``utt``'s window up to ``end`` the job in flight."""
        job = self._job(
            utt, end, closing=closing, past_comfort=load.past_comfort, speculative=speculative
        )
        self._next_job_id += 1
        utt.decoded_to = end
        self._in_flight = job
        return job

    def _job(
        self,
        utt: Utterance,
        end: int,
        *,
        closing: bool,
        past_comfort: bool,
        speculative: bool = False,
    ) -> DecodeJob:
        prompt = self._text.prompt
        return self._planner.job(
            utt,
            self._audio.slice(utt.window_start, end),
            self._planner.options(utt, self._detecting, self._settings.task, closing=closing),
            prompt,
            session_id=self.session_id,
            job_id=self._next_job_id,
            closing=closing,
            speculative=speculative,
            past_comfort=past_comfort,
        )

    def _speculative_end(self, utt: Utterance, crowded: bool) -> int | None:
        return self._planner.speculative_end(
            utt, self._audio.vad.tentative_end, len(self._utterances), crowded
        )

    def supersede_job(self, load: Load = IDLE) -> DecodeJob | None:
        """The utterance's closing decode, to start now in place of the decode in flight, or
        None (rule ``supersede``). The caller drops the job in flight (its result is never
        folded in; the pipeline stops it on its lane) and asks only while a decode lane is idle
        that no other stream needs.

        Nothing is lost by dropping such a decode: it makes no word final that the closing
        decode does not, and its partial would be overtaken by the final at the endpoint. Word
        by word it is not done: there a re-decode through the pause makes the last words final
        before the endpoint.
        """
        job = self._in_flight
        if job is None or not self._utterances or not self._finals.supersedes:
            return None
        utt = self._utterances[0]
        if (
            (job.closing and not job.speculative)
            or utt.language is None
            or utt.unforced_retry is not None
            or utt.speculation is not None
        ):
            return None
        end = utt.end if utt.end is not None else self._speculative_end(utt, load.crowded)
        if (
            end is None
            or (job.speculative and job.end_sample == end)
            or end <= utt.window_start
            or not self._planner.fits(utt, end, load.crowded)
        ):
            return None
        self._in_flight = None
        basis = utt.basis
        # The closing decode never waits for the scheduler's hop.
        replacement = self.next_job(dataclasses.replace(load, min_hop_s=0.0))
        if replacement is None and utt.basis == basis:
            self._in_flight = job  # nothing to start after all: the decode in flight stays
            return None
        self.rule_counts.fired("supersede")
        if replacement is None:
            # Held words moved the window (``_hold_agreed``): the decode in flight is of the
            # old one, and its result is dropped when it comes.
            self.log.debug("job %d dropped: the window moved under it", job.job_id)
        else:
            self.log.debug("job %d dropped for job %d to %d", job.job_id, replacement.job_id, end)
        return replacement

    def refresh_job(self, job: DecodeJob, load: Load = IDLE) -> DecodeJob:
        """``job``, still waiting for a decode lane, over the audio that arrived meanwhile.

        The decode stage asks just before a lane takes the job, so a stream that waited for a
        lane is decoded up to the present rather than up to when it asked: its newest words
        reach their right context sooner, and no decode is spent on audio already stale. The
        window keeps its start, prefix, prompt and draft (nothing changes them while a job is
        in flight); it grows to the end of the audio, at most to the window's cap (the cut
        comes with the next job), and becomes the closing decode if the utterance ended. Returns
        ``job`` itself when nothing arrived; the result of either settles the job.
        """
        if job is not self._in_flight or job.closing or not self._utterances:
            return job
        utt = self._utterances[0]
        cap = self._planner.window_cap(utt, load.crowded)
        end = min(utt.end if utt.end is not None else self._audio.end, cap)
        if end <= utt.decoded_to:
            return job
        audio = self._audio.slice(utt.window_start, end)
        closing = end == utt.end
        options = self._planner.options(utt, self._detecting, self._settings.task, closing=closing)
        fresh = dataclasses.replace(
            job,
            audio=audio,
            request=dataclasses.replace(
                job.request, audio_s=audio.shape[0] / SAMPLE_RATE_HZ, options=options
            ),
            closing=closing,
            past_comfort=load.past_comfort,
        )
        utt.decoded_to = end
        self._in_flight = fresh
        return fresh

    # -- background searches ---------------------------------------------------------------
    def next_search_job(self, load: Load = IDLE) -> DecodeJob | None:
        """A beam search of the open utterance's window so far, for a decode lane that no
        stream needs (``Pipeline.spare_lane``), or None (``searches.py``)."""
        if (
            not self._finals.searches
            or load.past_comfort
            or self._search_in_flight is not None
            or len(self._utterances) != 1
        ):
            return None
        utt = self._utterances[0]
        end = self._audio.end
        if not search_due(
            utt, end, self._audio.vad.tentative_end, self.streaming
        ) or not self._planner.fits(utt, end, crowded=False):
            return None
        job = dataclasses.replace(
            self._job(utt, end, closing=True, past_comfort=False), closing=False, urgent=False
        )
        self._next_job_id += 1
        utt.searched_to = end
        self._search_in_flight = job
        return job

    @property
    def search_stale(self) -> bool:
        """A background search is in flight whose result cannot count any more: its
        utterance has ended (the closing decode, started at once, hears the whole window)
        or held words moved the window it searched. The driver drops it (``drop_search``),
        and the pipeline frees its lane."""
        job = self._search_in_flight
        if job is None:
            return False
        if not self._utterances:
            return True
        utt = self._utterances[0]
        return utt.end is not None or utt.basis != basis_of(job)

    def drop_search(self) -> None:
        """The background search in flight was cancelled: the next may start."""
        self._search_in_flight = None

    def receive_search(self, job: DecodeJob, result: DecodeResult | None) -> None:
        """Fold in a background beam search (``next_search_job``); None: it failed. Words two
        searches of the window agree on are held at the stream's next job."""
        if self._search_in_flight is None or job.job_id != self._search_in_flight.job_id:
            return
        self._search_in_flight = None
        utt = self._utterances[0] if self._utterances else None
        if result is None or utt is None or utt.basis != basis_of(job):
            return
        settle(utt, job, self._tail_words(job, result), self.streaming)

    def _hold_agreed(self, utt: Utterance) -> None:
        """Hold the words background searches agreed on and cut the window before the last of
        them. Only while no decode of the stream is in flight: a cut moves the window under
        it."""
        agreed, utt.agreed = utt.agreed, None
        assert agreed is not None and self._in_flight is None
        if not holdable(utt, agreed, self.streaming.cut_carry_words):
            return
        self.log.debug(
            "%d word(s) held from background searches to %.2f s",
            len(agreed.words),
            agreed.end_sample / SAMPLE_RATE_HZ,
        )
        latest = utt.search_words
        self._commit(utt, agreed.words, why="held_search", hold=True)
        utt.heard_to = max(utt.heard_to, agreed.end_sample)
        at, carry = held_cut_point(utt, self.streaming)
        if at > utt.window_start:
            self._cut(utt, Cut(at, carry, "background_search"))
        else:
            self.rule_counts.fired("background_search")
            utt.forget_decodes()
        utt.search_words = rest_after_held(latest, agreed, utt.basis)

    # -- results -------------------------------------------------------------------------
    def _release_speculation(self, utt: Utterance) -> None:
        """Fold in the held speculative result: the closing decode when the utterance ended
        where it did, else an ordinary re-decode of the window (speech went on, or a flush or
        the stream's end closed it elsewhere; the closing decode then follows)."""
        assert utt.speculation is not None and self._in_flight is None
        job, result = utt.speculation
        utt.speculation = None
        self._in_flight = job
        self.receive_result(job, result)

    def receive_result(self, job: DecodeJob, result: DecodeResult) -> None:
        """Fold one decode result into the stream's text and emit events."""
        if self._in_flight is None or job.job_id != self._in_flight.job_id:
            self.log.warning("result for unknown job %d ignored", job.job_id)
            return
        job, self._in_flight = self._in_flight, None  # as last refreshed
        utt = self._utterances[0]
        overtaken = job.speculative and utt.end != job.end_sample
        if overtaken:
            if utt.end is None and self._audio.vad.tentative_end == job.end_sample:
                utt.speculation = (job, result)  # the endpoint may still come there
                return
            job = dataclasses.replace(job, closing=False, speculative=False)
        utt.heard_to = max(utt.heard_to, job.end_sample)
        if utt.language is None and not self._settle_language(utt, job, result):
            self._maybe_done()
            return
        tail = self._tail_words(job, result)
        chosen = self._check_skipped_speech(utt, job, result, tail)
        if chosen is None:
            self._maybe_done()
            return
        job, result, tail = chosen
        self._text.decoded(
            looped=result.stop_reason in (StopReason.REPETITION, StopReason.COMPRESSION)
        )
        utt.draft = result.sequence
        self._fold_in(utt, job, tail, overtaken=overtaken)
        self._maybe_done()

    def _fold_in(
        self, utt: Utterance, job: DecodeJob, tail: list[Word], *, overtaken: bool
    ) -> None:
        """Commit what the policy makes final of ``tail``, show the rest, and cut."""
        committed = utt.policy.update(
            tail,
            window_start_s=self._finals.commit_window_start_s(utt, job),
            window_end_s=job.start_s + job.audio_s,
            closing=job.closing,
            cut_in_speech=utt.cut_in_speech and job.end_sample == utt.end,
            settled_context_s=self._planner.settled_context_s(job),
        )
        utt.tentative = utt.policy.tentative
        self.log.debug(
            "job %d [%.2f-%.2f s] closing=%s speculative=%s beam asked=%d: %d word(s) final, "
            "%d not",
            job.job_id,
            job.start_s,
            job.end_sample / SAMPLE_RATE_HZ,
            job.closing,
            job.speculative,
            job.request.options.beam_size,
            len(committed),
            len(utt.tentative),
        )
        hold = self._finals.holds(closing=job.closing, committed=bool(committed))
        self._commit(utt, committed, why="closing" if job.closing else "agreement", hold=hold)
        if not overtaken and (not utt.unsent or utt.end is None):
            # A guess that speech overtook ends in the pause ("... word."): shown, it would be
            # taken back by the next decode. Words held at a closing decode wait for the
            # tail's final without a partial.
            self._emit_partial(utt)
        if job.closing:
            cut = unheard_tail_cut(utt, self.streaming) if self._on("unheard_tail") else None
            if cut is not None:
                self._cut(utt, cut)
            else:
                self._finish_utterance_if_closed(utt, decoded=True)
            return
        cut = None
        if self._on("stalled_tail"):
            cut = stalled_tail_cut(utt, job, tail, self._audio.vad.voiced_s, self.streaming)
            if cut is not None:
                self.log.info("decode ended at the final words with speech after them: cut")
        if cut is None and self._on("sentence_cut"):
            cut = sentence_cut(utt, self.streaming, inside_commit=self._finals.cuts_inside_commit)
        if cut is not None:
            self._cut(utt, cut)

    def _check_skipped_speech(
        self, utt: Utterance, job: DecodeJob, result: DecodeResult, tail: list[Word]
    ) -> tuple[DecodeJob, DecodeResult, list[Word]] | None:
        """Rule ``skipped_speech``: the decode to fold in, or None while the window is
        decoded again without the carried words (the decode with them is held meanwhile)."""
        retry = utt.unforced_retry
        if retry is not None:
            utt.unforced_retry = None
            heard_more = self.streaming.rules.skipped_speech.heard_more_words
            if not hears_more(tail, retry.tail, heard_more):
                # Whisper without the prefix can start a long window sentences in: the
                # decode with the prefix was the better one after all.
                self.log.info("the decode with the carried words kept: nothing more without")
                utt.carry(retry.carried)
                return retry.job, retry.result, retry.tail
            return job, result, tail
        if not self._on("skipped_speech"):
            return job, result, tail
        skipped = skipped_speech_s(utt, job, tail, self._audio.vad.voiced_s, self.streaming)
        if skipped is None:
            return job, result, tail
        self.log.info(
            "%.1f s of speech before %r skipped after the carried words: decoded without them",
            skipped,
            tail[0].text,
        )
        self.rule_counts.fired("skipped_speech")
        utt.unforced_retry = UnforcedRetry(job, result, tail, list(utt.committed))
        utt.drop_carried_prefix()
        return None

    def receive_failure(self, job: DecodeJob, error: Exception) -> None:
        """A decode failed: tell the client; the window is retried with the next job, up to
        ``MAX_DECODE_FAILURES`` times per utterance (the closing decode too: an utterance's last
        window holds the words not yet final, and one passing failure must not lose them)."""
        if self._in_flight is None or job.job_id != self._in_flight.job_id:
            return
        job, self._in_flight = self._in_flight, None  # as last refreshed
        self._text.emit.add(
            ErrorMessage("decode_failed", f"decoding failed: {error}", False, self.audio_received_s)
        )
        utt = self._utterances[0]
        utt.failures += 1
        if utt.failures < MAX_DECODE_FAILURES:
            utt.decoded_to = utt.window_start  # retried with the next audio
            return
        # Keep what was shown; the audio that could not be decoded is reported, not retried
        # forever.
        shown = utt.policy.finalize() if utt.language is not None else utt.tentative
        self._commit(utt, shown, why="failures")
        if utt.end is None:
            self._close_open_utterance(utt.window_start + job.audio.shape[0], reopen=True)
        self._finish_utterance_if_closed(utt, decoded=False)
        self._maybe_done()

    def _on(self, rule: str) -> bool:
        """Whether ``rule`` applies; counted as fired by its caller when it decides."""
        return self.streaming.rules.on(rule)

    def _settle_language(self, utt: Utterance, job: DecodeJob, result: DecodeResult) -> bool:
        """A decode of an utterance whose language is not decided: decide it when the detector
        is sure enough (``LanguageTracker``). True when the result can be committed from;
        False when it stays partial, or was decoded in a language the utterance did not get
        and the window is decoded again."""
        detector = self._detecting
        decision = (
            detector.observe(
                result.detected,
                window_s=job.audio_s,
                closing=job.closing,
                is_speech=result.is_speech,
            )
            if detector is not None
            else None
        )
        if decision is None:
            utt.detected = result.detected
            utt.draft = result.sequence
            utt.tentative = self._tail_words(job, result)
            self._emit_partial(utt, result.language, result.detected)
            return False
        utt.language = decision.language
        if decision.changed:
            self.log.info(
                "language %s (p=%.2f) after %.1f s of speech",
                decision.language,
                decision.probability,
                job.audio_s,
            )
            # Earlier text in another language would pull the decoder towards it.
            self._text.forget_prompt()
        if result.language == decision.language:
            return True
        utt.draft = ()
        utt.tentative = []
        utt.decoded_to = utt.window_start  # decoded again at once, in its language
        return False

    def _tail_words(self, job: DecodeJob, result: DecodeResult) -> list[Word]:
        utt = self._utterances[0] if self._utterances else None
        return tail_words(job, result, utt, self.streaming.rules, self.rule_counts)

    # -- finals and partials ---------------------------------------------------------------
    def _commit(self, utt: Utterance, words: list[Word], *, why: str, hold: bool = False) -> None:
        """Make ``words`` final (``Transcript.commit``): ``why`` names the path."""
        self._text.commit(
            utt,
            words,
            why=why,
            clock=self._clock(),
            language=self._language_fields(utt),
            labelled=self._speakers is not None,
            hold=hold,
        )

    def _clock(self) -> Clock:
        return Clock(self.audio_received_s, self.lag_s)

    def _language_fields(self, utt: Utterance) -> Language:
        """``language`` and ``language_probability`` of a decided utterance's messages."""
        if self._detector is None or utt.language is None:
            return None, None
        return utt.language, self._detector.probability

    def _emit_partial(
        self, utt: Utterance, guess: str | None = None, detected: tuple[str, float] | None = None
    ) -> None:
        """Show the utterance's tentative words when they changed. ``guess``, ``detected``: an
        undecided utterance's decode language and the detector's guess (its probability is
        reported when the two agree)."""
        provisional = utt.language is None
        if provisional:
            probability = detected[1] if detected and detected[0] == guess else None
            language: Language = (guess, probability)
        else:
            language = self._language_fields(utt)
        self._text.partial(utt, self._clock(), language, provisional=provisional)

    # -- cuts ------------------------------------------------------------------------------
    def _cut(self, utt: Utterance, cut: Cut) -> None:
        self._text.cut(utt, cut)
        self._trim()

    def _cut_at_cap(self, utt: Utterance, limit: int) -> None:
        """Rule ``window_cap``: the window outgrew its cap: cut at the last final word, or make
        the tentative words final first if nothing was agreed on since the window began (the
        words a cut carried into it do not count: a cut behind them would skip the whole
        window).

        Never past what the engine has heard of the window: a stream that fell behind (its
        decodes slower than its audio) holds more than the cap of undecoded speech, and a cut
        there would skip it. Without a cut the next job is the window's first cap; the cut
        follows once that was decoded."""
        if utt.language is None:
            self._decide_before_cut(utt)
        elif utt.only_carried and utt.tentative:
            self._commit(utt, utt.policy.finalize(), why="window_cap")
        heard = min(utt.heard_to, limit)
        at, carry = cut_point(utt, heard, self.streaming.cut_carry_words)
        if at <= utt.window_start:
            if utt.committed and utt.only_carried:
                # Whisper ended the text right after the carried prefix: decode the window
                # again without it rather than skip the speech after it.
                self.rule_counts.fired("window_cap")
                utt.drop_carried_prefix()
                return
            at, carry = heard, 0
        if at > utt.window_start:
            self._cut(utt, Cut(at, carry, "window_cap"))

    def _decide_before_cut(self, utt: Utterance) -> None:
        """An undecided window reached its cap (a cap under ``decide_max_speech_s``): decide
        as at an utterance's end, and commit the words shown, decoded in that language (an
        unsure detection keeps the language they were decoded in)."""
        detector = self._detecting
        decision = (
            detector.observe(utt.detected, window_s=0.0, closing=True, is_speech=True)
            if detector is not None
            else None
        )
        if decision is not None:  # None: nothing of the window was decoded yet
            utt.language = decision.language
            self._commit(utt, utt.tentative, why="language_cut")

    # -- retiring utterances ---------------------------------------------------------------
    def _finish_utterance_if_closed(self, utt: Utterance, *, decoded: bool) -> None:
        """Retire a closed utterance. ``decoded``: its last window was decoded to the end (else
        it is given up after decode failures)."""
        if utt.end is None:
            return
        self._commit(utt, [], why="closing")  # whatever path retires it, no held word stays
        self._text.retire(utt, decoded=decoded, audio_received_s=self.audio_received_s)
        self._utterances.popleft()
        self._settle_if_closed_finished()
        self._trim()

    def _settle_if_closed_finished(self) -> None:
        """Emit ``Settled`` once no closed utterance is left to decode (utterances finish in
        order; only the last one may still be open)."""
        if self._unsettled and (not self._utterances or self._utterances[0].end is None):
            self._unsettled = False
            self._text.emit.add(Settled(self.audio_received_s))

    def _maybe_done(self) -> None:
        if self._ended and not self._done and not self._utterances and self._in_flight is None:
            self._done = True
            self._text.emit.done(self.audio_received_s, self._audio.end)

    # -- output --------------------------------------------------------------------------
    def events_to_send(self) -> list[SessionEvent]:
        """Messages produced since the last call, in order. With speaker labels, a final
        waits (and what follows it) until its words' speakers are known."""
        tracker = self._speakers
        # After the end, once every window was heard, nothing more can be learnt.
        all_heard = (
            tracker is not None and self._ended and self._embedding is None and tracker.all_planned
        )
        return self._text.emit.take(tracker, all_heard=all_heard)
