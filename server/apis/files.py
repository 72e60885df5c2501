"""The seam for APIs that take a whole recording in one HTTP request and answer with its text
(OpenAI's ``/v1/audio/transcriptions``, Deepgram's pre-recorded ``/v1/listen``).

Each API parses its own request into a ``FileJob`` and renders the ``Transcript`` (and its
errors) in its own shape; ``server.serve.rest`` does the I/O: it checks access, decodes the
audio, runs the long-form loop on the decode lanes after the live streams
(``server.decode.file_transcription``) and writes the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from websockets.datastructures import Headers

from server.core.engine_api import DecodeOptions
from server.core.long_form import Segment, Transcript
from server.core.speakers import SpeakerLabel


class FileRequestError(Exception):
    """A request the API refuses; rendered in the API's error shape with ``status``."""

    def __init__(
        self, message: str, *, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class ModelFacts:
    """What a request is checked against: the server's model."""

    name: str
    multilingual: bool
    language_name: Callable[[str], str | None]  # Whisper's name of a code; None: no such code
    speakers: bool = False  # whether the server labels speakers (--speakers)


@dataclass(frozen=True)
class FileJob:
    """One recording to transcribe, as its API asked for it."""

    media: bytes  # a file in any container PyAV reads, or raw audio (``pcm_rate_hz``)
    options: DecodeOptions
    temperatures: tuple[float, ...]
    prompt: str = ""  # text the decoding is conditioned on (vocabulary, earlier text)
    stream: bool = False  # answer with server-sent events as the windows are decoded
    pcm_rate_hz: int | None = None  # raw mono audio at this rate, in ``pcm_encoding``
    pcm_encoding: str = "pcm_s16le"  # an ``AudioFormat.encoding``: s16le, or G.711
    response_format: str = "json"
    words: bool = False  # word times in the answer
    speakers: bool = False  # each word's speaker (``Finished.speakers``)


@dataclass(frozen=True)
class Rendered:
    """An answer's body."""

    content_type: str
    body: bytes


@dataclass(frozen=True)
class Finished:
    """A transcript and what the answer reports about it."""

    transcript: Transcript
    duration_s: float
    request_id: str
    model: ModelFacts
    # With ``FileJob.speakers``: one label per word of ``transcript.words``, in order.
    speakers: tuple[SpeakerLabel | None, ...] = ()


class FileApi(Protocol):
    """One API's request parsing and answer rendering."""

    def parse(self, target: str, headers: Headers, body: bytes, model: ModelFacts) -> FileJob:
        """The job of a request. Raises ``FileRequestError``."""
        ...

    def render(self, job: FileJob, done: Finished) -> Rendered:
        """The answer to a job that finished."""
        ...

    def render_error(self, status: HTTPStatus, message: str, param: str | None) -> Rendered:
        """The API's error body."""
        ...

    def render_delta(self, segments: list[Segment]) -> bytes:
        """A streamed job's event for the text a window added (server-sent events)."""
        ...

    def render_done(self, job: FileJob, done: Finished) -> bytes:
        """A streamed job's last event."""
        ...


@dataclass(frozen=True)
class FileRoute:
    """One file API as the server serves it: its registry entry (``server.apis.registry``)."""

    path: str
    auth_schemes: tuple[str, ...]  # Authorization schemes that carry the API key
    api: FileApi
