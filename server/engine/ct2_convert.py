"""Read CTranslate2 Whisper models (``model.bin``) and convert them to our MLX weights: a
converter run once per model, not an engine (``store`` caches what it writes).

The format (version 6, spec ``WhisperSpec``) is little-endian: ``u32 version``, spec name,
``u32 revision``, ``u32 n_vars``; per variable a name, ``u8 rank``, ``rank`` x ``u32`` dims,
``u8 dtype``, ``u32 nbytes`` and the raw row-major data; then ``u32 n_aliases`` and
alias/target pairs. A string is a ``u16`` length that counts its trailing NUL, then the bytes.
Zero-rank integer variables are settings (``num_heads``, activation ...), not weights.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from server.engine.model import ModelDimensions
from server.protocol.errors import ModelFormatError

_DTYPES: dict[int, npt.DTypeLike] = {
    0: np.float32,
    1: np.int8,
    2: np.int16,
    3: np.int32,
    4: np.float16,
    5: np.uint16,  # bfloat16, reinterpreted below
}
SUPPORTED_VERSIONS = (5, 6)
Array = npt.NDArray[np.generic]


class _Reader:
    def __init__(self, data: bytes | memoryview, path: Path) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.path = path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise ModelFormatError(f"{self.path}: truncated at byte {self.pos} (wanted {n} more)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u8(self) -> int:
        return int(self.take(1)[0])

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def string(self) -> str:
        n = self.u16()
        raw = bytes(self.take(n))
        return raw.rstrip(b"\0").decode("utf-8", errors="replace")


def read_model_bin(path: Path) -> tuple[str, dict[str, Array]]:
    """Return the spec name and every variable (aliases resolved) of a ``model.bin``."""
    data = path.read_bytes()
    r = _Reader(data, path)
    version = r.u32()
    if version not in SUPPORTED_VERSIONS:
        raise ModelFormatError(
            f"{path}: CTranslate2 binary version {version} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); is this a model.bin?"
        )
    spec = r.string()
    r.u32()  # revision
    n_vars = r.u32()
    if n_vars > 100_000:
        raise ModelFormatError(f"{path}: implausible variable count {n_vars}; file is corrupt")
    variables: dict[str, Array] = {}
    for _ in range(n_vars):
        name = r.string()
        rank = r.u8()
        shape = tuple(r.u32() for _ in range(rank))
        code = r.u8()
        if code not in _DTYPES:
            raise ModelFormatError(f"{path}: variable {name!r} has unknown dtype code {code}")
        nbytes = r.u32()
        raw = r.take(nbytes)
        arr: Array = np.frombuffer(raw, dtype=_DTYPES[code])
        if int(np.prod(shape, dtype=np.int64)) != arr.size:
            raise ModelFormatError(f"{path}: variable {name!r} has {arr.size} values for {shape}")
        if code == 5:
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        variables[name] = arr.reshape(shape)
    for _ in range(r.u32()):
        alias, target = r.string(), r.string()
        if target in variables:
            variables[alias] = variables[target]
    return spec, variables


_LAYER = re.compile(r"^(encoder|decoder)/layer_(\d+)/")


def _layers(variables: dict[str, Array], side: str) -> int:
    found = {int(m.group(2)) for k in variables if (m := _LAYER.match(k)) and m.group(1) == side}
    return max(found) + 1 if found else 0


def _setting(variables: dict[str, Array], *names: str) -> int | None:
    for name in names:
        if name in variables and variables[name].ndim == 0:
            return int(variables[name])
    return None


def dimensions(variables: dict[str, Array], path: Path) -> ModelDimensions:
    """Infer Whisper's dimensions from variable shapes and the stored head counts."""
    try:
        conv1 = variables["encoder/conv1/weight"]
        emb = variables["decoder/embeddings/weight"]
        text_pos = variables["decoder/position_encodings/encodings"]
    except KeyError as exc:
        raise ModelFormatError(
            f"{path}: not a CTranslate2 Whisper model (missing variable {exc.args[0]!r})"
        ) from None
    n_audio_state, n_mels = int(conv1.shape[0]), int(conv1.shape[1])
    n_text_state = int(emb.shape[1])
    audio_pos = variables.get("encoder/position_encodings/encodings")
    # CT2 stores one head count for both stacks; Whisper uses state / 64 everywhere.
    n_head_audio = _setting(variables, "encoder/num_heads", "num_heads") or n_audio_state // 64
    n_head_text = _setting(variables, "decoder/num_heads", "num_heads") or n_text_state // 64
    return ModelDimensions(
        n_mels=n_mels,
        n_audio_ctx=int(audio_pos.shape[0]) if audio_pos is not None else 1500,
        n_audio_state=n_audio_state,
        n_audio_head=n_head_audio,
        n_audio_layer=_layers(variables, "encoder"),
        n_vocab=int(emb.shape[0]),
        n_text_ctx=int(text_pos.shape[0]),
        n_text_state=n_text_state,
        n_text_head=n_head_text,
        n_text_layer=_layers(variables, "decoder"),
    )


