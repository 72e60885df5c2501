"""The turn model as a server holds it: found at start, loaded on its first call.

Importing onnxruntime and loading Smart Turn take about 2 s on a 2-core CPU, which a server
whose streams never ask for turns (and every test server) should not pay at start. So the
server only checks that both are installed, and the first pause a stream asks about loads the
model, in the turn model's own thread (``Pipeline.score_turn``).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

logger = logging.getLogger("server.serve.turn_model")

# Smart Turn v3.2 inside the installed ``pipecat`` package (the pipecat-ai wheel, installed
# --no-deps for its data files): ``server.turns.onnx.SMART_TURN_FILE``.
_SMART_TURN = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"


class LazyTurnModel:
    """Smart Turn, loaded on its first ``score``; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._model: object | None = None

    def load(self) -> None:
        """Load the model now (the first stream that asks for turns does, in the turn model's
        thread, so its first pause does not wait for it)."""
        from server.turns.smart_turn import SmartTurn, SmartTurnConfig

        with self._lock:
            if self._model is None:
                self._model = SmartTurn(SmartTurnConfig(model_path=self.path))
                logger.info("turn model loaded from %s", self.path)

    def score(self, audio_16k: npt.NDArray[np.float32]) -> float:
        from server.turns.smart_turn import SmartTurn

        self.load()
        model = self._model
        assert isinstance(model, SmartTurn)
        return model.score(audio_16k)


def find_turn_model() -> LazyTurnModel | None:
    """The turn model if onnxruntime and its file are installed, else None (logged)."""
    if importlib.util.find_spec("onnxruntime") is None:
        logger.info("no turn model (onnxruntime is not installed): /v2/listen refuses streams")
        return None
    spec = importlib.util.find_spec("pipecat")
    for folder in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / _SMART_TURN
        if path.is_file():
            return LazyTurnModel(path)
    logger.info("no turn model (%s not installed): /v2/listen refuses streams", _SMART_TURN)
    return None
