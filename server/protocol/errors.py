"""The exceptions Whisperwire raises, in one hierarchy.

    WhisperwireError
    ├── ModelError                 a model cannot be found, converted or loaded
    │   ├── ModelNotFoundError
    │   └── ModelFormatError       unknown or corrupt layout
    ├── StreamError                a client's stream broke a rule; carries a wire code
    │   ├── AudioFormatError       bad PCM (odd byte count, NaN/inf, bad encoding or rate)
    │   ├── FrameTooLargeError     a binary frame over the configured maximum
    │   ├── ProtocolError          malformed JSON, unknown type, a message out of order
    │   ├── SessionLimitError      too many sessions or too long a session
    │   └── AuthError              missing or wrong token, disallowed Origin
    └── DecodeError                the engine failed on a request

A ``StreamError`` says what the client is told: ``code`` goes into the ``error`` message and
``close_code`` is the WebSocket close code when the stream cannot go on (``None`` when the
session continues after the error).
"""

from __future__ import annotations


class WhisperwireError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelError(WhisperwireError):
    """A model could not be found, converted or loaded."""


class ModelNotFoundError(ModelError):
    """No model at the name or path given; the message lists what was tried."""


class ModelFormatError(ModelError):
    """A model folder whose layout, names or shapes we do not understand."""


class StreamError(WhisperwireError):
    """A client's stream broke a rule. The message is safe to show to that client."""

    code: str = "stream_error"
    close_code: int | None = None

    def __init__(self, message: str, *, close_code: int | None = None) -> None:
        super().__init__(message)
        if close_code is not None:
            self.close_code = close_code


class AudioFormatError(StreamError):
    """Audio that cannot be decoded as the announced PCM format.

    Fatal by default: after a frame of the wrong shape the byte stream may be misaligned.
    1003 is "unsupported data".
    """

    code = "bad_audio"
    close_code: int | None = 1003


class FrameTooLargeError(StreamError):
    """A binary frame over the configured maximum (1009 "message too big")."""

    code = "frame_too_large"
    close_code: int | None = 1009


class ProtocolError(StreamError):
    """A text message that is not valid for the protocol. Not fatal unless said so."""

    code = "protocol_error"


class SessionLimitError(StreamError):
    """The server is full or the session ran too long (1013 "try again later")."""

    code = "limit"
    close_code: int | None = 1013


class AuthError(StreamError):
    """Missing or wrong credentials, or an Origin that is not allowed (1008 "policy")."""

    code = "unauthorized"
    close_code: int | None = 1008


class DecodeError(WhisperwireError):
    """The engine failed while decoding a request."""
