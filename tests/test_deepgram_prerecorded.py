"""Deepgram pre-recorded ``POST /v1/listen`` (server/apis/deepgram_prerecorded.py) with
``diarize=true``: the ``deepgram-sdk`` package's own ``transcribe_file`` against a real server
with the real model and the real speaker encoder, on two shared readers
(``tests.helpers.two_readers``). The API's other options are tested through LiveKit's
plugin in tests/test_deepgram_live.py."""

from __future__ import annotations

import asyncio
import io
import wave
from pathlib import Path

import numpy as np
import pytest
from deepgram import AsyncDeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment

from server.config import ServerConfig
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine, two_readers

WAIT_S = 180.0  # a bound for the real model on a busy 2-core machine


def environment(ws_base: str) -> DeepgramClientEnvironment:
    """The SDK's endpoints, all on our server (as in tests/test_deepgram_live.py)."""
    http = "http" + ws_base.removeprefix("ws")
    return DeepgramClientEnvironment(base=http, production=ws_base, agent=ws_base, agent_rest=http)


def wav_bytes(audio: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE_HZ)
        out.writeframes(pcm_s16le_bytes(audio))
    return buffer.getvalue()


@pytest.mark.asyncio(loop_scope="session")  # the speakers_server_url fixture's loop
async def test_diarize_gives_words_and_utterances_their_readers_speaker(
    speakers_server_url: str, speech_dir: Path
) -> None:
    """Every word has ``speaker`` (the first reader's 0, the second's 1) and
    ``speaker_confidence``; each utterance is one speaker's, and says which."""
    talk = two_readers(speech_dir)
    client = AsyncDeepgramClient(api_key="unused", environment=environment(speakers_server_url))
    answer = await asyncio.wait_for(
        client.listen.v1.media.transcribe_file(
            request=wav_bytes(talk.audio), diarize=True, utterances=True, punctuate=True
        ),
        WAIT_S,
    )
    words = answer.results.channels[0].alternatives[0].words
    assert len(words) > 20
    for w in words:
        assert w.speaker == (0 if w.end <= talk.boundary_s else 1), (w, talk.boundary_s)
        assert w.speaker_confidence is not None and 0 <= w.speaker_confidence <= 1
    utterances = answer.results.utterances or []
    assert utterances and {u.speaker for u in utterances} == {0, 1}
    for u in utterances:
        assert u.words and {w.speaker for w in u.words} == {u.speaker}, u
    plain = await asyncio.wait_for(
        client.listen.v1.media.transcribe_file(request=wav_bytes(talk.audio[: 5 * SAMPLE_RATE_HZ])),
        WAIT_S,
    )
    assert all(w.speaker is None for w in plain.results.channels[0].alternatives[0].words)


async def test_diarize_is_refused_with_400_by_a_server_without_speakers() -> None:
    config = ServerConfig(host="127.0.0.1", port=0)
    engine = ScriptedEngine()
    async with WhisperwireServer(lambda: engine, server=config) as server:
        await server.wait_ready()
        client = AsyncDeepgramClient(api_key="unused", environment=environment(server.url))
        audio = np.zeros(SAMPLE_RATE_HZ, np.float32)
        with pytest.raises(ApiError) as refused:
            await client.listen.v1.media.transcribe_file(request=wav_bytes(audio), diarize=True)
    assert refused.value.status_code == 400
    assert "--speakers" in str(refused.value.body)