def _split(arr: Array, parts: int, name: str, path: Path) -> list[Array]:
    if arr.shape[0] % parts:
        raise ModelFormatError(f"{path}: {name} has {arr.shape[0]} rows, not divisible by {parts}")
    return list(np.split(arr, parts, axis=0))


def _linear(variables: dict[str, Array], src: str, dst: str) -> Iterator[tuple[str, Array]]:
    yield f"{dst}.weight", variables[f"{src}/weight"]
    if f"{src}/bias" in variables:
        yield f"{dst}.bias", variables[f"{src}/bias"]


def _ln(variables: dict[str, Array], src: str, dst: str) -> Iterator[tuple[str, Array]]:
    yield f"{dst}.weight", variables[f"{src}/gamma"]
    yield f"{dst}.bias", variables[f"{src}/beta"]


def _attention_split(
    variables: dict[str, Array], src: str, dsts: list[str], path: Path
) -> Iterator[tuple[str, Array]]:
    """A fused projection (QKV or KV) becomes separate linears; the key has no bias."""
    weights = _split(variables[f"{src}/weight"], len(dsts), f"{src}/weight", path)
    biases = _split(variables[f"{src}/bias"], len(dsts), f"{src}/bias", path)
    for dst, w, b in zip(dsts, weights, biases, strict=True):
        yield f"{dst}.weight", w
        if not dst.endswith(".key"):
            yield f"{dst}.bias", b


def to_mlx_weights(
    variables: dict[str, Array], dims: ModelDimensions, path: Path
) -> dict[str, Array]:
    """Map CT2 names and layouts onto the MLX Whisper parameter tree (float arrays)."""
    out: dict[str, Array] = {}

    def put(items: Iterator[tuple[str, Array]]) -> None:
        for name, arr in items:
            out[name] = arr

    try:
        for i in (1, 2):
            out[f"encoder.conv{i}.weight"] = variables[f"encoder/conv{i}/weight"].transpose(0, 2, 1)
            out[f"encoder.conv{i}.bias"] = variables[f"encoder/conv{i}/bias"]
        for side, n_layer in (("encoder", dims.n_audio_layer), ("decoder", dims.n_text_layer)):
            for i in range(n_layer):
                src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
                sa = f"{src}/self_attention"
                put(
                    _attention_split(
                        variables,
                        f"{sa}/linear_0",
                        [f"{dst}.attn.query", f"{dst}.attn.key", f"{dst}.attn.value"],
                        path,
                    )
                )
                put(_linear(variables, f"{sa}/linear_1", f"{dst}.attn.out"))
                put(_ln(variables, f"{sa}/layer_norm", f"{dst}.attn_ln"))
                if side == "decoder":
                    ca = f"{src}/attention"
                    put(_linear(variables, f"{ca}/linear_0", f"{dst}.cross_attn.query"))
                    put(
                        _attention_split(
                            variables,
                            f"{ca}/linear_1",
                            [f"{dst}.cross_attn.key", f"{dst}.cross_attn.value"],
                            path,
                        )
                    )
                    put(_linear(variables, f"{ca}/linear_2", f"{dst}.cross_attn.out"))
                    put(_ln(variables, f"{ca}/layer_norm", f"{dst}.cross_attn_ln"))
                put(_linear(variables, f"{src}/ffn/linear_0", f"{dst}.mlp1"))
                put(_linear(variables, f"{src}/ffn/linear_1", f"{dst}.mlp2"))
                put(_ln(variables, f"{src}/ffn/layer_norm", f"{dst}.mlp_ln"))
        put(_ln(variables, "encoder/layer_norm", "encoder.ln_post"))
        put(_ln(variables, "decoder/layer_norm", "decoder.ln"))
        out["decoder.token_embedding.weight"] = variables["decoder/embeddings/weight"]
        out["decoder.positional_embedding"] = variables["decoder/position_encodings/encodings"]
    except KeyError as exc:
        raise ModelFormatError(f"{path}: missing variable {exc.args[0]!r}") from None
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
