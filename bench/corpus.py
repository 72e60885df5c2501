"""The real-speech corpus that the benchmarks and the tests share: where it lives, its
manifest, its clips as float audio (and back to WAV bytes, as a client uploads them), and word
error rate against its transcripts."""

from __future__ import annotations

import csv
import io
import os
import wave
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jiwer
import numpy as np
import numpy.typing as npt
from whisper_normalizer.english import EnglishTextNormalizer

from server.protocol.audio import pcm_s16le_bytes
from server.protocol.formats import SAMPLE_RATE_HZ

REPO = Path(__file__).resolve().parents[1]
SPEECH_ENV = "WHISPERWIRE_SPEECH_DIR"

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ManifestRow:
    file: str  # path relative to the speech folder
    seconds: float
    language: str
    transcript: str  # exactly as the source gives it; normalise before scoring


def find_speech_dir() -> Path | None:
    """The real-speech folder: ``$WHISPERWIRE_SPEECH_DIR``, ``<repo>/../shared/speech`` or
    ``<repo>/shared/speech``, the first that holds ``manifest.tsv``; None if none does."""
    for candidate in (
        os.environ.get(SPEECH_ENV),
        REPO.parent / "shared" / "speech",
        REPO / "shared" / "speech",
    ):
        if candidate and (Path(candidate) / "manifest.tsv").is_file():
            return Path(candidate)
    return None


def read_manifest(path: Path) -> list[ManifestRow]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [
            ManifestRow(r["file"], float(r["seconds"]), r["language"], r["transcript"])
            for r in reader
        ]


def load_clip(path: Path) -> Float32Array:
    """A 16 kHz mono 16-bit WAV from the speech folder as float32 in [-1, 1)."""
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE_HZ)
        data = w.readframes(w.getnframes())
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


@lru_cache(maxsize=1)
def _normalizer() -> EnglishTextNormalizer:
    return EnglishTextNormalizer()


def normalize(text: str) -> str:
    """Whisper's English normaliser, with whitespace collapsed."""
    return " ".join(str(_normalizer()(text)).split())


def normalize_reference(text: str) -> str:
    """A reference transcript normalised as ``normalize`` does, keeping the words it holds in
    brackets: Whisper's normaliser drops a bracketed stretch as an annotation ("(laughs)"),
    but in a reference it was read aloud ("(which also was printed at Maintz ...)"), and
    dropped it would count the words heard for it as errors, after the last word too."""
    return normalize(text.replace("(", " ").replace(")", " "))


def wer(reference: str | list[str], hypothesis: str | list[str]) -> float:
    """Word error rate after Whisper's English normalisation of both sides.

    Lists are scored as one corpus (errors summed over all words), not averaged per clip.
    """
    refs = [reference] if isinstance(reference, str) else list(reference)
    hyps = [hypothesis] if isinstance(hypothesis, str) else list(hypothesis)
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    norm_refs = [normalize_reference(r) for r in refs]
    norm_hyps = [normalize(h) for h in hyps]
    # jiwer rejects empty references; they carry no words to get wrong, only insertions.
    pairs = [(r, h) for r, h in zip(norm_refs, norm_hyps, strict=True) if r]
    if not pairs:
        raise ValueError("every reference is empty after normalisation")
    return float(jiwer.wer([r for r, _ in pairs], [h if h else "" for _, h in pairs]))


def wav_bytes(audio: Float32Array) -> bytes:
    """16 kHz mono float audio as a 16-bit WAV file's bytes."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE_HZ)
        out.writeframes(pcm_s16le_bytes(audio))
    return buffer.getvalue()
