// Subtitle cues from timed words: the page's copy of client/subtitles.py (the rules are
// written out there), for its SRT and VTT downloads. Same decisions, same arithmetic, same
// rounding: tests/test_web_page.py checks that both give the same files for the same words.
// Plain script, no build step: defines window.WhisperwireSubtitles.
"use strict";

(() => {
  const DEFAULTS = Object.freeze({
    maxLineChars: 42,
    maxLines: 2,
    minDurationS: 1.0,
    maxDurationS: 7.0,
    minGapS: 0.08,
    chainGapS: 0.5,
    pauseBreakS: 1.0,
    maxCharsPerS: 20.0,
  });
  const SENTENCE_END = new Set([...".?!…。？！"]);
  const CLAUSE_END = new Set([...",;:–—、，；："]);
  const CLOSERS = new Set([..."\"'”’»)]}"]);
  const JOINING = /^[\p{Pe}\p{Pf}\p{Po}]/u; // unicodedata categories Pe, Pf, Po
  const MIN_VISIBLE_S = 0.04;

  // Lengths in code points, as Python's len().
  const chars = (text) => [...text].length;

  function endsWith(text, marks) {
    const cps = [...text];
    while (cps.length && CLOSERS.has(cps[cps.length - 1])) cps.pop();
    return cps.length > 0 && marks.has(cps[cps.length - 1]);
  }
  const endsSentence = (text) => endsWith(text, SENTENCE_END);
  const endsClause = (text) => endsWith(text, CLAUSE_END);
  const joins = (piece) => JOINING.test(piece);

  function joinText(before, after) {
    if (!before || !after) return before || after;
    return joins(after) ? before + after : `${before} ${after}`;
  }

  // speaker: who said it (0, 1, ...) with speaker labels, else null.
  const word = (text, startS, endS, joinsPrevious = false, speaker = null) => ({ text, startS, endS, joinsPrevious, speaker });

  function merge(words, piece) {
    const last = words[words.length - 1];
    words[words.length - 1] = word(last.text + piece.text, last.startS, Math.max(last.endS, piece.endS), last.joinsPrevious, last.speaker);
  }

  // How a speaker is shown by default (client/subtitles.py speaker_name): S1 for speaker 0.
  const speakerName = (speaker) => `S${speaker + 1}`;

  function estimatedWords(text, startS, endS) {
    const tokens = text.split(/\s+/).filter(Boolean);
    const total = tokens.reduce((n, t) => n + chars(t), 0);
    const out = [];
    let at = 0;
    for (const token of tokens) {
      const t0 = startS + ((endS - startS) * at) / total;
      at += chars(token);
      const t1 = startS + ((endS - startS) * at) / total;
      out.push(word(token, t0, t1, out.length === 0 && joins(token)));
    }
    return out;
  }

  // A final message's words, joined into subtitle words the way its text spaces them.
  function wordsFromFinal(msg) {
    const text = msg.text;
    if (!msg.words || msg.words.length === 0) return estimatedWords(text, msg.start, msg.end);
    const out = [];
    let pos = 0;
    for (const w of msg.words) {
      const piece = w.word.trim();
      if (!piece) continue;
      const found = text.indexOf(piece, pos);
      let spaced;
      if (found < 0) {
        spaced = !joins(piece);
      } else {
        spaced = found > pos;
        pos = found + piece.length;
      }
      const speaker = typeof w.speaker === "number" ? w.speaker : null;
      const next = word(piece, w.start, w.end, false, speaker);
      if (out.length === 0) out.push(word(piece, w.start, w.end, joins(piece), speaker));
      else if (spaced) out.push(next);
      else merge(out, next);
    }
    return out.length ? out : estimatedWords(text, msg.start, msg.end);
  }

  function layout(texts, c) {
    const text = texts.join(" ");
    if (chars(text) <= c.maxLineChars || texts.length === 1) return [text];
    if (c.maxLines < 2) return null;
    let best = null;
    for (let i = 1; i < texts.length; i++) {
      const top = texts.slice(0, i).join(" ");
      const bottom = texts.slice(i).join(" ");
      if (chars(top) > c.maxLineChars || chars(bottom) > c.maxLineChars) continue;
      const kind = endsSentence(texts[i - 1]) ? 0 : endsClause(texts[i - 1]) ? 1 : 2;
      const imbalance = Math.abs(chars(top) - chars(bottom));
      if (best === null || kind < best.kind || (kind === best.kind && imbalance < best.imbalance)) {
        best = { kind, imbalance, top, bottom };
      }
    }
    return best === null ? null : [best.top, best.bottom];
  }

  function wrapped(texts, c) {
    const lines = [];
    for (const t of texts) {
      if (lines.length && chars(lines[lines.length - 1]) + 1 + chars(t) <= c.maxLineChars) {
        lines[lines.length - 1] += ` ${t}`;
      } else {
        lines.push(t);
      }
    }
    return lines;
  }

  const pause = (before, after) => Math.max(0.0, after.startS - before.endS);

  class CueBuilder {
    // name(speaker): the speaker's name in SRT labels (speakerName unless renamed).
    constructor(config = {}, name = speakerName) {
      this.c = { ...DEFAULTS, ...config };
      this.name = name;
      this.open = [];
      this.closed = [];
      this.noWordsBeforeS = -Infinity;
      this.lastEndS = null;
      this.lastWord = null;
      this.closedSpeaker = null; // of the last words closed into a cue
      this.emittedSpeaker = null; // of the last cue given out
    }

    addWord(w) {
      w = this.inOrder(w);
      if (w.joinsPrevious && this.open.length) {
        const last = this.open[this.open.length - 1];
        const merged = word(last.text + w.text, last.startS, Math.max(last.endS, w.endS), last.joinsPrevious, last.speaker);
        if (this.fits([...this.open.slice(0, -1), merged])) {
          this.open[this.open.length - 1] = merged;
          this.lastWord = merged;
          return this.ready();
        }
        w = word(merged.text, merged.startS, merged.endS, false, merged.speaker);
        this.open.pop();
      }
      if (this.open.length && (this.breaksBefore(w.startS) || w.speaker !== this.open[this.open.length - 1].speaker)) {
        this.close(this.open.length);
      }
      while (this.open.length && !this.fits([...this.open, w])) this.close(this.splitPoint(w));
      this.open.push(w);
      this.lastWord = w;
      return this.ready();
    }

    finish() {
      if (this.open.length) this.close(this.open.length);
      const cues = this.ready();
      while (this.closed.length) cues.push(this.emit(this.closed.shift(), null));
      return cues;
    }

    inOrder(w) {
      const last = this.lastWord;
      const start = last === null ? w.startS : Math.max(w.startS, last.startS);
      return word(w.text, start, Math.max(w.endS, start), w.joinsPrevious, w.speaker);
    }

    breaksBefore(nextStartS) {
      const c = this.c;
      return (
        nextStartS - this.open[this.open.length - 1].endS >= c.pauseBreakS &&
        nextStartS - this.open[0].startS >= c.minDurationS + c.minGapS
      );
    }

    fits(words) {
      if (words.length > 1 && words[words.length - 1].endS - words[0].startS > this.c.maxDurationS) return false;
      return layout(this.texts(words, this.closedSpeaker), this.c) !== null;
    }

    // The words' texts, the first led by its speaker's SRT tag where the speaker changes.
    texts(words, speakerBefore) {
      const texts = words.map((w) => w.text);
      const first = words.length ? words[0].speaker : null;
      if (first !== null && first !== speakerBefore) texts[0] = `[${this.name(first)}] ${texts[0]}`;
      return texts;
    }

    splitPoint(next) {
      const c = this.c;
      const words = this.open;
      const n = words.length;
      const nextStart = (i) => (i < n ? words[i].startS : next.startS);
      const pauseAt = (i) => pause(words[i - 1], i < n ? words[i] : next);
      const points = [];
      for (let i = 1; i <= n; i++) points.push(i);
      const roomy = points.filter((i) => nextStart(i) - words[0].startS >= c.minDurationS + c.minGapS);
      const candidates = roomy.length ? roomy : points;
      for (const ends of [endsSentence, endsClause]) {
        const found = candidates.filter((i) => ends(words[i - 1].text));
        if (found.length) return found[found.length - 1];
      }
      let best = candidates[0];
      for (const i of candidates) if (pauseAt(i) >= pauseAt(best)) best = i;
      return best;
    }

    close(count) {
      this.closed.push(this.open.slice(0, count));
      this.closedSpeaker = this.open[count - 1].speaker;
      this.open = this.open.slice(count);
    }

    ready() {
      const cues = [];
      while (this.closed.length) {
        let nextStart;
        if (this.closed.length > 1) nextStart = this.closed[1][0].startS;
        else if (this.open.length) nextStart = this.open[0].startS;
        else {
          const [, desired] = this.span(this.closed[0]);
          if (this.noWordsBeforeS - desired < this.c.chainGapS) break;
          nextStart = null;
        }
        cues.push(this.emit(this.closed.shift(), nextStart));
      }
      return cues;
    }

    span(words) {
      const c = this.c;
      let start = words[0].startS;
      if (this.lastEndS !== null) start = Math.max(start, this.lastEndS + c.minGapS);
      const n = chars(words.map((w) => w.text).join(" "));
      const end = Math.max(words[words.length - 1].endS, start + c.minDurationS, start + n / c.maxCharsPerS);
      return [start, end];
    }

    emit(words, nextStartS) {
      const c = this.c;
      let [start, end] = this.span(words);
      if (nextStartS !== null && nextStartS - end < c.chainGapS) end = nextStartS - c.minGapS;
      end = Math.max(Math.min(end, start + c.maxDurationS), start + MIN_VISIBLE_S);
      this.lastEndS = end;
      const speaker = words[0].speaker;
      const speakerChanged = speaker !== null && speaker !== this.emittedSpeaker;
      this.emittedSpeaker = speaker;
      const texts = this.texts(words, speakerChanged ? null : speaker);
      const lines = layout(texts, c) || wrapped(texts, c);
      if (speakerChanged) {
        const tag = `[${this.name(speaker)}] `;
        if (lines[0].startsWith(tag)) lines[0] = lines[0].slice(tag.length); // SRT puts it back
      }
      return { startS: start, endS: end, lines, speaker, speakerChanged };
    }
  }

  function buildCues(words, config, name = speakerName) {
    const builder = new CueBuilder(config, name);
    const cues = [];
    for (const w of words) cues.push(...builder.addWord(w));
    cues.push(...builder.finish());
    return cues;
  }

  // Python's math.floor(x * 1000 + 0.5): half a millisecond rounds up in both.
  function splitMs(seconds) {
    let ms = Math.max(0, Math.floor(seconds * 1000 + 0.5));
    const h = Math.floor(ms / 3600000);
    ms -= h * 3600000;
    const m = Math.floor(ms / 60000);
    ms -= m * 60000;
    const s = Math.floor(ms / 1000);
    ms -= s * 1000;
    const two = (x) => String(x).padStart(2, "0");
    return [two(h), two(m), two(s), String(ms).padStart(3, "0")];
  }
  const srtTime = (x) => { const [h, m, s, ms] = splitMs(x); return `${h}:${m}:${s},${ms}`; };
  const vttTime = (x) => { const [h, m, s, ms] = splitMs(x); return `${h}:${m}:${s}.${ms}`; };
  const clean = (line) => line.split(/\s+/).filter(Boolean).join(" ");
  const escapeVtt = (line) => line.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

  // A cue's SRT lines: the first led by [name] where the speaker changes.
  function srtLines(cue, name) {
    const lines = cue.lines.map(clean);
    if (cue.speakerChanged && lines.length) lines[0] = `[${name(cue.speaker)}] ${lines[0]}`;
    return lines;
  }

  function srtDocument(cues, name = speakerName) {
    return cues
      .map((cue, i) => `${i + 1}\n${srtTime(cue.startS)} --> ${srtTime(cue.endS)}\n${srtLines(cue, name).join("\n")}\n\n`)
      .join("");
  }

  // A cue with a speaker is one voice span, <v S1>...</v> (the name escaped as text is).
  function vttText(cue, name) {
    const text = cue.lines.map((l) => escapeVtt(clean(l))).join("\n");
    return cue.speaker === null || cue.speaker === undefined ? text : `<v ${escapeVtt(name(cue.speaker))}>${text}</v>`;
  }

  function vttDocument(cues, name = speakerName) {
    const body = cues
      .map((cue) => `${vttTime(cue.startS)} --> ${vttTime(cue.endS)}\n${vttText(cue, name)}\n\n`)
      .join("");
    return `WEBVTT\n\n${body}`;
  }

  window.WhisperwireSubtitles = Object.freeze({
    wordsFromFinal, buildCues, srtDocument, vttDocument, joinText, endsSentence, speakerName,
  });
})();
