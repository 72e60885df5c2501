"""What a prompt of vocabulary (OpenAI's ``prompt``, Deepgram's ``keyterm`` / ``keywords``)
does to the words the model gets wrong: names and rare terms in the shared clips.

    python -m bench.vocabulary [--beam-size 1]
    make bench-vocabulary

Every English clip of ``manifest.tsv`` is decoded offline as an upload is (30 s windows,
temperature fallback) three times:

- plain: no prompt;
- vocabulary: prompted with the clip's own missed terms, the way a user lists the names
  and terms their audio holds (a missed term: a word of 5 letters or more of the reference
  that the plain decode does not have; capitalised as the model writes names);
- unrelated: prompted with the missed terms of a clip from another source (another reader,
  another subject), to see what a prompt that does not fit does.

Reported: how many of the missed terms each decode has, and the WER of each over all clips.
Writes ``bench/results/vocabulary.json``; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

from bench.corpus import load_clip, normalize, wer
from bench.engine import speech_dir, write_results
from bench.latency_audio import english_clips
from server.core.engine_api import DecodeOptions
from server.core.long_form import FALLBACK_TEMPERATURES, LongForm
from server.engine.engine import Engine, EngineConfig

logger = logging.getLogger("bench.vocabulary")

MIN_TERM_LETTERS = 5


def missed_terms(reference: str, hypothesis: str) -> list[str]:
    """Words of 5 letters or more of the reference (normalised) that the hypothesis lacks."""
    heard = set(normalize(hypothesis).split())
    out: list[str] = []
    for word in normalize(reference).split():
        if len(word) >= MIN_TERM_LETTERS and word.isalpha() and word not in heard | set(out):
            out.append(word)
    return out


def decode(engine: Engine, audio: Any, beam_size: int, prompt: str) -> str:
    tokens = engine.encode_text(" " + prompt) if prompt else ()
    options = DecodeOptions(word_timestamps=False, beam_size=beam_size)
    recording = LongForm(audio, options, FALLBACK_TEMPERATURES, prompt=tokens)
    while (job := recording.next_window()) is not None:
        recording.take(*engine.transcribe_window(job.audio, job.request, job.temperatures))
    return recording.transcript().text


def run(beam_size: int) -> dict[str, Any]:
    engine = Engine.load(EngineConfig())
    engine.warmup()
    rows = english_clips(min_s=0.0, max_s=30.0)
    clips: list[dict[str, Any]] = []
    for row in rows:
        audio = load_clip(speech_dir() / row.file)
        plain = decode(engine, audio, beam_size, "")
        clips.append(
            {"file": row.file, "reference": row.transcript, "audio": audio, "plain": plain}
        )
    for clip in clips:
        clip["terms"] = missed_terms(clip["reference"], clip["plain"])
    with_terms = [c for c in clips if c["terms"]]
    for k, clip in enumerate(with_terms):
        # The next clip of another source: a talk on another subject, by another reader.
        source = clip["file"].split("/")[0]
        others = with_terms[k + 1 :] + with_terms[:k]
        other = next((c for c in others if c["file"].split("/")[0] != source), others[0])
        clip["vocabulary"] = decode(
            engine, clip["audio"], beam_size, ", ".join(t.title() for t in clip["terms"])
        )
        clip["unrelated"] = decode(
            engine, clip["audio"], beam_size, ", ".join(t.title() for t in other["terms"])
        )
    terms = sum(len(c["terms"]) for c in with_terms)

    def found(kind: str) -> int:
        return sum(
            sum(t in set(normalize(c[kind]).split()) for t in c["terms"]) for c in with_terms
        )

    refs = [c["reference"] for c in with_terms]
    return {
        "beam_size": beam_size,
        "clips": len(clips),
        "clips_with_missed_terms": len(with_terms),
        "missed_terms": terms,
        "terms_found": {
            "plain": 0,
            "vocabulary": found("vocabulary"),
            "unrelated": found("unrelated"),
        },
        "wer": {
            kind: round(wer(refs, [c[kind] for c in with_terms]), 4)
            for kind in ("plain", "vocabulary", "unrelated")
        },
        "per_clip": [
            {k: c[k] for k in ("file", "terms", "plain", "vocabulary", "unrelated")}
            for c in with_terms
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--beam-size", type=int, default=1, help="beams (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.perf_counter()
    results = run(args.beam_size) | {"loadavg": os.getloadavg()}
    results["wall_s"] = round(time.perf_counter() - started, 1)
    path = write_results("vocabulary", results)
    print(f"wrote {path} in {results['wall_s']:.0f} s")
    print(
        json.dumps(
            {
                k: results[k]
                for k in ("missed_terms", "terms_found", "wer", "clips_with_missed_terms")
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
