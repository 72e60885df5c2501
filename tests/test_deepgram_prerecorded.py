"""Deepgram's pre-recorded API, ``POST /v1/listen`` (server/apis/deepgram_prerecorded.py): the
query checks and the answer's shape on their own; then the ``deepgram-sdk`` package's own
``transcribe_file`` and raw HTTP against a real server with the real model and real speech;
and ``diarize=true`` with the real speaker encoder on two shared readers
(``tests.helpers.two_readers``). LiveKit's plugin is in tests/test_deepgram_live.py."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from pathlib import Path

import httpx
import numpy as np
import pytest
from deepgram import AsyncDeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from websockets.datastructures import Headers

from bench.corpus import ManifestRow, load_clip, wav_bytes, wer
from bench.phone_line import PHONE_RATE_HZ, phone_line
from server.apis.deepgram_prerecorded import DeepgramFileApi, ListenJob
from server.apis.files import FileRequestError, Finished, ModelFacts
from server.config import ServerConfig
from server.core.engine_api import TextSpan, WordTiming
from server.core.long_form import Segment, Transcript
from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ
from server.serve.app import WhisperwireServer
from tests.helpers import ScriptedEngine, encode_audio, two_readers

WAIT_S = 180.0  # a bound for the real model on a busy 2-core machine


def environment(ws_base: str) -> DeepgramClientEnvironment:
    """The SDK's endpoints, all on our server (as in tests/test_deepgram_live.py)."""
    http = "http" + ws_base.removeprefix("ws")
    return DeepgramClientEnvironment(base=http, production=ws_base, agent=ws_base, agent_rest=http)


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
        assert w.speaker == (0 if w.start < talk.boundary_s else 1), (w, talk.boundary_s)
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


CLIP = "ljspeech/LJ001-0004.wav"
MAX_WER_CLIP = 0.35
NAMES = {"en": "english", "de": "german"}
ENGLISH_ONLY = ModelFacts("tiny.en", False, NAMES.get)
MULTILINGUAL = ModelFacts("base", True, NAMES.get)
WAV = Headers({"Content-Type": "audio/wav"})
on_session_loop = pytest.mark.asyncio(loop_scope="session")  # the server_url fixture's loop


def parse(query: str, model: ModelFacts = ENGLISH_ONLY, headers: Headers = WAV) -> ListenJob:
    job = DeepgramFileApi().parse(f"/v1/listen?{query}", headers, b"RIFF....", model)
    assert isinstance(job, ListenJob)
    return job


# --------------------------------------------------------------------------- requests


def test_livekits_and_the_sdks_options_are_taken() -> None:
    job = parse(
        "model=nova-3&punctuate=true&smart_format=true&detect_language=false&"
        "profanity_filter=false&numerals=false&mip_opt_out=true&language=en-US&"
        "keywords=Okonjo:2&keyterm=Lagos+State&tag=t&version=latest&extra=k:v&utterances=true"
    )
    assert job.punctuate and job.utterances and not job.detect_language
    assert job.options.language == "en" and job.options.word_timestamps
    assert job.prompt == "Okonjo, Lagos State" and job.extra == (("k", "v"),)
    assert job.pcm_rate_hz is None  # containerised: the file says what it holds


def test_raw_linear16_needs_its_rate() -> None:
    assert parse("encoding=linear16&sample_rate=8000").pcm_rate_hz == 8000
    with pytest.raises(FileRequestError, match="sample_rate"):
        parse("encoding=linear16")
    with pytest.raises(FileRequestError, match="encoding=linear16, mulaw, alaw"):
        parse("encoding=opus&sample_rate=8000")


