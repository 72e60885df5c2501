"""``whisperwire-server``: flags -> config dataclasses -> the app.

    whisperwire-server [--host 127.0.0.1] [--port 8765] [--model tiny.en] [--dtype float32]
                       [--quantize-bits 4|8] [--min-context-s 3] [--max-batch-size 8]
                       [--batch-wait-ms 5] [--decode-lanes auto] [--min-right-context-s 0.8]
                       [--closing-beam-size 1] [--finals utterance|words]
                       [--agent-finals words|utterance]
                       [--utterance-search-s 6]
                       [--utterance-beam-size 5] [--utterance-settled-context-s 1.5]
                       [--no-utterance-cut-inside-commit]
                       [--max-sessions 32] [--no-capacity-limit] [--capacity N]
                       [--capacity-hop-s 1] [--capacity-utilization 0.8]
                       [--admission-utilization 1.5] [--comfort-utilization 0.7]
                       [--max-session-s 14400] [--idle-timeout-s 30] [--api-key KEY]
                       [--allowed-origin URL ...]
                       [--tls-cert PEM --tls-key PEM] [--drain-s 0] [--log-level info]
                       [--wyoming-port 10300 [--wyoming-host 127.0.0.1]
                        [--no-wyoming-zeroconf]]
                       [--twilio-auth-token TOKEN] [--twilio-webhook-url URL]

SIGTERM drains for up to ``--drain-s`` (new sessions refused, open ones served), then
finishes the open sessions (finals, ``done``, close 1001); SIGINT finishes them at once; a
second signal drops them.

Exit status: 0 after a clean shutdown (SIGINT or SIGTERM); 2 for bad flags, a model that
cannot be loaded, unreadable TLS files or an address already in use.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import json
import logging
import os
import ssl
import sys
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.apis.twilio_media import TwilioConfig
from server.config import (
    COMFORT_UTILIZATION,
    VAD_DETECTORS,
    PipelineConfig,
    ServerConfig,
    StreamingConfig,
    VadConfig,
    WyomingConfig,
    with_setting,
)
from server.core.policy import CommitConfig
from server.core.rules import RulesConfig
from server.core.speakers import SpeakerConfig
from server.engine.store import DEFAULT_MODEL, available_models
from server.protocol.errors import ModelError
from server.protocol.formats import FINALS

if TYPE_CHECKING:
    from server.engine.engine import Engine, EngineConfig

logger = logging.getLogger("server.serve.cli")

API_KEY_ENV = "WHISPERWIRE_API_KEY"
TWILIO_TOKEN_ENV = "TWILIO_AUTH_TOKEN"  # the name Twilio's own libraries read it from
EXIT_OK = 0
EXIT_USAGE = 2  # argparse's status for bad flags; also a model, TLS file or port we cannot use
LOG_LEVELS = ("debug", "info", "warning", "error")
_LISTEN_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


class _SessionIdDefault(logging.Filter):
    """Records from a session's LoggerAdapter carry ``session_id``; give the others a dash so
    one format string fits every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "session_id"):
            record.session_id = "-"
        return True


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults come from the config dataclasses."""
    s = ServerConfig()
    p = PipelineConfig()
    parser = argparse.ArgumentParser(
        prog="whisperwire-server",
        description="Real-time streaming speech transcription over WebSocket (Whisper on MLX).",
    )
    net = parser.add_argument_group("network")
    net.add_argument("--host", default=s.host, help="address to listen on (default %(default)s)")
    net.add_argument("--port", type=int, default=s.port, help="port (default %(default)s; 0: any)")
    net.add_argument(
        "--tls-cert", metavar="PEM", help="certificate chain; serves wss:// with --tls-key"
    )
    net.add_argument("--tls-key", metavar="PEM", help="private key for --tls-cert")

    wyoming = parser.add_argument_group("Home Assistant (Wyoming protocol; docs/home-assistant.md)")
    wyoming.add_argument(
        "--wyoming-port",
        type=int,
        metavar="PORT",
        help="also serve speech-to-text over the Wyoming protocol on this TCP port "
        "(10300 by convention; default: not served)",
    )
    wyoming.add_argument(
        "--wyoming-host",
        default=WyomingConfig().host,
        help="address for --wyoming-port (default %(default)s: this machine only; Wyoming has "
        "no authentication, so name another address only on a network you trust)",
    )
    wyoming.add_argument(
        "--wyoming-zeroconf",
        action=argparse.BooleanOptionalAction,
        default=WyomingConfig().zeroconf,
        help="advertise the Wyoming port over mDNS for Home Assistant's discovery, when the "
        "zeroconf package is installed and --wyoming-host is not loopback (default: %(default)s)",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry name ({', '.join(available_models())}), a Hugging Face repo owner/name "
        "(MLX or CTranslate2 layout; HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE apply) or a model "
        "folder (default %(default)s)",
    )
    model.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="weights' dtype (default: float16 on a GPU, float32 on CPU)",
    )
    model.add_argument("--quantize-bits", type=int, choices=(4, 8), help="quantize linear layers")
    model.add_argument(
        "--min-context-s",
        type=float,
        help="shortest audio context encoded, seconds (default 3; see bench/README.md)",
    )

    batching = parser.add_argument_group("batching")
    batching.add_argument(
        "--max-batch-size",
        type=int,
        default=p.max_batch_size,
        help="windows decoded together (default %(default)s)",
    )
    batching.add_argument(
        "--decode-lanes",
        type=_lanes,
        default=None,
        metavar="N|auto",
        help="engine calls run side by side: this process and N-1 child processes, each "
        "with its own copy of the model (default auto: one per core on a CPU, one on a GPU)",
    )
    batching.add_argument(
        "--batch-wait-ms",
        type=float,
        default=p.batch_wait_ms,
        help="how long a ready window waits for others to batch with (default %(default)s)",
    )

    streaming = parser.add_argument_group("streaming")
    streaming.add_argument(
        "--min-right-context-s",
        type=float,
        default=CommitConfig().min_right_context_s,
        help="audio after a word before it can become final: less is faster, more is surer "
        "(default %(default)s; bench-accuracy's table in bench/README.md)",
    )
    streaming.add_argument(
        "--closing-beam-size",
        type=int,
        default=StreamingConfig().closing_beam_size,
        help="with 'words' finals, the beam width of the decode that commits the rest of an "
        "utterance when it ends; 1: greedy ('utterance' finals search 5 beams; either runs "
        "greedy while more streams are open than the capacity estimate) (default %(default)s)",
    )
    streaming.add_argument(
        "--finals",
        choices=FINALS,
        default=StreamingConfig().finals,
        help="when a v1 stream's words become final unless it chooses: 'utterance' an "
        "utterance's together when it ends, from a beam search over it (offline beam-5 "
        "accuracy), 'words' one by one as decodes agree (about 2 s after each, less accurate) "
        "(default %(default)s)",
    )
    streaming.add_argument(
        "--agent-finals",
        choices=FINALS,
        default=StreamingConfig().agent_finals,
        help="the same for the voice-agent streams (Deepgram's /v1/listen, OpenAI's Realtime), "
        "whose turns end when their finals arrive (default %(default)s)",
    )
    streaming.add_argument(
        "--utterance-search-s",
        type=float,
        default=StreamingConfig().utterance_search_s,
        help="with 'utterance' finals and a decode lane to spare, beam-search an utterance in "
        "the background once it is this long: the words two such searches agree on are held "
        "for its final, and its closing decode hears the rest; 0: off (default %(default)s)",
    )
    streaming.add_argument(
        "--utterance-beam-size",
        type=int,
        default=StreamingConfig().utterance_beam_size,
        help="with 'utterance' finals, the beam width of an utterance's closing decode; greedy "
        "anyway while more streams are open than the capacity estimate; 1: always greedy, "
        "the turn's final sooner under load and less accurate (default %(default)s)",
    )
    streaming.add_argument(
        "--utterance-settled-context-s",
        type=float,
        default=StreamingConfig().utterance_settled_context_s,
        help="with 'utterance' finals, past half the window a word with this much audio after "
        "it becomes final even where two decodes read it differently; 0: only words two "
        "decodes agree on (default %(default)s)",
    )
    streaming.add_argument(
        "--utterance-cut-inside-commit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with 'utterance' finals, cut a long utterance's window after the last sentence "
        "end its finals hold (default: %(default)s)",
    )
    streaming.add_argument(
        "--speculative-closing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start an utterance's closing decode in the pause, before the endpoint "
        "(default: %(default)s)",
    )
    streaming.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="any streaming setting by its dotted name, the value as JSON, e.g. "
        "rules.stalled_tail.min_voiced_s=2.5, rules.disabled='[\"sentence_cut\"]', "
        "commit.min_window_s=3 (docs/internals.md lists the rules; repeatable)",
    )
    streaming.add_argument(
        "--vad",
        choices=VAD_DETECTORS,
        default=VadConfig().detector,
        help="the voice activity detector that finds each stream's utterances: webrtcvad (a "
        "few microseconds a frame) or silero (Silero VAD on onnxruntime, about 1%% of a core a "
        "stream; it calls no noise speech, where webrtcvad calls loud noise speech) "
        "(default %(default)s)",
    )
    streaming.add_argument(
        "--speakers",
        action="store_true",
        help="label who is speaking on finals and words (resemblyzer's speaker encoder, no "
        "PyTorch); every v1 stream gets labels unless its config says speakers: false, "
        "Deepgram streams with diarize=true",
    )

    limits = parser.add_argument_group("limits and security")
    limits.add_argument(
        "--max-sessions",
        type=int,
        default=s.max_sessions,
        help="concurrent streams; more are refused with HTTP 503 and Retry-After "
        "(default %(default)s)",
    )
    limits.add_argument(
        "--capacity-limit",
        action=argparse.BooleanOptionalAction,
        default=s.capacity_limit,
        help="also refuse (HTTP 503) streams beyond what the decode lanes are measured to "
        "keep in real time, up to --max-sessions (default on)",
    )
    limits.add_argument(
        "--capacity",
        type=int,
        default=s.capacity_streams,
        metavar="N",
        help="the real-time streams this machine carries, as make bench-capacity measured "
        "them (max_streams_p95_final_le_2s): admit exactly that many (default: estimated, "
        "between a floor and a ceiling from a calibration at startup)",
    )
    limits.add_argument(
        "--max-upload-mb",
        type=float,
        default=s.max_upload_bytes / 2**20,
        help="largest file POSTed to /v1/audio/transcriptions or /v1/listen, in MiB; larger "
        "ones get 413 (default %(default)s)",
    )
    limits.add_argument(
        "--max-file-requests",
        type=int,
        default=s.max_file_requests,
        help="uploads transcribed at once; more get 503 and Retry-After (default %(default)s)",
    )
    limits.add_argument(
        "--file-beam-size",
        type=int,
        default=s.file_beam_size,
        help="beams for an upload's windows (1: greedy, about 2.5x faster; default "
        "%(default)s, Whisper's offline default)",
    )
    limits.add_argument(
        "--capacity-hop-s",
        type=float,
        default=p.capacity_hop_s,
        help="for the capacity estimate: the longest a stream may wait between two decodes "
        "(default %(default)s)",
    )
    limits.add_argument(
        "--capacity-utilization",
        type=float,
        default=p.capacity_utilization,
        help="for the decode cadence: the share of that wait a decode lane may plan to be "
        "busy; under load each stream gathers more audio between decodes to stay within it "
        "(default %(default)s)",
    )
    limits.add_argument(
        "--admission-utilization",
        type=float,
        default=p.admission_utilization,
        help="for the capacity estimate: how much of that wait (up to twice it) a decode "
        "lane's round of the admitted streams may take; lower admits fewer streams without "
        "slowing the decodes of those admitted (default %(default)s)",
    )
    limits.add_argument(
        "--comfort-utilization",
        type=float,
        default=None,
        help="the share of that wait a decode lane's round of the streams may fill while "
        "closing decodes can still be beam searches; past it they run greedy (default "
        f"{COMFORT_UTILIZATION}, or --admission-utilization where that is lower)",
    )
    limits.add_argument(
        "--max-session-s",
        type=float,
        default=s.max_session_s,
        help="longest session, wall-clock or audio seconds (default %(default)s)",
    )
    limits.add_argument(
        "--idle-timeout-s",
        type=float,
        default=s.idle_timeout_s,
        help="finish a session that sends nothing for this long (default %(default)s)",
    )
    limits.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require this key (Bearer header or ?token=); default ${API_KEY_ENV}",
    )
    limits.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="URL",
        help="a browser Origin allowed besides the server's own page (repeatable; '*': any)",
    )
    twilio = parser.add_argument_group("Twilio Media Streams (docs/telephony.md)")
    twilio.add_argument(
        "--twilio-auth-token",
        default=os.environ.get(TWILIO_TOKEN_ENV) or None,
        metavar="TOKEN",
        help="take /twilio/media streams only when signed with this account's auth token "
        f"(X-Twilio-Signature); default ${TWILIO_TOKEN_ENV}",
    )
    twilio.add_argument(
        "--twilio-webhook-url",
        metavar="URL",
        help="POST each final of every call here as JSON (bounded retries, never blocking)",
    )
    shutdown = parser.add_argument_group("shutdown")
    shutdown.add_argument(
        "--drain-s",
        type=float,
        default=s.drain_s,
        metavar="S",
        help="on SIGTERM, refuse new sessions (/readyz 503) and keep serving the open ones "
        "for up to this long before finishing them; for a server behind a load balancer "
        "(default %(default)s: finish them at once)",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="(default %(default)s)"
    )
    return parser


def _with_pair(streaming: StreamingConfig, pair: str) -> StreamingConfig:
    """``streaming`` with one ``--set FIELD=JSON``. Raises ValueError."""
    path, sep, raw = pair.partition("=")
    if not sep or not path:
        raise ValueError(
            f"--set takes FIELD=JSON, e.g. rules.stalled_tail.min_voiced_s=2.5; got {pair!r}"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--set {path}: the value is not JSON ({exc.msg}): {raw!r}") from None
    return with_setting(streaming, path, value)


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_SessionIdDefault())
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(session_id)s] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # websockets logs every refused handshake at INFO; keep its chatter at WARNING.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, root.level))


def _fail(message: str) -> int:
    sys.stderr.write(f"whisperwire-server: {message}\n")
    sys.stderr.flush()
    return EXIT_USAGE


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Run under uvloop when it is installed (a faster event loop), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def switched_off_rules(args: argparse.Namespace) -> tuple[str, ...]:
    """The rules that flags of their own switch off (any rule: ``--set rules.disabled=``)."""
    flags = (
        ("speculative_closing", args.speculative_closing),
        ("cut_inside_commit", args.utterance_cut_inside_commit),
    )
    return tuple(rule for rule, on in flags if not on)


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    """The decode stage's settings from the parsed flags (ValueError where they are bad).
    Without ``--comfort-utilization``, a lower ``--admission-utilization`` lowers it too."""
    comfort = args.comfort_utilization
    return PipelineConfig(
        decode_lanes=args.decode_lanes or 1,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        capacity_hop_s=args.capacity_hop_s,
        capacity_utilization=args.capacity_utilization,
        admission_utilization=args.admission_utilization,
        comfort_utilization=(
            min(COMFORT_UTILIZATION, args.admission_utilization) if comfort is None else comfort
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT or SIGTERM; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        server = ServerConfig(
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            capacity_limit=args.capacity_limit,
            capacity_streams=args.capacity,
            max_session_s=args.max_session_s,
            idle_timeout_s=args.idle_timeout_s,
            api_key=args.api_key,
            allowed_origins=tuple(args.allowed_origin),
            tls_cert_path=args.tls_cert,
            tls_key_path=args.tls_key,
            drain_s=args.drain_s,
            max_upload_bytes=round(args.max_upload_mb * 2**20),
            max_file_requests=args.max_file_requests,
            file_beam_size=args.file_beam_size,
        )
        streaming = StreamingConfig(
            closing_beam_size=args.closing_beam_size,
            finals=args.finals,
            agent_finals=args.agent_finals,
            utterance_search_s=args.utterance_search_s,
            utterance_beam_size=args.utterance_beam_size,
            utterance_settled_context_s=args.utterance_settled_context_s,
            rules=RulesConfig(disabled=switched_off_rules(args)),
            commit=CommitConfig(min_right_context_s=args.min_right_context_s),
            speakers=SpeakerConfig(enabled=args.speakers),
        )
        for pair in args.set:
            streaming = _with_pair(streaming, pair)
        vad = VadConfig(detector=args.vad)
        pipeline = pipeline_config(args)
        wyoming = WyomingConfig(
            port=args.wyoming_port, host=args.wyoming_host, zeroconf=args.wyoming_zeroconf
        )
        twilio = TwilioConfig(
            auth_token=args.twilio_auth_token, webhook_url=args.twilio_webhook_url
        )
        from server.engine.engine import EngineConfig

        engine_config = EngineConfig(
            model=args.model, dtype=args.dtype, quantize_bits=args.quantize_bits
        )
        if args.min_context_s is not None:
            engine_config = replace(engine_config, min_context_s=args.min_context_s)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not os.access(path, os.R_OK):
            return _fail(f"cannot read {flag} {path}: no such file or no permission")
    _configure_logging(args.log_level)
    if args.speakers:
        from server.speakers.weights import WeightsError, package_weights_path

        try:
            package_weights_path()
        except WeightsError as exc:
            return _fail(f"cannot label speakers: {exc}")
    if vad.detector == "silero":
        from server.turns.onnx import SILERO_VAD_FILE, packaged_model

        try:
            packaged_model(SILERO_VAD_FILE)
        except ModelError as exc:
            return _fail(f"cannot use --vad silero: {exc}")

    # Imported here: the engine pulls in MLX, which --help does not need.
    from server.engine.engine import computes_on_cpu, default_decode_lanes
    from server.serve.app import run_server

    if args.decode_lanes is None:
        pipeline = replace(pipeline, decode_lanes=default_decode_lanes())
    pipeline = replace(pipeline, calibrate_on_cpu_time=computes_on_cpu())
    try:
        _run(
            run_server(
                functools.partial(load_engine, engine_config),
                server=server,
                pipeline=pipeline,
                streaming=streaming,
                vad=vad,
                wyoming=wyoming,
                twilio=twilio,
            )
        )
    except ModelError as exc:
        return _fail(
            f"cannot load model: {exc}. Fix: pass --model with a registry name or a folder "
            "holding an MLX or CTranslate2 Whisper model"
        )
    except ssl.SSLError as exc:
        return _fail(f"cannot use --tls-cert/--tls-key: {exc}")
    except OSError as exc:
        if exc.errno in _LISTEN_ERRNOS:
            where = f"{args.host}:{args.port}"
            if wyoming.enabled:
                where += f" or (Wyoming) {wyoming.host}:{wyoming.port}"
            return _fail(f"cannot listen on {where}: {exc.strerror or exc}")
        raise
    except KeyboardInterrupt:
        # A second Ctrl-C while shutting down: leave without waiting for the sessions.
        return 130
    return EXIT_OK


def load_engine(config: EngineConfig) -> Engine:
    """Load the model for one decode lane; runs on the lane (a thread, or a child process:
    so it is a module-level function, which pickles)."""
    from server.engine.blas import check_blas
    from server.engine.engine import Engine

    check_blas()
    return Engine.load(config)


def _lanes(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        lanes = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto; got {value!r}") from None
    if lanes < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {lanes}")
    return lanes


def run() -> None:
    """The console entry point: ``main``, then a hard exit.

    The decode thread owns MLX, and MLX's per-thread state can abort the interpreter's
    teardown ("terminate called without an active exception", exit status 134 in about half
    of our runs) after the server has already shut down cleanly. Nothing is left to clean up
    by then, so the process leaves with ``main``'s status without running that teardown.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
