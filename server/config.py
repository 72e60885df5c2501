"""Frozen configuration objects, one per concern, checked when built.

The CLI only maps flags onto these; nothing else reads options from dictionaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar

from server.core.policy import CommitConfig
from server.core.rules import RulesConfig
from server.core.speakers import SpeakerConfig
from server.protocol.formats import FINALS, TASKS

# An utterance's window in "utterance" finals: long enough for most utterances to be decoded
# whole, as offline decoding hears them (Whisper's 30 s context). Past half of it, words
# commit one by one as in "words" finals, so a long utterance still gets finals.
UTTERANCE_WINDOW_S = 30.0

_Config = TypeVar("_Config")


VAD_DETECTORS = ("webrtcvad", "silero")


@dataclass(frozen=True)
class VadConfig:
    """Voice activity detection on 16 kHz audio: webrtcvad, or Silero VAD."""

    # "webrtcvad" (a few microseconds a frame) or "silero" (Silero VAD v5 on onnxruntime, from
    # the pipecat-ai wheel: about 0.25 ms of CPU a 32 ms frame, and it calls no noise speech;
    # bench/README.md, "Silero VAD against webrtcvad"). aggressiveness and frame_ms are
    # webrtcvad's; Silero's frames are 32 ms.
    detector: str = "webrtcvad"
    aggressiveness: int = 2  # webrtcvad mode 0 (least) .. 3 (most eager to call audio non-speech)
    frame_ms: int = 30  # webrtcvad accepts only 10, 20 or 30 ms frames
    speech_start_ms: int = 90  # voiced audio needed within the start window to open speech
    speech_start_window_ms: int = 150  # hysteresis window for the start decision
    speech_end_silence_ms: int = 500  # unvoiced audio that ends speech
    # Speech shorter than this (onset to last voiced frame) needs the longer silence below to
    # end: a word or two said alone and then a breath ("Well, | the best on't is ...") decoded
    # as an utterance of its own has no context to be heard right in (tiny.en: "war."). The
    # longer of the two silences applies (an API's endpointing may lengthen the first).
    short_speech_s: float = 2.5
    short_speech_end_silence_ms: int = 1000
    speech_pad_ms: int = 200  # audio kept before the onset so word starts are not clipped

    def __post_init__(self) -> None:
        if self.detector not in VAD_DETECTORS:
            raise ValueError(
                f"detector must be one of {', '.join(VAD_DETECTORS)}; got {self.detector!r}"
            )
        if self.aggressiveness not in (0, 1, 2, 3):
            raise ValueError(f"aggressiveness must be 0, 1, 2 or 3; got {self.aggressiveness}")
        if self.frame_ms not in (10, 20, 30):
            raise ValueError(f"frame_ms must be 10, 20 or 30; got {self.frame_ms}")
        if not 0 < self.speech_start_ms <= self.speech_start_window_ms:
            raise ValueError("need 0 < speech_start_ms <= speech_start_window_ms")
        if self.speech_end_silence_ms < self.frame_ms:
            raise ValueError("speech_end_silence_ms must be at least one frame")
        if self.speech_pad_ms < 0:
            raise ValueError("speech_pad_ms must be >= 0")
        if self.short_speech_s < 0:
            raise ValueError("short_speech_s must be >= 0")
        if self.short_speech_end_silence_ms < 0:
            raise ValueError("short_speech_end_silence_ms must be >= 0")


@dataclass(frozen=True)
class LanguageConfig:
    """When a session that detects its language decides it (server/core/language.py).

    Measured with base on the shared clips (7 languages and 24 English recordings), the
    detector on the first N seconds of speech against its answer on the whole clip: every
    wrong guess from 2 s on had a probability of 0.74 or less; the right one reached 0.9
    within 2-4 s (Italian at 2.5 s, German and Spanish LibriVox and Korean at 4 s)."""

    decide_speech_s: float = 2.0  # a detection on a shorter window never decides
    confident_probability: float = 0.9  # what a detection needs to decide (or switch)
    # An utterance still unsure after this much speech takes the session's language, or the best
    # guess; its words cannot wait for finals forever (nor past a window cap: a cut decides).
    decide_max_speech_s: float = 8.0

    def __post_init__(self) -> None:
        if not 0 < self.decide_speech_s <= self.decide_max_speech_s:
            raise ValueError("need 0 < decide_speech_s <= decide_max_speech_s")
        if not 0 < self.confident_probability <= 1:
            raise ValueError("confident_probability must be in (0, 1]")


@dataclass(frozen=True)
class StreamingConfig:
    """How a session turns speech into decode windows and commits words."""

    language: str | None = "en"  # None: detect (multilingual models only)
    task: str = "transcribe"
    min_new_audio_ms: int = 300  # re-decode once this much new speech arrived
    first_decode_ms: int = 200  # decode cadence of an utterance until it shows its first word
    max_window_s: float = 15.0  # cut the window at a committed boundary beyond this
    # The cap instead while streams outnumber decode lanes, so that each stream's decodes stay
    # short: shorter windows cost long recordings a little accuracy and bring their finals
    # sooner, and leave short clips as they were.
    crowded_max_window_s: float = 10.0
    sentence_cut_s: float = 2.0  # cut the window after a committed sentence end past this
    # Past this, also cut after a committed comma, colon or semicolon. At max_window_s: clause
    # cuts made earlier lost words whose end the alignment put too late.
    clause_cut_s: float = 15.0
    # Committed words a cut keeps at the head of the new window, heard again as its forced
    # prefix (``server.core.cuts.cut_point``), so that the new window's first words are read
    # with the speech before them; two made the fewest errors at cuts.
    cut_carry_words: int = 2
    prompt_max_tokens: int = 64  # committed text fed back as context, most recent first
    # Beam width of a window's closing decode (end of speech, flush, end), which commits all
    # that is left of it; 1: greedy. Run greedy past the comfortable estimate
    # (``Pipeline.past_comfort``).
    # Greedy by default: on the few tokens of a tail, Whisper's length normalisation favours
    # splitting a word into likelier pieces and adding a word past the end of the audio, so
    # a beam search there made more errors than greedy decoding on hard speech.
    closing_beam_size: int = 1
    # A v1 stream's finals unless it chooses. "utterance": an utterance's words become final
    # together when it ends, from a beam search over the whole utterance, while partials come
    # as fast as ever. "words": each word becomes final once decodes agree on it with
    # ``commit``'s right context (finals about 2 s after the word). Per utterance by default:
    # its finals make clearly fewer errors than word by word, near an offline beam search of
    # the whole recording (bench/README.md, "Finals per utterance").
    finals: str = "utterance"
    # The finals of the voice-agent streams (Deepgram's /v1/listen, OpenAI's Realtime): an
    # agent answers a turn when its final arrives, so they take the fast finals.
    agent_finals: str = "words"
    # Beam width of an utterance's closing decode in "utterance" finals (greedy past the
    # capacity estimate, as every closing decode is).
    utterance_beam_size: int = 5
    # In "utterance" finals, ``CommitConfig.settled_context_s``: past half the window, a word
    # with this much audio after it commits even where the decode before read it otherwise.
    # Without it a long utterance's first final held only the words before the decodes'
    # first difference: one word read two ways early in a long window (an ending dropped)
    # held every word after it for many seconds. With it finals come about a second sooner
    # at the 95th percentile, for about the same errors. Not in "words" finals: there it
    # made more errors.
    utterance_settled_context_s: float = 1.5
    # The same, for a decode that started while more streams were open than the capacity
    # estimate: each stream's decodes come further apart then, and the settled context plus
    # that wait made the long utterances' word-by-word finals the slowest; a shorter one
    # keeps them within 2 s at the same accuracy. Not the default within the estimate: there
    # a shorter one read no better (fewer errors on one set of recordings, more on another).
    utterance_busy_settled_context_s: float = 0.8
    # In "utterance" finals, a stream with a decode lane to spare (fewer streams than lanes)
    # beam-searches its open window in the background once the utterance holds this much
    # audio, and again after each ``utterance_search_step_s`` of new audio. The words that two
    # such searches of one window agree on, with ``commit.settled_context_s`` of audio after
    # them, become the utterance's held words (final with the rest of it at its end) and the
    # window is cut before their last ``utterance_search_context_s``: the closing decode then
    # hears the tail, not the whole utterance, whose beam search takes seconds after a long
    # utterance on a CPU. Fewer errors, and the final sooner after the end of speech
    # (bench/README.md, "Background searches"). 0: off, as for every stream without a spare
    # lane.
    utterance_search_s: float = 6.0
    utterance_search_step_s: float = 2.0
    # The held words' last seconds that the window keeps after the cut, as its forced
    # prefix: the closing decode hears them again, as context for the tail. A few seconds
    # read better than the two words of an ordinary cut, and better than no cut at all.
    utterance_search_context_s: float = 4.0
    # One binary audio frame; larger gets an error and 1009. The server's WebSocket frame
    # limit is derived from it, so this is the only place the limit is set.
    max_frame_bytes: int = 1 << 20
    commit: CommitConfig = field(default_factory=CommitConfig)  # when a word becomes final
    detection: LanguageConfig = field(default_factory=LanguageConfig)  # with language None
    speakers: SpeakerConfig = field(default_factory=SpeakerConfig)  # who is speaking (--speakers)
    rules: RulesConfig = field(default_factory=RulesConfig)  # the streaming rules' own knobs

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if not 0 < self.max_window_s <= 30.0:
            raise ValueError(f"max_window_s must be in (0, 30]; got {self.max_window_s}")
        if not 0 < self.crowded_max_window_s <= 30.0:
            raise ValueError(
                f"crowded_max_window_s must be in (0, 30]; got {self.crowded_max_window_s}"
            )
        if not 0 < self.clause_cut_s <= self.max_window_s:
            raise ValueError("clause_cut_s must be in (0, max_window_s]")
        if not 0 <= self.sentence_cut_s <= self.max_window_s:
            raise ValueError("sentence_cut_s must be in [0, max_window_s]")
        if self.min_new_audio_ms <= 0 or self.first_decode_ms <= 0:
            raise ValueError("min_new_audio_ms and first_decode_ms must be > 0")
        if not 0 <= self.prompt_max_tokens <= 223:
            raise ValueError(
                "prompt_max_tokens must be in [0, 223] (half of Whisper's text context)"
            )
        if not 0 <= self.cut_carry_words <= 8:
            raise ValueError(f"cut_carry_words must be in [0, 8]; got {self.cut_carry_words}")
        if self.max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0")
        if not 1 <= self.closing_beam_size <= 16:
            raise ValueError(f"closing_beam_size must be in [1, 16]; got {self.closing_beam_size}")
        if not 1 <= self.utterance_beam_size <= 16:
            raise ValueError(
                f"utterance_beam_size must be in [1, 16]; got {self.utterance_beam_size}"
            )
        if self.utterance_settled_context_s < 0:
            raise ValueError(
                f"utterance_settled_context_s must be >= 0; got {self.utterance_settled_context_s}"
            )
        if self.utterance_busy_settled_context_s < 0:
            raise ValueError(
                "utterance_busy_settled_context_s must be >= 0; "
                f"got {self.utterance_busy_settled_context_s}"
            )
        if not 0 <= self.utterance_search_s <= UTTERANCE_WINDOW_S:
            raise ValueError(
                f"utterance_search_s must be in [0, {UTTERANCE_WINDOW_S:g}]; "
                f"got {self.utterance_search_s}"
            )
        if self.utterance_search_context_s < 0:
            raise ValueError(
                f"utterance_search_context_s must be >= 0; got {self.utterance_search_context_s}"
            )
        if self.utterance_search_step_s <= 0:
            raise ValueError(
                f"utterance_search_step_s must be > 0; got {self.utterance_search_step_s}"
            )
        for name, value in (("finals", self.finals), ("agent_finals", self.agent_finals)):
            if value not in FINALS:
                raise ValueError(f"{name} must be one of {', '.join(FINALS)}; got {value!r}")

    def with_finals(self, finals: str) -> StreamingConfig:
        """This config as a stream with ``finals`` runs it. "utterance": windows to
        ``UTTERANCE_WINDOW_S`` whatever the load (a window cut at its cap commits words
        unchecked), nothing committed before the utterance holds half of that (the session
        counts ``min_window_s`` from its start), then words with ``utterance_settled_context_s``
        of audio after them without agreement (a word with the punctuation after it), and a
        beam-searched closing decode."""
        if finals != "utterance":
            return dataclasses.replace(self, finals=finals)  # __post_init__ checks the name
        return dataclasses.replace(
            self,
            finals=finals,
            max_window_s=UTTERANCE_WINDOW_S,
            crowded_max_window_s=UTTERANCE_WINDOW_S,
            closing_beam_size=self.utterance_beam_size,
            commit=dataclasses.replace(
                self.commit,
                min_window_s=UTTERANCE_WINDOW_S / 2,
                settled_context_s=self.utterance_settled_context_s,
                marks_wait=True,
            ),
        )


MAX_DECODE_LANES = 64  # each lane holds a copy of the model
# The default share of the hop within which the streams' round leaves the lanes time to
# spare (``PipelineConfig.comfort_utilization``): within it closing decodes asked as beam
# searches are searched and words settle with the full context (``Pipeline.past_comfort``).
# Chosen so that the estimate lands on the streams that ``make bench-capacity`` carries at
# final p95 <= 2 s with beam closings; a larger share gives beam closings to streams whose
# finals then come past 2 s.
COMFORT_UTILIZATION = 0.7
# The default admission budget (``PipelineConfig.admission_utilization``): the admitted
# streams' round may take this many hops on each lane. Past the comfortable estimate the
# cadence stretches every stream's hop and closings are greedy, and finals stay within 2 s
# well past a round of one hop. 1.5 makes the startup estimate land on the streams that
# ``make bench-capacity`` carries; the fit of the clients' calls may say a little more, held
# within the startup ceiling (server.decode.capacity).
ADMISSION_UTILIZATION = 1.5
# The admission budget may pass the hop, up to this: a round of two hops leaves a stream's
# words two hops and a decode behind, past the 2 s of the finals' target.
MAX_ADMISSION_UTILIZATION = 2.0


@dataclass(frozen=True)
class PipelineConfig:
    """The decode stage: how windows from many sessions are batched onto the decode lanes."""

    # Engine calls that run at once: this process's decode thread, and a child process with
    # its own model for each further lane. On a CPU one per core (``server.serve.cli`` sets it so
    # by default); on a GPU one.
    decode_lanes: int = 1
    max_batch_size: int = 8  # windows decoded together in one engine call
    batch_wait_ms: float = 30.0  # how long the stalest window may wait for other streams' ones
    feature_workers: int = 2  # threads computing log-mel (NumPy releases the GIL)
    max_queued_windows: int = 256  # windows waiting for a decode lane; more wait upstream
    capacity_hop_s: float = 1.0  # the longest a stream may wait between two of its decodes
    capacity_utilization: float = 0.8  # share of that hop the decode lanes may plan to be busy
    # How much of that hop (up to twice it) the admitted streams' round may take on each
    # lane: the capacity estimate, and nothing else. The scheduler's cadence (how long a
    # stream gathers audio between decodes under load) keeps ``capacity_utilization``:
    # lowering that to admit fewer streams would also slow every admitted stream's decodes.
    admission_utilization: float = ADMISSION_UTILIZATION
    # The share of the hop within which the lanes have time to spare for beam closings and
    # the full settled context; at most ``admission_utilization``.
    comfort_utilization: float = COMFORT_UTILIZATION
    # The head start in the queue of a decode a listener waits on (an utterance's first words,
    # a closing decode: ``DecodeJob.urgent``) over routine re-decodes: it goes before every
    # routine window queued less than this before it, and after older ones, so a routine
    # window waits at most this much longer than it would have (no stream starves).
    urgent_head_start_ms: float = 500.0
    # Time the startup calibration's engine calls on this process's CPU time where that is
    # less than their wall time: on the CPU backend (``server.serve.cli`` sets it there) a
    # call's work is this process's, and wall time would count the time other processes held
    # the cores as what a stream costs, and bound the estimate by it for the server's life.
    # Off for a GPU, whose work is not CPU time.
    calibrate_on_cpu_time: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.decode_lanes <= MAX_DECODE_LANES:
            raise ValueError(
                f"decode_lanes must be in [1, {MAX_DECODE_LANES}]; got {self.decode_lanes}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1; got {self.max_batch_size}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError(f"batch_wait_ms must be in [0, 1000]; got {self.batch_wait_ms}")
        if self.feature_workers < 1:
            raise ValueError(f"feature_workers must be >= 1; got {self.feature_workers}")
        if self.max_queued_windows < self.max_batch_size:
            raise ValueError("max_queued_windows must be >= max_batch_size")
        if self.capacity_hop_s <= 0:
            raise ValueError(f"capacity_hop_s must be > 0; got {self.capacity_hop_s}")
        if not 0 < self.capacity_utilization <= 1:
            raise ValueError(
                f"capacity_utilization must be in (0, 1]; got {self.capacity_utilization}"
            )
        if not 0 < self.admission_utilization <= MAX_ADMISSION_UTILIZATION:
            raise ValueError(
                f"admission_utilization must be in (0, {MAX_ADMISSION_UTILIZATION:g}]; "
                f"got {self.admission_utilization}"
            )
        if not 0 < self.comfort_utilization <= min(1.0, self.admission_utilization):
            raise ValueError(
                "comfort_utilization must be in (0, 1] and at most admission_utilization; "
                f"got {self.comfort_utilization}"
            )
        if not 0 <= self.urgent_head_start_ms <= 10_000:
            raise ValueError(
                f"urgent_head_start_ms must be in [0, 10000]; got {self.urgent_head_start_ms}"
            )


@dataclass(frozen=True)
class ServerConfig:
    """The network side: where to listen, limits per connection, security, shutdown."""

    host: str = "127.0.0.1"
    port: int = 8765  # 0: any free port (tests)
    max_sessions: int = 32  # concurrent streams; more are refused with close 1013
    # Also refuse a stream beyond what the decode lanes are measured to keep in real time
    # (PipelineConfig.capacity_hop_s); off: only max_sessions limits.
    capacity_limit: bool = True
    # The real-time streams this machine carries, as measured (make bench-capacity's
    # max_streams_p95_final_le_2s): the estimate is pinned there. None: measured at startup
    # and in service, held between a floor and a ceiling from the startup calibration.
    capacity_streams: int | None = None
    # The Retry-After of a stream refused with HTTP 503 (full, draining, loading): a session
    # lasts minutes, so a refused client that asks again this much later finds a seat soon
    # after one frees, without hammering; a balancer retries elsewhere at once regardless.
    retry_after_s: int = 5
    max_session_s: float = 4 * 3600.0  # wall-clock or audio seconds, whichever comes first
    idle_timeout_s: float = 30.0  # no frame from the client for this long ends the session
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    allowed_origins: tuple[str, ...] = ()  # besides the server's own origin; "*" allows any
    tls_cert_path: str | None = None  # PEM certificate chain; with tls_key_path serves wss://
    tls_key_path: str | None = None
    ping_interval_s: float | None = 20.0  # WebSocket keepalive ping; None disables it
    ping_timeout_s: float | None = 20.0  # no pong within this closes the connection (1011)
    open_timeout_s: float = 10.0  # the opening handshake must complete within this
    close_timeout_s: float = 5.0  # wait this long for the peer's close frame, then drop TCP
    write_limit_bytes: int = 64 * 1024  # outgoing bytes buffered per connection before sends wait
    max_pending_messages: int = 512  # server messages queued for one client; more drops it
    max_incoming_frames: int = 16  # frames read ahead per connection before TCP backpressure
    # On SIGTERM, first drain: /readyz says 503 and new streams are refused (a balancer sends
    # them elsewhere) while open sessions go on for up to this long or until all have ended;
    # then the rest are finished (finals, done, 1001). 0: finish them at once, which suits a
    # lone server, whose new sessions have nowhere else to go. deploy/README.md: sizing it.
    drain_s: float = 0.0
    shutdown_timeout_s: float = 30.0  # then, time for open sessions to send finals and done
    warmup: bool = True  # decode once before /readyz turns ready
    # File uploads (POST /v1/audio/transcriptions, /v1/listen): OpenAI's 25 MB limit, and how
    # many are decoded at once (more are refused with 503 and Retry-After).
    max_upload_bytes: int = 25 * 1024 * 1024
    max_file_requests: int = 4
    # An upload's windows at temperature 0 are beam-searched with this many beams (1: greedy),
    # as Whisper's offline transcribe() does; bench/README.md "Uploads" measures both.
    file_beam_size: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1; got {self.max_sessions}")
        if self.capacity_streams is not None and self.capacity_streams < 1:
            raise ValueError(f"capacity_streams must be None or >= 1; got {self.capacity_streams}")
        if not 1 <= self.retry_after_s <= 3600:
            raise ValueError(f"retry_after_s must be in [1, 3600]; got {self.retry_after_s}")
        for name in ("max_session_s", "idle_timeout_s", "open_timeout_s", "close_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0; got {self.shutdown_timeout_s}")
        if not 0 <= self.drain_s <= self.max_session_s:
            raise ValueError(
                f"drain_s must be in [0, max_session_s={self.max_session_s:g}]; got {self.drain_s}"
            )
        for name in ("ping_interval_s", "ping_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None; got {value}")
        if self.write_limit_bytes < 1024 or self.max_pending_messages < 1:
            raise ValueError("write_limit_bytes must be >= 1024 and max_pending_messages >= 1")
        if self.max_incoming_frames < 1:
            raise ValueError(f"max_incoming_frames must be >= 1; got {self.max_incoming_frames}")
        if self.max_upload_bytes < 1024 or self.max_file_requests < 0:
            raise ValueError("max_upload_bytes must be >= 1024 and max_file_requests >= 0")
        if not 1 <= self.file_beam_size <= 16:
            raise ValueError(f"file_beam_size must be 1 to 16; got {self.file_beam_size}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None (no authentication) or a non-empty string")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("tls_cert_path and tls_key_path must be given together")
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                raise ValueError(
                    f"allowed_origins holds scheme://host[:port] or '*'; got {origin!r}"
                )

    @property
    def tls(self) -> bool:
        return self.tls_cert_path is not None


def with_setting(config: _Config, path: str, value: object) -> _Config:
    """``config`` with the field at the dotted ``path`` set to ``value``; a path goes into
    nested configs (``rules.stalled_tail.min_voiced_s``, ``commit.min_window_s``), and a list
    becomes a tuple. Raises ValueError naming the fields there are, or the field's own check."""
    name, _, rest = path.partition(".")
    fields = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    if name not in fields:
        raise ValueError(f"no setting {name!r} here; there are {', '.join(sorted(fields))}")
    current = getattr(config, name)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"{name!r} has no settings inside it")
        value = with_setting(current, rest, value)
    elif isinstance(value, list):
        value = tuple(value)
    return dataclasses.replace(config, **{name: value})  # type: ignore[type-var]


@dataclass(frozen=True)
class WyomingConfig:
    """Home Assistant's Wyoming protocol on a TCP port of its own (server/serve/wyoming.py).

    Wyoming has no authentication (the API key does not apply to it), so it listens on
    loopback unless the operator names another address.
    """

    port: int | None = None  # None: not served; 10300 by convention; 0: any free port (tests)
    host: str = "127.0.0.1"
    # Advertise _wyoming._tcp.local. over mDNS when the zeroconf package is installed and the
    # address is not loopback (Home Assistant then offers the server under Discovered).
    zeroconf: bool = True
    # A connection with no transcription open that sends nothing for this long is closed; a
    # transcription itself is bounded by ServerConfig.idle_timeout_s like any stream.
    idle_connection_s: float = 300.0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be None (off) or in [0, 65535]; got {self.port}")
        if not self.host:
            raise ValueError("host must be an address to listen on, such as 127.0.0.1")
        if self.idle_connection_s <= 0:
            raise ValueError(f"idle_connection_s must be > 0; got {self.idle_connection_s}")

    @property
    def enabled(self) -> bool:
        return self.port is not None
