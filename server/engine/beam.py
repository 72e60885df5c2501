"""Beam search and best-of sampling over the streaming decoder's forward pass.

The rules are OpenAI Whisper's (``decoding.py``: ``BeamSearchDecoder`` and
``MaximumLikelihoodRanker``):

- Beam search (temperature 0, ``beam_size`` > 1): each live hypothesis proposes its
  ``beam_size + 1`` most likely next tokens, after the same logit filters as greedy decoding
  (blank and symbol suppression, the timestamp rules); the ``beam_size`` best proposals that do
  not end the text live on, those that end it are finished. The search stops once
  ``round(beam_size * patience)`` hypotheses have finished, or at the token cap, where the live
  ones fill the pool up to ``beam_size``.
- Sampling (temperature > 0): ``best_of`` independent hypotheses, each token drawn from
  softmax(logits / temperature); the pool is every hypothesis once all have ended.
- Ranking: the sum of log-probabilities (end-of-text included) over the sampled length, or
  over ((5 + length) / 6) ** ``length_penalty``. Log-probabilities are of the filtered logits
  at temperature 1, as in Whisper.

One request at a time: its hypotheses are the rows of one batch that share the request's
prefill (computed once, then its self-attention cache is gathered per hypothesis) and its
encoder output. A hypothesis whose text starts looping is finished there (the greedy decoder's
repeated-n-gram cut), so a search never runs a loop to the token cap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from server.core.engine_api import (
    DecodeOptions,
    DecodeRequest,
    DecodeResult,
    StopReason,
    stop_if_interrupted,
)
from server.engine.cpu_step import softmax
from server.engine.decoder import NEG_INF, StreamingDecoder

logger = logging.getLogger("server.engine.beam")


@dataclass(frozen=True)
class _Hypothesis:
    tokens: tuple[int, ...]  # sampled tokens, end-of-text excluded
    logprobs: tuple[float, ...]  # of each sampled token
    sum_logprob: float  # end-of-text's included once finished
    parent: int  # the row of the last forward pass whose cache it continues
    stop: StopReason = StopReason.EOT


def rank_score(sum_logprob: float, length: int, length_penalty: float | None) -> float:
    """Whisper's ``MaximumLikelihoodRanker`` score of one finished hypothesis."""
    n = max(1, length)
    penalty = n if length_penalty is None else ((5 + n) / 6) ** length_penalty
    return sum_logprob / penalty


