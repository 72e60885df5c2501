"""The ONNX files of the turn models and the onnxruntime sessions that run them.

The files come from the ``pipecat-ai`` wheel (BSD-2-Clause), which deploy/install.sh installs
with ``--no-deps`` for its data files alone: Smart Turn v3.2 (8.7 MB) and Silero VAD v5
(2.3 MB). They are located through the import system without importing pipecat, whose
``__init__`` pulls in loguru, aiohttp and the rest of a voice-agent framework.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidProtobuf

from server.protocol.errors import ModelFormatError, ModelNotFoundError

logger = logging.getLogger("server.turns.onnx")

# Where the files sit inside the ``pipecat`` package (pipecat-ai 1.14.0).
SMART_TURN_FILE = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
SILERO_VAD_FILE = "audio/vad/data/silero_vad.onnx"

_INSTALL_HINT = "pip install --no-deps 'pipecat-ai==1.14.0' (deploy/install.sh does)"


def packaged_model(relative: str) -> Path:
    """The path of ``relative`` inside the installed ``pipecat`` package.

    ``find_spec`` on a top-level package reads its location without running its
    ``__init__``. Raises ``ModelNotFoundError`` with an install hint when the package or the
    file is missing.
    """
    spec = importlib.util.find_spec("pipecat")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / relative
        if path.is_file():
            return path
    tried = ", ".join(str(Path(folder) / relative) for folder in locations) or "no pipecat package"
    raise ModelNotFoundError(f"{relative} not found (tried: {tried}); install it: {_INSTALL_HINT}")


def resolve_model(configured: Path | None, relative: str) -> Path:
    """``configured`` if given (it must exist), else the packaged ``relative`` file."""
    if configured is None:
        return packaged_model(relative)
    if not configured.is_file():
        raise ModelNotFoundError(f"no ONNX model at {configured}")
    return configured


def cpu_session(path: Path, *, threads: int) -> ort.InferenceSession:
    """An onnxruntime session on the CPU with ``threads`` intra-op threads and no inter-op
    parallelism: these models are small and sequential, and every thread they take is one the
    Whisper decodes on the same cores do not get."""
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except (Fail, InvalidProtobuf) as e:
        raise ModelFormatError(f"{path} is not a loadable ONNX model: {e}") from e
    logger.debug("loaded %s with %d thread(s)", path.name, threads)
    return session
