"""The streaming core of one client: audio and control messages in, events and decode jobs out.

No asyncio, sockets or MLX here. The caller makes typed calls (``configure``, ``feed_audio``,
``flush``, ``end``), takes decode work from ``next_job`` and hands results back to
``receive_result``; events come out of ``events_to_send``: protocol v1's server messages, and
``Settled`` when all speech closed so far is final. No wire format is parsed here: each API's
adapter turns its client's messages into these calls. Every piece of state about the client
lives on this object.

How text is produced:
- webrtcvad splits the stream into utterances (``vad.py``).
- While speech goes on, the window -- the audio since the last cut -- is decoded again each
  time ``min_new_audio_ms`` of new audio has arrived and no decode of this session is in
  flight. Words already committed in the window are forced as the decoder's prefix, so each
  decode only proposes the tail after them.
- The commit policy (``policy.py``) commits the words that n consecutive tails agree on once
  the window has enough audio around them. Committed words go out at once as a ``final``;
  the rest goes out as a ``partial``.
- The window is cut after a committed word that ends a sentence, at the last committed word when
  it grows past ``max_window_s``, and there too when a decode ended its text at the committed
  words although ``STALLED_TAIL_S`` of speech follows them; committed text before the cut is
  the prompt. The new window starts at the last ``cut_carry_words`` committed words and hears
  them again as its forced prefix, so a word that starts near the cut is never lost. When
  their times were estimated late, the window starts after them and the prefix swallows the
  words it does hear. After a decode whose first new word comes after more than
  ``SKIPPED_SPEECH_S`` of voiced audio, the window is decoded again without the prefix, and
  that decode is kept when it heard words before the first one (else the first decode is).
- At the end of speech, on ``flush`` and on ``end``, the window is decoded once more and
  everything left is committed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from server.config import StreamingConfig, VadConfig
from server.core.agreement import Word, normalize_word, read_alike
from server.core.buffer import SampleBuffer
from server.core.engine_api import DecodeOptions, DecodeRequest, DecodeResult, StopReason
from server.core.language import LanguageTracker
from server.core.policy import CommitConfig, CommitPolicy
from server.core.speakers import EmbedJob, SpeakerLabel, SpeakerTracker
from server.core.vad import SpeechEnded, SpeechStarted, VadSegmenter
from server.protocol.audio import PcmDecoder
from server.protocol.errors import ProtocolError
from server.protocol.formats import FINALS, SAMPLE_RATE_HZ, AudioFormat
from server.protocol.messages import (
    DoneMessage,
    ErrorMessage,
    FinalMessage,
    PartialMessage,
    ServerMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    WordInfo,
)

logger = logging.getLogger("server.core.session")

Float32Array = npt.NDArray[np.float32]
# The end-of-speech silences a client may choose. Below 200 ms a reader's pauses between words
# end utterances (webrtcvad frames are 30 ms); bench-accuracy on test-other measured the floor.
END_OF_SPEECH_MS_RANGE = (200, 5000)
MAX_SPEECH_PAD_MS = 1000  # the audio kept while nobody speaks (IDLE_KEEP_S)
SENTENCE_END = (".", "?", "!", "。", "？", "！")
CLAUSE_END = (",", ";", ":", "，", "；", "：")
CUT_OVERLAP_WORDS = 3  # longest repeat of the pre-cut words looked for after a cut
MAX_DECODE_FAILURES = 3  # per utterance, before its remaining audio is given up with an error
FIRST_WORDS_WINDOW_S = 3.0  # an utterance without words after this decodes at the usual pace
IDLE_KEEP_S = 1.0  # audio kept while nobody speaks, for the VAD's look-back padding
TAIL_RETRY_S = 1.0  # speech left after a closing decode's last word that is decoded again
# Voiced audio between the words a cut carried and the first word after them that means the
# decoder skipped speech (2609-156975-0004: "picture which it", 1.3 s, never came out).
SKIPPED_SPEECH_S = 0.8
# Speech after the committed words that a re-decode ended its text before: the window is
# cut there (``_cut_before_stalled_tail``).
STALLED_TAIL_S = 2.0
HEARD_MORE_WORDS = 10  # how far into the decode without it that word is looked for


@dataclass(frozen=True)
class StreamSettings:
    """What a client chooses for its stream; each API maps its own options onto these."""

    audio_format: AudioFormat = field(default_factory=AudioFormat)
    language: str | None = "en"  # None: detected per utterance (multilingual models only)
    task: str = "transcribe"
    # The silence that ends an utterance (its final follows), within END_OF_SPEECH_MS_RANGE;
    # None: the server's (VadConfig.speech_end_silence_ms). Short speech keeps its longer end.
    end_of_speech_ms: int | None = None
    speech_pad_ms: int | None = None  # audio kept before an onset, 0-1000; None: the server's
    vad_aggressiveness: int | None = None  # webrtcvad's mode 0-3; None: the server's
    # Speaker labels on finals and words; None: the server's (StreamingConfig.speakers).
    speakers: bool | None = None
    # "words" or "utterance" (``StreamingConfig.finals``); None: the server's.
    finals: str | None = None


@dataclass(frozen=True)
class Settled:
    """Every utterance closed so far (at the end of speech, a flush or the end) is
    finished: all of its words were sent, as finals, before this event. The APIs that speak
    in turns (OpenAI's items, Deepgram's ``speech_final``) close a turn on it."""

    audio_received_s: float


SessionEvent = ServerMessage | Settled


@dataclass(frozen=True)
class _Unlabelled:
    """A final waiting for its words' speakers (``SpeakerTracker.covered``); it and every
    event after it stay in the session until then, so the order is kept."""

    final: FinalMessage


@dataclass(frozen=True)
class DecodeJob:
    """One window for the decode stage: ``audio`` (16 kHz mono, starting at ``start_s`` of
    the stream) and the request the decoder gets for it."""

    session_id: str
    job_id: int
    audio: Float32Array
    start_s: float
    request: DecodeRequest
    closing: bool  # the last decode of this window: everything it returns is committed
    created_at: float = field(default_factory=time.monotonic)
    # A decode a listener is waiting on: the utterance's first words (time to first token) or
    # its closing decode (its final). The scheduler serves it ahead of routine re-decodes
    # (``PipelineConfig.urgent_head_start_ms``).
    urgent: bool = False
    # A closing decode started when the silence after speech had covered the trailing pad,
    # before the endpoint (``StreamingConfig.speculative_closing``): it closes the utterance
    # if the endpoint comes where it ended, and is an ordinary re-decode if speech goes on.
    speculative: bool = False
    # Created (or brought up to date) while more streams were open than the server's
    # comfortable estimate (``Pipeline.past_comfort``): its words need less settled context
    # (``utterance_busy_settled_context_s``).
    past_comfort: bool = False

    @property
    def end_sample(self) -> int:
        return round(self.start_s * SAMPLE_RATE_HZ) + int(self.audio.shape[0])

    @property
    def audio_s(self) -> float:
        return self.request.audio_s


@dataclass
class _Utterance:
    """One stretch of speech between VAD boundaries (or a flush)."""

    start: int  # stream samples
    end: int | None = None  # set when speech ended
    window_start: int = 0
    decoded_to: int = 0  # end sample of the last decode's window
    committed: list[Word] = field(default_factory=list)  # committed in the current window
    committed_tokens: list[int] = field(default_factory=list)
    prompted_tokens: int = 0  # leading committed_tokens already in the session's prompt
    policy: CommitPolicy = field(default_factory=CommitPolicy)
    tentative: list[Word] = field(default_factory=list)
    draft: tuple[int, ...] = ()  # DecodeResult.sequence of the window's last decode
    failures: int = 0
    before_cut: list[Word] = field(default_factory=list)  # last words committed before a cut
    # End sample of the last decode of the current window that came back with a result. Unlike
    # decoded_to (set when a job is dispatched, reset after a failure), it only counts audio the
    # engine has actually heard: it bounds where a cut may go and measures the lag.
    heard_to: int = 0
    # The language its words are committed in; None while a session that detects its language
    # has not decided this utterance's (its words stay partial until then).
    language: str | None = None
    detected: tuple[str, float] | None = None  # the last detection while undecided
    # A speculative closing decode's result, held until the endpoint says whether it closes
    # the utterance (nothing else of the window is decoded meanwhile).
    speculation: tuple[DecodeJob, DecodeResult] | None = None
    speculated_to: int = 0  # end sample of the last speculative closing decode
    # The server ended the stream inside this speech (``Session.end``, ``by_server``): its
    # closing decode commits nothing placed at the audio's very end.
    cut_in_speech: bool = False
    # In "utterance" finals, the words of a closing decode that ended well before the
    # utterance: sent with the words of the tail decoded after them, one final for the
    # utterance (``_cut_before_unheard_tail``).
    unsent: list[Word] = field(default_factory=list)
    # A decode that went on from the carried words past speech it did not transcribe, held
    # while the window is decoded again without them (``_skipped_after_carried``).
    unforced_retry: _UnforcedRetry | None = None
    # Background beam searches of the open window (``StreamingConfig.utterance_search_s``):
    searched_to: int = 0  # end sample of the last one asked for
    search_words: _SearchedWords | None = None  # the settled words of the last one back
    agreed: _SearchedWords | None = None  # words two of them agreed on, to hold at the next job

    @property
    def basis(self) -> tuple[int, int]:
        """What a decode's words depend on besides its audio: the window's start and the
        committed words forced as its prefix."""
        return self.window_start, len(self.committed_tokens)


@dataclass(frozen=True)
class _SearchedWords:
    basis: tuple[int, int]  # _Utterance.basis when the search was asked for
    end_sample: int  # the end of the audio it heard
    words: list[Word]


@dataclass(frozen=True)
class _UnforcedRetry:
    job: DecodeJob
    result: DecodeResult
    tail: list[Word]  # its words after the carried ones
    carried: list[Word]


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
        # As this stream's finals make it (``configure``).
        self.streaming = self._server_streaming.with_finals(self._server_streaming.finals)
        self._server_vad = vad or VadConfig()
        self.vad_config = self._server_vad  # as this stream's settings make it (``configure``)
        self.multilingual = multilingual
        self.log = logging.LoggerAdapter(logger, {"session_id": session_id})
        self._settings = self.resolve(
            StreamSettings(
                audio_format=audio_format or AudioFormat(),
                language=self.streaming.language,
                task=self.streaming.task,
            )
        )
        self._pcm = PcmDecoder(
            self._settings.audio_format, max_frame_bytes=self.streaming.max_frame_bytes
        )
        self._vad = VadSegmenter(self.vad_config)
        self._speakers: SpeakerTracker | None = self._tracker()
        self._buffer = SampleBuffer()
        self._events: list[SessionEvent | _Unlabelled] = []
        self._embedding: EmbedJob | None = None  # the speaker encoder's job in flight
        self._next_embed_id = 0
        self._utterances: deque[_Utterance] = deque()
        self._prompt: list[int] = []
        self._prompt_ok = True
        self._detector: LanguageTracker | None = None
        self._unsettled = False  # speech was closed and a Settled is owed for it
        self._next_segment_id = 0
        self._next_job_id = 0
        self._in_flight: DecodeJob | None = None
        self._search_in_flight: DecodeJob | None = None  # a background beam search
        self._audio_started = False
        self._ended = False
        self._done = False
        self._last_partial: tuple[int, str] | None = None
        self._speech_samples = 0
        # Every speech sample ends up in exactly one of these (see DoneMessage).
        self._transcribed_samples = 0
        self._failed_samples = 0
        self._created = time.monotonic()

    # -- properties ----------------------------------------------------------------------
    @property
    def audio_received_s(self) -> float:
        return self._pcm.seconds_in

    @property
    def done(self) -> bool:
        """True once ``end`` was processed, every word finalised and ``done`` emitted."""
        return self._done and not any(isinstance(e, _Unlabelled) for e in self._events)

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
            end = utt.end if utt.end is not None else self._buffer.end
            behind += max(0, end - max(utt.heard_to, utt.window_start))
        return behind / SAMPLE_RATE_HZ

    # -- input ---------------------------------------------------------------------------
    def resolve(self, settings: StreamSettings) -> StreamSettings:
        """``settings`` as they would take effect on this model: an English-only model
        transcribes English (no detection, no translation). Raises ProtocolError."""
        low, high = END_OF_SPEECH_MS_RANGE
        if settings.end_of_speech_ms is not None and not low <= settings.end_of_speech_ms <= high:
            raise ProtocolError(
                f"end_of_speech_ms must be {low} to {high}; got {settings.end_of_speech_ms}"
            )
        if (
            settings.speech_pad_ms is not None
            and not 0 <= settings.speech_pad_ms <= MAX_SPEECH_PAD_MS
        ):
            raise ProtocolError(f"speech_pad_ms must be 0 to {MAX_SPEECH_PAD_MS}")
        if settings.vad_aggressiveness not in (None, 0, 1, 2, 3):
            raise ProtocolError("vad_aggressiveness must be 0, 1, 2 or 3")
        if settings.speakers and not self.streaming.speakers.enabled:
            raise ProtocolError(
                "speaker labels are off on this server (whisperwire-server --speakers)"
            )
        if settings.finals not in (None, *FINALS):
            raise ProtocolError(
                f"finals must be one of {', '.join(FINALS)}; got {settings.finals!r}"
            )
        if self.multilingual:
            return settings
        if settings.language not in (None, "en"):
            raise ProtocolError(
                f"this model is English-only; language {settings.language!r} is not available"
            )
        if settings.task == "translate":
            raise ProtocolError("this model is English-only; task 'translate' is not available")
        return dataclasses.replace(settings, language="en")

    def configure(self, settings: StreamSettings) -> None:
        """Change the stream's settings, before its first audio. Raises ProtocolError."""
        if self._audio_started:
            raise ProtocolError("config must come before the first audio frame")
        if self._ended:
            raise ProtocolError("config after end")
        self._settings = self.resolve(settings)
        self._pcm = PcmDecoder(
            self._settings.audio_format, max_frame_bytes=self.streaming.max_frame_bytes
        )
        self._detector = None
        chosen = self._settings
        self.streaming = self._server_streaming.with_finals(
            chosen.finals or self._server_streaming.finals
        )
        self.vad_config = dataclasses.replace(
            self._server_vad,
            speech_end_silence_ms=_or(
                chosen.end_of_speech_ms, self._server_vad.speech_end_silence_ms
            ),
            speech_pad_ms=_or(chosen.speech_pad_ms, self._server_vad.speech_pad_ms),
            aggressiveness=_or(chosen.vad_aggressiveness, self._server_vad.aggressiveness),
        )
        self._vad = VadSegmenter(self.vad_config)
        self._speakers = self._tracker()

    def _tracker(self) -> SpeakerTracker | None:
        wanted = self._settings.speakers
        if wanted is None:
            wanted = self.streaming.speakers.enabled
        return SpeakerTracker(self.streaming.speakers) if wanted else None

    def feed_audio(self, data: bytes) -> None:
        """Accept audio bytes in the stream's format. Raises a StreamError subclass."""
        if self._ended:
            raise ProtocolError("audio after end", close_code=1008)
        samples = self._pcm.decode(data)
        self._audio_started = self._audio_started or len(data) > 0
        self._ingest(samples)

    def flush(self) -> None:
        """Close the speech heard so far: its words all become final (then ``Settled``), and
        speech still going on goes on in a new utterance. Raises ProtocolError after ``end``."""
        if self._ended:
            raise ProtocolError("flush after end")
        self._close_open_utterance(self._buffer.end, reopen=self._vad.in_speech)
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
        tail = self._pcm.flush()
        self._ingest(tail)
        if (
            by_server
            and self._utterances
            and self._vad.in_speech
            and self._vad.tentative_end is None
        ):
            self._utterances[-1].cut_in_speech = True
        # A stream that ends in a pause after speech: with a beam-searched closing decode the
        # utterance ends where the endpoint would have ended it, so the guess begun in the pause
        # closes it (served per utterance, a second beam search over the whole utterance had
        # followed: turn end p50 0.77 -> 0.63 s, final p95 3.7 -> 2.0 s). A greedy closing
        # decode of the rest is cheap and hears the audio to the end, which on test-other
        # read better (word by word, simulated: 131 errors against 141).
        at_pause = self.streaming.closing_beam_size > 1
        for event in self._vad.flush(at_pause=at_pause):
            self._on_vad(event)
        self._close_open_utterance(self._buffer.end, reopen=False)
        # Ended only now: the flush can release a speculative closing decode that finishes
        # the last utterance, and ``done`` must not go out before the ``Settled`` owed here.
        self._ended = True
        self._unsettled = True
        self._settle_if_closed_finished()
        self._maybe_done()

    def _ingest(self, samples: Float32Array) -> None:
        if samples.size:
            self._buffer.append(samples)
        for event in self._vad.receive(samples) if samples.size else []:
            self._on_vad(event)
        self._trim()

    def _on_vad(self, event: SpeechStarted | SpeechEnded) -> None:
        now_s = self.audio_received_s
        if isinstance(event, SpeechStarted):
            start = max(event.start_sample, self._buffer.start)
            self._utterances.append(self._new_utterance(start))
            if self._speakers is not None:
                self._speakers.open_utterance(start)
            self._events.append(SpeechStartedMessage(start / SAMPLE_RATE_HZ, now_s))
        else:
            self._events.append(SpeechEndedMessage(event.end_sample / SAMPLE_RATE_HZ, now_s))
            self._close_open_utterance(event.end_sample, reopen=False)
            self._unsettled = True
            if self._utterances and self._utterances[0].speculation is not None:
                self._release_speculation(self._utterances[0])

    def _new_utterance(self, start: int) -> _Utterance:
        return _Utterance(
            start=start,
            window_start=start,
            decoded_to=start,
            heard_to=start,
            policy=CommitPolicy(self._commit_config()),
            language=self.language,
        )

    def _commit_config(self) -> CommitConfig:
        """The commit policy's config, with the first commit due by half the smallest window
        cap at the latest: a window cut at its cap before anything was agreed commits its
        words unchecked (``_force_cut``)."""
        c = self.streaming
        cap_s = min(c.max_window_s, c.crowded_max_window_s)
        return dataclasses.replace(c.commit, min_window_s=min(c.commit.min_window_s, cap_s / 2))

    def _close_open_utterance(self, end: int, *, reopen: bool) -> None:
        if self._utterances and self._utterances[-1].end is None:
            utt = self._utterances[-1]
            utt.end = max(end, utt.window_start)
            self._speech_samples += utt.end - utt.start
            if self._speakers is not None:
                self._speakers.close_utterance(utt.end)
            if reopen:
                self._utterances.append(self._new_utterance(end))
                if self._speakers is not None:
                    self._speakers.open_utterance(end)

    def _trim(self) -> None:
        if self._utterances:
            keep_from = self._utterances[0].window_start
        else:
            keep_from = self._buffer.end - int(IDLE_KEEP_S * SAMPLE_RATE_HZ)
        if self._speakers is not None:
            needed = self._speakers.keep_from()
            if needed is not None:
                keep_from = min(keep_from, needed)
        self._buffer.trim(keep_from)
        self._vad.forget_before(keep_from)

    # -- speaker jobs ----------------------------------------------------------------------
    def next_speaker_job(self) -> EmbedJob | None:
        """The next windows for the speaker encoder (``SpeakerEmbedder``), or None: none due,
        one in flight, or no speaker labels on this stream."""
        if self._speakers is None or self._embedding is not None:
            return None
        planned = self._speakers.plan(self._buffer.end)
        if planned is None:
            return None
        start, end, starts = planned
        start = max(start, self._buffer.start)
        job = EmbedJob(
            session_id=self.session_id,
            job_id=self._next_embed_id,
            audio=self._buffer.slice(start, min(end, self._buffer.end)),
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
    def next_job(
        self, *, min_hop_s: float = 0.0, crowded: bool = False, past_comfort: bool = False
    ) -> DecodeJob | None:
        """The next window to decode, or None (one job per session is in flight at most).

        ``min_hop_s``: the scheduler's floor on the new audio a decode waits for, raised as
        the server gets busier (``Pipeline.stream_hop_s``); the session's own cadence applies
        when it is higher. Closing decodes and an utterance's first words never wait for it.
        ``crowded``: streams outnumber the decode lanes, and windows are capped at
        ``crowded_max_window_s``. ``past_comfort``: more streams are open than the server's
        comfortable estimate (``DecodeJob.past_comfort``).
        """
        if self._in_flight is not None or not self._utterances:
            return None
        utt = self._utterances[0]
        if utt.agreed is not None:
            self._hold_agreed(utt)
        if utt.speculation is not None:
            if utt.end is None and self._vad.tentative_end == utt.speculation[0].end_sample:
                return None  # the silence goes on: the endpoint decides
            self._release_speculation(utt)
            return self.next_job(min_hop_s=min_hop_s, crowded=crowded, past_comfort=past_comfort)
        closing = utt.end is not None
        end = utt.end if utt.end is not None else self._buffer.end
        speculative = self._speculative_end(utt, crowded)
        if speculative is not None:
            job = self._job(
                utt,
                speculative,
                closing=True,
                job_id=self._next_job_id,
                speculative=True,
                past_comfort=past_comfort,
            )
            self._next_job_id += 1
            utt.decoded_to = utt.speculated_to = speculative
            self._in_flight = job
            return job
        if not closing:
            new = end - utt.decoded_to
            # Until the utterance shows a word, decode at the first-decode cadence: the time to
            # the first word is what a listener notices most.
            # The scheduler's stretched hop does not hold them back either: under load it
            # spaces re-decodes, and first words waiting on it made TTFT grow with the streams
            # (bench-capacity: 0.45 s at one stream, 1.5 s at six).
            need_s = (
                self.streaming.first_decode_ms / 1000
                if self._awaits_first_words(utt, end)
                else max(self.streaming.min_new_audio_ms / 1000, min_hop_s)
            )
            if new < need_s * SAMPLE_RATE_HZ:
                return None
        max_window = int(self._window_cap_s(crowded) * SAMPLE_RATE_HZ)
        if end - utt.window_start > max_window:
            self._force_cut(utt, utt.window_start + max_window)
            end = utt.end if closing and utt.end is not None else self._buffer.end
            end = min(end, utt.window_start + max_window)
            closing = closing and end == utt.end
        if end <= utt.window_start:
            # Nothing left to decode (a flush at a window's end leaves an empty utterance): it
            # may have been the last thing ``done`` waited for.
            self._finish_utterance_if_closed(utt, decoded=True)
            self._maybe_done()
            return self.next_job(min_hop_s=min_hop_s, crowded=crowded, past_comfort=past_comfort)
        job = self._job(
            utt, end, closing=closing, job_id=self._next_job_id, past_comfort=past_comfort
        )
        self._next_job_id += 1
        utt.decoded_to = end
        self._in_flight = job
        return job

    def supersede_job(
        self, *, crowded: bool = False, past_comfort: bool = False
    ) -> DecodeJob | None:
        """The utterance's closing decode, to start now in place of the decode in flight, or
        None. The caller drops the job in flight (its result is never folded in; the pipeline
        stops it on its lane) and asks only while a decode lane is idle that no other stream
        needs.

        In "utterance" finals the closing decode is a beam search over the whole utterance,
        and it waited for the decode in flight: a re-decode of the growing window, or a guess
        at a pause that speech went on after (another beam search). Served, that wait was most
        of the turn end's tail. Nothing is lost by dropping such a decode: it makes no word
        final that the closing decode does not, and its partial would be overtaken by the
        final at the endpoint. Word by word it is not done: there a re-decode through the pause
        makes the last words final before the endpoint (bench/README.md, session 23).
        """
        job = self._in_flight
        if job is None or not self._utterances or self.streaming.finals != "utterance":
            return None
        utt = self._utterances[0]
        if (
            (job.closing and not job.speculative)
            or utt.language is None
            or utt.unforced_retry is not None
            or utt.speculation is not None
        ):
            return None
        end = utt.end if utt.end is not None else self._speculative_end(utt, crowded)
        if (
            end is None
            or (job.speculative and job.end_sample == end)
            or end <= utt.window_start
            or end - utt.window_start > self._window_cap_s(crowded) * SAMPLE_RATE_HZ
        ):
            return None
        self._in_flight = None
        basis = utt.basis
        replacement = self.next_job(crowded=crowded, past_comfort=past_comfort)
        if replacement is None and utt.basis == basis:
            self._in_flight = job  # nothing to start after all: the decode in flight stays
        elif replacement is None:
            # Held words moved the window (``_hold_agreed``): the decode in flight is of the
            # old one, and its result is dropped when it comes.
            self.log.debug("job %d dropped: the window moved under it", job.job_id)
        else:
            self.log.debug("job %d dropped for job %d to %d", job.job_id, replacement.job_id, end)
        return replacement

    def next_search_job(self, *, past_comfort: bool = False) -> DecodeJob | None:
        """A beam search of the open utterance's window so far, for a decode lane that no
        stream needs (``Pipeline.spare_lane``), or None. It runs beside the stream's own
        decodes and changes nothing until two of them agree (``receive_search``); a result
        that comes back for a window that moved on meanwhile is dropped.

        In "utterance" finals the closing decode is a beam search over the whole utterance,
        which took 0.95-2.5 s after the end of a 10-23 s utterance on a 2-core CPU; with the
        words before its last seconds held and the window cut before them, it hears only
        the tail (``StreamingConfig.utterance_search_s``)."""
        c = self.streaming
        if (
            c.finals != "utterance"
            or c.utterance_search_s <= 0
            or past_comfort
            or self._search_in_flight is not None
            or len(self._utterances) != 1
        ):
            return None
        utt = self._utterances[0]
        end = self._buffer.end
        if (
            utt.end is not None
            or utt.language is None
            or utt.speculation is not None
            or utt.unforced_retry is not None
            # silence after speech: the speculative closing decode is due, not this
            or self._vad.tentative_end is not None
            or end - utt.start < c.utterance_search_s * SAMPLE_RATE_HZ
            or end - max(utt.window_start, utt.searched_to)
            < c.utterance_search_step_s * SAMPLE_RATE_HZ
            or end - utt.window_start > self._window_cap_s(False) * SAMPLE_RATE_HZ
        ):
            return None
        job = dataclasses.replace(
            self._job(utt, end, closing=True, job_id=self._next_job_id),
            closing=False,
            urgent=False,
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
        return utt.end is not None or utt.basis != _basis_of(job)

    def drop_search(self) -> None:
        """The background search in flight was cancelled: the next may start."""
        self._search_in_flight = None

    def receive_search(self, job: DecodeJob, result: DecodeResult | None) -> None:
        """Fold in a background beam search (``next_search_job``); None: it failed. Its
        words with ``commit.settled_context_s`` of audio after them (1.5 s per utterance)
        that the search before it of the same window read alike are held at the stream's
        next job (``_hold_agreed``)."""
        if self._search_in_flight is None or job.job_id != self._search_in_flight.job_id:
            return
        self._search_in_flight = None
        utt = self._utterances[0] if self._utterances else None
        if result is None or utt is None or utt.basis != _basis_of(job):
            return
        limit_s = job.start_s + job.audio_s - self.streaming.commit.settled_context_s
        settled: list[Word] = []
        for word in self._tail_words(job, result):
            if word.end_s > limit_s:
                break
            settled.append(word)
        before = utt.search_words
        utt.search_words = _SearchedWords(utt.basis, job.end_sample, settled)
        if before is None or before.basis != utt.basis:
            return
        agreed = read_alike(settled, before.words)
        if agreed:
            utt.agreed = _SearchedWords(utt.basis, job.end_sample, agreed)

    def _hold_agreed(self, utt: _Utterance) -> None:
        """Hold the words background searches agreed on (``receive_search``) and cut the
        window before the last of them, when the window is still the one they heard and a
        cut leaves words of theirs behind it. Only while no decode of the stream is in
        flight: a cut moves the window under it."""
        agreed, utt.agreed = utt.agreed, None
        assert agreed is not None and self._in_flight is None
        spoken = [w for w in agreed.words if normalize_word(w.text)]
        if (
            agreed.basis != utt.basis
            or utt.speculation is not None
            or utt.unforced_retry is not None
            or len(spoken) <= self.streaming.cut_carry_words
        ):
            return
        self.log.debug(
            "%d word(s) held from background searches to %.2f s",
            len(agreed.words),
            agreed.end_sample / SAMPLE_RATE_HZ,
        )
        latest = utt.search_words
        self._commit(utt, agreed.words, hold=True)
        utt.heard_to = max(utt.heard_to, agreed.end_sample)
        at, carry = self._held_cut_point(utt)
        if at > utt.window_start:
            self._cut(utt, at, carry=carry)
        else:
            self._forget_decodes(utt)
        # The latest search's words after the held ones are what the next search of the
        # new window is checked against.
        utt.search_words = None
        if latest is not None and latest.basis == agreed.basis:
            rest = latest.words[len(agreed.words) :]
            utt.search_words = _SearchedWords(utt.basis, latest.end_sample, rest)

    def _held_cut_point(self, utt: _Utterance) -> tuple[int, int]:
        """Where the window is cut after held words, and how many it carries: at the start
        of the first spoken word within ``utterance_search_context_s`` of the last one's end
        (at least ``cut_carry_words``, as any cut carries). The closing decode after a cut
        that carried two words heard too little before the tail: simulated on test-other, 124
        errors where 4 s of context read 112 (115 without the searches)."""
        at, carry = self._cut_point(utt, utt.heard_to)
        words = utt.committed
        floor = words[-1].end_s - self.streaming.utterance_search_context_s
        for k in range(len(words) - carry):
            if (
                words[k].start_s >= floor
                and normalize_word(words[k].text)
                and all(w.tokens for w in words[k:])
            ):
                start = round(words[k].start_s * SAMPLE_RATE_HZ)
                return max(utt.window_start, start), len(words) - k
        return at, carry

    def _speculative_end(self, utt: _Utterance, crowded: bool) -> int | None:
        """Where a speculative closing decode of ``utt`` would end, when one is due: the
        open utterance (the only one) heard silence covering its pad, and that end was not
        decoded speculatively yet (nor past the window's cap, where a cut comes first). Under
        load too: when the endpoint comes where it guessed, the guess is the closing decode
        and costs nothing extra (bench-capacity at 4 and 6 streams, 2 cores: lanes as busy,
        final p95 2.00 -> 1.67-1.76 s and 3.36 -> 2.67 s, end of speech to final p50
        0.84-1.12 -> 0.60-0.67 s at 4)."""
        end = self._vad.tentative_end
        if end is None or end == utt.speculated_to:
            end = self._phrase_end(utt, crowded)
        if (
            end is None
            or not self.streaming.speculative_closing
            or utt.end is not None
            or len(self._utterances) > 1
            or utt.language is None
            or end == utt.speculated_to
            or end <= utt.window_start
            or end - utt.window_start > self._window_cap_s(crowded) * SAMPLE_RATE_HZ
        ):
            return None
        return end

    def _phrase_end(self, utt: _Utterance, crowded: bool) -> int | None:
        """In "utterance" finals, the last pause the speech of ``utt`` went on after that
        ends a phrase (``utterance_phrase_s`` of window before it) and was not decoded to yet.
        A pause is often over before the speculative decode of it could start: a decode of
        the growing window is in flight while it lasts."""
        if not self._phrases_on:
            return None
        first = utt.window_start + round(self.streaming.utterance_phrase_s * SAMPLE_RATE_HZ)
        last = utt.window_start + round(self._window_cap_s(crowded) * SAMPLE_RATE_HZ)
        pauses = self._vad.pause_ends(max(first - 1, utt.speculated_to), last)
        return pauses[-1] if pauses else None

    def _ends_phrase(self, utt: _Utterance, job: DecodeJob) -> bool:
        """Whether speech that went on after ``job``'s speculative closing decode of the open
        utterance ends a phrase there (``StreamingConfig.utterance_phrase_s``): the decode
        heard the window whole up to a pause, as the closing decode would have."""
        return (
            self._phrases_on
            and utt.end is None
            and len(self._utterances) == 1
            and job.start_s == utt.window_start / SAMPLE_RATE_HZ
            and job.audio_s >= self.streaming.utterance_phrase_s
        )

    @property
    def _phrases_on(self) -> bool:
        return self.streaming.finals == "utterance" and self.streaming.utterance_phrase_s > 0

    def _release_speculation(self, utt: _Utterance) -> None:
        """Fold in the held speculative result: the closing decode when the utterance ended
        where it did, else an ordinary re-decode of the window (speech went on, or a flush or
        the stream's end closed it elsewhere; the closing decode then follows)."""
        assert utt.speculation is not None and self._in_flight is None
        job, result = utt.speculation
        utt.speculation = None
        self._in_flight = job
        self.receive_result(job, result)

    def refresh_job(
        self, job: DecodeJob, *, crowded: bool = False, past_comfort: bool = False
    ) -> DecodeJob:
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
        cap = utt.window_start + int(self._window_cap_s(crowded) * SAMPLE_RATE_HZ)
        end = min(utt.end if utt.end is not None else self._buffer.end, cap)
        if end <= utt.decoded_to:
            return job
        audio = self._buffer.slice(utt.window_start, end)
        closing = end == utt.end
        fresh = dataclasses.replace(
            job,
            audio=audio,
            request=dataclasses.replace(
                job.request,
                audio_s=audio.shape[0] / SAMPLE_RATE_HZ,
                options=self._options(utt, closing=closing),
            ),
            closing=closing,
            past_comfort=past_comfort,
        )
        utt.decoded_to = end
        self._in_flight = fresh
        return fresh

    def _window_cap_s(self, crowded: bool) -> float:
        c = self.streaming
        return min(c.max_window_s, c.crowded_max_window_s) if crowded else c.max_window_s

    def _settled_context_s(self, job: DecodeJob) -> float | None:
        """The settled context ``job``'s words commit with (``CommitPolicy.update``): less
        past the comfortable estimate; None: the policy's own."""
        if not job.past_comfort:
            return None
        c = self.streaming
        return min(c.commit.settled_context_s, c.utterance_busy_settled_context_s)

    def _options(self, utt: _Utterance, *, closing: bool) -> DecodeOptions:
        """The decode options of ``utt``'s next window: its language (or detection), and a
        beam search for a closing decode (which the scheduler runs greedy when the lanes
        cannot afford it: ``Pipeline.past_comfort``)."""
        detector = self._detecting
        beam = self.streaming.closing_beam_size if closing else 1
        if utt.language is not None or detector is None:
            return DecodeOptions(language=utt.language, task=self._settings.task, beam_size=beam)
        return DecodeOptions(
            language=detector.decode_language(),
            task=self._settings.task,
            detect_language=True,
            beam_size=beam,
        )

    def _awaits_first_words(self, utt: _Utterance, end: int) -> bool:
        """Whether a decode of ``utt`` up to ``end`` is one its first word waits on: nothing
        shown yet, and the utterance still short enough to be decoded at the first-decode pace."""
        return (
            not utt.committed_tokens
            and not utt.tentative
            and end - utt.start < FIRST_WORDS_WINDOW_S * SAMPLE_RATE_HZ
        )

    def _job(
        self,
        utt: _Utterance,
        end: int,
        *,
        closing: bool,
        job_id: int,
        speculative: bool = False,
        past_comfort: bool = False,
    ) -> DecodeJob:
        """The decode of ``utt``'s window up to ``end``."""
        audio = self._buffer.slice(utt.window_start, end)
        options = self._options(utt, closing=closing)
        return DecodeJob(
            session_id=self.session_id,
            job_id=job_id,
            audio=audio,
            start_s=utt.window_start / SAMPLE_RATE_HZ,
            request=DecodeRequest(
                audio_s=audio.shape[0] / SAMPLE_RATE_HZ,
                options=options,
                prompt=tuple(self._prompt[-self.streaming.prompt_max_tokens :])
                if self._prompt_ok
                else (),
                prefix=tuple(utt.committed_tokens),
                draft=utt.draft,
            ),
            closing=closing,
            urgent=closing or self._awaits_first_words(utt, end),
            speculative=speculative,
            past_comfort=past_comfort,
        )

    def receive_result(self, job: DecodeJob, result: DecodeResult) -> None:
        """Fold one decode result into the stream's text and emit events."""
        if self._in_flight is None or job.job_id != self._in_flight.job_id:
            self.log.warning("result for unknown job %d ignored", job.job_id)
            return
        job, self._in_flight = self._in_flight, None  # as last refreshed
        utt = self._utterances[0]
        overtaken = job.speculative and utt.end != job.end_sample
        phrase = False
        if overtaken:
            if utt.end is None and self._vad.tentative_end == job.end_sample:
                utt.speculation = (job, result)  # the endpoint may still come there
                return
            phrase = self._ends_phrase(utt, job)
            overtaken = not phrase
            job = dataclasses.replace(job, closing=False, speculative=False)
        utt.heard_to = max(utt.heard_to, job.end_sample)
        if utt.language is None and not self._settle_language(utt, job, result):
            self._maybe_done()
            return
        tail = self._tail_words(job, result)
        retry = utt.unforced_retry
        if retry is not None:
            utt.unforced_retry = None
            if not _hears_more(tail, retry.tail):
                # Whisper without the prefix can start a long window sentences in: the
                # decode with the prefix was the better one after all.
                self.log.info("the decode with the carried words kept: nothing more without")
                self._carry_again(utt, retry.carried)
                job, result, tail = retry.job, retry.result, retry.tail
        elif self._skipped_after_carried(utt, job, tail):
            utt.unforced_retry = _UnforcedRetry(job, result, tail, list(utt.committed))
            self._drop_carried_prefix(utt)
            self._maybe_done()
            return
        self._prompt_ok = result.stop_reason not in (StopReason.REPETITION, StopReason.COMPRESSION)
        utt.draft = result.sequence
        committed = utt.policy.update(
            tail,
            # Per utterance, "nothing final before half the window" counts from the
            # utterance's start: a window cut past that (at its cap, after a sentence) goes on
            # word by word, where it waited for 15 s of new window (LJ long: no final for 10 s).
            window_start_s=utt.start / SAMPLE_RATE_HZ
            if self.streaming.finals == "utterance"
            else job.start_s,
            window_end_s=job.start_s + job.audio_s,
            closing=job.closing,
            cut_in_speech=utt.cut_in_speech and job.end_sample == utt.end,
            # The utterance goes on in the same window, the phrase's final words its prefix.
            phrase=phrase,
            settled_context_s=self._settled_context_s(job),
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
        # Per utterance, a closing decode's words wait for the tail that it may have missed:
        # two finals of one utterance, the first ending seconds before the pause, are what
        # "utterance" finals promise not to send (test-other 3080-5032-0007: the beam search
        # of 14.3 s stopped 1.3 s early, its final came 2.9 s after its last word). Words held
        # from background searches wait for the utterance's end too, unless words commit
        # after them (past half the window: word by word).
        hold = job.closing or not committed
        self._commit(utt, committed, hold=hold and self.streaming.finals == "utterance")
        if not overtaken and (not utt.unsent or utt.end is None):
            # A guess that speech overtook ends in the pause ("... word."): shown, it would be
            # taken back by the next decode (bench-latency flicker 0.245 -> 0.279). Words held
            # at a closing decode wait for the tail's final without a partial.
            self._emit_partial(utt)
        if job.closing:
            if not self._cut_before_unheard_tail(utt):
                self._finish_utterance_if_closed(utt, decoded=True)
        elif not self._cut_before_stalled_tail(utt, job, tail):
            self._maybe_cut(utt)
        self._maybe_done()

    def receive_failure(self, job: DecodeJob, error: Exception) -> None:
        """A decode failed: tell the client; the window is retried with the next job, up to
        ``MAX_DECODE_FAILURES`` times per utterance (the closing decode too: an utterance's last
        window holds the words not yet final, and one passing failure must not lose them)."""
        if self._in_flight is None or job.job_id != self._in_flight.job_id:
            return
        job, self._in_flight = self._in_flight, None  # as last refreshed
        self._events.append(
            ErrorMessage("decode_failed", f"decoding failed: {error}", False, self.audio_received_s)
        )
        utt = self._utterances[0]
        utt.failures += 1
        if utt.failures >= MAX_DECODE_FAILURES:
            # Keep what was shown; the audio that could not be decoded is reported, not retried
            # forever.
            shown = utt.policy.finalize() if utt.language is not None else utt.tentative
            self._commit(utt, shown)
            if utt.end is None:
                self._close_open_utterance(utt.window_start + job.audio.shape[0], reopen=True)
            self._finish_utterance_if_closed(utt, decoded=False)
            self._maybe_done()
        else:
            utt.decoded_to = utt.window_start  # retried with the next audio

    def _settle_language(self, utt: _Utterance, job: DecodeJob, result: DecodeResult) -> bool:
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
            if self._prompt:
                # Earlier text in another language would pull the decoder towards it.
                self._prompt = []
        if result.language == decision.language:
            return True
        utt.draft = ()
        utt.tentative = []
        utt.decoded_to = utt.window_start  # decoded again at once, in its language
        return False

    def _decide_before_cut(self, utt: _Utterance) -> None:
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
            self._commit(utt, utt.tentative)

    def _tail_words(self, job: DecodeJob, result: DecodeResult) -> list[Word]:
        """Words after the forced prefix, in stream time."""
        if not result.is_speech:
            return []
        words = list(result.words)
        forced = len(job.request.prefix)
        count = 0
        k = 0
        while k < len(words) and count < forced:
            count += len(words[k].tokens)
            k += 1
        tail = [
            Word(w.word, job.start_s + w.start_s, job.start_s + w.end_s, w.probability, w.tokens)
            for w in words[k:]
            if w.word.strip()
        ]
        if not job.request.prefix and self._utterances:
            tail = self._drop_repeat_of_cut(self._utterances[0], tail)
        utt = self._utterances[0] if self._utterances else None
        before = (utt.committed or utt.before_cut)[-1:] if utt is not None else []
        if before:
            # After a cut, the alignment can squeeze the new words onto the window's first
            # frame, before the words final already (seen on LJ long): they follow them.
            floor = before[0].end_s
            tail = [
                w
                if w.start_s >= floor
                else dataclasses.replace(w, start_s=floor, end_s=max(w.end_s, floor))
                for w in tail
            ]
        return tail

    def _drop_repeat_of_cut(self, utt: _Utterance, tail: list[Word]) -> list[Word]:
        """A window that starts at a cut can hear the end of the last committed word again
        (word end times are estimates). Drop the longest opening n-gram that repeats the words
        committed just before the cut, when it lies at the cut."""
        before = utt.before_cut
        if not before or not tail or tail[0].start_s > utt.window_start / SAMPLE_RATE_HZ + 1.0:
            return tail
        for n in range(min(len(before), len(tail), CUT_OVERLAP_WORDS), 0, -1):
            if [normalize_word(w.text) for w in tail[:n]] == [
                normalize_word(w.text) for w in before[-n:]
            ]:
                return tail[n:]
        return tail

    def _commit(self, utt: _Utterance, words: list[Word], *, hold: bool = False) -> None:
        """Record committed words on the window and send them as a final, after the words
        held back before them. ``hold``: keep them back too (``_Utterance.unsent``)."""
        for w in words:
            utt.committed_tokens.extend(w.tokens)
        utt.committed.extend(words)
        words = utt.unsent + words
        if hold:
            utt.unsent = words
            return
        utt.unsent = []
        text = "".join(w.text for w in words).strip()
        if not text:
            return
        language, probability = self._language_fields(utt)
        final = FinalMessage(
            segment_id=self._next_segment_id,
            text=text,
            start=words[0].start_s,
            end=words[-1].end_s,
            words=tuple(WordInfo(w.text.strip(), w.start_s, w.end_s, w.probability) for w in words),
            audio_received_s=self.audio_received_s,
            lag_s=self.lag_s,
            language=language,
            language_probability=probability,
        )
        self._events.append(final if self._speakers is None else _Unlabelled(final))
        self._next_segment_id += 1
        self._last_partial = None

    def _language_fields(self, utt: _Utterance) -> tuple[str | None, float | None]:
        """``language`` and ``language_probability`` of a decided utterance's messages."""
        if self._detector is None or utt.language is None:
            return None, None
        return utt.language, self._detector.probability

    def _emit_partial(
        self,
        utt: _Utterance,
        guess: str | None = None,
        detected: tuple[str, float] | None = None,
    ) -> None:
        """Send the utterance's tentative words when they changed. ``guess``, ``detected``: an
        undecided utterance's decode language and the detector's guess (its probability is
        reported when the two agree)."""
        provisional = utt.language is None
        if provisional:
            language = guess
            probability = detected[1] if detected and detected[0] == guess else None
        else:
            language, probability = self._language_fields(utt)
        # Held words (``_hold_agreed``) are final at the utterance's end: shown until then.
        words = utt.unsent + utt.tentative
        text = "".join(w.text for w in words).strip()
        key = (self._next_segment_id, text)
        if key == self._last_partial or (not text and self._last_partial is None):
            return
        self._last_partial = key
        start = words[0].start_s if words else utt.window_start / SAMPLE_RATE_HZ
        end = words[-1].end_s if words else start
        self._events.append(
            PartialMessage(
                self._next_segment_id,
                text,
                start,
                end,
                self.audio_received_s,
                self.lag_s,
                language,
                probability,
                language_provisional=provisional,
            )
        )

    def _cut(self, utt: _Utterance, at: int, *, carry: int = 0) -> None:
        """Start a new window at ``at``; committed text of the old one becomes the prompt.

        ``carry``: how many of the last committed words the new window keeps as its forced
        prefix (see ``_cut_point``); they are final already and not sent again."""
        self._release_to_prompt(utt)
        start = max(utt.window_start, min(at, utt.end if utt.end is not None else at))
        heard = max(utt.window_start, min(start, utt.heard_to))
        self._transcribed_samples += heard - utt.window_start
        if start > heard:
            # A cut past what the engine heard skips audio; callers cut at heard_to at most.
            self.log.error("cut at %d skipped %d samples never decoded", start, start - heard)
            self._failed_samples += start - heard
        utt.window_start = start
        utt.decoded_to = max(utt.decoded_to, utt.window_start)
        utt.heard_to = max(utt.heard_to, utt.window_start)
        utt.before_cut = utt.committed[-CUT_OVERLAP_WORDS:]
        utt.committed = utt.committed[len(utt.committed) - carry :] if carry else []
        utt.committed_tokens = [t for w in utt.committed for t in w.tokens]
        utt.prompted_tokens = len(utt.committed_tokens)
        self._forget_decodes(utt)
        self._trim()

    @staticmethod
    def _forget_decodes(utt: _Utterance) -> None:
        """The window's words changed under its decodes (a cut, held or dropped words): what
        they agreed on, showed and drafted no longer applies."""
        utt.policy.reset()
        utt.tentative = []
        utt.draft = ()

    def _release_to_prompt(self, utt: _Utterance) -> None:
        """The window's committed tokens become context for the windows after it (those a cut
        carried into this window are there already)."""
        self._prompt.extend(utt.committed_tokens[utt.prompted_tokens :])
        self._prompt = self._prompt[-self.streaming.prompt_max_tokens * 2 :]
        utt.prompted_tokens = len(utt.committed_tokens)

    def _cut_point(self, utt: _Utterance, limit: int, upto: int | None = None) -> tuple[int, int]:
        """Where a cut after the committed words goes, and how many words it carries.

        At the start of the ``cut_carry_words``-th last committed word with letters; the new
        window keeps the words from there as its forced prefix. A word's end is only the
        alignment's estimate, and a cut at the last one lands in the next word often enough
        to lose it (LJ long, cuts at max_window_s: 13 of 14 lost or garbled the word after).
        Fewer words when that start is not inside the window; none, at the end of the last
        word, when no word's start is. ``upto``: the cut follows the committed word of that
        index instead of the last one, and the words after it are carried as well."""
        words = utt.committed
        last = len(words) - 1 if upto is None else upto
        end = min(round(words[last].end_s * SAMPLE_RATE_HZ), limit) if words else limit
        spoken = [i for i, w in enumerate(words[: last + 1]) if normalize_word(w.text)]
        n = self.streaming.cut_carry_words
        for k in spoken[max(0, len(spoken) - n) :] if n else []:
            start = round(words[k].start_s * SAMPLE_RATE_HZ)
            if utt.window_start < start <= limit and all(w.tokens for w in words[k:]):
                return start, len(words) - k
        if all(w.tokens for w in words[last + 1 :]):
            return end, len(words) - last - 1
        return utt.window_start, 0

    def _maybe_cut(self, utt: _Utterance) -> None:
        """Cut after a committed sentence end, or a clause end once the window is long: short
        windows keep every re-decode cheap, and punctuation is where no word straddles.

        Per utterance, a commit past half the window holds many words, and the cut goes
        after the last such end among them, the words after it carried: the word-by-word
        re-decodes of a long utterance then hear seconds, not 15-30 s (test-other
        3080-5032-0009: 0.6 s a decode of 17-22 s, finals 2.1-2.6 s after their words).

        Cutting in pauses the VAD heard (between the last committed word and the next) was
        measured and dropped: at 3 s windows +1.7 points on the short clips, at 6 s +7 errors
        on LJ long, for a few percent less decode time. Whisper needs the context."""
        if not utt.committed:
            return
        c = self.streaming
        last = len(utt.committed) - 1
        scan = c.finals == "utterance" and c.utterance_cut_inside_commit
        for k in range(last, -1 if scan else last - 1, -1):
            word = utt.committed[k]
            at = round(word.end_s * SAMPLE_RATE_HZ)
            window_s = (at - utt.window_start) / SAMPLE_RATE_HZ
            text = word.text.rstrip()
            if (text.endswith(SENTENCE_END) and window_s >= c.sentence_cut_s) or (
                text.endswith(CLAUSE_END) and window_s >= c.clause_cut_s
            ):
                break
        else:
            return
        at, carry = self._cut_point(utt, max(at, utt.heard_to), upto=k)
        if at > utt.window_start:
            self._cut(utt, at, carry=carry)

    def _cut_before_unheard_tail(self, utt: _Utterance) -> bool:
        """After a closing decode: when its words end well before the utterance does, cut at
        the last one so the rest is decoded as a window of its own. Whisper can end a long
        window at a sentence end although speech follows (seen on 13 s windows of a stream
        that fell behind: the second sentence never came out); finishing the utterance there
        would lose those words. Each cut moves the window forward, so this ends.
        Returns False when the words reach the end and the utterance can be finished."""
        if utt.end is None or not utt.committed:
            return False
        last = utt.committed[-1]
        if utt.end - round(last.end_s * SAMPLE_RATE_HZ) < TAIL_RETRY_S * SAMPLE_RATE_HZ:
            return False
        # The cut goes at the start of the last word, not its end (_cut_point): a word before
        # an early end of text tends to be given the time of the silence or speech after it,
        # and the words under that time would be skipped.
        at, carry = self._cut_point(utt, utt.end)
        if not carry:
            return False
        self._cut(utt, at, carry=carry)
        return True

    def _cut_before_stalled_tail(self, utt: _Utterance, job: DecodeJob, tail: list[Word]) -> bool:
        """After a re-decode of the open utterance that ended its text at the committed words
        although ``STALLED_TAIL_S`` of speech follows them: cut at the last of them, so that
        the next decode hears a window of its own after them. Whisper can stop at a forced
        prefix again and again as the window grows (test-other 3080-5032-0009: "... brag
        much that he", then nothing new for 4 s of decodes, greedy and beam alike, until the
        closing decode heard 14.7 s). Returns whether it cut."""
        if (
            utt.end is not None
            or not job.request.prefix
            or not utt.committed
            or any(normalize_word(w.text) for w in tail)
        ):
            return False
        last_end = round(utt.committed[-1].end_s * SAMPLE_RATE_HZ)
        stalled_s = self._vad.voiced_s(last_end, job.end_sample)
        if stalled_s < STALLED_TAIL_S:
            return False
        at, carry = self._cut_point(utt, min(utt.heard_to, job.end_sample))
        if at <= utt.window_start:
            return False
        self.log.info(
            "decode ended at the committed words with %.1f s of speech after them: cut", stalled_s
        )
        self._cut(utt, at, carry=carry)
        return True

    def _force_cut(self, utt: _Utterance, limit: int) -> None:
        """The window outgrew ``max_window_s``: cut at the last committed word, or commit the
        tentative words first if nothing was agreed on since the window began (the words a cut
        carried into it do not count: a cut behind them would skip the whole window, as it
        did on LJ long streamed faster than real time, 15 s of words lost per cut).

        Never past what the engine has heard of the window: a stream that fell behind (its
        decodes slower than its audio) holds more than ``max_window_s`` of undecoded speech,
        and a cut there would skip it. Without a cut the next job is the window's first
        ``max_window_s``; the cut follows once that was decoded."""
        if utt.language is None:
            self._decide_before_cut(utt)
        elif len(utt.committed_tokens) <= utt.prompted_tokens and utt.tentative:
            self._commit(utt, utt.policy.finalize())
        heard = min(utt.heard_to, limit)
        at, carry = self._cut_point(utt, heard)
        if at <= utt.window_start:
            if utt.committed and len(utt.committed_tokens) <= utt.prompted_tokens:
                # Whisper ended the text right after the carried prefix (seen on LJ long, after
                # words squeezed onto a window's last frame): decode the window again without
                # it rather than skip the speech after it.
                self._drop_carried_prefix(utt)
                return
            at, carry = heard, 0
        if at > utt.window_start:
            self._cut(utt, at, carry=carry)

    def _skipped_after_carried(self, utt: _Utterance, job: DecodeJob, tail: list[Word]) -> bool:
        """Whether a decode that continued the words a cut carried skipped the speech after
        them. The carried words' times come from the window before the cut; when the new
        window starts later than they were really spoken, the forced prefix takes up the first
        words of its audio and the decoder goes on from the words after those."""
        if not (job.request.prefix and tail and utt.committed):
            return False
        if len(utt.committed_tokens) != utt.prompted_tokens:
            return False  # words of this window were committed after the carried ones
        carried_end = round(utt.committed[-1].end_s * SAMPLE_RATE_HZ)
        skipped_s = self._vad.voiced_s(carried_end, round(tail[0].start_s * SAMPLE_RATE_HZ))
        if skipped_s < SKIPPED_SPEECH_S:
            return False
        self.log.info(
            "%.1f s of speech before %r skipped after the carried words: decoded without them",
            skipped_s,
            tail[0].text,
        )
        return True

    def _carry_again(self, utt: _Utterance, carried: list[Word]) -> None:
        """Undo ``_drop_carried_prefix``: the window's words are the carried ones again."""
        utt.committed = list(carried)
        utt.committed_tokens = [t for w in carried for t in w.tokens]
        utt.prompted_tokens = len(utt.committed_tokens)

    def _drop_carried_prefix(self, utt: _Utterance) -> None:
        """Decode the window from its start with no forced prefix: the carried words are final
        and in the prompt already (``_cut``), so nothing is sent again."""
        utt.committed = []
        utt.committed_tokens = []
        utt.prompted_tokens = 0
        self._forget_decodes(utt)
        utt.decoded_to = utt.window_start
        # Nothing of the window was heard by a decode that counts: a cut at the window's cap
        # before the next decode would skip it (LJ long at pace 0: 15 s lost).
        utt.heard_to = utt.window_start

    def _finish_utterance_if_closed(self, utt: _Utterance, *, decoded: bool) -> None:
        """Retire a closed utterance. ``decoded``: its last window was decoded to the end (else
        it is given up after decode failures, and only what was heard counts as transcribed)."""
        if utt.end is None:
            return
        self._commit(utt, [])  # whatever path retires it, no held word stays unsent
        heard = utt.end if decoded else max(utt.window_start, min(utt.heard_to, utt.end))
        self._transcribed_samples += heard - utt.window_start
        self._failed_samples += utt.end - heard
        self._release_to_prompt(utt)
        if self._last_partial is not None and self._last_partial[1]:
            self._events.append(
                PartialMessage(
                    self._next_segment_id,
                    "",
                    utt.end / SAMPLE_RATE_HZ,
                    utt.end / SAMPLE_RATE_HZ,
                    self.audio_received_s,
                )
            )
        self._last_partial = None
        self._utterances.popleft()
        self._settle_if_closed_finished()
        self._trim()

    def _settle_if_closed_finished(self) -> None:
        """Emit ``Settled`` once no closed utterance is left to decode (utterances finish in
        order; only the last one may still be open)."""
        if self._unsettled and (not self._utterances or self._utterances[0].end is None):
            self._unsettled = False
            self._events.append(Settled(self.audio_received_s))

    def _maybe_done(self) -> None:
        if self._ended and not self._done and not self._utterances and self._in_flight is None:
            self._done = True
            self._events.append(
                DoneMessage(
                    segments=self._next_segment_id,
                    audio_received_s=self.audio_received_s,
                    speech_s=self._speech_samples / SAMPLE_RATE_HZ,
                    session_s=time.monotonic() - self._created,
                    non_speech_s=(self._buffer.end - self._speech_samples) / SAMPLE_RATE_HZ,
                    transcribed_s=self._transcribed_samples / SAMPLE_RATE_HZ,
                    failed_s=self._failed_samples / SAMPLE_RATE_HZ,
                )
            )

    # -- output --------------------------------------------------------------------------
    def events_to_send(self) -> list[SessionEvent]:
        """Messages produced since the last call, in order. With speaker labels, a final
        waits (and what follows it) until its words' speakers are known."""
        ready: list[SessionEvent] = []
        for k, event in enumerate(self._events):
            if isinstance(event, _Unlabelled):
                labelled = self._labelled(event.final)
                if labelled is None:
                    self._events = self._events[k:]
                    return ready
                event = labelled
            ready.append(event)
        self._events = []
        return ready

    def _labelled(self, final: FinalMessage) -> FinalMessage | None:
        """``final`` with each word's speaker, or None while a word cannot be labelled yet."""
        tracker = self._speakers
        if tracker is None:
            return final
        waiting = not all(tracker.covered(round(w.end * SAMPLE_RATE_HZ)) for w in final.words)
        # After the end, once every window was heard, nothing more can be learnt.
        if waiting and not (self._ended and self._embedding is None and tracker.all_planned):
            return None
        labels: list[SpeakerLabel | None] = [
            tracker.label(round((w.start + w.end) / 2 * SAMPLE_RATE_HZ)) for w in final.words
        ]
        words = tuple(
            w
            if label is None
            else dataclasses.replace(
                w, speaker=label.speaker, speaker_confidence=round(label.confidence, 3)
            )
            for w, label in zip(final.words, labels, strict=True)
        )
        spoken: dict[int, float] = {}
        for w, label in zip(final.words, labels, strict=True):
            if label is not None:
                spoken[label.speaker] = spoken.get(label.speaker, 0.0) + max(w.end - w.start, 0.01)
        speaker = max(spoken, key=lambda k: spoken[k]) if spoken else None
        return dataclasses.replace(final, words=words, speaker=speaker)


def nearest_end_of_speech_ms(ms: int) -> int:
    """The end-of-speech silence served for a vendor API's ``ms``: the nearest one in
    ``END_OF_SPEECH_MS_RANGE`` (v1 refuses values outside it instead)."""
    low, high = END_OF_SPEECH_MS_RANGE
    return min(max(ms, low), high)


def _basis_of(job: DecodeJob) -> tuple[int, int]:
    """The window basis (``_Utterance.basis``) a job was made for: its start and forced prefix."""
    return round(job.start_s * SAMPLE_RATE_HZ), len(job.request.prefix)


def _or(chosen: int | None, default: int) -> int:
    return default if chosen is None else chosen


def _hears_more(unforced: list[Word], forced: list[Word]) -> bool:
    """Whether a decode without the carried prefix heard words before the first one the
    decode with it went on with: that word comes in its opening words, after others.
    (Timing alone cannot tell: the carried words' end is an estimate from the window before
    the cut, and on LJ long it was 1.3 s early with nothing skipped.)"""
    if not forced:
        return bool(unforced)
    first = normalize_word(forced[0].text)
    return first in [normalize_word(w.text) for w in unforced[1:HEARD_MORE_WORDS]]
