"""Every Whisper shape loads and decodes: 80 and 128 mel bands, the 51864/51865/51866-token
vocabularies and their tokenizers (``yue`` included), any encoder and decoder depth, MLX
float16/float32 and 4-bit quantized weights, and CTranslate2 float16/float32 ones (8-bit
quantized weights: tests/test_store.py, with real ones).

No real weights of the large models reach these machines: the checkpoints are large-v3's and
large-v3-turbo's exact widths, vocabularies and tokenizers with the layer counts cut down and
seeded random weights (``bench/checkpoints.py``). Random weights decode to random tokens, so
these tests hold the structure of what comes back; tests/test_store.py holds real text from
real weights in each layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.checkpoints import random_weights, shape, write_ct2, write_mlx
from bench.corpus import load_clip
from server.core.engine_api import DecodeOptions, DecodeRequest, DecodeResult, Window
from server.engine import store
from server.engine.engine import Engine, EngineConfig
from server.engine.model import ModelDimensions

# Each case builds a checkpoint of up to 110 M parameters and decodes with it.
# Heavy; and one worker builds each checkpoint once (module-scoped fixtures: xdist would build
# them again on every worker that gets one of their tests).
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("model_shapes")]

# Cut depths: turbo keeps its shape's point (a deeper encoder than decoder), large-v3 the
# other way round, so both orders of depth run.
LARGE_V3 = shape("large-v3", n_audio_layer=1, n_text_layer=2)
TURBO = shape("large-v3-turbo", n_audio_layer=2, n_text_layer=1)
TINY = shape("tiny", n_audio_layer=1, n_text_layer=1)  # 80 mel bands, 51865 tokens
TINY_EN = shape("tiny.en", n_audio_layer=1, n_text_layer=1)  # 51864 tokens, English only
WINDOW_S = 1.0
WINDOW_SAMPLES = round(WINDOW_S * 16000)


@dataclass(frozen=True)
class Case:
    dims: ModelDimensions
    write: Callable[[Path, ModelDimensions], Path]
    quantization: tuple[int, int] | None = None


CASES = {
    "large-v3-mlx-fp16": Case(LARGE_V3, lambda f, d: write_mlx(f, d, dtype="float16")),
    # 4-bit on tiny's widths: a 4-bit matmul on the CPU costs ten times a float one, and the
    # large widths load and decode through the same code in the float cases.
    "tiny-mlx-4bit": Case(
        TINY, lambda f, d: write_mlx(f, d, dtype="float16", quantize_bits=4), (64, 4)
    ),
    "turbo-mlx-fp32-npz": Case(
        TURBO, lambda f, d: write_mlx(f, d, dtype="float32", file="weights.npz")
    ),
    "turbo-ct2-fp32": Case(TURBO, lambda f, d: write_ct2(f, d, dtype="float32")),
    "tiny-mlx-fp16": Case(TINY, lambda f, d: write_mlx(f, d, dtype="float16")),
    "tiny.en-ct2-fp16": Case(TINY_EN, lambda f, d: write_ct2(f, d, dtype="float16")),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(store.CACHE_ENV, str(root))
        yield root


@pytest.fixture(scope="module", params=sorted(CASES))
def shaped(
    request: pytest.FixtureRequest, cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Engine]:
    case = CASES[request.param]
    folder = case.write(tmp_path_factory.mktemp(request.param), case.dims)
    loaded = store.load_model(str(folder), dtype="float32")
    assert loaded.dims == case.dims
    assert loaded.quantization == case.quantization
    return request.param, Engine(loaded, EngineConfig(model=str(folder)))


@pytest.fixture(scope="module")
def speech(speech_dir: Path) -> np.ndarray:
    """A second of real speech: the shortest window a stream decodes. Random weights decode
    up to the token cap, which grows with the window, and a quantized matmul on the CPU is
    slow: a longer window would cost these tests time and prove nothing more."""
    return load_clip(speech_dir / "misc_en" / "jfk.wav")[:WINDOW_SAMPLES]


def _well_formed(result: DecodeResult, dims: ModelDimensions, eot: int) -> None:
    assert isinstance(result.text, str)
    assert all(0 <= t < eot for t in result.tokens)  # text tokens only
    assert all(0 <= t < dims.n_vocab for t in result.sequence)
    assert result.n_generated <= 8 + 12 * WINDOW_S  # the token cap of the window
    assert np.isfinite(result.avg_logprob) and 0.0 <= result.no_speech_prob <= 1.0
    # A span still open when the token cap cut the decode has no end (-1).
    assert all(0 <= s.start_s <= 30 for s in result.spans), result.spans
    assert all(s.start_s <= s.end_s or s.end_s == -1 for s in result.spans), result.spans


def test_each_shape_encodes_to_its_width(shaped: tuple[str, Engine], speech: np.ndarray) -> None:
    _, e = shaped
    mel = e.features(speech)
    assert mel.shape == (e.context_frames(WINDOW_S), e.dims.n_mels)
    (encoded,) = e.encode([mel])
    assert tuple(encoded.shape) == (mel.shape[0] // 2, e.dims.n_audio_state)
    assert np.isfinite(np.array(encoded)).all()


def test_each_shape_decodes_a_window(shaped: tuple[str, Engine], speech: np.ndarray) -> None:
    _, e = shaped
    mel = e.features(speech)
    results = e.decode_windows(
        [
            Window(mel, DecodeRequest(WINDOW_S)),
            Window(mel, DecodeRequest(WINDOW_S, prefix=e.encode_text(" Hello"))),
        ]
    )
    assert len(results) == 2
    for r in results:
        _well_formed(r, e.dims, e.vocab.eot)
    assert results[1].tokens[: len(e.encode_text(" Hello"))] == e.encode_text(" Hello")


def test_each_shape_has_its_tokenizer(shaped: tuple[str, Engine]) -> None:
    _, e = shaped
    tok = e.vocab.tokenizer
    if e.dims.n_vocab == 51864:
        assert not e.dims.is_multilingual and e.vocab.eot == 50256
        return
    assert e.dims.is_multilingual and e.vocab.eot == 50257
    languages = tok.all_language_codes
    assert len(languages) == e.dims.num_languages == e.dims.n_vocab - 51766
    # Timestamps start right after the last special token, wherever the language list ends.
    assert e.vocab.timestamp_begin == e.dims.n_vocab - 1501
    if e.dims.n_vocab == 51866:
        assert "yue" in languages
        assert e.vocab.language_token("yue") == e.vocab.sot + 100
    else:
        assert "yue" not in languages


# The multilingual shapes, quantized weights aside: language detection reads the same
# logits whatever the weights' storage, and a 4-bit matmul on the CPU costs a decode ten times.
MULTILINGUAL = sorted(
    name for name, case in CASES.items() if case.dims.is_multilingual and not case.quantization
)


@pytest.mark.parametrize("shaped", MULTILINGUAL, indirect=True)
def test_multilingual_shapes_detect_and_take_a_language(
    shaped: tuple[str, Engine], speech: np.ndarray
) -> None:
    _, e = shaped
    mel = e.features(speech)
    languages = set(e.vocab.tokenizer.all_language_codes)
    wanted = "yue" if "yue" in languages else "de"
    detected, forced = e.decode_windows(
        [
            Window(mel, DecodeRequest(WINDOW_S, DecodeOptions(language=None))),
            Window(mel, DecodeRequest(WINDOW_S, DecodeOptions(language=wanted, task="translate"))),
        ]
    )
    assert detected.language in languages
    assert forced.language == wanted
    for r in (detected, forced):
        _well_formed(r, e.dims, e.vocab.eot)


def test_ct2_and_mlx_checkpoints_of_one_seed_load_the_same_weights(
    cache: Path, tmp_path: Path
) -> None:
    """The CTranslate2 writer is the converter's inverse: one seed, two layouts, one model."""
    mlx = store.load_model(str(write_mlx(tmp_path / "mlx", TINY, dtype="float32")), dtype="float32")
    ct2 = store.load_model(str(write_ct2(tmp_path / "ct2", TINY, dtype="float32")), dtype="float32")
    a = dict(store._flatten(mlx.model.parameters()))
    b = dict(store._flatten(ct2.model.parameters()))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(np.array(a[name]), np.array(b[name]), err_msg=name)
    expected = random_weights(TINY)["decoder.blocks.0.cross_attn.value.weight"]
    np.testing.assert_array_equal(np.array(a["decoder.blocks.0.cross_attn.value.weight"]), expected)


