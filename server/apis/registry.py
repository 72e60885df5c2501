"""The streaming APIs this server speaks, one entry each: adding an API is a module and a line.

``routes.py`` checks each one's handshake (API key schemes, its own query) and ``app.py``
gives each connection on its path a new adapter of its kind.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.apis import deepgram_live, openai_realtime, v1_stream
from server.apis.adapters import StreamApi

STREAM_APIS: Mapping[str, StreamApi] = {
    api.path: api for api in (v1_stream.API, openai_realtime.API, deepgram_live.API)
}
