"""The wire schema: round trips, every refusal, and a fuzz test of the client-side parser."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.protocol.errors import ProtocolError
from server.protocol.messages import (
    AUTO_LANGUAGE,
    MAX_TEXT_MESSAGE_BYTES,
    ConfigMessage,
    DoneMessage,
    EndMessage,
    ErrorMessage,
    FinalMessage,
    FlushMessage,
    PartialMessage,
    ReadyMessage,
    ServerMessage,
    SpeechEndedMessage,
    SpeechStartedMessage,
    TurnMessage,
    WordInfo,
    parse_client_message,
    parse_server_message,
)

SERVER_MESSAGES: list[ServerMessage] = [
    ReadyMessage("s-1", "tiny.en", 16000, "pcm_s16le", "en", "transcribe"),
    ReadyMessage("s-2", "base", 48000, "pcm_f32le", None, "translate", 0.0),
    ReadyMessage("s-3", "tiny.en", 16000, "pcm_s16le", "en", "transcribe", speakers=True),
    SpeechStartedMessage(start=0.51, audio_received_s=0.6),
    SpeechEndedMessage(end=3.2, audio_received_s=3.9),
    PartialMessage(segment_id=0, text=" hello wor", start=0.51, end=1.2, audio_received_s=1.3),
    FinalMessage(
        segment_id=0,
        text=" Hello world.",
        start=0.51,
        end=1.7,
        words=(
            WordInfo(" Hello", 0.51, 0.9, 0.98),
            WordInfo(" world.", 0.9, 1.7, 0.875),
        ),
        audio_received_s=2.5,
    ),
    FinalMessage(0, "", 0.0, 0.0, (), 0.0),
    FinalMessage(7, ' Grüße, 世界 "quoted"', 1.0, 2.0, (), 2.0),
    ErrorMessage("protocol_error", "invalid JSON", fatal=False, audio_received_s=1.0),
    ErrorMessage("bad_audio", "odd byte count", fatal=True, audio_received_s=1.0),
    DoneMessage(segments=3, audio_received_s=10.435, speech_s=9.2, session_s=10.9),
    PartialMessage(1, " so", 0.5, 0.9, 1.3, lag_s=0.412),
    FinalMessage(2, " so", 0.5, 0.9, (), 1.3, lag_s=12.25),
    DoneMessage(3, 10.435, 9.2, 10.9, non_speech_s=1.235, transcribed_s=8.7, failed_s=0.5),
    PartialMessage(4, " und", 7.1, 7.6, 7.9, 0.3, "de", None, language_provisional=True),
    PartialMessage(4, " und so", 7.1, 7.9, 8.2, 0.3, "de", 0.934),
    FinalMessage(5, " Der Raum", 7.1, 8.0, (), 8.5, 0.2, "de", 0.998),
    TurnMessage("start", 0, 0.51, 0.51, "", (), 0.0, 0.6),
    TurnMessage(
        "end",
        2,
        0.51,
        1.7,
        "Hello world.",
        (WordInfo("Hello", 0.51, 0.9, 0.98),),
        0.87,
        2.5,
        "model",
    ),
]


@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_server_message_round_trip(message: ServerMessage) -> None:
    assert parse_server_message(message.to_json()) == message


@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_server_message_carries_audio_received(message: ServerMessage) -> None:
    obj = json.loads(message.to_json())
    assert isinstance(obj["audio_received_s"], float)
    assert isinstance(obj["type"], str)


def test_ready_json_is_compact_and_names_the_protocol() -> None:
    text = ReadyMessage("abc", "tiny.en", 16000, "pcm_s16le", "en", "transcribe").to_json()
    assert text == (
        '{"type":"ready","session_id":"abc","model":"tiny.en","sample_rate":16000,'
        '"encoding":"pcm_s16le","language":"en","task":"transcribe","protocol":"v1",'
        '"audio_received_s":0.0,"speakers":false,"finals":"words"}'
    )


def test_ready_says_whether_speakers_are_labelled_and_older_servers_did_not() -> None:
    ready = ReadyMessage("a", "m", 16000, "pcm_s16le", "en", "transcribe", speakers=True)
    assert json.loads(ready.to_json())["speakers"] is True
    older = json.loads(ready.to_json())
    del older["speakers"]
    parsed = parse_server_message(json.dumps(older))
    assert isinstance(parsed, ReadyMessage) and parsed.speakers is False


def test_ready_says_when_words_become_final_and_older_servers_finalised_words() -> None:
    ready = ReadyMessage("a", "m", 16000, "pcm_s16le", "en", "transcribe", finals="utterance")
    assert parse_server_message(ready.to_json()) == ready
    older = json.loads(ready.to_json())
    del older["finals"]
    parsed = parse_server_message(json.dumps(older))
    assert isinstance(parsed, ReadyMessage) and parsed.finals == "words"


def test_config_chooses_finals_among_the_known_ones() -> None:
    message = parse_client_message('{"type":"config","finals":"utterance"}')
    assert message == ConfigMessage(finals="utterance")
    with pytest.raises(ProtocolError, match="finals"):
        parse_client_message('{"type":"config","finals":"sentence"}')


def test_floats_are_rounded_to_milliseconds() -> None:
    text = PartialMessage(1, "x", 0.123456, 1.0004999, 2.71828).to_json()
    obj = json.loads(text)
    assert (obj["start"], obj["end"], obj["audio_received_s"]) == (0.123, 1.0, 2.718)


def test_nan_time_is_refused_when_encoding() -> None:
    with pytest.raises(ValueError):
        SpeechStartedMessage(start=float("nan"), audio_received_s=0.0).to_json()


def test_server_parser_ignores_unknown_fields() -> None:
    text = '{"type":"speech_started","start":1.5,"audio_received_s":2,"extra":[1,2]}'
    assert parse_server_message(text) == SpeechStartedMessage(1.5, 2.0)


def test_fields_added_within_v1_are_optional_both_ways() -> None:
    # A server from before lag_s and the done accounting: its messages still parse.
    old_done = '{"type":"done","segments":1,"audio_received_s":2,"speech_s":1,"session_s":3}'
    assert parse_server_message(old_done) == DoneMessage(1, 2.0, 1.0, 3.0)
    old_partial = (
        '{"type":"partial","segment_id":0,"text":"a","start":0,"end":1,"audio_received_s":1}'
    )
    assert parse_server_message(old_partial) == PartialMessage(0, "a", 0.0, 1.0, 1.0, None)
    # Unset, they are left out of the JSON rather than sent as null.
    assert "lag_s" not in json.loads(PartialMessage(0, "a", 0.0, 1.0, 1.0).to_json())
    obj = json.loads(DoneMessage(1, 2.0, 1.5, 3.0, 0.5, 1.0, 0.5).to_json())
    assert (obj["non_speech_s"], obj["transcribed_s"], obj["failed_s"]) == (0.5, 1.0, 0.5)
    with pytest.raises(ProtocolError, match="'lag_s' must be a number"):
        parse_server_message(old_partial[:-1] + ',"lag_s":"1"}')


def test_language_fields_are_sent_only_by_sessions_that_detect() -> None:
    plain = json.loads(FinalMessage(0, " a", 0.0, 1.0, (), 1.0).to_json())
    assert not {"language", "language_probability", "language_provisional"} & set(plain)
    partial = PartialMessage(0, " a", 0.0, 1.0, 1.0, None, "de", 0.9, language_provisional=True)
    obj = json.loads(partial.to_json())
    assert (obj["language"], obj["language_probability"], obj["language_provisional"]) == (
        "de",
        0.9,
        True,
    )
    decided = json.loads(PartialMessage(0, " a", 0.0, 1.0, 1.0, None, "de", 0.9).to_json())
    assert "language_provisional" not in decided
    with pytest.raises(ProtocolError, match="'language_provisional' must be true or false"):
        parse_server_message(
            '{"type":"partial","segment_id":0,"text":"a","start":0,"end":1,'
            '"audio_received_s":1,"language_provisional":1}'
        )


def test_server_parser_refuses_another_protocol_version() -> None:
    obj = json.loads(ReadyMessage("a", "m", 16000, "pcm_s16le", "en", "transcribe").to_json())
    obj["protocol"] = "v2"
    with pytest.raises(ProtocolError, match="protocol 'v2'"):
        parse_server_message(json.dumps(obj))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"type":"partial","segment_id":0,"text":"a","start":0,"end":1}', "audio_received_s"),
        ('{"type":"final","segment_id":0,"text":"a","start":0,"end":1,"words":{},'
         '"audio_received_s":1}', "'words' must be a list"),
        ('{"type":"final","segment_id":0,"text":"a","start":0,"end":1,"words":[{"word":"a"}],'
         '"audio_received_s":1}', r"words\[0\].*missing field 'start'"),
        ('{"type":"error","code":"x","message":"y","fatal":1,"audio_received_s":0}',
         "'fatal' must be true or false"),
        ('{"type":"surprise","audio_received_s":0}', "unknown server message type 'surprise'"),
    ],
)  # fmt: skip
def test_server_parser_errors(text: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_server_message(text)


# --------------------------------------------------------------------------- client messages


@pytest.mark.parametrize(
    "message",
    [
        ConfigMessage(),
        ConfigMessage(16000, "pcm_s16le", "en", "transcribe"),
        ConfigMessage(sample_rate_hz=44100, encoding="pcm_f32le"),
        ConfigMessage(language=AUTO_LANGUAGE, task="translate"),
        ConfigMessage(turns=True, eot_threshold=0.8, eager_eot_threshold=0.5, eot_timeout_ms=3000),
        ConfigMessage(turns=False),
        FlushMessage(),
        EndMessage(),
    ],
    ids=repr,
)
def test_client_message_round_trip(message: ConfigMessage | FlushMessage | EndMessage) -> None:
    assert parse_client_message(message.to_json()) == message


def test_config_fields_are_optional_and_named_as_on_the_wire() -> None:
    text = '{"type":"config","sample_rate":8000,"encoding":"pcm_f32le","language":"de"}'
    assert parse_client_message(text) == ConfigMessage(8000, "pcm_f32le", "de", None)
    assert parse_client_message('{"type":"config"}') == ConfigMessage()


@pytest.mark.parametrize("value", ["null", '"auto"'])
def test_config_language_null_or_auto_asks_for_detection(value: str) -> None:
    message = parse_client_message('{"type":"config","language":' + value + "}")
    assert message == ConfigMessage(language=AUTO_LANGUAGE)


def test_whitespace_and_key_order_do_not_matter() -> None:
    text = ' {\n "task": "translate",\t"type" : "config" } '
    assert parse_client_message(text) == ConfigMessage(task="translate")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "invalid JSON"),
        ("{", "invalid JSON"),
        ("{'type': 'end'}", "invalid JSON"),
        ('{"type":"end"} trailing', "invalid JSON: Extra data"),
        ('{"type":"end","type":"flush"}', "duplicate key 'type'"),
        ('{"type":"config","sample_rate":NaN}', "NaN is not a JSON value"),
        ('{"type":"config","sample_rate":Infinity}', "Infinity is not a JSON value"),
        ('{"type":"config","sample_rate":' + "1" * 5000 + "}", "5000 digits is too long"),
        ('{"type":"end","x":1e999}', "number 1e999 is out of range"),
        ("[]", "must be a JSON object, got an array"),
        ('"end"', "must be a JSON object, got a string"),
        ("null", "must be a JSON object, got null"),
        ("42", "must be a JSON object, got a number"),
        ("{}", "no 'type' field"),
        ('{"sample_rate":16000}', "no 'type' field"),
        ('{"type":null}', "'type' must be a string, got null"),
        ('{"type":["end"]}', "'type' must be a string, got an array"),
        ('{"type":"audio"}', "unknown message type 'audio'; expected one of 'config'"),
        ('{"type":"End"}', "unknown message type 'End'"),
        ('{"type":"end","now":true}', "'end' message has unknown field.*'now'"),
        ('{"type":"flush","x":1}', "'flush' message has unknown field"),
        ('{"type":"config","samplerate":16000}', "unknown field.*'samplerate'"),
        ('{"type":"config","sample_rate":"16000"}', "must be an integer, got a string"),
        ('{"type":"config","sample_rate":16000.0}', "must be an integer, got a number"),
        ('{"type":"config","sample_rate":true}', "'sample_rate' must be an integer, got a boolean"),
        ('{"type":"config","sample_rate":null}', "'sample_rate' must be an integer, got null"),
        ('{"type":"config","sample_rate":7999}', "between 8000 and 48000 Hz; got 7999"),
        ('{"type":"config","sample_rate":96000}', "between 8000 and 48000 Hz; got 96000"),
        ('{"type":"config","encoding":"mp3"}', "'encoding' must be one of pcm_s16le, pcm_f32le"),
        ('{"type":"config","encoding":16}', "'encoding' must be a string, got a number"),
        ('{"type":"config","task":"summarise"}', "'task' must be one of transcribe, translate"),
        ('{"type":"config","task":{}}', "'task' must be a string, got an object"),
        ('{"type":"config","language":"english"}', "language code such as 'en'"),
        ('{"type":"config","language":"EN"}', "language code such as 'en'"),
        ('{"type":"config","language":""}', "language code such as 'en'"),
        ('{"type":"config","language":5}', "'language' must be a string or null, got a number"),
        ('{"type":"config","turns":"yes"}', "'turns' must be true or false, got a string"),
        ('{"type":"config","eot_threshold":"high"}', "'eot_threshold' must be a number"),
        ('{"type":"config","eot_timeout_ms":1500.5}', "'eot_timeout_ms' must be an integer"),
    ],
)  # fmt: skip
def test_client_parser_errors(text: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_client_message(text)


def test_protocol_errors_carry_the_wire_code_and_do_not_close() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_message("nope")
    assert info.value.code == "protocol_error"
    assert info.value.close_code is None


def test_text_over_the_limit_is_refused_before_parsing() -> None:
    padding = " " * (MAX_TEXT_MESSAGE_BYTES - len('{"type":"end"}'))
    assert parse_client_message('{"type":"end"}' + padding) == EndMessage()
    with pytest.raises(ProtocolError, match="over 65536 bytes"):
        parse_client_message('{"type":"end"}' + padding + " ")


def test_limit_counts_utf8_bytes_not_characters() -> None:
    # 3 bytes per character: under the limit in characters, over it in bytes.
    text = '{"type":"end","x":"' + "€" * (MAX_TEXT_MESSAGE_BYTES // 3) + '"}'
    with pytest.raises(ProtocolError, match="over 65536 bytes"):
        parse_client_message(text)


def test_deep_nesting_is_a_protocol_error() -> None:
    depth = MAX_TEXT_MESSAGE_BYTES // 2 - 1
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_client_message("[" * depth + "]" * depth)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_client_message('{"a":' * 10_000 + "1" + "}" * 10_000)


def test_error_messages_do_not_echo_huge_values() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(json.dumps({"type": "x" * 10_000}))
    assert len(str(info.value)) < 200


# --------------------------------------------------------------------------- fuzzing


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=12,
)
_config_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["config", "flush", "end", "partial", ""])},
    optional={
        "sample_rate": _json_values | st.integers(0, 100_000),
        "encoding": _json_values | st.sampled_from(["pcm_s16le", "pcm_f32le"]),
        "language": _json_values | st.sampled_from(["en", "auto", "haw"]),
        "task": _json_values | st.sampled_from(["transcribe", "translate"]),
    },
)


def _parse_or_protocol_error(text: str) -> None:
    try:
        parse_client_message(text)
    except ProtocolError as exc:
        assert str(exc)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_raises_only_protocol_error(text: str) -> None:
    _parse_or_protocol_error(text)


@settings(max_examples=300, deadline=None)
@given(_json_values | _config_like)
def test_arbitrary_json_raises_only_protocol_error(value: object) -> None:
    _parse_or_protocol_error(json.dumps(value))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_server_parser_raises_only_protocol_error(text: str) -> None:
    with contextlib.suppress(ProtocolError):
        parse_server_message(text)
