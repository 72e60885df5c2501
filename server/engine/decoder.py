"""Greedy Whisper decoding built for streaming.

- Self-attention keys and values go into caches preallocated to the text context and kept
  between calls; nothing grows by concatenation.
- Cross-attention keys and values are projected once per encoder output.
- The prompt (earlier committed text) and the forced prefix (words being re-checked) are
  prefilled in one forward pass.
- Rows of a batch may come from different streams with different prompts and audio lengths:
  prompts are left-padded and masked, audio is right-padded and masked, each row stops on
  its own.
- Speculative re-decoding: a stream decodes the same growing window again and again, and
  most of each output equals the previous one. That previous output comes in as a draft, is
  fed with the prefill and verified in the same pass; greedy decoding steps token by token
  only from the first token it disagrees with. The output is greedy decoding's, whatever
  the draft.
- Guards: Whisper's token suppression and timestamp rules, no-speech probability, a token
  cap per audio second, a repeated-n-gram cut, a compression-ratio check, and endings that
  read the words before them again (word for word, loosely, or in no time) cut off.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from server.core.agreement import normalize_word
from server.core.engine_api import (
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    TextSpan,
    WordTiming,
    stop_if_interrupted,
)
from server.engine.blas import vector_matrix
from server.engine.cpu_step import CpuTokenStep, softmax
from server.engine.features import AUDIO_TOKENS_PER_SECOND
from server.engine.model import Whisper
from server.engine.words import align_words

logger = logging.getLogger("server.engine.decoder")

NEG_INF = -np.inf
SECONDS_PER_TIMESTAMP = 0.02
END_SLACK_S = 0.5  # a transcript whose timestamps reach this close to the audio end is whole
# A loose copy of the words before it that aligns to less than this share of their time is
# a reading the audio has no room for (``crammed_copy_start``).
CRAMMED_COPY_SHARE = 0.5
GEMV_MAX_ROWS = 2  # from 3 rows up, one sgemm beats a matrix-vector product per row
# Draft tokens fed with the prefill, at most: about a 15 s window's output (the session's
# longest). Measured on our 2-core CPU: each draft token fed costs 0.6-0.7 ms of prefill, each
# one verified saves a step (10-16 ms), so even a draft mostly wrong costs little.
DRAFT_MAX_TOKENS = 64
# Positions whose logits are computed together while verifying: 8 rows cost 6.5 ms, 48 rows
# 27-32 ms (a 51864 x 384 projection each), so a draft rejected early wastes little.
VERIFY_ROUND_TOKENS = 8


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
    (a trailing partial copy is allowed), or reads them again loosely (``_loose_copy_start``).
    None when the ending repeats nothing. Phrases shorter than ``min_words`` do not count:
    people do repeat a word or two."""
    n = len(keys)
    best: int | None = None
    for k in range(min_words, n // 2 + 1):
        s = n  # walk back while each word equals the one k before it
        while s - 1 - k >= 0 and keys[s - 1] == keys[s - 1 - k]:
            s -= 1
        if n - s >= k and (best is None or s < best):
            best = s
    loose = _loose_copy_start(keys, 2 * min_words + 1)
    if loose is not None and (best is None or loose < best):
        best = loose
    return best


def _loose_copy_start(keys: list[str], min_words: int) -> int | None:
    """Where an ending of at least ``min_words`` words starts that reads the words just
    before it again with a word or two changed (one edit per five words, at least one): a
    beam search at the end of the audio reads the last sentence again, and length
    normalisation ranks the longer text first. Seen on hard speech, where the closing beam
    search of an utterance read its last sentence a second time with a word or two changed,
    tripling the errors of that clip."""
    return next((start for start, _ in _loose_copies(keys, min_words)), None)


def _loose_copies(
    keys: list[str],
    min_words: int,
    timed: Callable[[int, int], bool] = lambda start, before: True,
) -> Iterator[tuple[int, int]]:
    """Each ending of at least ``min_words`` words that reads the words just before it again
    loosely (``_loose_copy_start``), as (its start, how many words before it it reads), the
    longest ending first; only pairs ``timed`` accepts, asked before the words are compared.
    Both copies end alike, which keeps the search to a few candidate lengths."""
    n = len(keys)
    for m in range(n // 2, min_words - 1, -1):
        s = n - m
        if keys[s - 1] != keys[-1]:
            continue
        allowed = max(1, m // 5)
        for la in range(max(min_words, m - allowed), min(s, m + allowed) + 1):
            if timed(s, la) and _word_edits(keys[s - la : s], keys[s:], allowed) <= allowed:
                yield s, la


def crammed_copy_start(words: tuple[WordTiming, ...], min_words: int) -> int | None:
    """The index in ``words`` where an ending starts that reads the words just before it
    again, loosely (``_loose_copies``), in under ``CRAMMED_COPY_SHARE`` of the time they
    took: the audio had no room for it. None when there is none. Seen on a stream's last
    second and a half: a short phrase read twice, the second copy aligned to a third of
    the time of the first. Phrases said twice take about as long each time; too short to
    count under ``_loose_copy_start``'s length, such a copy is told by its time."""
    spoken = [i for i, w in enumerate(words) if normalize_word(w.word)]
    keys = [normalize_word(words[i].word) for i in spoken]

    def crammed(start: int, before: int) -> bool:
        first = words[spoken[start - 1]].end_s - words[spoken[start - before]].start_s
        second = words[spoken[-1]].end_s - words[spoken[start]].start_s
        return second < CRAMMED_COPY_SHARE * first

    return next((spoken[start] for start, _ in _loose_copies(keys, min_words, crammed)), None)


def _word_edits(a: list[str], b: list[str], limit: int) -> int:
    """Word-level edit distance of ``a`` and ``b``; anything above ``limit`` reads as
    ``limit + 1``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    previous = list(range(len(b) + 1))
    for i, word in enumerate(a, start=1):
        current = [i]
        for j, other in enumerate(b, start=1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word != other))
            )
        if min(current) > limit:
            return limit + 1
        previous = current
    return min(previous[-1], limit + 1)


def draft_continuation(draft: tuple[int, ...], n_prefix: int, eot: int) -> tuple[int, ...]:
    """What ``draft`` (an earlier output sequence) guesses after a forced prefix of
    ``n_prefix`` text tokens: everything after its ``n_prefix``-th text token (tokens below
    ``eot``). Its first text tokens are taken to be the prefix: earlier decodes of a stream
    emitted what it forces now. Without a prefix nothing is forced and all of it is a guess.
    """
    if n_prefix == 0:
        return draft
    seen = 0
    for k, t in enumerate(draft):
        if t < eot:
            seen += 1
            if seen == n_prefix:
                return draft[k + 1 :]
    return ()


@dataclass(frozen=True)
class _Prompt:
    """What the prefill feeds for one row, before its draft."""

    tokens: tuple[int, ...]  # earlier text, start tokens, forced prefix
    sot_index: int  # where <|startoftranscript|> is: the no-speech probability is read there
    sample_begin: int  # where the output begins (the forced prefix is part of it)


@dataclass
class _Row:
    """One row's decoding state. Mutable, unlike the values that cross the API: the step
    loop updates it token by token, and it never leaves ``StreamingDecoder.decode``."""

    request: DecodeRequest
    index: int  # the row in the batch (its cross-attention keys and values)
    language: str | None
    prompt: _Prompt
    pad: int  # left padding before the prompt in the prefill
    n_audio: int  # encoder positions of this row's audio (before batch padding)
    max_new: int  # tokens it may sample: the token cap per audio second, the text context
    max_ts: int  # the last timestamp inside the real audio, in timestamp units
    draft: tuple[int, ...]  # the guessed continuation fed with the prefill
    full: list[int]  # the output so far: forced prefix, then sampled tokens
    length: int  # positions fed so far (the next token's positional embedding)
    generated: list[int] = field(default_factory=list)  # sampled tokens only
    token_logprobs: list[float] = field(default_factory=list)  # of the sampled tokens
    sum_logprob: float = 0.0  # end-of-text included
    no_speech_prob: float = 0.0
    stop: StopReason = StopReason.MAX_TOKENS
    done: bool = False
    n_steps: int = 0
    detected: tuple[str, float] | None = None


class _Walk:
    """Greedy decoding along one row's draft, over logits computed ``VERIFY_ROUND_TOKENS``
    positions at a time: a draft that goes wrong early costs little more than its share of
    the prefill."""

    def __init__(self, row: _Row) -> None:
        self.row = row
        self.decided = 0  # walk positions decided: position j follows j draft tokens
        self.accepted = 0  # draft tokens greedy decoding chose too
        self.next_token = -1  # the token after them, decided but not yet fed
        self.finished = False

    def next_round(self) -> range:
        """Walk positions whose logits the next round needs (empty when finished)."""
        if self.finished:
            return range(0)
        return range(self.decided, min(self.decided + VERIFY_ROUND_TOKENS, len(self.row.draft) + 1))

    def record(self, token: int) -> None:
        """Take the token greedy decoding chose at the next walk position (the row has
        already accepted it and applied its stop rules)."""
        j = self.decided
        self.decided += 1
        draft = self.row.draft
        if self.row.done or j == len(draft) or token != draft[j]:
            self.accepted, self.next_token, self.finished = j, token, True


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
        # Token steps in numpy (see ``cpu_step``), where the CPU kernels are on: it computes
        # GELU as they do, and a decode call takes about two thirds of its time on MLX, for
        # one row or eight (bench/README.md, "Where the defaults come from").
        cpu = on_cpu and model.encoder.cpu_kernels_enabled
        self._cpu_step = CpuTokenStep.for_decoder(model.decoder, self._projection) if cpu else None

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
    def _blocks(
        self,
        tokens: mx.array,
        positions: mx.array,
        offset: int,
        caches: list[tuple[mx.array, mx.array]],
        self_mask: mx.array | None,
        cross: list[tuple[mx.array, mx.array]],
        cross_mask: mx.array | None,
    ) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        """Hidden states (rows, tokens, state) of ``tokens`` written at cache column
        ``offset``, and the updated caches."""
        dec = self.model.decoder
        x = dec.token_embedding(tokens) + dec.positional_embedding[positions]
        new_caches = []
        for block, (ck, cv), (xk, xv) in zip(dec.blocks, caches, cross, strict=True):
            x, ck, cv = block.decode(x, ck, cv, offset, self_mask, xk, xv, cross_mask)
            new_caches.append((ck, cv))
        return x, new_caches

    def _forward(
        self,
        tokens: mx.array,
        positions: mx.array,
        offset: int,
        caches: list[tuple[mx.array, mx.array]],
        self_mask: mx.array | None,
        cross: list[tuple[mx.array, mx.array]],
        cross_mask: mx.array | None,
    ) -> tuple[npt.NDArray[np.float32], list[tuple[mx.array, mx.array]]]:
        """Logits after the last of ``tokens`` per row, and the updated caches."""
        x, new_caches = self._blocks(
            tokens, positions, offset, caches, self_mask, cross, cross_mask
        )
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
        self, features: list[mx.array]
    ) -> tuple[list[tuple[mx.array, mx.array]], mx.array | None, list[int]]:
        """Cross-attention keys and values of encoder outputs of any lengths: right-padded
        to the longest and masked."""
        lengths = [int(f.shape[0]) for f in features]
        longest = max(lengths)
        if all(n == longest for n in lengths):
            audio = mx.stack(features)
            mask = None
        else:
            audio = mx.stack([mx.pad(f, [(0, longest - f.shape[0]), (0, 0)]) for f in features])
            pad = np.zeros((len(features), 1, 1, longest), dtype=np.float32)
            for i, n in enumerate(lengths):
                pad[i, 0, 0, n:] = NEG_INF
            mask = mx.array(pad).astype(self.dtype)
        return self.model.decoder.cross_kv(audio.astype(self.dtype)), mask, lengths

    # -- language ----------------------------------------------------------------------
    def detect_language(self, features: list[mx.array]) -> list[tuple[str, float]]:
        """Most likely language per encoder output from the logits after
        <|startoftranscript|>."""
        if not self.vocab.multilingual:
            raise ValueError("language detection needs a multilingual model; pass language='en'")
        tok = self.vocab.tokenizer
        cross, cross_mask, _ = self._cross(features)
        b = len(features)
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
    def decode(self, requests: list[DecodeRequest], features: list[mx.array]) -> list[DecodeResult]:
        """Greedy-decode every request over its encoder output (``features[i]``, (audio
        positions, state)) in lockstep; rows stop independently.

        A request's draft is fed with the prefill and verified there: each draft token that
        greedy decoding would have chosen saves one sequential step. The output does not
        depend on the draft.
        """
        if not requests:
            return []
        if len(features) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(features)} encoder outputs")
        languages, detected = self._languages(requests, features)
        prompts = [self._prompt(r, lang) for r, lang in zip(requests, languages, strict=True)]
        cross, cross_mask, lengths = self._cross(features)
        rows = self._rows(requests, languages, prompts, lengths)
        for row, guess in zip(rows, detected, strict=True):
            row.detected = guess
        caches = self._cache(len(rows))
        cpu_step = self._cpu_step
        if cpu_step is not None and all(len(r.prompt.tokens) == 1 and not r.draft for r in rows):
            next_tokens, valid, offset = self._prefill_start_on_cpu(rows, cpu_step, cross, lengths)
        else:
            next_tokens, valid, offset, caches = self._prefill(rows, caches, cross, cross_mask)
            if cpu_step is not None and not all(row.done for row in rows):
                cpu_step.begin(caches, offset, cross, lengths)
        caches = self._step_loop(
            rows, next_tokens, valid, offset, caches, cross, cross_mask, cpu_step
        )
        self._caches = caches if len(rows) == self._cache_batch else self._caches
        for row in rows:
            # A loop cut mid-audio ("repetition") is left to the caller's fallback: words after
            # it are missing. A whole transcript only needs an ending read twice removed.
            if row.stop in (StopReason.EOT, StopReason.REPEAT_AT_END):
                trimmed = self._trim_repeated_ending(row.full, row.request.options)
                if trimmed is not None:
                    row.full, row.stop = trimmed, StopReason.REPEAT_AT_END
        return [self._result(row, cross) for row in rows]

    def _languages(
        self, requests: list[DecodeRequest], features: list[mx.array]
    ) -> tuple[list[str | None], list[tuple[str, float] | None]]:
        """Each request's language (its own, detected when None, English for English-only
        models) and the detector's guess where it ran."""
        if not self.vocab.multilingual:
            return ["en"] * len(requests), [None] * len(requests)
        languages = [r.options.language for r in requests]
        detected: list[tuple[str, float] | None] = [None] * len(requests)
        needs = [
            i
            for i, r in enumerate(requests)
            if r.options.language is None or r.options.detect_language
        ]
        if needs:
            guesses = self.detect_language([features[i] for i in needs])
            for i, guess in zip(needs, guesses, strict=True):
                detected[i] = guess
                if languages[i] is None:
                    languages[i] = guess[0]
        return languages, detected

    def _prompt(self, r: DecodeRequest, language: str | None) -> _Prompt:
        """Earlier text, the start tokens and the forced prefix of one request."""
        v = self.vocab
        seq: list[int] = []
        if r.prompt:
            seq += [v.sot_prev, *r.prompt[-(self.dims.n_text_ctx // 2 - 1) :]]
        sot_index = len(seq)
        seq.append(v.sot)
        if v.multilingual:
            assert language is not None
            seq += [
                v.language_token(language),
                v.translate if r.options.task == "translate" else v.transcribe,
            ]
        if not r.options.timestamps:
            seq.append(v.no_timestamps)
        sample_begin = len(seq)
        if r.prefix:
            if r.options.timestamps:
                seq.append(v.timestamp_begin)
            seq += r.prefix
        return _Prompt(tuple(seq), sot_index, sample_begin)

    def _rows(
        self,
        requests: list[DecodeRequest],
        languages: list[str | None],
        prompts: list[_Prompt],
        lengths: list[int],
    ) -> list[_Row]:
        """Per-row state with its limits: the token cap, the text context, the last
        timestamp inside the real audio, and how much of its draft to feed."""
        ctx = self.dims.n_text_ctx
        longest = max(len(p.tokens) for p in prompts)
        caps = [
            max(1, min(ctx - longest - 1, int(8 + r.options.max_tokens_per_audio_s * r.audio_s)))
            for r in requests
        ]
        # The rows advance in lockstep from the end of the longest prompt, one column a step.
        steps = min(max(caps), ctx - longest)
        # A row that rejects its whole draft still needs ``steps - 1`` columns after the
        # draft region, all inside the text context.
        room = ctx + 1 - longest - steps
        rows = []
        for i, (r, lang, p, n) in enumerate(
            zip(requests, languages, prompts, lengths, strict=True)
        ):
            max_new = min(caps[i], steps)
            max_ts = min(
                round(min(r.audio_s, n / AUDIO_TOKENS_PER_SECOND) / SECONDS_PER_TIMESTAMP), 1500
            )
            draft = self._draft(r, min(DRAFT_MAX_TOKENS, max_new - 1, room))
            rows.append(
                _Row(
                    request=r,
                    index=i,
                    language=lang,
                    prompt=p,
                    pad=longest - len(p.tokens),
                    n_audio=n,
                    max_new=max_new,
                    max_ts=max_ts,
                    draft=draft,
                    full=list(p.tokens[p.sample_begin :]),
                    length=len(p.tokens),
                )
            )
        return rows

    def _draft(self, r: DecodeRequest, limit: int) -> tuple[int, ...]:
        """The speculative continuation of a request: its draft after the forced prefix, cut
        at end-of-text (nothing is decided after it), at ids outside the vocabulary (the
        embedding cannot look them up) and at ``limit`` tokens."""
        out: list[int] = []
        for t in draft_continuation(r.draft, len(r.prefix), self.vocab.eot):
            if len(out) >= limit or t == self.vocab.eot or not 0 <= t < self.dims.n_vocab:
                break
            out.append(t)
        return tuple(out)

    def _prefill(
        self,
        rows: list[_Row],
        caches: list[tuple[mx.array, mx.array]],
        cross: list[tuple[mx.array, mx.array]],
        cross_mask: mx.array | None,
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_], int, list[tuple[mx.array, mx.array]]]:
        """One forward over every row's prompt and draft, then the drafts verified.

        Prompts are left-padded so they all end at column ``longest``; drafts follow,
        right-padded to the longest draft. Sets each row's no-speech probability, accepts
        the draft tokens greedy decoding chooses too, and returns the tokens to feed next,
        the cache columns each row may attend to (not its left padding, not the draft tokens
        it rejected), and the column the next step writes.
        """
        v = self.vocab
        b = len(rows)
        longest = max(len(row.prompt.tokens) for row in rows)
        width = longest + max(len(row.draft) for row in rows)
        tok_np = np.full((b, width), v.eot, dtype=np.int32)
        pos_np = np.zeros((b, width), dtype=np.int32)
        mask_np = np.full((b, 1, width, width), NEG_INF, dtype=np.float32)
        q_idx = np.arange(width)[:, None]
        k_idx = np.arange(width)[None, :]
        for i, row in enumerate(rows):
            seq = [*row.prompt.tokens, *row.draft]
            p = row.pad
            tok_np[i, p : p + len(seq)] = seq
            pos_np[i, p : p + len(seq)] = np.arange(len(seq))
            allowed = (k_idx <= q_idx) & ((k_idx >= p) | (k_idx == q_idx))
            mask_np[i, 0][allowed] = 0.0
        x, caches = self._blocks(
            mx.array(tok_np),
            mx.array(pos_np),
            0,
            caches,
            mx.array(mask_np).astype(self.dtype),
            cross,
            cross_mask,
        )
        hidden = x.reshape(b * width, x.shape[-1])
        # Row i's walk reads the logits after its prompt (flat row ``ends[i]``) and after each
        # of its draft tokens; the no-speech probability is read at <|startoftranscript|>,
        # which is not the last prompt position when there is earlier text.
        ends = [i * width + longest - 1 for i in range(b)]
        sot_rows = [i * width + row.pad + row.prompt.sot_index for i, row in enumerate(rows)]
        walks = [_Walk(row) for row in rows]
        picks = [(i, j) for i, w in enumerate(walks) for j in w.next_round()]
        # Without earlier text or forced tokens the prompt is <|startoftranscript|> alone:
        # both readings are one row, and one row goes through ``sgemv``.
        flat = sot_rows + [ends[i] + j for i, j in picks]
        unique = sorted(set(flat))
        table = self._logits(hidden[mx.array(unique)])
        both = table[np.searchsorted(unique, flat)]
        no_speech = softmax(both[:b])[:, v.no_speech]
        logits = both[b:]
        while picks:
            for (i, _), row_logits in zip(picks, logits, strict=True):
                # A round may hold positions after the one where the walk ended.
                if not walks[i].finished:
                    walks[i].record(self._take(rows[i], row_logits))
            picks = [(i, j) for i, w in enumerate(walks) for j in w.next_round()]
            if picks:
                logits = self._logits(hidden[mx.array([ends[i] + j for i, j in picks])])

        next_tokens = np.full(b, v.eot, dtype=np.int32)
        valid = np.ones((b, self.dims.n_text_ctx), dtype=np.bool_)
        for i, (row, w) in enumerate(zip(rows, walks, strict=True)):
            row.no_speech_prob = float(no_speech[i])
            if not row.done:
                next_tokens[i] = w.next_token
            row.length += w.accepted
            valid[i, : row.pad] = False
            valid[i, longest + w.accepted : width] = False
        return next_tokens, valid, width, caches

    def _prefill_start_on_cpu(
        self,
        rows: list[_Row],
        cpu_step: CpuTokenStep,
        cross: list[tuple[mx.array, mx.array]],
        lengths: list[int],
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_], int]:
        """``_prefill`` for rows whose prompt is <|startoftranscript|> alone and that have
        no draft (a session's first decode): one numpy step at column 0, whose logits give
        both the no-speech probability and the first token."""
        b = len(rows)
        valid = np.ones((b, self.dims.n_text_ctx), dtype=np.bool_)
        cpu_step.begin([], 0, cross, lengths)
        logits = cpu_step.forward(
            list(range(b)),
            np.array([row.prompt.tokens[0] for row in rows], dtype=np.int32),
            np.zeros(b, dtype=np.int32),
            0,
            valid,
        )
        no_speech = softmax(logits)[:, self.vocab.no_speech]
        next_tokens = np.full(b, self.vocab.eot, dtype=np.int32)
        for i, row in enumerate(rows):
            row.no_speech_prob = float(no_speech[i])
            token = self._take(row, logits[i])
            if not row.done:
                next_tokens[i] = token
        return next_tokens, valid, 1

    def _step_loop(
        self,
        rows: list[_Row],
        next_tokens: npt.NDArray[np.int32],
        valid: npt.NDArray[np.bool_],
        offset: int,
        caches: list[tuple[mx.array, mx.array]],
        cross: list[tuple[mx.array, mx.array]],
        cross_mask: mx.array | None,
        cpu_step: CpuTokenStep | None,
    ) -> list[tuple[mx.array, mx.array]]:
        """One token per row and step until every row is done. All rows write the same cache
        column; each continues its own positions and masks the columns it does not use.
        ``cpu_step``, when given, has taken over the caches and runs every step."""
        while not all(row.done for row in rows):
            stop_if_interrupted()
            positions = np.array([row.length for row in rows], dtype=np.int32)
            if cpu_step is not None:
                active = [i for i, row in enumerate(rows) if not row.done]
                logits = cpu_step.forward(active, next_tokens, positions, offset, valid)
                if len(active) < len(rows):  # rows that are done read no logits
                    stepped, logits = logits, np.empty((len(rows), logits.shape[1]), np.float32)
                    logits[active] = stepped
            else:
                mask = np.where(valid[:, None, None, : offset + 1], 0.0, NEG_INF)
                logits, caches = self._forward(
                    mx.array(next_tokens[:, None]),
                    mx.array(positions[:, None]),
                    offset,
                    caches,
                    mx.array(mask.astype(np.float32)).astype(self.dtype),
                    cross,
                    cross_mask,
                )
            offset += 1
            for i, row in enumerate(rows):
                row.length += 1
                if row.done:
                    next_tokens[i] = self.vocab.eot
                    continue
                row.n_steps += 1
                next_tokens[i] = self._take(row, logits[i])
        return caches

    def _take(self, row: _Row, logits: npt.NDArray[np.float32]) -> int:
        """Choose one row's next token greedily and apply the stop rules: end-of-text, a
        repeated n-gram, the token cap. Returns the token (end-of-text included)."""
        v = self.vocab
        opts = row.request.options
        first = not row.generated and not row.request.prefix
        x = self._filter(logits, row.full, opts, row.max_ts, first=first)
        tok = int(np.argmax(x))
        lse = np.log(np.sum(np.exp(x - x[tok])))  # log-softmax of the chosen token
        logprob = float(-lse)
        row.sum_logprob += logprob
        if tok == v.eot:
            row.done = True
            row.stop = StopReason.EOT
            return tok
        row.generated.append(tok)
        row.full.append(tok)
        row.token_logprobs.append(logprob)
        looped = self._loop_cut(row.full, opts, row.max_ts)
        if looped is not None:
            row.full, row.stop = looped
            row.done = True
        elif len(row.generated) >= row.max_new:
            row.done = True
        return tok

    def _loop_cut(
        self, seq: list[int], opts: DecodeOptions, max_ts: int
    ) -> tuple[list[int], StopReason] | None:
        """When the text of ``seq`` ends in a loop: ``seq`` cut where the loop began, and
        why it stopped; None otherwise."""
        text_only = [t for t in seq if t < self.vocab.eot]
        cut = repeated_tail(
            text_only,
            opts.repetition_max_ngram,
            opts.repetition_min_repeats,
            opts.repetition_phrase_tokens,
        )
        if cut is None:
            return None
        kept = self._truncate_text(seq, cut)
        # Starting the whole transcript over means the first copy covered the audio; so do
        # timestamps that reached its end.
        restarted = text_only[cut : 2 * cut] == text_only[:cut]
        if restarted or self._reached_end(kept, max_ts):
            return kept, StopReason.REPEAT_AT_END
        return kept, StopReason.REPETITION

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

    def _result(self, row: _Row, cross: list[tuple[mx.array, mx.array]]) -> DecodeResult:
        v = self.vocab
        r = row.request
        opts = r.options
        seq, generated, stop = row.full, row.generated, row.stop
        text_tokens = tuple(t for t in seq if t < v.eot)
        text = v.text(text_tokens)
        avg_logprob = row.sum_logprob / (len(generated) + 1)
        ratio = compression_ratio(text)
        no_speech_prob = row.no_speech_prob
        # Whisper's rule needs both signals; silence that slips past VAD ("you", ".") comes with
        # a confident log-probability, so a near-certain no-speech probability suffices alone.
        if no_speech_prob > opts.no_speech_certain or (
            no_speech_prob > opts.no_speech_threshold and avg_logprob < opts.logprob_threshold
        ):
            stop = StopReason.NO_SPEECH
        elif ratio > opts.compression_ratio_threshold:
            stop = StopReason.COMPRESSION
        if not stop.is_speech:
            text_tokens, text = (), ""
        words: tuple[WordTiming, ...] = ()
        if opts.word_timestamps and text_tokens:
            # Probabilities are known for sampled tokens; forced ones count as certain.
            forced = len(text_tokens) - len([t for t in generated if t < v.eot])
            probs = [1.0] * max(forced, 0) + [
                math.exp(lp)
                for lp, t in zip(row.token_logprobs, generated, strict=True)
                if t < v.eot
            ]
            n_frames = min(row.n_audio, max(1, math.ceil(r.audio_s * AUDIO_TOKENS_PER_SECOND)))
            words = tuple(self._words(r, row, list(text_tokens), probs, cross, n_frames))
            start = crammed_copy_start(words, opts.repetition_phrase_words)
            kept = sum(len(w.tokens) for w in words[:start]) if start is not None else 0
            if start is not None and kept >= len(r.prefix):
                row.full, row.stop = self._truncate_text(seq, kept), StopReason.REPEAT_AT_END
                return self._result(row, cross)
        return DecodeResult(
            tokens=text_tokens,
            text=text,
            spans=self._spans(seq) if stop.is_speech else (),
            words=words,
            language=row.language,
            avg_logprob=avg_logprob,
            no_speech_prob=no_speech_prob,
            compression_ratio=ratio,
            stop_reason=stop,
            n_generated=len(generated),
            sequence=tuple(seq),
            n_steps=row.n_steps,
            detected=row.detected,
        )

    def _spans(self, seq: list[int]) -> tuple[TextSpan, ...]:
        v = self.vocab
        tb = v.timestamp_begin
        out: list[TextSpan] = []
        start: float | None = None
        current: list[int] = []
        last_time = 0.0
        for t in seq:
            if t >= tb:
                time_s = (t - tb) * SECONDS_PER_TIMESTAMP
                if start is None:
                    start = time_s
                elif current:
                    out.append(TextSpan(start, time_s, v.text(current), tuple(current)))
                    current, start = [], None
                else:
                    start = time_s
                last_time = time_s
            elif t < v.eot:
                current.append(t)
        if current:
            out.append(
                TextSpan(
                    start if start is not None else last_time, -1.0, v.text(current), tuple(current)
                )
            )
        return tuple(out)

    def _words(
        self,
        r: DecodeRequest,
        row: _Row,
        text_tokens: list[int],
        probs: list[float],
        cross: list[tuple[mx.array, mx.array]],
        n_frames: int,
    ) -> list[WordTiming]:
        v = self.vocab
        language = row.language
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
            # The row's own audio positions: a batch pads shorter audio to the longest.
            i, n = row.index, row.n_audio
            xk_r, xv_r = xk[i : i + 1, :, :n], xv[i : i + 1, :, :n]
            if li == last_layer:
                weights_per_layer[li] = block.cross_weights(x, causal, xk_r)[0]
                break
            x, w = block.decode_full(x, causal, xk_r, xv_r, li in wanted_layers)
            if w is not None:
                weights_per_layer[li] = w[0]
        stacked = mx.stack([weights_per_layer[layer][head] for layer, head in heads])
        weights = np.array(stacked[:, begin:, :].astype(mx.float32))
        words, word_tokens = v.tokenizer.split_to_word_tokens([*text_tokens, v.eot])
        pairs = [(w, toks) for w, toks in zip(words[:-1], word_tokens[:-1], strict=True)]
        return align_words(weights, pairs, probs, n_frames)

    _alignment_heads: tuple[tuple[int, int], ...] = ()

    def set_alignment_heads(self, heads: tuple[tuple[int, int], ...]) -> None:
        self._alignment_heads = heads
