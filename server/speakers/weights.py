"""Resemblyzer's speaker encoder weights, read from its wheel without PyTorch.

``resemblyzer/pretrained.pt`` (resemblyzer 0.1.4, 17 MB) is written in PyTorch's legacy
(pre-1.6) serialization, not the zip format of later versions: five pickles in a row --
a magic number, the protocol version, system info, the checkpoint itself, and the list of
storage keys -- followed by each storage's raw bytes, preceded by its element count as a
little-endian int64. The checkpoint refers to storages by persistent id and builds tensors
with ``torch._utils._rebuild_tensor_v2``; ``_CheckpointUnpickler`` answers those names with
numpy stand-ins and refuses every other global, so reading the file runs no code from it.

The package is installed with ``--no-deps`` (its metadata requires torch, librosa and scipy)
and is never imported: its ``__init__`` imports torch. We only locate its folder.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger("server.speakers.weights")

PACKAGE = "resemblyzer"
WEIGHTS_FILE = "pretrained.pt"
INSTALL_HINT = "pip install --no-deps 'resemblyzer==0.1.4' (make install does)"
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
# PyTorch's storage classes as the legacy pickle names them, and their element types.
_STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}

Float32Array = npt.NDArray[np.float32]


class WeightsError(Exception):
    """The encoder's weights are missing or not what this reader understands."""


@dataclass
class _Storage:
    """A storage the checkpoint refers to; its bytes follow the pickles in the file."""

    dtype: np.dtype[Any]
    numel: int
    data: npt.NDArray[Any] | None = None


@dataclass(frozen=True)
class _TensorRef:
    """What ``_rebuild_tensor_v2`` was asked to build; made into an array once the storages
    are read (they come after the pickle that refers to them)."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def array(self) -> npt.NDArray[Any]:
        data = self.storage.data
        if data is None:
            raise WeightsError("a tensor refers to a storage the file does not hold")
        item = data.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(
            data[self.offset :],
            shape=self.shape,
            strides=tuple(s * item for s in self.stride),
            writeable=False,
        )
        return np.ascontiguousarray(view)


def _rebuild_tensor(
    storage: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], *_: Any
) -> _TensorRef:
    # _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks)
    return _TensorRef(storage, offset, tuple(shape), tuple(stride))


class _StorageType:
    """Stands in for ``torch.FloatStorage`` and its kin inside persistent ids."""

    def __init__(self, name: str) -> None:
        self.dtype: np.dtype[Any] = _STORAGE_DTYPES[name]


class _CheckpointUnpickler(pickle.Unpickler):
    """Unpickles a legacy checkpoint with numpy stand-ins for PyTorch's rebuild functions."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) in (
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_tensor"),
        ):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise WeightsError(f"the checkpoint names {module}.{name}, which this reader refuses")

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage_type, key, location, numel, view_metadata)
        if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
            raise WeightsError(f"unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel, view = pid
        if view is not None:
            raise WeightsError("storage views are not supported")
        if not isinstance(storage_type, _StorageType):
            raise WeightsError(f"unexpected storage type {storage_type!r}")
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = _Storage(storage_type.dtype, int(numel))
        return storage


def _refuse_globals(module: str, name: str) -> Any:
    raise WeightsError(f"the checkpoint header names {module}.{name}")


class _PlainUnpickler(pickle.Unpickler):
    """The header pickles hold only numbers, strings and dicts."""

    def find_class(self, module: str, name: str) -> Any:
        return _refuse_globals(module, name)


def read_legacy_checkpoint(data: bytes) -> dict[str, Any]:
    """The checkpoint in a legacy PyTorch file, with every tensor as a numpy array.

    Raises ``WeightsError`` when the bytes are not that format (a zip-format file from
    PyTorch 1.6 or later included) or name anything but tensors and ordered dicts."""
    f = io.BytesIO(data)
    try:
        magic = _PlainUnpickler(f).load()
        if magic != _LEGACY_MAGIC:
            raise WeightsError("not a legacy PyTorch checkpoint (bad magic number)")
        protocol = _PlainUnpickler(f).load()
        if protocol != _LEGACY_PROTOCOL:
            raise WeightsError(f"unsupported legacy protocol version {protocol!r}")
        info = _PlainUnpickler(f).load()
        if not isinstance(info, dict) or not info.get("little_endian", False):
            raise WeightsError("the checkpoint was written on a big-endian machine")
        unpickler = _CheckpointUnpickler(f)
        checkpoint = unpickler.load()
        keys = _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise WeightsError(f"unreadable checkpoint: {exc}") from exc
    for key in keys:
        storage = unpickler.storages.get(key)
        if storage is None:
            raise WeightsError(f"storage {key!r} is listed but never used")
        head = f.read(8)
        if len(head) != 8:
            raise WeightsError("the file ends inside the storages")
        (numel,) = struct.unpack("<q", head)
        nbytes = numel * storage.dtype.itemsize
        raw = f.read(nbytes)
        if numel != storage.numel or len(raw) != nbytes:
            raise WeightsError(f"storage {key!r}: size does not match the checkpoint")
        storage.data = np.frombuffer(raw, dtype=storage.dtype)
    return _resolve(checkpoint)  # type: ignore[no-any-return]


def _resolve(value: Any) -> Any:
    """Turn the tensor placeholders in (nested) dicts and lists into arrays."""
    if isinstance(value, _TensorRef):
        return value.array()
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_resolve(v) for v in value)
    return value


def package_weights_path() -> Path:
    """``pretrained.pt`` of the installed resemblyzer wheel, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"{PACKAGE} is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / WEIGHTS_FILE
    if not path.is_file():
        raise WeightsError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class EncoderWeights:
    """The d-vector network's parameters, in PyTorch's layout (gates i, f, g, o)."""

    lstm: tuple[tuple[Float32Array, Float32Array, Float32Array], ...]  # (W_ih, W_hh, b) a layer
    linear_weight: Float32Array  # (embedding, hidden)
    linear_bias: Float32Array

    @property
    def hidden_size(self) -> int:
        return int(self.lstm[0][1].shape[1])

    @property
    def input_size(self) -> int:
        return int(self.lstm[0][0].shape[1])


def load_weights(path: Path | None = None) -> EncoderWeights:
    """The encoder's weights from ``path`` (default: the installed wheel's). Raises
    ``WeightsError``."""
    path = path or package_weights_path()
    checkpoint = read_legacy_checkpoint(path.read_bytes())
    state = checkpoint.get("model_state")
    if not isinstance(state, dict):
        raise WeightsError(f"{path}: no model_state in the checkpoint")
    layers = []
    try:
        for k in range(len([n for n in state if n.startswith("lstm.weight_ih_l")])):
            w_ih = np.asarray(state[f"lstm.weight_ih_l{k}"], dtype=np.float32)
            w_hh = np.asarray(state[f"lstm.weight_hh_l{k}"], dtype=np.float32)
            # PyTorch adds two biases; one sum is the same computation.
            bias = np.asarray(
                state[f"lstm.bias_ih_l{k}"] + state[f"lstm.bias_hh_l{k}"], dtype=np.float32
            )
            layers.append((w_ih, w_hh, bias))
        weights = EncoderWeights(
            tuple(layers),
            np.asarray(state["linear.weight"], dtype=np.float32),
            np.asarray(state["linear.bias"], dtype=np.float32),
        )
    except KeyError as exc:
        raise WeightsError(f"{path}: the checkpoint lacks {exc}") from None
    if not layers:
        raise WeightsError(f"{path}: no LSTM layers in the checkpoint")
    logger.debug("speaker encoder weights from %s: %d LSTM layers", path, len(layers))
    return weights