@pytest.mark.parametrize("name", ["mulaw", "alaw"])
def test_raw_g711_is_taken_with_its_rate(name: str) -> None:
    job = parse(f"encoding={name}&sample_rate=8000")
    assert (job.pcm_encoding, job.pcm_rate_hz) == (name, 8000)
    with pytest.raises(FileRequestError, match=f"sample_rate .* encoding={name}"):
        parse(f"encoding={name}")


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("diarize=true", "started without --speakers"),
        ("summarize=true", "not available"),
        ("redact=pci", "redact"),
        ("channels=2", "channels=1"),
        ("callback=https://x.example/hook", "unsupported option"),
        ("language=de", "English-only"),
        ("punctuate=yes", "true or false"),
        ("extra=novalue", "key:value"),
    ],
)
def test_what_cannot_be_delivered_is_refused(query: str, reason: str) -> None:
    with pytest.raises(FileRequestError, match=reason) as refused:
        parse(query)
    assert refused.value.status == HTTPStatus.BAD_REQUEST


def test_a_url_to_fetch_is_refused() -> None:
    with pytest.raises(FileRequestError, match="does not fetch"):
        parse("", headers=Headers({"Content-Type": "application/json"}))


def test_language_on_a_multilingual_model() -> None:
    assert parse("language=de", MULTILINGUAL).options.language == "de"
    assert parse("detect_language=true", MULTILINGUAL).options.language is None
    assert parse("", MULTILINGUAL).options.language is None
    with pytest.raises(FileRequestError, match="unknown language"):
        parse("language=xx", MULTILINGUAL)


# --------------------------------------------------------------------------- answers


def finished() -> Finished:
    spans = (TextSpan(0.0, 2.0, " Um, hello there.", (1, 2, 3)), TextSpan(2.0, 3.0, " Bye.", (4,)))
    words = (
        WordTiming(" Um,", (1,), 0.0, 0.3, 0.5),
        WordTiming(" hello", (2,), 0.4, 0.8, 0.9),
        WordTiming(" there.", (3,), 0.9, 1.5, 0.8),
        WordTiming(" Bye.", (4,), 2.2, 2.6, 0.7),
    )
    segments = tuple(Segment(s, 0.0, 0.0, -0.2, 1.1, 0.01) for s in spans)
    transcript = Transcript("Um, hello there. Bye.", spans, "en", words, segments)
    return Finished(transcript, 3.0, "rid", ENGLISH_ONLY)


def test_the_answer_has_deepgrams_shape() -> None:
    job = parse("punctuate=true&utterances=true")
    body = json.loads(DeepgramFileApi().render(job, finished()).body)
    meta = body["metadata"]
    assert meta["request_id"] == "rid" and meta["duration"] == 3.0 and meta["channels"] == 1
    assert meta["model_info"][meta["models"][0]]["name"] == "tiny.en"
    alternative = body["results"]["channels"][0]["alternatives"][0]
    # Filler words are left out unless filler_words=true, as on Deepgram.
    assert alternative["transcript"] == "hello there. Bye."
    assert [w["word"] for w in alternative["words"]] == ["hello", "there", "bye"]
    assert [w["punctuated_word"] for w in alternative["words"]] == ["hello", "there.", "Bye."]
    assert alternative["words"][0] == {
        "word": "hello",
        "start": 0.4,
        "end": 0.8,
        "confidence": 0.9,
        "punctuated_word": "hello",
    }
    assert alternative["confidence"] == pytest.approx((0.9 + 0.8 + 0.7) / 3, abs=1e-4)
    utterances = body["results"]["utterances"]
    assert [u["transcript"] for u in utterances] == ["hello there.", "Bye."]
    assert [(u["start"], u["end"]) for u in utterances] == [(0.0, 2.0), (2.0, 3.0)]


def test_without_punctuate_the_words_are_plain() -> None:
    job = parse("filler_words=true")
    alternative = json.loads(DeepgramFileApi().render(job, finished()).body)["results"]["channels"][
        0
    ]["alternatives"][0]
    assert alternative["transcript"] == "um hello there bye"
    assert "punctuated_word" not in alternative["words"][0]


def test_errors_are_in_deepgrams_shape() -> None:
    body = json.loads(
        DeepgramFileApi().render_error(HTTPStatus.BAD_REQUEST, "bad option", None).body
    )
    assert body["err_code"] == "Bad Request" and body["err_msg"] == "bad option"


# --------------------------------------------------------------------------- the real server