def log_softmax(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    finite = x[np.isfinite(x)]
    if not finite.size:
        return np.full(x.shape, NEG_INF)
    m = float(finite.max())
    y: npt.NDArray[np.float64] = x.astype(np.float64) - m
    return y - float(np.log(np.sum(np.exp(y))))


def top_logprobs(x: npt.NDArray[np.float32], k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest tokens of the filtered logits ``x`` with their log-probabilities,
    likeliest first (of equals, the lower token first); tokens filtered out never.

    The values are ``log_softmax``'s, to the bit. A beam step asks this of every hypothesis:
    ``argpartition`` over the vocabulary and the whole float64 ``log_softmax`` took 1.2 ms a
    hypothesis (6 of a beam-5 step's 27 ms on our CPUs); k ``argmax`` calls and one sum, 0.5.
    """
    m = float(np.max(x))
    if not np.isfinite(m):
        return []
    lse = float(np.log(np.sum(np.exp(x.astype(np.float64) - m))))
    rest = x.copy()
    out: list[tuple[int, float]] = []
    for _ in range(min(k, x.shape[0])):
        token = int(np.argmax(rest))
        if not np.isfinite(rest[token]):
            break
        out.append((token, (float(x[token]) - m) - lse))
        rest[token] = NEG_INF
    return out


def search(
    decoder: StreamingDecoder, requests: list[DecodeRequest], features: list[mx.array]
) -> list[DecodeResult]:
    """Decode each request by beam search or best-of sampling (``DecodeOptions.searches``)."""
    languages, detected = decoder._languages(requests, features)
    return [
        _Search(decoder, r, language, feature).run(guess)
        for r, language, feature, guess in zip(requests, languages, features, detected, strict=True)
    ]


class _Search:
    """The search of one request: its prefill, its hypotheses, and the result chosen."""

    def __init__(
        self,
        decoder: StreamingDecoder,
        request: DecodeRequest,
        language: str | None,
        feature: mx.array,
    ) -> None:
        self.decoder = decoder
        self.request = request
        self.options: DecodeOptions = request.options
        self.prompt = decoder._prompt(request, language)
        self.cross, _, lengths = decoder._cross([feature])
        self.cross_lengths = lengths
        # The row carries the limits (token cap, last timestamp) and the forced prefix.
        (self.row,) = decoder._rows(
            [replace(request, draft=())], [language], [self.prompt], lengths
        )
        opts = self.options
        self.sampling = opts.temperature > 0
        self.width = opts.best_of if self.sampling else opts.beam_size
        self.rng = np.random.default_rng(opts.seed)

    def run(self, detected: tuple[str, float] | None) -> DecodeResult:
        decoder, row, opts = self.decoder, self.row, self.options
        logits, caches, no_speech = self._prefill()
        offset = len(self.prompt.tokens)
        cpu_step = decoder._cpu_step
        cross_rows: list[tuple[mx.array, mx.array]] = []
        if cpu_step is not None:
            cpu_step.begin(caches, offset, self.cross, self.cross_lengths, self.width)
        else:
            cross_rows = [
                (mx.repeat(k, self.width, axis=0), mx.repeat(val, self.width, axis=0))
                for k, val in self.cross
            ]
        valid = np.ones((self.width, decoder.dims.n_text_ctx), dtype=np.bool_)
        live = [_Hypothesis((), (), 0.0, 0)] * (self.width if self.sampling else 1)
        finished: list[_Hypothesis] = []
        capped: list[_Hypothesis] = []
        steps = 0
        while live:
            stop_if_interrupted()
            proposals = self._propose(live, logits)
            live, ended = self._select(proposals)
            for h in ended:
                if self.sampling or len(finished) < round(self.width * opts.patience):
                    finished.append(h)
            live = self._guard(live, finished, capped)
            if not self.sampling and len(finished) >= round(self.width * opts.patience):
                break
            if not live:
                break
            parents = [h.parent for h in live]
            n = len(live)
            tokens = np.array([h.tokens[-1] for h in live], dtype=np.int32)
            if cpu_step is not None:
                cpu_step.reorder(parents, offset)
                logits = cpu_step.forward(
                    list(range(n)), tokens, np.full(n, offset, dtype=np.int32), offset, valid
                )
            else:
                index = mx.array(parents)
                caches = [
                    (mx.take(k, index, axis=0), mx.take(val, index, axis=0)) for k, val in caches
                ]
                logits, caches = decoder._forward(
                    mx.array(tokens[:, None]),
                    mx.full((n, 1), offset, dtype=mx.int32),
                    offset,
                    caches,
                    None,
                    [(k[:n], val[:n]) for k, val in cross_rows],
                    None,
                )
            live = [replace(h, parent=j) for j, h in enumerate(live)]
            offset += 1
            steps += 1
        # A hypothesis cut for looping is chosen only when nothing else finished: length
        # normalisation favours a loop of likely tokens ("... ... ..."), the longer the better.
        pool = [h for h in finished if not h.stop.looped] or finished
        if len(pool) < self.width:
            # The token cap ended the search: live hypotheses fill the pool, best first.
            rest = sorted(capped, key=lambda h: h.sum_logprob, reverse=True)
            pool = pool + rest[: self.width - len(pool)]
        best = max(
            pool,
            key=lambda h: rank_score(h.sum_logprob, len(h.tokens), opts.length_penalty),
        )
        row.full = [*row.full, *best.tokens]
        row.generated = list(best.tokens)
        row.token_logprobs = list(best.logprobs)
        row.sum_logprob = best.sum_logprob
        row.no_speech_prob = no_speech
        row.stop = best.stop
        row.n_steps = steps
        row.detected = detected
        row.done = True
        if row.stop in (StopReason.EOT, StopReason.REPEAT_AT_END):
            trimmed = decoder._trim_repeated_ending(row.full, opts)
            if trimmed is not None:
                row.full, row.stop = trimmed, StopReason.REPEAT_AT_END
        logger.debug(
            "search width %d: %d steps, %d finished, score %.3f",
            self.width,
            steps,
            len(finished),
            rank_score(best.sum_logprob, len(best.tokens), opts.length_penalty),
        )
        return decoder._result(row, self.cross)

    def _prefill(
        self,
    ) -> tuple[npt.NDArray[np.float32], list[tuple[mx.array, mx.array]], float]:
        """The prompt fed once, into a one-row cache: the logits after it, the cache, and the
        no-speech probability read at <|startoftranscript|>."""
        decoder = self.decoder
        d = decoder.dims
        shape = (1, d.n_text_head, d.n_text_ctx, d.n_text_state // d.n_text_head)
        caches = [
            (mx.zeros(shape, dtype=decoder.dtype), mx.zeros(shape, dtype=decoder.dtype))
            for _ in range(d.n_text_layer)
        ]
        tokens = self.prompt.tokens
        t = len(tokens)
        causal = np.triu(np.full((t, t), NEG_INF, dtype=np.float32), 1)[None, None]
        x, caches = decoder._blocks(
            mx.array([tokens], dtype=mx.int32),
            mx.arange(t)[None],
            0,
            caches,
            mx.array(causal).astype(decoder.dtype),
            self.cross,
            None,
        )
        both = decoder._logits(x[0][mx.array([self.prompt.sot_index, t - 1])])
        no_speech = float(softmax(both[:1])[0, decoder.vocab.no_speech])
        return both[1:], caches, no_speech

    def _propose(
        self, live: list[_Hypothesis], logits: npt.NDArray[np.float32]
    ) -> list[tuple[float, _Hypothesis, int, float]]:
        """(score, parent, token, token log-probability) of every continuation considered."""
        decoder, row, opts = self.decoder, self.row, self.options
        out: list[tuple[float, _Hypothesis, int, float]] = []
        for h in live:
            seq = [*row.full, *h.tokens]
            first = not h.tokens and not self.request.prefix
            x = decoder._filter(logits[h.parent], seq, opts, row.max_ts, first=first)
            if self.sampling:
                logprobs = log_softmax(x)
                p = softmax((x / opts.temperature)[None])[0].astype(np.float64)
                token = int(self.rng.choice(p.shape[0], p=p / p.sum()))
                out.append((h.sum_logprob + logprobs[token], h, token, float(logprobs[token])))
                continue
            for token, lp in top_logprobs(x, self.width + 1):
                out.append((h.sum_logprob + lp, h, token, lp))
        return out

    def _select(
        self, proposals: list[tuple[float, _Hypothesis, int, float]]
    ) -> tuple[list[_Hypothesis], list[_Hypothesis]]:
        """The hypotheses that live on and those that ended, from the proposals."""
        eot = self.decoder.vocab.eot
        if not self.sampling:
            proposals = sorted(proposals, key=lambda p: p[0], reverse=True)
        live: list[_Hypothesis] = []
        ended: list[_Hypothesis] = []
        for score, h, token, lp in proposals:
            if token == eot:
                ended.append(replace(h, sum_logprob=score))
                continue
            live.append(_Hypothesis((*h.tokens, token), (*h.logprobs, lp), score, h.parent))
            if not self.sampling and len(live) == self.width:
                break
        return live, ended

    def _guard(
        self, live: list[_Hypothesis], finished: list[_Hypothesis], capped: list[_Hypothesis]
    ) -> list[_Hypothesis]:
        """Finish hypotheses that loop (cut where the loop began) and set aside those at the
        token cap; return the ones that go on."""
        decoder, row = self.decoder, self.row
        going: list[_Hypothesis] = []
        for h in live:
            looped = decoder._loop_cut([*row.full, *h.tokens], self.options, row.max_ts)
            if looped is not None:
                full, stop = looped
                kept = max(0, len(full) - len(row.full))
                finished.append(
                    _Hypothesis(h.tokens[:kept], h.logprobs[:kept], h.sum_logprob, h.parent, stop)
                )
            elif len(h.tokens) >= row.max_new:
                capped.append(replace(h, stop=StopReason.MAX_TOKENS))
            else:
                going.append(h)
        return going
