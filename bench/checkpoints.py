"""Whisper checkpoints of any real model's shape with seeded random weights, written in
mlx-community's MLX layout (float16/float32, or 4/8-bit quantized) or in faster-whisper's
CTranslate2 layout: the shapes no real weights reach on these machines (large-v3's 128 mel
bands and 51866-token vocabulary, turbo's 4-layer decoder under a 32-layer encoder) load and
decode through the same code as real ones.

Random weights decode to random tokens: what such a checkpoint proves is that every shape
loads, runs and returns well-formed results, and what it costs; not what it transcribes.
The tests cut the layer count down (``n_audio_layer``/``n_text_layer``); the benchmark
builds them at full size. Used by tests/test_model.py and bench/bench_shapes.py.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from server.engine.model import ModelDimensions, Whisper, sinusoids

# The dimensions of OpenAI's checkpoints (their ``dims``), by registry name.
SHAPES: dict[str, ModelDimensions] = {
    "tiny.en": ModelDimensions(80, 1500, 384, 6, 4, 51864, 448, 384, 6, 4),
    "tiny": ModelDimensions(80, 1500, 384, 6, 4, 51865, 448, 384, 6, 4),
    "base": ModelDimensions(80, 1500, 512, 8, 6, 51865, 448, 512, 8, 6),
    "small": ModelDimensions(80, 1500, 768, 12, 12, 51865, 448, 768, 12, 12),
    "medium.en": ModelDimensions(80, 1500, 1024, 16, 24, 51864, 448, 1024, 16, 24),
    "large-v2": ModelDimensions(80, 1500, 1280, 20, 32, 51865, 448, 1280, 20, 32),
    "large-v3": ModelDimensions(128, 1500, 1280, 20, 32, 51866, 448, 1280, 20, 32),
    "large-v3-turbo": ModelDimensions(128, 1500, 1280, 20, 32, 51866, 448, 1280, 20, 4),
}
WEIGHT_STD = 0.02  # GPT-2's initialisation: activations stay finite through any depth

F32 = npt.NDArray[np.float32]


def shape(
    name: str, *, n_audio_layer: int | None = None, n_text_layer: int | None = None
) -> ModelDimensions:
    """A real model's dimensions, with the layer counts cut down where asked."""
    dims = SHAPES[name]
    return replace(
        dims,
        n_audio_layer=dims.n_audio_layer if n_audio_layer is None else n_audio_layer,
        n_text_layer=dims.n_text_layer if n_text_layer is None else n_text_layer,
    )


def random_weights(dims: ModelDimensions, seed: int = 0) -> dict[str, F32]:
    """Every parameter of ``Whisper(dims)`` by its MLX name, float32 from a fixed seed: layer
    norms at one and zero, everything else normal with ``WEIGHT_STD``."""
    import mlx.core as mx  # noqa: F401  (Whisper's arrays need the library loaded)

    rng = np.random.default_rng(seed)
    names = _parameter_shapes(Whisper(dims).parameters())
    out: dict[str, F32] = {}
    for name, dims_of in names:
        norm = name.split(".")[-2] in ("attn_ln", "cross_attn_ln", "mlp_ln", "ln_post", "ln")
        if norm and name.endswith(".weight"):
            out[name] = np.ones(dims_of, dtype=np.float32)
        elif norm or name.endswith(".bias"):
            out[name] = np.zeros(dims_of, dtype=np.float32)
        else:
            out[name] = (rng.standard_normal(dims_of, dtype=np.float32) * WEIGHT_STD).astype(
                np.float32
            )
    return out