def reference(manifest: list[ManifestRow]) -> str:
    return next(row.transcript for row in manifest if row.file == CLIP)


@on_session_loop
async def test_the_deepgram_sdk_transcribes_a_file(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    client = AsyncDeepgramClient(api_key="unused", environment=environment(server_url))
    answer = await client.listen.v1.media.transcribe_file(
        request=(speech_dir / CLIP).read_bytes(),
        model="nova-3",
        smart_format=True,
        utterances=True,
        language="en",
    )
    alternative = answer.results.channels[0].alternatives[0]  # type: ignore[union-attr]
    assert wer(reference(manifest), alternative.transcript or "") <= MAX_WER_CLIP
    words = alternative.words or []
    assert " ".join(w.punctuated_word or "" for w in words) == alternative.transcript
    assert all(0 <= (w.start or 0) <= (w.end or 0) <= answer.metadata.duration + 0.1 for w in words)  # type: ignore[union-attr,operator]
    assert answer.results.utterances  # type: ignore[union-attr]


@on_session_loop
async def test_the_deepgram_sdk_transcribes_a_raw_mulaw_phone_recording(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    """A call recording as raw mu-law at 8 kHz (a telephone channel's audio): the SDK names
    the encoding; its ``transcribe_file`` has no ``sample_rate`` argument, so the rate rides
    in the request options' extra query, as Deepgram's docs tell SDK users to send it."""
    client = AsyncDeepgramClient(api_key="unused", environment=environment(server_url))
    line = phone_line(load_clip(speech_dir / CLIP))
    answer = await client.listen.v1.media.transcribe_file(
        request=line,
        model="nova-3",
        encoding="mulaw",
        punctuate=True,
        request_options={"additional_query_parameters": {"sample_rate": PHONE_RATE_HZ}},
    )
    assert answer.metadata.duration == pytest.approx(len(line) / PHONE_RATE_HZ, abs=0.01)  # type: ignore[union-attr]
    alternative = answer.results.channels[0].alternatives[0]  # type: ignore[union-attr]
    assert wer(reference(manifest), alternative.transcript or "") <= MAX_WER_CLIP, alternative


@on_session_loop
async def test_raw_alaw_is_decoded_and_a_bad_encoding_gets_deepgrams_error(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    base = "http" + server_url.removeprefix("ws") + "/v1/listen"
    line = phone_line(load_clip(speech_dir / CLIP), "alaw")
    headers = {"Content-Type": "application/octet-stream", "Authorization": "Token x"}
    async with httpx.AsyncClient(timeout=120) as http:
        alaw = await http.post(
            base + "?encoding=alaw&sample_rate=8000", content=line, headers=headers
        )
        speex = await http.post(
            base + "?encoding=speex&sample_rate=8000", content=line, headers=headers
        )
    text = alaw.json()["results"]["channels"][0]["alternatives"][0]["transcript"]
    assert wer(reference(manifest), text) <= MAX_WER_CLIP, text
    assert speex.status_code == 400
    assert "encoding=linear16, mulaw, alaw" in speex.json()["err_msg"]


@on_session_loop
async def test_raw_linear16_and_an_ogg_file_give_the_same_words(
    server_url: str, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    speech = load_clip(speech_dir / CLIP)
    base = "http" + server_url.removeprefix("ws") + "/v1/listen"
    async with httpx.AsyncClient(timeout=60) as http:
        raw = await http.post(
            base + "?encoding=linear16&sample_rate=16000",
            content=pcm_s16le_bytes(speech),
            headers={"Content-Type": "application/octet-stream", "Authorization": "Token x"},
        )
        ogg = await http.post(
            base, content=encode_audio(speech, "ogg"), headers={"Content-Type": "audio/ogg"}
        )
        garbage = await http.post(base, content=b"not audio" * 100)
    texts = [
        a.json()["results"]["channels"][0]["alternatives"][0]["transcript"] for a in (raw, ogg)
    ]
    assert all(wer(reference(manifest), t) <= MAX_WER_CLIP for t in texts), texts
    assert garbage.status_code == 400 and "could not be decoded" in garbage.json()["err_msg"]
