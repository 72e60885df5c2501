"""Greedy Whisper decoding built for streaming.

- Self-attention keys and values go into caches preallocated to the text context and kept
  between calls; nothing grows by concatenation.
- Cross-attention keys and values are projected once per encoder output.
- The prompt (earlier committed text) and the forced prefix (words being re-checked) are
  prefilled in one forward pass.
- Rows of a batch may come from different streams with different prompts and audio lengths:
  prompts are left-padded and masked, audio is right-padded and masked, each row stops on
  its own.
- Guards: Whisper's token suppression and timestamp rules, no-speech probability, a token
  cap per audio second, a repeated-n-gram cut and a compression-ratio check.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from ..features import AUDIO_TOKENS_PER_SECOND
from ..hypothesis import normalize_word
from .blas import vector_matrix
from .model import Whisper
from .options import DecodeOptions
from .words import WordTiming, align_words

logger = logging.getLogger("server.engine.decoder")

NEG_INF = -np.inf
SECONDS_PER_TIMESTAMP = 0.02
END_SLACK_S = 0.5  # a transcript whose timestamps reach this close to the audio end is whole
GEMV_MAX_ROWS = 2  # from 3 rows up, one sgemm beats a matrix-vector product per row


@dataclass(frozen=True)
class Vocabulary:
    """The special tokens and suppression lists of one tokenizer."""

    tokenizer: Any  # lightning_whisper_mlx.tokenizer.Tokenizer
    eot: int
    sot: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    timestamp_begin: int
    transcribe: int
    translate: int
    blank: tuple[int, ...]  # the encoding of " ", suppressed as the first token
    suppress: tuple[int, ...]  # non-speech symbols and control tokens, always suppressed
    multilingual: bool

    @classmethod
    def from_tokenizer(cls, tok: Any, multilingual: bool) -> Vocabulary:
        suppress = {
            *tok.non_speech_tokens,
            tok.transcribe,
            tok.translate,
            tok.sot,
            tok.sot_prev,
            tok.sot_lm,
            tok.no_speech,
        }
        return cls(
            tokenizer=tok,
            eot=tok.eot,
            sot=tok.sot,
            sot_prev=tok.sot_prev,
            no_speech=tok.no_speech,
            no_timestamps=tok.no_timestamps,
            timestamp_begin=tok.timestamp_begin,
            transcribe=tok.transcribe,
            translate=tok.translate,
            blank=(*tuple(tok.encode(" ")), tok.eot),
            suppress=tuple(sorted(suppress)),
            multilingual=multilingual,
        )

    def language_token(self, language: str) -> int:
        return int(self.tokenizer.to_language_token(language))

    def text(self, tokens: list[int] | tuple[int, ...]) -> str:
        return str(self.tokenizer.decode([t for t in tokens if t < self.eot]))


@dataclass(frozen=True)
class DecodeRequest:
    """One window of one stream, already encoded."""

    features: mx.array  # (audio positions, state) from the encoder
    audio_s: float  # seconds of real audio in the window (the rest is padding)
    options: DecodeOptions = field(default_factory=DecodeOptions)
    prompt: tuple[int, ...] = ()  # earlier committed text, as context
    prefix: tuple[int, ...] = ()  # text tokens forced at the start of the output
    language: str | None = None  # resolved language (filled by detection when None)


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class DecodeResult:
    tokens: tuple[int, ...]  # text tokens after the prompt, forced prefix included
    text: str
    segments: tuple[Segment, ...]
    words: tuple[WordTiming, ...]  # empty unless word_timestamps
    language: str | None
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    # "eot", "max_tokens", "repetition", "repeat_at_end" (the transcript said its ending
    # again, or looped after reaching the end of the audio: cut, nothing is missing),
    # "no_speech", "compression"
    stop_reason: str
    n_generated: int  # tokens sampled (not forced) in this call

    @property
    def is_speech(self) -> bool:
        return self.stop_reason not in ("no_speech", "compression")


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def repeated_tail(
    tokens: list[int], max_ngram: int, min_repeats: int, phrase_tokens: int | None = None
) -> int | None:
    """If the tail is one n-gram repeated back to back, return where the repeats begin.

    Short n-grams need more repeats ("no, no, no" is speech; "the the the the the the the the"
    is a loop): n-grams of length n need max(min_repeats, ceil(8 / n)) copies. A phrase of
    ``phrase_tokens`` or more said twice in a row is the loop short audio contexts fall into
    ("We must find a new home in the stars. We must find a new home in the stars."), so two
    copies suffice there.
    """
    for n in range(1, max_ngram + 1):
        need = max(min_repeats, math.ceil(8 / n))
        if phrase_tokens is not None and n >= phrase_tokens:
            need = 2
        if len(tokens) < n * need:
            continue
        gram = tokens[-n:]
        if all(tokens[-n * (k + 1) : len(tokens) - n * k] == gram for k in range(need)):
            start = len(tokens) - n * need
            while start - n >= 0 and tokens[start - n : start] == gram:
                start -= n
            # The tail's n-gram may begin mid-phrase ("regard, in this" for "in this regard,"):
            # slide back to where the repetition really starts, so the kept copy is whole.
            while start > 0 and tokens[start - 1] == tokens[start - 1 + n]:
                start -= 1
            return start + n  # keep the first occurrence
    return None


def repeat_start(keys: list[str], min_words: int) -> int | None:
    """Where the words stop being new: the earliest ``s`` such that ``keys[s:]`` repeats the
    ``k`` words before it, periodically, at least once in full, for some ``k >= min_words``
    (a trailing partial copy is allowed). None when the ending repeats nothing. Phrases
    shorter than ``min_words`` do not count: people do repeat a word or two."""
    n = len(keys)
    best: int | None = None
    for k in range(min_words, n // 2 + 1):
        s = n  # walk back while each word equals the one k before it
        while s - 1 - k >= 0 and keys[s - 1] == keys[s - 1 - k]:
            s -= 1
        if n - s >= k and (best is None or s < best):
            best = s
    return best


class StreamingDecoder:
    """Batched greedy decoding over one model, with caches kept between calls."""

    def __init__(self, model: Whisper, vocab: Vocabulary, dtype: mx.Dtype) -> None:
        self.model = model
        self.vocab = vocab
        self.dims = model.dims
        self.dtype = dtype  # activations; weights may be quantized integers
        # Index arrays built once: the filters run for every row at every token.
        self._suppress = np.array(vocab.suppress, dtype=np.int64)
        self._blank = np.array(vocab.blank, dtype=np.int64)
        self._caches: list[tuple[mx.array, mx.array]] = []
        self._cache_batch = 0
        on_cpu = mx.default_device() == mx.cpu
        self._projection = model.decoder.projection_array() if on_cpu else None

    # -- caches -------------------------------------------------------------------------
    def _cache(self, batch: int) -> list[tuple[mx.array, mx.array]]:
        """Preallocated (batch, head, n_text_ctx, state / head) caches, grown only when a bigger
        batch comes."""
        if batch > self._cache_batch:
            d = self.dims
            shape = (batch, d.n_text_head, d.n_text_ctx, d.n_text_state // d.n_text_head)
            self._caches = [
                (mx.zeros(shape, dtype=self.dtype), mx.zeros(shape, dtype=self.dtype))
                for _ in range(self.dims.n_text_layer)
            ]
            mx.eval(self._caches)
            self._cache_batch = batch
        if batch == self._cache_batch:
            return self._caches
        return [(k[:batch], v[:batch]) for k, v in self._caches]

    def release_caches(self) -> None:
        """Drop the preallocated caches (sized to the largest batch seen so far)."""
        self._caches = []
        self._cache_batch = 0

    # -- forward ------------------------------------------------------------------------
    def _forward(
        self,
        tokens: mx.array,
        positions: mx.array,
        offset: int,
        caches: list[tuple[mx.array, mx.array]],
        self_mask: mx.array,
        cross: list[tuple[mx.array, mx.array]],
        cross_mask: mx.array | None,
    ) -> tuple[npt.NDArray[np.float32], list[tuple[mx.array, mx.array]]]:
        dec = self.model.decoder
        x = dec.token_embedding(tokens) + dec.positional_embedding[positions]
        new_caches = []
        for block, (ck, cv), (xk, xv) in zip(dec.blocks, caches, cross, strict=True):
            x, ck, cv = block.decode(x, ck, cv, offset, self_mask, xk, xv, cross_mask)
            new_caches.append((ck, cv))
        return self._logits(x[:, -1, :]), new_caches

    def _logits(self, x: mx.array) -> npt.NDArray[np.float32]:
        """Vocabulary logits (rows, vocab) of the last hidden states (rows, state).

        For one or two rows on CPU the projection is a ``cblas_sgemv`` per row on the same
        memory MLX holds (see ``blas.vector_matrix``): 3x faster than MLX's matmul there.
        """
        dec = self.model.decoder
        if self._projection is not None and x.shape[0] <= GEMV_MAX_ROWS:
            hidden = np.array(dec.ln(x).astype(mx.float32))
            out = vector_matrix(hidden, self._projection)
            if out is not None:
                return out
        return np.array(dec.logits(x).astype(mx.float32))

    def _cross(
        self, requests: list[DecodeRequest]
    ) -> tuple[list[tuple[mx.array, mx.array]], mx.array | None, list[int]]:
        lengths = [int(r.features.shape[0]) for r in requests]
        longest = max(lengths)
        if all(n == longest for n in lengths):
            audio = mx.stack([r.features for r in requests])
            mask = None
        else:
            audio = mx.stack(
                [mx.pad(r.features, [(0, longest - r.features.shape[0]), (0, 0)]) for r in requests]
            )
            pad = np.zeros((len(requests), 1, 1, longest), dtype=np.float32)
            for i, n in enumerate(lengths):
                pad[i, 0, 0, n:] = NEG_INF
            mask = mx.array(pad).astype(self.dtype)
        return self.model.decoder.cross_kv(audio.astype(self.dtype)), mask, lengths

    # -- language ----------------------------------------------------------------------
    def detect_language(self, requests: list[DecodeRequest]) -> list[tuple[str, float]]:
        """Most likely language per row from the logits after <|startoftranscript|>."""
        if not self.vocab.multilingual:
            raise ValueError("language detection needs a multilingual model; pass language='en'")
        tok = self.vocab.tokenizer
        cross, cross_mask, _ = self._cross(requests)
        b = len(requests)
        caches = self._cache(b)
        tokens = mx.array(np.full((b, 1), self.vocab.sot, dtype=np.int32))
        logits, _ = self._forward(
            tokens,
            mx.zeros((b, 1), dtype=mx.int32),
            0,
            caches,
            mx.zeros((b, 1, 1, 1), dtype=self.dtype),
            cross,
            cross_mask,
        )
        lang_ids = np.array(tok.all_language_tokens)
        scores = logits[:, lang_ids]
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        best = probs.argmax(axis=-1)
        return [(tok.all_language_codes[k], float(probs[i, k])) for i, k in enumerate(best)]

    # -- decode ------------------------------------------------------------------------
    def decode(self, requests: list[DecodeRequest]) -> list[DecodeResult]:
        """Greedy-decode every request in lockstep; rows stop independently."""
        if not requests:
            return []
        v = self.vocab
        needs_lang = [i for i, r in enumerate(requests) if r.options.language is None]
        languages: list[str | None] = [r.options.language for r in requests]
        lang: str | None
        if needs_lang and v.multilingual:
            for i, (lang, _) in zip(
                needs_lang, self.detect_language([requests[i] for i in needs_lang]), strict=True
            ):
                languages[i] = lang
        if not v.multilingual:
            languages = ["en"] * len(requests)

        seqs: list[list[int]] = []
        sample_begins: list[int] = []
        sot_index: list[int] = []
        for r, lang in zip(requests, languages, strict=True):
            seq: list[int] = []
            half = self.dims.n_text_ctx // 2
            if r.prompt:
                seq += [v.sot_prev, *r.prompt[-(half - 1) :]]
            sot_index.append(len(seq))
            seq.append(v.sot)
            if v.multilingual:
                assert lang is not None
                seq += [
                    v.language_token(lang),
                    v.translate if r.options.task == "translate" else v.transcribe,
                ]
            if not r.options.timestamps:
                seq.append(v.no_timestamps)
            sample_begins.append(len(seq))
            if r.prefix:
                if r.options.timestamps:
                    seq.append(v.timestamp_begin)
                seq += list(r.prefix)
            seqs.append(seq)

        b = len(requests)
        longest = max(len(s) for s in seqs)
        pads = [longest - len(s) for s in seqs]
        max_new = [
            max(
                1,
                min(
                    self.dims.n_text_ctx - longest - 1,
                    int(8 + r.options.max_tokens_per_audio_s * r.audio_s),
                ),
            )
            for r in requests
        ]
        steps = max(max_new)
        if longest + steps > self.dims.n_text_ctx:
            steps = self.dims.n_text_ctx - longest

        cross, cross_mask, lengths = self._cross(requests)
        caches = self._cache(b)

        # Prefill: left-padded tokens, per-row positions, causal mask that hides padding.
        tok_np = np.full((b, longest), v.eot, dtype=np.int32)
        pos_np = np.zeros((b, longest), dtype=np.int32)
        mask_np = np.full((b, 1, longest, longest), NEG_INF, dtype=np.float32)
        q_idx = np.arange(longest)[:, None]
        k_idx = np.arange(longest)[None, :]
        for i, (s, p) in enumerate(zip(seqs, pads, strict=True)):
            tok_np[i, p:] = s
            pos_np[i, p:] = np.arange(len(s))
            allowed = (k_idx <= q_idx) & ((k_idx >= p) | (k_idx == q_idx))
            mask_np[i, 0][allowed] = 0.0
        dt = self.dtype
        # The no-speech probability is read at <|startoftranscript|>, which is not the last
        # prefill position when there is a prompt; the prefill returns logits for both.
        no_speech = np.zeros(b, dtype=np.float64)
        x_logits, caches = self._prefill_with_no_speech(
            tok_np, pos_np, mask_np, pads, sot_index, caches, cross, cross_mask, no_speech
        )

        # Greedy loop.
        generated: list[list[int]] = [[] for _ in range(b)]  # sampled tokens only
        full: list[list[int]] = [list(s[sb:]) for s, sb in zip(seqs, sample_begins, strict=True)]
        sum_logprob = np.zeros(b)
        token_logprobs: list[list[float]] = [[] for _ in range(b)]
        done = [False] * b
        stop = ["max_tokens"] * b
        max_ts = [
            min(
                round(min(r.audio_s, n / AUDIO_TOKENS_PER_SECOND) / SECONDS_PER_TIMESTAMP),
                1500,
            )
            for r, n in zip(requests, lengths, strict=True)
        ]
        offset = longest
        logits_np: npt.NDArray[np.float32] = np.array(x_logits)  # (rows, vocab)
        for step in range(steps):
            next_tokens = np.full(b, v.eot, dtype=np.int32)
            for i in range(b):
                if done[i]:
                    continue
                row = self._filter(
                    logits_np[i],
                    full[i],
                    requests[i].options,
                    max_ts[i],
                    first=not generated[i] and not requests[i].prefix,
                )
                tok = int(np.argmax(row))
                lse = np.log(np.sum(np.exp(row - row[tok])))  # log-softmax of the chosen token
                logprob = float(-lse)
                next_tokens[i] = tok
                sum_logprob[i] += logprob
                if tok == v.eot:
                    done[i] = True
                    stop[i] = "eot"
                    continue
                generated[i].append(tok)
                full[i].append(tok)
                token_logprobs[i].append(logprob)
                text_only = [t for t in full[i] if t < v.eot]
                opts = requests[i].options
                cut = repeated_tail(
                    text_only,
                    opts.repetition_max_ngram,
                    opts.repetition_min_repeats,
                    opts.repetition_phrase_tokens,
                )
                if cut is not None:
                    full[i] = self._truncate_text(full[i], cut)
                    done[i] = True
                    stop[i] = "repetition"
                    # Starting the whole transcript over means the first copy covered the
                    # audio; so do timestamps that reached its end.
                    restarted = text_only[cut : 2 * cut] == text_only[:cut]
                    if restarted or self._reached_end(full[i], max_ts[i]):
                        stop[i] = "repeat_at_end"
                elif len(generated[i]) >= max_new[i]:
                    done[i] = True
            if all(done) or step == steps - 1:
                break
            positions = mx.array((offset - np.array(pads, dtype=np.int32))[:, None])
            step_mask = np.zeros((b, 1, 1, offset + 1), dtype=np.float32)
            for i, p in enumerate(pads):
                step_mask[i, 0, 0, :p] = NEG_INF
            logits_np, caches = self._forward(
                mx.array(next_tokens[:, None]),
                positions,
                offset,
                caches,
                mx.array(step_mask).astype(dt),
                cross,
                cross_mask,
            )
            offset += 1
        self._caches = caches if b == self._cache_batch else self._caches
        for i in range(b):
            # A loop cut mid-audio ("repetition") is left to the caller's fallback: words after
            # it are missing. A whole transcript only needs an ending read twice removed.
            if stop[i] in ("eot", "repeat_at_end"):
                trimmed = self._trim_repeated_ending(full[i], requests[i].options)
                if trimmed is not None:
                    full[i], stop[i] = trimmed, "repeat_at_end"

        results = []
        for i, r in enumerate(requests):
            results.append(
                self._result(
                    r,
                    languages[i],
                    full[i],
                    generated[i],
                    token_logprobs[i],
                    float(sum_logprob[i]),
                    float(no_speech[i]),
                    stop[i],
                    cross,
                    i,
                    lengths[i],
                )
            )
        return results

    def _prefill_with_no_speech(
        self,
        tok_np: npt.NDArray[np.int32],
        pos_np: npt.NDArray[np.int32],
        mask_np: npt.NDArray[np.float32],
        pads: list[int],
        sot_index: list[int],
        caches: list[tuple[mx.array, mx.array]],
        cross: list[tuple[mx.array, mx.array]],
        cross_mask: mx.array | None,
        no_speech: npt.NDArray[np.float64],
    ) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        dec = self.model.decoder
        dt = self.dtype
        x = dec.token_embedding(mx.array(tok_np)) + dec.positional_embedding[mx.array(pos_np)]
        mask = mx.array(mask_np).astype(dt)
        new_caches = []
        for block, (ck, cv), (xk, xv) in zip(dec.blocks, caches, cross, strict=True):
            x, ck, cv = block.decode(x, ck, cv, 0, mask, xk, xv, cross_mask)
            new_caches.append((ck, cv))
        sot_rows = mx.array(np.array([p + s for p, s in zip(pads, sot_index, strict=True)]))
        picked = mx.take_along_axis(x, sot_rows[:, None, None], axis=1)
        both = dec.logits(mx.concatenate([picked, x[:, -1:, :]], axis=1)).astype(mx.float32)
        sot_logits = both[:, 0, :]
        probs = mx.softmax(sot_logits, axis=-1)[:, self.vocab.no_speech]
        no_speech[:] = np.array(probs)
        return both[:, 1, :], new_caches

    def _filter(
        self,
        logits: npt.NDArray[np.float32],
        seq: list[int],
        opts: DecodeOptions,
        max_ts: int,
        first: bool,
    ) -> npt.NDArray[np.float32]:
        """Whisper's logit filters for one row: blank, suppress, timestamp rules."""
        v = self.vocab
        x = logits.copy()
        if first and opts.suppress_blank:
            x[self._blank] = NEG_INF
        x[self._suppress] = NEG_INF
        if not opts.timestamps:
            x[v.timestamp_begin :] = NEG_INF
            return x
        tb = v.timestamp_begin
        x[v.no_timestamps] = NEG_INF
        last_ts = len(seq) >= 1 and seq[-1] >= tb
        penult_ts = len(seq) < 2 or seq[-2] >= tb
        if last_ts:
            if penult_ts:
                x[tb:] = NEG_INF
            else:
                x[: v.eot] = NEG_INF
        stamps = [t for t in seq if t >= tb]
        if stamps:
            floor = stamps[-1] if (last_ts and not penult_ts) else stamps[-1] + 1
            x[tb:floor] = NEG_INF
        if not seq:
            x[:tb] = NEG_INF
            max_initial = round(opts.max_initial_timestamp_s / SECONDS_PER_TIMESTAMP)
            x[tb + max_initial + 1 :] = NEG_INF
        x[tb + max_ts + 1 :] = NEG_INF  # nothing after the audio that is really there
        finite = x[np.isfinite(x)]
        if finite.size:
            m = finite.max()
            ts = x[tb:]
            ts_fin = ts[np.isfinite(ts)]
            text_max = x[:tb].max()
            if ts_fin.size and np.isfinite(text_max):
                ts_lse = m + np.log(np.sum(np.exp(ts_fin - m)))
                if ts_lse > text_max:
                    x[:tb] = NEG_INF
        return x

    def _trim_repeated_ending(self, seq: list[int], opts: DecodeOptions) -> list[int] | None:
        """``seq`` without the repeats of its last phrase, or None when it ends in none.

        Short audio contexts make the model read the end of the window again ("... by a
        similar process, by a similar process."); punctuation differs between the copies, so
        words are compared normalised.
        """
        v = self.vocab
        text_tokens = [t for t in seq if t < v.eot]
        words, word_tokens = v.tokenizer.split_to_word_tokens(text_tokens)
        spoken = [i for i, w in enumerate(words) if normalize_word(w)]  # not punctuation
        keys = [normalize_word(words[i]) for i in spoken]
        start = repeat_start(keys, opts.repetition_phrase_words)
        if start is None:
            return None
        kept = sum(len(toks) for toks in word_tokens[: spoken[start]])
        return self._truncate_text(seq, kept)

    def _reached_end(self, seq: list[int], max_ts: int) -> bool:
        """Whether the timestamps of ``seq`` already reach the last second of real audio:
        a loop that starts there repeats what was transcribed, and nothing is missing."""
        tb = self.vocab.timestamp_begin
        stamps = [t - tb for t in seq if t >= tb]
        return bool(stamps) and max(stamps) >= max_ts - round(END_SLACK_S / SECONDS_PER_TIMESTAMP)

    def _truncate_text(self, seq: list[int], keep_text: int) -> list[int]:
        """Keep the first ``keep_text`` text tokens of ``seq`` (timestamps ride along)."""
        out: list[int] = []
        count = 0
        for t in seq:
            if t < self.vocab.eot:
                if count == keep_text:
                    break
                count += 1
            out.append(t)
        return out

    def _result(
        self,
        r: DecodeRequest,
        language: str | None,
        seq: list[int],
        generated: list[int],
        token_logprobs: list[float],
        sum_logprob: float,
        no_speech_prob: float,
        stop: str,
        cross: list[tuple[mx.array, mx.array]],
        row: int,
        n_audio: int,
    ) -> DecodeResult:
        v = self.vocab
        opts = r.options
        text_tokens = tuple(t for t in seq if t < v.eot)
        text = v.text(text_tokens)
        avg_logprob = sum_logprob / (len(generated) + 1)
        ratio = compression_ratio(text)
        # Whisper's rule needs both signals; silence that slips past VAD ("you", ".") comes with
        # a confident log-probability, so a near-certain no-speech probability suffices alone.
        if no_speech_prob > opts.no_speech_certain or (
            no_speech_prob > opts.no_speech_threshold and avg_logprob < opts.logprob_threshold
        ):
            stop = "no_speech"
        elif ratio > opts.compression_ratio_threshold:
            stop = "compression"
        if stop in ("no_speech", "compression"):
            return DecodeResult(
                (), "", (), (), language, avg_logprob, no_speech_prob, ratio, stop, len(generated)
            )
        segments = self._segments(seq)
        words: tuple[WordTiming, ...] = ()
        if opts.word_timestamps and text_tokens:
            # Probabilities are known for sampled tokens; forced ones count as certain.
            forced = len(text_tokens) - len([t for t in generated if t < v.eot])
            probs = [1.0] * max(forced, 0) + [
                math.exp(lp) for lp, t in zip(token_logprobs, generated, strict=True) if t < v.eot
            ]
            n_frames = min(n_audio, max(1, math.ceil(r.audio_s * AUDIO_TOKENS_PER_SECOND)))
            words = tuple(self._words(r, language, list(text_tokens), probs, cross, row, n_frames))
        return DecodeResult(
            text_tokens,
            text,
            segments,
            words,
            language,
            avg_logprob,
            no_speech_prob,
            ratio,
            stop,
            len(generated),
        )

    def _segments(self, seq: list[int]) -> tuple[Segment, ...]:
        v = self.vocab
        tb = v.timestamp_begin
        out: list[Segment] = []
        start: float | None = None
        current: list[int] = []
        last_time = 0.0
        for t in seq:
            if t >= tb:
                time_s = (t - tb) * SECONDS_PER_TIMESTAMP
                if start is None:
                    start = time_s
                elif current:
                    out.append(Segment(start, time_s, v.text(current), tuple(current)))
                    current, start = [], None
                else:
                    start = time_s
                last_time = time_s
            elif t < v.eot:
                current.append(t)
        if current:
            out.append(
                Segment(
                    start if start is not None else last_time, -1.0, v.text(current), tuple(current)
                )
            )
        return tuple(out)

    def _words(
        self,
        r: DecodeRequest,
        language: str | None,
        text_tokens: list[int],
        probs: list[float],
        cross: list[tuple[mx.array, mx.array]],
        row: int,
        n_frames: int,
    ) -> list[WordTiming]:
        v = self.vocab
        heads = self._alignment_heads
        if not heads:
            return []
        seq = [v.sot]
        if v.multilingual:
            seq += [
                v.language_token(language or "en"),
                v.translate if r.options.task == "translate" else v.transcribe,
            ]
        seq.append(v.no_timestamps)
        begin = len(seq)
        seq += [*text_tokens, v.eot]
        dec = self.model.decoder
        t = len(seq)
        x = dec.token_embedding(mx.array([seq])) + dec.positional_embedding[:t]
        causal = mx.array(np.triu(np.full((t, t), NEG_INF, dtype=np.float32), 1)).astype(self.dtype)
        wanted_layers = {layer for layer, _ in heads}
        weights_per_layer: dict[int, mx.array] = {}
        last_layer = max(wanted_layers)
        for li, (block, (xk, xv)) in enumerate(zip(dec.blocks, cross, strict=True)):
            xk_r, xv_r = xk[row : row + 1], xv[row : row + 1]
            x, w = block.decode_full(x, causal, xk_r, xv_r, li in wanted_layers)
            if w is not None:
                weights_per_layer[li] = w[0]
            if li == last_layer:
                break
        stacked = mx.stack([weights_per_layer[layer][head] for layer, head in heads])
        weights = np.array(stacked[:, begin:, :].astype(mx.float32))
        words, word_tokens = v.tokenizer.split_to_word_tokens([*text_tokens, v.eot])
        pairs = [(w, toks) for w, toks in zip(words[:-1], word_tokens[:-1], strict=True)]
        return align_words(weights, pairs, probs, n_frames)

    _alignment_heads: tuple[tuple[int, int], ...] = ()

    def set_alignment_heads(self, heads: tuple[tuple[int, int], ...]) -> None:
        self._alignment_heads = heads