async def test_a_turbo_shaped_model_streams_through_the_server(
    cache: Path, tmp_path: Path, speech_dir: Path
) -> None:
    """Partials and finals from a large-v3-turbo-shaped model through the real server and a
    real WebSocket client: random words, but every stage of the stream runs on its shape."""
    from server.config import PipelineConfig, ServerConfig
    from server.serve.app import WhisperwireServer
    from tests.helpers import pcm_frames, stream_frames

    folder = write_mlx(tmp_path / "turbo", TURBO, dtype="float32")
    engine = Engine(store.load_model(str(folder), dtype="float32"), EngineConfig(model=str(folder)))
    # Four seconds: every decode of random weights runs to the token cap, and the stages are
    # the same for a short stream as for a long one.
    audio = load_clip(speech_dir / "misc_en" / "jfk.wav")[: 4 * 16000]
    # No warmup, so no startup calibration: random weights decode every calibration window to
    # its token cap (a minute of CPU here), where real ones stop at the speech's last word.
    config = ServerConfig(
        host="127.0.0.1", port=0, max_sessions=2, capacity_limit=False, warmup=False
    )
    async with WhisperwireServer(
        lambda: engine, server=config, pipeline=PipelineConfig(max_batch_size=2)
    ) as server:
        outcome = await stream_frames(f"{server.url}/v1/stream", pcm_frames(audio))
    assert outcome.of_type("error") == []
    assert outcome.close_code == 1000
    (done,) = outcome.of_type("done")
    assert done["audio_received_s"] == pytest.approx(len(audio) / 16000, abs=0.01)
    assert outcome.of_type("speech_started")
    finals = outcome.of_type("final")
    assert finals and all(isinstance(f["text"], str) for f in finals)
    assert all(isinstance(p["text"], str) for p in outcome.of_type("partial"))