def _parameter_shapes(tree: Any, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _parameter_shapes(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _parameter_shapes(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tuple(int(d) for d in tree.shape))]


def _alignment_heads(dims: ModelDimensions) -> list[list[int]]:
    return [[dims.n_text_layer - 1, h] for h in range(min(2, dims.n_text_head))]


def write_mlx(
    folder: Path,
    dims: ModelDimensions,
    *,
    dtype: str = "float16",
    quantize_bits: int | None = None,
    group_size: int = 64,
    file: str = "weights.safetensors",
    seed: int = 0,
) -> Path:
    """mlx-community's layout: ``config.json`` (with ``quantization`` when quantized) and
    ``weights.safetensors`` or ``weights.npz``."""
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(dims, seed)
    target = getattr(mx, dtype)
    config: dict[str, Any] = {"model_type": "whisper", **dims.__dict__}
    config["alignment_heads"] = _alignment_heads(dims)
    if quantize_bits is None:
        # One tensor at a time, each numpy copy dropped once converted: a full-size large
        # model is 3.2 GB in float32, and two copies at once would crowd a shared machine.
        arrays = {}
        for k in list(weights):
            arrays[k] = mx.array(weights.pop(k)).astype(target)
            mx.eval(arrays[k])
    else:
        model = Whisper(dims)
        model.load_weights([(k, mx.array(v).astype(target)) for k, v in weights.items()])
        model.quantize_layers(group_size, quantize_bits, lambda path: "conv" not in path)
        arrays = dict(_flat_arrays(model.parameters()))
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    mx.eval(arrays)
    if file.endswith(".npz"):
        mx.savez(str(folder / file), **arrays)
    else:
        mx.save_safetensors(str(folder / file), arrays)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _flat_arrays(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_arrays(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat_arrays(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


# --- faster-whisper's CTranslate2 layout ---------------------------------------------------------

_CT2_DTYPES = {
    np.dtype(np.float32): 0,
    np.dtype(np.int8): 1,
    np.dtype(np.int16): 2,
    np.dtype(np.float16): 4,
}


def ct2_variables(weights: dict[str, F32], dims: ModelDimensions) -> dict[str, npt.NDArray[Any]]:
    """The CTranslate2 ``WhisperSpec`` variables of MLX-named weights: the inverse of
    ``server.engine.ct2_convert.to_mlx_weights`` (fused QKV and cross KV projections, the key's
    zero bias stored, convolutions (out, in, width))."""
    v: dict[str, npt.NDArray[Any]] = {}
    for i in (1, 2):
        v[f"encoder/conv{i}/weight"] = weights[f"encoder.conv{i}.weight"].transpose(0, 2, 1)
        v[f"encoder/conv{i}/bias"] = weights[f"encoder.conv{i}.bias"]
    for side, n_layer in (("encoder", dims.n_audio_layer), ("decoder", dims.n_text_layer)):
        for i in range(n_layer):
            src, dst = f"{side}.blocks.{i}", f"{side}/layer_{i}"
            w = {k[len(src) + 1 :]: a for k, a in weights.items() if k.startswith(src + ".")}
            zeros = np.zeros_like(w["attn.query.bias"])
            sa = f"{dst}/self_attention"
            v[f"{sa}/linear_0/weight"] = np.concatenate(
                [w["attn.query.weight"], w["attn.key.weight"], w["attn.value.weight"]]
            )
            v[f"{sa}/linear_0/bias"] = np.concatenate(
                [w["attn.query.bias"], zeros, w["attn.value.bias"]]
            )
            v[f"{sa}/linear_1/weight"] = w["attn.out.weight"]
            v[f"{sa}/linear_1/bias"] = w["attn.out.bias"]
            v[f"{sa}/layer_norm/gamma"] = w["attn_ln.weight"]
            v[f"{sa}/layer_norm/beta"] = w["attn_ln.bias"]
            if side == "decoder":
                ca = f"{dst}/attention"
                v[f"{ca}/linear_0/weight"] = w["cross_attn.query.weight"]
                v[f"{ca}/linear_0/bias"] = w["cross_attn.query.bias"]
                v[f"{ca}/linear_1/weight"] = np.concatenate(
                    [w["cross_attn.key.weight"], w["cross_attn.value.weight"]]
                )
                v[f"{ca}/linear_1/bias"] = np.concatenate([zeros, w["cross_attn.value.bias"]])
                v[f"{ca}/linear_2/weight"] = w["cross_attn.out.weight"]
                v[f"{ca}/linear_2/bias"] = w["cross_attn.out.bias"]
                v[f"{ca}/layer_norm/gamma"] = w["cross_attn_ln.weight"]
                v[f"{ca}/layer_norm/beta"] = w["cross_attn_ln.bias"]
            v[f"{dst}/ffn/linear_0/weight"] = w["mlp1.weight"]
            v[f"{dst}/ffn/linear_0/bias"] = w["mlp1.bias"]
            v[f"{dst}/ffn/linear_1/weight"] = w["mlp2.weight"]
            v[f"{dst}/ffn/linear_1/bias"] = w["mlp2.bias"]
            v[f"{dst}/ffn/layer_norm/gamma"] = w["mlp_ln.weight"]
            v[f"{dst}/ffn/layer_norm/beta"] = w["mlp_ln.bias"]
    v["encoder/layer_norm/gamma"] = weights["encoder.ln_post.weight"]
    v["encoder/layer_norm/beta"] = weights["encoder.ln_post.bias"]
    v["decoder/layer_norm/gamma"] = weights["decoder.ln.weight"]
    v["decoder/layer_norm/beta"] = weights["decoder.ln.bias"]
    v["decoder/embeddings/weight"] = weights["decoder.token_embedding.weight"]
    v["decoder/position_encodings/encodings"] = weights["decoder.positional_embedding"]
    v["encoder/position_encodings/encodings"] = np.array(
        sinusoids(dims.n_audio_ctx, dims.n_audio_state), dtype=np.float32
    )
    v["encoder/num_heads"] = np.array(dims.n_audio_head, dtype=np.int16)
    v["decoder/num_heads"] = np.array(dims.n_text_head, dtype=np.int16)
    v["decoder/pre_norm"] = np.array(1, dtype=np.int8)
    v["decoder/activation"] = np.array(3, dtype=np.int8)  # GELU
    return v


def _ct2_string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(
    folder: Path, dims: ModelDimensions, *, dtype: str = "float16", seed: int = 0
) -> Path:
    """faster-whisper's layout: ``model.bin`` (CTranslate2 version 6, ``WhisperSpec``, weights
    in ``dtype``, the output projection an alias of the embedding) and ``config.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    variables = ct2_variables(random_weights(dims, seed), dims)
    float_type = np.dtype(np.float16 if dtype == "float16" else np.float32)
    with (folder / "model.bin").open("wb") as fh:
        fh.write(struct.pack("<I", 6) + _ct2_string("WhisperSpec") + struct.pack("<I", 3))
        fh.write(struct.pack("<I", len(variables)))
        for name, array in variables.items():
            data = array.astype(float_type) if array.dtype.kind == "f" else array
            data = np.ascontiguousarray(data)
            fh.write(_ct2_string(name) + struct.pack("<B", data.ndim))
            fh.write(b"".join(struct.pack("<I", d) for d in data.shape))
            fh.write(struct.pack("<BI", _CT2_DTYPES[data.dtype], data.nbytes))
            fh.write(data.tobytes())
        fh.write(struct.pack("<I", 1))
        fh.write(
            _ct2_string("decoder/projection/weight") + _ct2_string("decoder/embeddings/weight")
        )
    languages = dims.n_vocab - 51765 - int(dims.n_vocab >= 51865)
    config = {
        "alignment_heads": _alignment_heads(dims),
        "lang_ids": list(range(50259, 50259 + languages)) if dims.n_vocab >= 51865 else [],
        "suppress_ids": [],
        "suppress_ids_begin": [220, 50256 if dims.n_vocab == 51864 else 50257],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
