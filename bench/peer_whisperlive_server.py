"""Entry point of the WhisperLive peer server, run with ``.venv-peer/bin/python`` (not ``.venv``).

    .venv-peer/bin/python -m bench.peer_whisperlive_server --port 9090 --model-path DIR

What WhisperLive's ``run_server.py`` does (it is not in the wheel): ``OMP_NUM_THREADS`` from the
environment, then ``TranscriptionServer().run(...)`` with the faster-whisper backend and a
custom model folder, here on 127.0.0.1 with the REST API off.

whisper-live imports ``torch`` at module level (server, faster-whisper backend, its own VAD),
but on the faster-whisper path it only asks ``torch.cuda.is_available()`` to choose the
device. PyPI's Linux torch is the CUDA build (gigabytes with its nvidia-* wheels) and none of
it would run here, so the peer venv has no torch and this stands in a module that answers that
one question with the truth for this machine: no CUDA. Anything else asked of it raises
AttributeError, so a code path that really needed torch fails loudly instead of silently.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types


class _NoCuda:
    @staticmethod
    def is_available() -> bool:
        return False


def install_torch_stand_in() -> None:
    if "torch" in sys.modules:
        return
    try:
        import torch  # noqa: F401  (a real torch, if someone installed one, is used as is)
    except ImportError:
        stand_in = types.ModuleType("torch")
        stand_in.cuda = _NoCuda  # type: ignore[attr-defined]
        sys.modules["torch"] = stand_in


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", required=True, help="CTranslate2 Whisper model folder")
    parser.add_argument("--max-clients", type=int, default=4)
    parser.add_argument("--max-connection-time-s", type=int, default=600)
    parser.add_argument("--no-single-model", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    install_torch_stand_in()
    from whisper_live.server import TranscriptionServer

    TranscriptionServer().run(
        "127.0.0.1",
        port=args.port,
        backend="faster_whisper",
        faster_whisper_custom_model_path=args.model_path,
        single_model=not args.no_single_model,
        max_clients=args.max_clients,
        max_connection_time=args.max_connection_time_s,
        enable_rest=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
