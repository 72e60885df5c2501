"""``whisperwire``: stream a file, standard input or the microphone to a server, or transcribe
a file in-process.

    whisperwire stream FILE|- [--url URL] [--pace 1.0] [--format live|text|jsonl|srt|vtt]
                              [--token KEY] [--language en] [--task transcribe] [--stats]
                              [--retries 5]
                              [--sample-rate 16000 --encoding pcm_s16le]   (stdin only)
    whisperwire listen [--url URL] [--format ...] [--token KEY] [--language ...] [--stats]
                       [--retries 5]
    whisperwire transcribe FILE [--model tiny.en] [--language en] [--task transcribe]
                                [--format text|srt|vtt] [--beam-size 5] [--no-fallback]
    whisperwire models [pull NAME]     (``client.models``)

On a terminal, ``live`` captions flow: finals fill the line at the terminal's width, the
partial is redrawn after them, and a line ends with its utterance (``client.render``).
``srt`` and ``vtt`` are subtitles made from word times under broadcast rules
(``client.subtitles``); ``jsonl`` is every server message as it came.

A server that shuts down, is full or drops the connection mid-stream is connected to again
with backoff (behind a load balancer: another instance), and the audio goes on from where
it stopped taking it, on one timeline (``client.reconnect``); ``--retries 0`` turns that off.

Exit status: 0 done; 1 no connection or the stream failed; 2 bad usage, an unreadable source
or no microphone; 130 interrupted. The first Ctrl-C while streaming ends the audio early and
still waits for the last finals; a second one aborts.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from client import models
from client.reconnect import RetryPolicy, stream_with_reconnect
from client.render import FORMATS, Renderer, TerminalRenderer, format_stats, make_renderer
from client.sources import (
    DEFAULT_CHUNK_MS,
    AudioSource,
    FileSource,
    MicrophoneSource,
    SourceError,
    StdinSource,
)
from client.stream import DEFAULT_URL, ClientError, StreamResult
from client.subtitles import (
    build_cues,
    speaker_lines,
    srt_document,
    vtt_document,
    words_from_pieces,
)
from server.protocol.errors import ModelError, WhisperwireError
from server.protocol.formats import ENCODINGS, FINALS, SAMPLE_RATE_HZ, TASKS

if TYPE_CHECKING:
    from server.core.engine_api import WordTiming

logger = logging.getLogger("client.cli")

EXIT_OK = 0
EXIT_FAILED = 1  # no connection, or the stream or engine failed
EXIT_USAGE = 2  # bad arguments, unreadable audio, no microphone (argparse uses 2 as well)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
TRANSCRIBE_FORMATS = ("text", "srt", "vtt")


def main(argv: list[str] | None = None) -> int:
    """Run the ``whisperwire`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s"
        if args.verbose
        else "whisperwire: %(message)s",
        stream=sys.stderr,
    )
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    return status


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subcommand per way of getting audio."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log debug detail")

    net = argparse.ArgumentParser(add_help=False)
    net.add_argument(
        "--url",
        default=os.environ.get("WHISPERWIRE_URL", DEFAULT_URL),
        help="server stream endpoint (default: $WHISPERWIRE_URL or %(default)s)",
    )
    net.add_argument(
        "--token",
        default=os.environ.get("WHISPERWIRE_TOKEN"),
        help="API key, sent as 'Authorization: Bearer' (default: $WHISPERWIRE_TOKEN)",
    )
    net.add_argument(
        "--language",
        help="language code such as 'en', or 'auto' to detect (default: the server's)",
    )
    net.add_argument("--task", choices=TASKS, help="default: the server's")
    net.add_argument(
        "--finals",
        choices=FINALS,
        help="'words': each word final about 2 s after it is said; 'utterance': an "
        "utterance's words final together when it ends, from a beam search over all of it "
        "(fewer errors on hard speech, later finals; default: the server's)",
    )
    net.add_argument(
        "--format",
        choices=FORMATS,
        help="output: live captions (default on a terminal), text: one line per utterance "
        "(default otherwise), jsonl (every server message), srt or vtt (subtitles from the "
        "finals' word times)",
    )
    net.add_argument(
        "--stats",
        action="store_true",
        help="at the end, print time to first token, final latency and real-time factor to stderr",
    )
    net.add_argument(
        "--chunk-ms", type=_positive_int, default=DEFAULT_CHUNK_MS, help="default: %(default)s"
    )
    net.add_argument(
        "--retries",
        type=_non_negative_int,
        default=RetryPolicy().max_retries,
        help="connect again this many times in a row when the server goes away, is full "
        "(after the wait its Retry-After asks for) or the connection drops, resuming the "
        "audio; 0: never (default: %(default)s)",
    )

    parser = argparse.ArgumentParser(
        prog="whisperwire",
        description="Live captions from a Whisperwire server, or in-process transcription.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    stream = commands.add_parser(
        "stream",
        parents=[common, net],
        help="stream an audio file, or raw PCM from stdin ('-')",
        description="Stream an audio file (wav, flac, mp3, m4a, ogg, webm) or raw PCM on "
        "standard input ('-') to the server.",
    )
    stream.add_argument("file", metavar="FILE|-", help="audio file, or - for raw PCM on stdin")
    stream.add_argument(
        "--pace",
        type=_non_negative_float,
        default=1.0,
        help="seconds of wall time per second of audio: 1 is real time, 0 as fast as the "
        "server takes it (default: %(default)s)",
    )
    stream.add_argument(
        "--sample-rate",
        type=int,
        help=f"stdin only: the PCM's rate in Hz (default: {SAMPLE_RATE_HZ})",
    )
    stream.add_argument(
        "--encoding", choices=ENCODINGS, help="stdin only: the PCM's encoding (default: pcm_s16le)"
    )
    stream.set_defaults(run=_run_stream_command)

    listen = commands.add_parser(
        "listen",
        parents=[common, net],
        help="stream the microphone (needs: pip install 'whisperwire[mic]')",
        description="Live captions from the default microphone. Ctrl-C stops.",
    )
    listen.add_argument(
        "--sample-rate",
        type=int,
        default=SAMPLE_RATE_HZ,
        help="capture rate in Hz (default: %(default)s)",
    )
    listen.set_defaults(run=_run_listen_command)

    transcribe = commands.add_parser(
        "transcribe",
        parents=[common],
        help="transcribe a file in-process, without a server",
        description="Transcribe an audio file with the engine in this process.",
    )
    transcribe.add_argument("file", metavar="FILE")
    transcribe.add_argument("--model", default="tiny.en", help="default: %(default)s")
    transcribe.add_argument(
        "--language", default="en", help="language code, or 'auto' to detect (default: en)"
    )
    transcribe.add_argument("--task", choices=TASKS, default="transcribe")
    transcribe.add_argument(
        "--format",
        choices=TRANSCRIBE_FORMATS,
        default="text",
        help="the transcript as one line, or srt or vtt subtitles (default: %(default)s)",
    )
    transcribe.add_argument(
        "--beam-size",
        type=int,
        default=5,
        help="beam search width; 1 decodes greedily (default: %(default)s)",
    )
    transcribe.add_argument(
        "--speakers",
        action="store_true",
        help="label who is speaking: [S1] where the speaker changes, one line per turn "
        "(text), a speaker per cue (<v S1> in vtt, [S1] in srt)",
    )
    transcribe.add_argument(
        "--no-fallback",
        action="store_true",
        help="decode each window once, at temperature 0 (default: a window that loops or whose "
        "log-probability is low is decoded again by sampling at rising temperatures)",
    )
    transcribe.set_defaults(run=_run_transcribe_command)
    models.add_parser(commands)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0; got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
    return value


def _fail(message: str) -> None:
    sys.stderr.write(f"whisperwire: {message}\n")
    sys.stderr.flush()


def _prepare_stdout(fmt: str | None) -> None:
    """Subtitles and JSON are written as UTF-8 (WebVTT allows nothing else); captions and
    text in the terminal's encoding, with what it cannot show replaced instead of failing
    (a Latin-1 or ASCII locale)."""
    if not isinstance(sys.stdout, io.TextIOWrapper):
        return
    if fmt in ("srt", "vtt", "jsonl"):
        sys.stdout.reconfigure(encoding="utf-8")
    else:
        sys.stdout.reconfigure(errors="replace")


# --------------------------------------------------------------------------- stream / listen


def _run_stream_command(args: argparse.Namespace) -> int:
    try:
        source: AudioSource
        if args.file == "-":
            if sys.stdin.isatty():
                _fail("error: '-' reads raw PCM from stdin; pipe audio in (e.g. from arecord)")
                return EXIT_USAGE
            source = StdinSource(
                args.sample_rate if args.sample_rate is not None else SAMPLE_RATE_HZ,
                args.encoding if args.encoding is not None else "pcm_s16le",
                args.chunk_ms,
            )
        else:
            if args.sample_rate is not None or args.encoding is not None:
                _fail("error: --sample-rate and --encoding describe raw PCM on stdin ('-') only")
                return EXIT_USAGE
            source = FileSource(args.file, args.chunk_ms)
    except (SourceError, ValueError) as exc:
        _fail(f"error: {exc}")
        return EXIT_USAGE
    return _stream(args, source, pace=args.pace)


def _run_listen_command(args: argparse.Namespace) -> int:
    try:
        source = MicrophoneSource(args.sample_rate, args.chunk_ms)
    except (SourceError, ValueError) as exc:
        _fail(f"error: {exc}")
        return EXIT_USAGE
    sys.stderr.write(f"whisperwire: listening on {source.device_name}; Ctrl-C stops\n")
    return _stream(args, source, pace=0.0)


def _stream(args: argparse.Namespace, source: AudioSource, *, pace: float) -> int:
    _prepare_stdout(args.format)
    renderer = make_renderer(args.format, sys.stdout)
    try:
        try:
            result = asyncio.run(_stream_async(args, source, renderer, pace=pace))
        finally:
            renderer.close()
    except SourceError as exc:  # e.g. the microphone failed to open once streaming started
        _fail(f"error: {exc}")
        return EXIT_USAGE
    except ClientError as exc:
        _fail(f"error: {exc}")
        return EXIT_FAILED
    except BrokenPipeError:
        # The reader went away (`| head`). Point stdout at devnull so the interpreter's final
        # flush does not raise again, as the Python docs on SIGPIPE advise.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    if args.stats:
        sys.stderr.write(format_stats(result.stats))
        sys.stderr.flush()
    return EXIT_OK


async def _stream_async(
    args: argparse.Namespace, source: AudioSource, renderer: Renderer, *, pace: float
) -> StreamResult:
    loop = asyncio.get_running_loop()

    def stop_audio() -> None:
        # First Ctrl-C: end the audio and let the server send its last finals and done.
        # The next one gets Python's default handling (KeyboardInterrupt).
        logger.warning("stopping: waiting for the last finals (Ctrl-C again to abort)")
        source.stop()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, stop_audio)
        if isinstance(renderer, TerminalRenderer) and hasattr(signal, "SIGWINCH"):
            loop.add_signal_handler(signal.SIGWINCH, renderer.resized)
    except (NotImplementedError, RuntimeError):  # Windows event loops, or not the main thread
        logger.debug("no SIGINT handler: Ctrl-C aborts at once")
    try:
        resumed = await stream_with_reconnect(
            args.url,
            source,
            retry=RetryPolicy(max_retries=args.retries),
            pace=pace,
            token=args.token,
            language=args.language,
            task=args.task,
            finals=args.finals,
            on_message=renderer.on_message,
        )
        return resumed.result
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if hasattr(signal, "SIGWINCH"):
            loop.remove_signal_handler(signal.SIGWINCH)


# --------------------------------------------------------------------------- transcribe


def _run_transcribe_command(args: argparse.Namespace) -> int:
    # Imported here: the engine pulls in MLX, which streaming from a server does not need.
    try:
        from server.core.long_form import FALLBACK_TEMPERATURES
        from server.engine.offline import transcribe_file
    except ImportError as exc:
        _fail(f"error: the in-process engine is not available: {exc}")
        return EXIT_FAILED
    language = None if args.language == "auto" else args.language
    subtitles = args.format != "text"
    try:
        transcript = transcribe_file(
            args.file,
            model=args.model,
            language=language,
            task=args.task,
            word_timestamps=subtitles or args.speakers,
            beam_size=args.beam_size,
            temperatures=(0.0,) if args.no_fallback else FALLBACK_TEMPERATURES,
        )
    except (FileNotFoundError, ValueError, ModelError) as exc:
        _fail(f"error: {exc}")
        return EXIT_USAGE
    except (OSError, WhisperwireError) as exc:
        _fail(f"error: {exc}")
        return EXIT_FAILED
    speakers: list[int | None] = [None] * len(transcript.words)
    if args.speakers:
        try:
            speakers = _speakers_of(args.file, transcript.words)
        except (OSError, ValueError, WhisperwireError) as exc:
            _fail(f"error: cannot label speakers: {exc}")
            return EXIT_FAILED
    _prepare_stdout(args.format)
    words = words_from_pieces(
        (w.word, w.start_s, w.end_s, speaker)
        for w, speaker in zip(transcript.words, speakers, strict=True)
    )
    if subtitles:
        cues = build_cues(words)
        sys.stdout.write(srt_document(cues) if args.format == "srt" else vtt_document(cues))
    elif args.speakers:
        sys.stdout.write(speaker_lines(words))
    else:
        sys.stdout.write(transcript.text.strip() + "\n")
    sys.stdout.flush()
    return EXIT_OK


def _speakers_of(path: str, words: Sequence[WordTiming]) -> list[int | None]:
    """Each word's speaker, by the server's speaker tracker over the recording as if it were
    streamed (``server.core.recording_speakers``), in this process."""
    from server.config import VadConfig
    from server.core.speakers import SpeakerConfig
    from server.decode.file_speakers import label_words
    from server.engine.blas import set_numpy_blas_threads
    from server.protocol.audio import read_audio_file
    from server.speakers.encoder import SpeakerEncoder

    set_numpy_blas_threads(1)
    audio = read_audio_file(path)
    labels = label_words(
        audio,
        words,
        SpeakerEncoder.load(),
        vad=VadConfig(),
        config=SpeakerConfig(enabled=True),
    )
    return [None if label is None else label.speaker for label in labels]


if __name__ == "__main__":
    sys.exit(main())
