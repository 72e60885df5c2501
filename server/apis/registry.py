"""The APIs this server speaks, one entry each: adding an API is a module and a line.

Streaming APIs (WebSocket): ``routes.py`` checks each one's handshake (API key schemes, its
own query) and ``app.py`` gives each connection on its path a new adapter of its kind. File
APIs (a recording POSTed whole): ``rest.py`` checks, transcribes and answers in each one's
shape. Call routes (telephony): ``routes.py`` checks their handshakes and ``app.py`` serves
each connection with the route's own connection class.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.apis import (
    deepgram_flux,
    deepgram_live,
    deepgram_prerecorded,
    openai_realtime,
    openai_transcriptions,
    twilio_media,
    v1_stream,
)
from server.apis.adapters import StreamApi
from server.apis.files import FileRoute
from server.apis.twilio_media import CallRoute

STREAM_APIS: Mapping[str, StreamApi] = {
    api.path: api
    for api in (v1_stream.API, openai_realtime.API, deepgram_live.API, deepgram_flux.API)
}

# Telephony (WebSocket): connections with their own handler, a session per call track
# (Twilio Media Streams) or none (the call's event subscribers).
CALL_ROUTES: Mapping[str, CallRoute] = {
    route.path: route for route in (twilio_media.MEDIA, twilio_media.EVENTS)
}

FILE_ROUTES: Mapping[str, FileRoute] = {
    route.path: route
    for route in (
        openai_transcriptions.TRANSCRIPTIONS,
        openai_transcriptions.TRANSLATIONS,
        deepgram_prerecorded.PRERECORDED,
    )
}
