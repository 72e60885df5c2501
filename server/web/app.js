// Whisperwire browser client: microphone -> AudioWorklet (16 kHz s16le) -> WebSocket,
// live captions back. Plain JavaScript, no build step. Protocol: docs/protocol.md.
//
// Stable hooks for tests and embedding: #start, #status, #transcript (a <p> per utterance,
// .final spans and one .partial), #ttft, #latency, #chart, #level, #model, #language,
// #connection, #download-txt, #download-srt, #download-vtt, #copy, body[data-state]
// (idle | starting | running | stopping) and window.whisperwire (counters and data).
//
// Reconnects resume with overlap, as client/reconnect.py does: a session its server ends
// mid-speech (a drain: its last finals, "done", close 1001) is cut mid-word, and the cut
// word is lost unless someone hears it again. So the page keeps the audio it captured from
// a little before the second-last final word on (SEAM_WORDS, RESUME_BEFORE_SEAM_S), starts the
// next session there and sends that audio first, then the live audio; the words the new
// session repeats at the seam are dropped from its first final (client/timeline.py,
// drop_seam_repeat).
//
// A full server refuses the handshake with 503 and Retry-After, which a browser does not
// show to the page (the WebSocket just closes with 1006): the page asks /readyz, which says
// 503 with the same Retry-After while the server is full, shows the wait (#connection
// "waiting", a countdown in #status) and tries again then, MAX_FULL_WAITS times at most.
"use strict";

(() => {
  const TARGET_RATE = 16000;
  const CHUNK_MS = 100;
  // Final words a resumed session hears again (client/reconnect.py SEAM_WORDS: the server
  // keeps as many at its own window cuts).
  const SEAM_WORDS = 2;
  const SEAM_REPEAT_WINDOW_S = 1.0; // a repeat is looked for only this close to the seam
  // client/timeline.py: a session resumes this long before the first seam word (whose start
  // may be placed a syllable late), and an opening word that ends by the seam's end, give or
  // take SEAM_END_TOLERANCE_S, was heard before, whatever it was heard as.
  const RESUME_BEFORE_SEAM_S = 0.25;
  const SEAM_END_TOLERANCE_S = 0.05;
  // Audio kept for a resend (client/reconnect.py RetryPolicy.max_replay_s): a cap for long
  // speech without a final; past it the oldest is dropped, with a warning.
  const MAX_REPLAY_S = 60;
  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 10000;
  const DONE_TIMEOUT_MS = 10000; // after "end", how long to wait for "done"
  // A full server refuses the handshake with 503 and Retry-After, which a browser cannot
  // read from a failed WebSocket: the page asks /readyz, which says 503 with the same hint
  // while the server is full. It waits that long this many times in a row, then gives up;
  // at the server's 5 s that is 50 s, within the MAX_REPLAY_S of audio kept meanwhile, so
  // what was said while waiting is transcribed once a seat frees.
  const MAX_FULL_WAITS = 10;
  const RETRY_AFTER_MAX_S = 60; // a bad hint must not stall the page (RetryPolicy.retry_after_max_s)
  // Close codes that retrying cannot fix: bad audio, policy (auth, Origin), frame too large.
  const NO_RETRY_CODES = new Set([1003, 1008, 1009]);
  const TIME_EPSILON_S = 1e-6;
  const LEVEL_FLOOR_DB = -60; // the meter's empty end; 0 dBFS is full
  const SCROLL_SLACK_PX = 8; // this close to the bottom counts as reading the newest text

  const Subtitles = window.WhisperwireSubtitles;
  const Chart = window.WhisperwireChart;
  const ui = {
    start: document.getElementById("start"),
    status: document.getElementById("status"),
    transcript: document.getElementById("transcript"),
    ttft: document.getElementById("ttft"),
    latency: document.getElementById("latency"),
    chart: document.getElementById("chart"),
    level: document.getElementById("level"),
    model: document.getElementById("model"),
    language: document.getElementById("language"),
    connection: document.getElementById("connection"),
    copied: document.getElementById("copied"),
    downloads: [...document.querySelectorAll("[data-download]")],
    copy: document.getElementById("copy"),
  };

  // Everything about the current capture; `session` is per WebSocket connection.
  const state = {
    phase: "idle",
    media: null,
    ctx: null,
    node: null,
    ws: null,
    session: null,
    sessions: 0,
    // Captured audio a next session may need: {pcm, samples, startSample} on the page's
    // timeline, from the resume point (or the oldest within MAX_REPLAY_S) to the newest.
    kept: [],
    keptOverflowWarned: false,
    resumeSample: 0, // where a next session starts: RESUME_BEFORE_SEAM_S before the first seam word
    seamWords: [], // the last SEAM_WORDS final words, {word, start, end} on the page's timeline
    retries: 0,
    reconnectTimer: null,
    fullWaits: 0, // refusals in a row by a full server, each waited out
    waitTicker: null, // redraws the countdown while waiting for a full server
    capturedSamples: 0, // the page's timeline: audio captured since the first Start
    paragraphs: [], // {el, text}: one per utterance
    breakPending: false, // the current utterance is over: the next text opens a paragraph
    partialEl: null,
    words: [], // subtitle words on the page's timeline, for the SRT and VTT downloads
    chart: { latency: [], ttft: [] },
  };

  // Read-only view for tests and curious users (the page never reads it).
  const exposed = {
    chunksSent: 0,
    chunksCaptured: 0,
    lastRms: 0,
    maxRms: 0,
    level: 0,
    sessionId: null,
    finals: [],
    // {message, offsetS}: every final with text, as it came but for the seam repeat a
    // resumed session's first one had dropped, and its session's offset.
    finalLog: [],
    ttftS: null,
    ttftsS: [],
    latenciesS: [],
    reconnects: 0,
    // Waits for a full server: how many in all, the last Retry-After (seconds), and when the
    // next attempt is due (performance.now() ms; null when none is).
    fullWaits: 0,
    retryAfterS: null,
    nextAttemptMs: null,
    lastClose: null,
    language: null,
    // One per session that got "ready": {sessionId, offsetS (where its audio began on the
    // page's timeline), replayedS (kept audio sent first), sentS (audio sent in all),
    // receivedS (what its "done" said the server had; null before)}.
    sessionLog: [],
    // One per resumed session that made a final: {atS (its offsetS), replayedS, seam (the
    // final words before it, which it heard again: {word, start, end} on the page's
    // timeline), final (its first final with words, as the server sent it), dropped (the
    // opening words of that final dropped as their repeat)}.
    seams: [],
    sendGaps: 0, // chunks sent out of order within a session (a bug if ever above 0)
  };
  Object.defineProperty(exposed, "phase", { get: () => state.phase, enumerable: true });
  Object.defineProperty(exposed, "words", { get: () => state.words, enumerable: true });
  Object.defineProperty(exposed, "chart", { get: () => state.chart, enumerable: true });
  Object.defineProperty(exposed, "resumeS", {
    get: () => state.resumeSample / TARGET_RATE,
    enumerable: true,
  });
  Object.defineProperty(exposed, "keptS", {
    get: () => state.kept.reduce((n, c) => n + c.samples, 0) / TARGET_RATE,
    enumerable: true,
  });
  Object.defineProperty(exposed, "paragraphs", {
    get: () => state.paragraphs.map((p) => p.text),
    enumerable: true,
  });
  window.whisperwire = exposed;

  function setPhase(phase) {
    state.phase = phase;
    document.body.dataset.state = phase;
    ui.start.textContent = phase === "running" ? "Stop" : "Start";
    ui.start.classList.toggle("recording", phase === "running");
    // Clicks while getUserMedia or the final "done" is pending would race with them.
    ui.start.disabled = phase === "starting" || phase === "stopping";
  }

  function setStatus(text, isError = false) {
    ui.status.textContent = text;
    ui.status.classList.toggle("error", isError);
  }

  function setConnection(text) {
    ui.connection.textContent = text;
    ui.connection.dataset.state = text;
  }

  function showLanguage(language, probability, provisional) {
    exposed.language = language;
    let text = language || "auto";
    if (language && typeof probability === "number") text += ` (${Math.round(probability * 100)}%)`;
    if (provisional) text += "?";
    ui.language.textContent = text;
  }

  function streamUrl() {
    const page = new URL(window.location.href);
    const params = new URLSearchParams({ sample_rate: String(TARGET_RATE), encoding: "pcm_s16le" });
    for (const key of ["token", "language", "task"]) {
      const value = page.searchParams.get(key);
      if (value) params.set(key, value);
    }
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    return `${scheme}//${window.location.host}/v1/stream?${params}`;
  }

  // ------------------------------------------------------------------ capture

  function micErrorMessage(err) {
    switch (err && err.name) {
      case "NotAllowedError":
      case "SecurityError":
        return "Microphone permission was refused. Allow the microphone for this page (the icon in the address bar), then press Start again.";
      case "NotFoundError":
      case "OverconstrainedError":
        return "No microphone found. Connect one, then press Start again.";
      case "NotReadableError":
        return "The microphone is in use by another application or could not be opened.";
      default:
        return `Could not start the microphone: ${err && err.message ? err.message : err}`;
    }
  }

  async function start() {
    setPhase("starting");
    setStatus("Asking for the microphone…");
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      setStatus("This page needs a secure context (https or localhost) to use the microphone.", true);
      setPhase("idle");
      return;
    }
    try {
      state.media = await navigator.mediaDevices.getUserMedia({
        // Processing off: echo cancellation, noise suppression and AGC change the audio
        // the recogniser hears (measured with Chromium's fake device).
        audio: { echoCancellation: false, noiseSuppression: false, autoGainControl: false, channelCount: 1 },
      });
    } catch (err) {
      setStatus(micErrorMessage(err), true);
      setPhase("idle");
      return;
    }
    // A new recording: nothing of the last one is sent again, and none of its words is a
    // seam. Reset before the worklet posts its first chunk.
    state.kept = [];
    state.keptOverflowWarned = false;
    state.resumeSample = state.capturedSamples;
    state.seamWords = [];
    try {
      state.ctx = new AudioContext({ latencyHint: "interactive" });
      await state.ctx.audioWorklet.addModule("audio-worklet.js");
      state.node = new AudioWorkletNode(state.ctx, "pcm16k-capture", {
        numberOfInputs: 1,
        numberOfOutputs: 1,
        outputChannelCount: [1],
        processorOptions: { targetRate: TARGET_RATE, chunkMs: CHUNK_MS },
      });
      state.node.port.onmessage = (event) => onWorkletMessage(event.data);
      const source = state.ctx.createMediaStreamSource(state.media);
      // The worklet must sit on a path to the destination to be rendered; a zero gain
      // keeps the microphone out of the speakers.
      const mute = state.ctx.createGain();
      mute.gain.value = 0;
      source.connect(state.node).connect(mute).connect(state.ctx.destination);
      if (state.ctx.state === "suspended") await state.ctx.resume();
    } catch (err) {
      setStatus(`Could not start audio processing: ${err && err.message ? err.message : err}`, true);
      releaseCapture();
      setPhase("idle");
      return;
    }
    state.retries = 0;
    state.fullWaits = 0;
    state.breakPending = true; // a new recording starts a new paragraph
    setPhase("running");
    connect();
  }

  function releaseCapture() {
    if (state.media) state.media.getTracks().forEach((t) => t.stop());
    if (state.ctx) state.ctx.close().catch(() => {});
    state.media = null;
    state.ctx = null;
    state.node = null;
    showLevel(0);
  }

  function showLevel(rms) {
    // dBFS on a 60 dB scale: speech sits around -30 to -10, silence near the floor.
    const db = 20 * Math.log10(Math.max(rms, 1e-9));
    const level = Math.min(1, Math.max(0, (db - LEVEL_FLOOR_DB) / -LEVEL_FLOOR_DB));
    exposed.level = level;
    ui.level.value = level;
  }

  function onWorkletMessage(data) {
    if (data.stopped) {
      finishAfterCapture();
      return;
    }
    exposed.chunksCaptured += 1;
    exposed.lastRms = data.rms;
    exposed.maxRms = Math.max(exposed.maxRms, data.rms);
    showLevel(data.rms);
    const chunk = { pcm: data.pcm, samples: data.samples, startSample: state.capturedSamples };
    state.capturedSamples += data.samples;
    keep(chunk);
    // Sent now only to a session that has had the kept audio (its "ready"); otherwise it
    // waits in the ring for the next "ready".
    const s = state.session;
    if (s && s.ready && state.ws.readyState === WebSocket.OPEN) sendChunk(chunk);
  }

  function keep(chunk) {
    state.kept.push(chunk);
    const maxSamples = MAX_REPLAY_S * TARGET_RATE;
    while (state.kept.length > 1 && state.capturedSamples - state.kept[0].startSample > maxSamples) {
      state.kept.shift();
      if (!state.keptOverflowWarned) {
        state.keptOverflowWarned = true;
        console.warn(
          `whisperwire: over ${MAX_REPLAY_S} s of audio with no final to cover it: the oldest is dropped and cannot be resent to a new session`,
        );
      }
    }
  }

  // A final covers the audio before the resume point: it need not be sent again.
  function trimKept() {
    const kept = state.kept;
    let n = 0;
    while (n < kept.length && kept[n].startSample + kept[n].samples <= state.resumeSample) n += 1;
    kept.splice(0, n);
  }

  // A session's first audio, on "ready": what is kept from where it starts, the first chunk
  // cut at that sample; the live chunks follow as they come (onWorkletMessage).
  function sendKept(s) {
    for (const chunk of state.kept) {
      const skip = s.startSample - chunk.startSample;
      if (skip >= chunk.samples) continue;
      if (skip <= 0) {
        sendChunk(chunk);
      } else {
        sendChunk({ pcm: chunk.pcm.slice(skip * 2), samples: chunk.samples - skip, startSample: s.startSample });
      }
    }
    s.replayedS = s.samplesSent / TARGET_RATE;
    s.log.replayedS = s.replayedS;
  }

  function sendChunk(chunk) {
    const s = state.session;
    // A session's stream time starts at its first chunk: where that lies on the page's
    // timeline (later than its resume point only if more than MAX_REPLAY_S was kept).
    if (s.offsetS === null) {
      s.offsetSample = chunk.startSample;
      s.offsetS = chunk.startSample / TARGET_RATE;
    } else if (chunk.startSample !== s.offsetSample + s.samplesSent) {
      exposed.sendGaps += 1;
      console.error("whisperwire: audio sent out of order", chunk.startSample, s.offsetSample + s.samplesSent);
    }
    state.ws.send(chunk.pcm);
    s.samplesSent += chunk.samples;
    s.log.offsetS = s.offsetS;
    s.log.sentS = s.samplesSent / TARGET_RATE;
    s.sentEndsS.push(s.samplesSent / TARGET_RATE);
    s.sentWallMs.push(performance.now());
    exposed.chunksSent += 1;
  }

  // ------------------------------------------------------------------ connection

  function newSession() {
    return {
      ready: false,
      done: false,
      endSent: false,
      doneTimedOut: false, // the page closed after waiting DONE_TIMEOUT_MS for "done"
      startSample: state.resumeSample, // where its audio starts on the page's timeline
      // The final words before that, which it hears again: dropped from the opening of its
      // first final with words when it repeats them.
      seam: state.seamWords.slice(),
      seamPending: state.seamWords.length > 0,
      offsetSample: null,
      offsetS: null,
      replayedS: 0, // kept audio sent on "ready", before the live audio
      log: null, // its exposed.sessionLog entry, from "ready"
      samplesSent: 0,
      sentEndsS: [], // stream time at the end of each chunk sent
      sentWallMs: [], // performance.now() when each chunk was sent
      utterances: [], // [start, end|null] not known to be over (see utteranceOver)
      ttftWaiting: [], // starts of utterances that have shown no text yet
      anyText: false,
      latenciesS: [],
    };
  }

  function connect() {
    state.reconnectTimer = null;
    stopWaitTicker();
    const ws = new WebSocket(streamUrl());
    ws.binaryType = "arraybuffer";
    state.ws = ws;
    state.session = newSession();
    setConnection(state.retries === 0 ? "connecting" : "reconnecting");
    if (state.retries === 0) setStatus("Connecting…");
    ws.onmessage = (event) => {
      if (ws !== state.ws || typeof event.data !== "string") return;
      let msg;
      try {
        msg = JSON.parse(event.data);
      } catch (err) {
        console.warn("whisperwire: unparsable server message", err);
        return;
      }
      onServerMessage(msg);
    };
    ws.onclose = (event) => {
      if (ws === state.ws) onClose(event);
    };
    // onerror carries no detail in browsers; onclose follows it and decides.
  }

  function onClose(event) {
    const s = state.session;
    exposed.lastClose = { code: event.code, reason: event.reason };
    removePartial();
    // "done" without our "end": the server finished the session itself (a draining instance
    // behind a load balancer); carry on with a new session, which lands on another instance.
    const endedByServer = s && s.done && !s.endSent && state.phase === "running";
    if (endedByServer) {
      scheduleReconnect(event, true);
      return;
    }
    setConnection("closed");
    if (state.phase === "stopping" || (s && s.done)) {
      let text = "Stopped (the server closed before its summary).";
      if (s && s.done) text = "Stopped.";
      else if (s && s.doneTimedOut) text = `Stopped (no summary from the server within ${DONE_TIMEOUT_MS / 1000} s).`;
      finishStopped(text);
      return;
    }
    if (state.phase !== "running") return;
    // No "ready": the handshake failed (1006: a browser is not told its HTTP status) or a
    // full server refused the session right after it (1013). Ask /readyz whether it is full.
    if (s && !s.ready && (event.code === 1006 || event.code === 1013)) {
      askWhyRefused(state.ws, event);
      return;
    }
    if (NO_RETRY_CODES.has(event.code)) {
      setStatus(`The server closed the connection (${event.code}${event.reason ? `: ${event.reason}` : ""}).`, true);
      releaseCapture();
      setPhase("idle");
      return;
    }
    scheduleReconnect(event);
  }

  function scheduleReconnect(event, endedByServer = false) {
    state.retries += 1;
    exposed.reconnects += 1;
    setConnection("reconnecting");
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** (state.retries - 1));
    const delay = base * (0.8 + 0.4 * Math.random()); // jitter: clients do not return in step
    // A session the server finished with its summary (a draining instance) is no error,
    // whichever close code reached us first (1000 or 1001).
    const why =
      endedByServer || event.code === 1000 ? "the server ended the session"
      : event.code === 1013 ? "server busy"
      : `connection lost (${event.code})`;
    setStatus(`${why}; reconnecting in ${(delay / 1000).toFixed(1)} s…`, !endedByServer);
    state.reconnectTimer = setTimeout(connect, delay);
  }

  // /readyz says 503 with Retry-After while the server is full (through HAProxy, also once
  // every instance is out of rotation). Then wait the hint out; otherwise the refusal was
  // something else (the server is down, starting, or refused this client): back off as usual.
  async function askWhyRefused(ws, event) {
    setConnection("checking");
    let hintS = null;
    try {
      const answer = await fetch("/readyz", { cache: "no-store" });
      const header = answer.headers.get("Retry-After");
      if (answer.status === 503 && header !== null && /^\d+$/.test(header.trim())) {
        hintS = Math.min(RETRY_AFTER_MAX_S, Number(header.trim()));
      }
    } catch (err) {
      hintS = null; // no answer at all: the server is not there
    }
    if (ws !== state.ws || state.phase !== "running") return; // stopped meanwhile
    if (hintS === null) {
      scheduleReconnect(event);
      return;
    }
    if (state.fullWaits >= MAX_FULL_WAITS) {
      setConnection("closed");
      setStatus(`The server is still full after ${MAX_FULL_WAITS} attempts. Press Start to try again later.`, true);
      releaseCapture();
      state.ws = null;
      setPhase("idle");
      return;
    }
    state.fullWaits += 1;
    exposed.fullWaits += 1;
    exposed.retryAfterS = hintS;
    const delay = hintS * 1000 * (0.8 + 0.4 * Math.random()); // jitter, as the CLI's
    exposed.nextAttemptMs = performance.now() + delay;
    setConnection("waiting");
    showWait();
    state.waitTicker = setInterval(showWait, 1000);
    state.reconnectTimer = setTimeout(connect, delay);
  }

  function showWait() {
    const leftS = Math.max(1, Math.ceil((exposed.nextAttemptMs - performance.now()) / 1000));
    setStatus(`The server is full. Trying again in ${leftS} s (attempt ${state.fullWaits + 1} of ${MAX_FULL_WAITS + 1}); Stop cancels.`);
  }

  function stopWaitTicker() {
    if (state.waitTicker !== null) clearInterval(state.waitTicker);
    state.waitTicker = null;
    exposed.nextAttemptMs = null;
  }

  // ------------------------------------------------------------------ transcript

  function sentAtMs(streamS) {
    // Wall time the chunk holding stream time `streamS` was sent (lower bound search).
    const s = state.session;
    const ends = s.sentEndsS;
    if (ends.length === 0) return null;
    let lo = 0;
    let hi = ends.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (ends[mid] < streamS - TIME_EPSILON_S) lo = mid + 1;
      else hi = mid;
    }
    return s.sentWallMs[Math.min(lo, ends.length - 1)];
  }

  // speech_ended usually comes before its utterance's last finals (they are decoded after
  // it). Utterances are decoded in order, each starting where the last ended, so the first
  // text that starts at or after an utterance's end shows that utterance is over (as
  // UtteranceTracker in client/render.py).
  function utteranceOver(s, startS) {
    let over = false;
    while (s.utterances.length) {
      const end = s.utterances[0][1];
      if (end === null || startS < end) break;
      s.utterances.shift();
      over = true;
    }
    return over;
  }

  function endParagraph() {
    const last = state.paragraphs[state.paragraphs.length - 1];
    if (last && last.text) state.breakPending = true;
  }

  function currentParagraph() {
    let last = state.paragraphs[state.paragraphs.length - 1];
    if (!last || state.breakPending) {
      const el = document.createElement("p");
      el.className = "utterance";
      ui.transcript.appendChild(el);
      last = { el, text: "" };
      state.paragraphs.push(last);
      state.breakPending = false;
    }
    return last;
  }

  function removePartial() {
    if (state.partialEl) state.partialEl.remove();
    state.partialEl = null;
  }

  // Updates the transcript, following the newest text unless the reader scrolled up.
  function updateTranscript(change) {
    const el = ui.transcript;
    const following = el.scrollHeight - el.scrollTop - el.clientHeight <= SCROLL_SLACK_PX;
    change();
    if (following) el.scrollTop = el.scrollHeight;
  }

  function showPartial(text) {
    updateTranscript(() => {
      const paragraph = currentParagraph();
      if (!text) {
        removePartial();
        return;
      }
      if (!state.partialEl || state.partialEl.parentNode !== paragraph.el) {
        removePartial();
        state.partialEl = document.createElement("span");
        state.partialEl.className = "partial";
        paragraph.el.appendChild(state.partialEl);
      }
      state.partialEl.textContent = Subtitles.joinText(paragraph.text, text).slice(paragraph.text.length);
    });
  }

  function showFinal(text) {
    updateTranscript(() => {
      removePartial();
      const paragraph = currentParagraph();
      const joined = Subtitles.joinText(paragraph.text, text);
      const span = document.createElement("span");
      span.className = "final";
      span.textContent = joined.slice(paragraph.text.length);
      paragraph.el.appendChild(span);
      paragraph.text = joined;
    });
  }

  // ------------------------------------------------------------------ speakers

  // With speaker labels (a server with --speakers), each speaker's words open a paragraph
  // led by a label in the speaker's colour; clicking a label renames that speaker everywhere
  // (the page, the TXT, SRT and VTT downloads). Names live in this page only.
  const SPEAKER_COLOURS = ["#1f6feb", "#c2410c", "#15803d", "#9333ea", "#b91c1c", "#0e7490", "#a16207", "#be185d"];
  const speakerNames = new Map(); // speaker number -> the name the user gave
  const speakerColour = (speaker) => SPEAKER_COLOURS[speaker % SPEAKER_COLOURS.length];
  const speakerLabel = (speaker) => speakerNames.get(speaker) || Subtitles.speakerName(speaker);
  const hasSpeakers = (msg) => (msg.words || []).some((w) => typeof w.speaker === "number");

  // A final's words in runs of one speaker each: [{speaker, text}].
  function speakerRuns(msg) {
    const runs = [];
    for (const w of Subtitles.wordsFromFinal(msg)) {
      const last = runs[runs.length - 1];
      if (last && (last.speaker === w.speaker || w.joinsPrevious)) last.text = Subtitles.joinText(last.text, w.text);
      else runs.push({ speaker: w.speaker, text: w.text });
    }
    return runs;
  }

  function showSpeakerFinal(msg) {
    for (const run of speakerRuns(msg)) {
      updateTranscript(() => {
        let paragraph = currentParagraph();
        if (paragraph.speaker !== undefined && paragraph.speaker !== run.speaker && paragraph.text) {
          endParagraph();
          paragraph = currentParagraph();
        }
        if (paragraph.speaker === undefined && run.speaker !== null) labelParagraph(paragraph, run.speaker);
      });
      showFinal(run.text);
    }
  }

  function labelParagraph(paragraph, speaker) {
    paragraph.speaker = speaker;
    paragraph.el.dataset.speaker = String(speaker);
    paragraph.el.style.borderLeftColor = speakerColour(speaker);
    const label = document.createElement("button");
    label.type = "button";
    label.className = "speaker";
    label.dataset.speaker = String(speaker);
    label.style.color = speakerColour(speaker);
    label.title = "Rename this speaker";
    label.textContent = speakerLabel(speaker);
    label.addEventListener("click", () => renameSpeaker(label, speaker));
    paragraph.el.prepend(label);
  }

  // The label becomes a text field; Enter or leaving it keeps the name (empty: the default),
  // Escape keeps the old one.
  function renameSpeaker(label, speaker) {
    const field = document.createElement("input");
    field.className = "speaker-name";
    field.value = speakerLabel(speaker);
    field.size = Math.max(6, field.value.length + 2);
    field.setAttribute("aria-label", `name of ${speakerLabel(speaker)}`);
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep) {
        const name = field.value.trim().replace(/\s+/g, " ").slice(0, 40);
        if (name && name !== Subtitles.speakerName(speaker)) speakerNames.set(speaker, name);
        else speakerNames.delete(speaker);
      }
      field.replaceWith(label);
      for (const el of ui.transcript.querySelectorAll(`.speaker[data-speaker="${speaker}"]`)) {
        el.textContent = speakerLabel(speaker);
      }
      label.focus();
    };
    field.addEventListener("keydown", (event) => {
      if (event.key !== "Enter" && event.key !== "Escape") return;
      // Not passed on: the label, focused again, would take this Enter as a click.
      event.preventDefault();
      finish(event.key === "Enter");
    });
    field.addEventListener("blur", () => finish(true));
    label.replaceWith(field);
    field.focus();
    field.select();
  }

  // ------------------------------------------------------------------ the seam

  // client/timeline.py _comparable: casefolded, letters and digits only.
  const comparable = (word) => word.toLowerCase().replace(/[^\p{L}\p{N}]/gu, "");

  // How many opening `words` (strings) repeat the end of `seam` (strings), longest first.
  function repeatedAtSeam(words, seam) {
    for (let n = Math.min(seam.length, words.length); n > 0; n--) {
      const tail = seam.slice(seam.length - n);
      if (words.slice(0, n).every((w, i) => comparable(w) === comparable(tail[i]))) return n;
    }
    return 0;
  }

  // Whether a word reads as a seam word (both `comparable`): the same, or the same stem with
  // up to two letters more or fewer ("book" for "books"); client/timeline.py _reads_as.
  function readsAs(key, seamKey) {
    const [short, long] = key.length <= seamKey.length ? [key, seamKey] : [seamKey, key];
    return key === seamKey || (short.length >= 3 && long.startsWith(short) && long.length - short.length <= 2);
  }

  // How many opening `words` ({word, end} on the page's timeline) of a session's first final
  // repeat `seam`: each reads as a seam word, in the seam's order (one may be skipped), or
  // ends within the seam's time; client/timeline.py seam_repeat_count.
  function seamRepeatCount(words, seam) {
    const keys = seam.map((w) => comparable(w.word));
    const seamEnd = seam.length ? seam[seam.length - 1].end + SEAM_END_TOLERANCE_S : 0;
    let matched = 0;
    let count = 0;
    for (const w of words) {
      const key = comparable(w.word);
      let at = -1;
      for (let k = matched; k < keys.length && at < 0; k++) if (readsAs(key, keys[k])) at = k;
      if (at >= 0) matched = at + 1;
      else if (w.end > seamEnd) break;
      count += 1;
    }
    return count;
  }

  // `final` (the session's stream time) without the opening words that repeat the session's
  // seam, when they start within SEAM_REPEAT_WINDOW_S of it (the session starts at the seam:
  // stream time 0); client/timeline.py drop_seam_repeat. The text keeps its own spacing
  // (the server's text is its words joined). All of it repeated: no text, no words.
  function dropSeamRepeat(s, final) {
    const words = final.words;
    if (words[0].start > SEAM_REPEAT_WINDOW_S || s.seam.length === 0) return { final, dropped: [] };
    const n = seamRepeatCount(words.map((w) => ({ word: w.word, end: w.end + s.offsetS })), s.seam);
    if (n === 0) return { final, dropped: [] };
    const dropped = words.slice(0, n).map((w) => w.word);
    const kept = words.slice(n);
    if (kept.length === 0) return { final: { ...final, text: "", words: [], start: final.end }, dropped };
    let pos = 0;
    for (const w of words.slice(0, n)) {
      const found = final.text.indexOf(w.word.trim(), pos);
      if (found < 0) {
        pos = -1;
        break;
      }
      pos = found + w.word.trim().length;
    }
    const text = pos < 0 ? kept.map((w) => w.word.trim()).join(" ") : final.text.slice(pos).trim();
    return { final: { ...final, text, words: kept, start: kept[0].start }, dropped };
  }

  // The session's first final with words, once: its seam repeat dropped and noted.
  function seamFinal(s, msg) {
    if (!s.seamPending || !Array.isArray(msg.words) || msg.words.length === 0) return msg;
    s.seamPending = false;
    const { final, dropped } = dropSeamRepeat(s, msg);
    exposed.seams.push({ atS: s.offsetS, replayedS: s.replayedS, seam: s.seam, final: msg, dropped });
    return final;
  }

  // A partial before that final: shown without the words it repeats at the seam, by the
  // same rule (its text's words; a partial carries no word times).
  function seamPartial(s, msg) {
    if (!s.seamPending || typeof msg.text !== "string" || msg.start > SEAM_REPEAT_WINDOW_S) return msg;
    const words = msg.text.split(/\s+/).filter(Boolean);
    const n = repeatedAtSeam(words, s.seam.map((w) => w.word));
    return n === 0 ? msg : { ...msg, text: words.slice(n).join(" ") };
  }

  // A final's words move the resume point on: a next session starts at the last SEAM_WORDS
  // of them, and the audio before that is dropped from the ring.
  function noteFinalWords(s, final) {
    const words = (final.words || []).map((w) => ({ word: w.word, start: w.start + s.offsetS, end: w.end + s.offsetS }));
    if (words.length === 0) return;
    state.seamWords = [...state.seamWords, ...words].slice(-SEAM_WORDS);
    const resume = Math.floor((state.seamWords[0].start - RESUME_BEFORE_SEAM_S) * TARGET_RATE);
    state.resumeSample = Math.max(state.resumeSample, s.offsetSample, resume);
    trimKept();
  }

  // ------------------------------------------------------------------ latency

  function noteFirstText(msg) {
    // Time to first token per utterance: from the speech start's audio leaving the page to
    // the first text of that utterance. Old text of the utterance before starts earlier.
    const s = state.session;
    let speechS = null;
    while (s.ttftWaiting.length && s.ttftWaiting[0] <= msg.start + TIME_EPSILON_S) {
      speechS = s.ttftWaiting.shift();
    }
    if (speechS === null && !s.anyText) speechS = msg.start; // a server without speech_started
    s.anyText = true;
    if (speechS === null) return;
    const sent = sentAtMs(speechS);
    if (sent === null) return;
    const ttft = (performance.now() - sent) / 1000;
    exposed.ttftS = ttft;
    exposed.ttftsS.push(ttft);
    ui.ttft.textContent = `${ttft.toFixed(2)} s`;
    addPoint(state.chart.ttft, speechS + s.offsetS, ttft);
  }

  function median(values) {
    const v = [...values].sort((a, b) => a - b);
    return v[Math.floor((v.length - 1) / 2)];
  }

  function noteFinalLatency(msg) {
    const s = state.session;
    const sent = sentAtMs(msg.end);
    if (sent === null) return;
    const latency = (performance.now() - sent) / 1000;
    s.latenciesS.push(latency);
    exposed.latenciesS.push(latency);
    ui.latency.textContent = `${latency.toFixed(2)} s (median ${median(s.latenciesS).toFixed(2)} s, n=${s.latenciesS.length})`;
    addPoint(state.chart.latency, msg.end + s.offsetS, latency);
  }

  function addPoint(series, x, y) {
    series.push({ x, y });
    Chart.draw(ui.chart, state.chart);
  }

  // ------------------------------------------------------------------ server messages

  function onServerMessage(message) {
    const s = state.session;
    let msg = message;
    if (msg.type === "final") msg = seamFinal(s, msg);
    else if (msg.type === "partial") msg = seamPartial(s, msg);
    const hasText = typeof msg.text === "string" && msg.text.trim() !== "";
    if ((msg.type === "partial" || msg.type === "final") && utteranceOver(s, msg.start)) endParagraph();
    switch (msg.type) {
      case "ready":
        s.ready = true;
        state.sessions += 1;
        s.log = { sessionId: msg.session_id, offsetS: null, replayedS: 0, sentS: 0, receivedS: null };
        exposed.sessionLog.push(s.log);
        if (state.sessions > 1) endParagraph(); // a resumed recording: its words start anew
        exposed.sessionId = msg.session_id;
        state.retries = 0;
        state.fullWaits = 0;
        setConnection("connected");
        ui.model.textContent = msg.model;
        showLanguage(msg.language, null, false);
        setStatus(`Listening (model ${msg.model}).`);
        sendKept(s);
        if (state.phase === "stopping") sendEnd();
        break;
      case "speech_started": {
        const last = s.utterances[s.utterances.length - 1];
        if (last && last[1] === null) last[1] = msg.start;
        s.utterances.push([msg.start, null]);
        s.ttftWaiting.push(msg.start);
        break;
      }
      case "speech_ended": {
        const last = s.utterances[s.utterances.length - 1];
        if (last && last[1] === null) last[1] = msg.end;
        else s.utterances.push([msg.end, msg.end]);
        break;
      }
      case "partial":
        if (msg.language) showLanguage(msg.language, msg.language_probability, msg.language_provisional);
        if (hasText) noteFirstText(msg);
        showPartial(msg.text.split(/\s+/).filter(Boolean).join(" "));
        break;
      case "final": {
        if (msg.language) showLanguage(msg.language, msg.language_probability, false);
        noteFinalWords(s, msg);
        if (!hasText) {
          updateTranscript(removePartial);
          break;
        }
        noteFirstText(msg);
        const text = msg.text.split(/\s+/).filter(Boolean).join(" ");
        if (hasSpeakers(msg)) showSpeakerFinal(msg);
        else showFinal(text);
        exposed.finals.push(text);
        exposed.finalLog.push({ message: msg, offsetS: s.offsetS }); // seam repeat dropped
        // Word times in the session's stream time first, then on the page's timeline: the
        // same arithmetic as client/subtitles.py and client/timeline.py.
        for (const w of Subtitles.wordsFromFinal(msg)) {
          state.words.push({ ...w, startS: w.startS + s.offsetS, endS: w.endS + s.offsetS });
        }
        noteFinalLatency(msg);
        setDownloads(true);
        break;
      }
      case "error":
        setStatus(`Server ${msg.fatal ? "error" : "warning"}: ${msg.code}: ${msg.message}`, msg.fatal);
        break;
      case "done":
        s.done = true;
        if (s.log) s.log.receivedS = msg.audio_received_s;
        s.utterances = [];
        endParagraph();
        state.ws.close(1000);
        break;
      default:
        break; // anything newer: nothing to show
    }
  }

  // ------------------------------------------------------------------ take away

  function transcriptText() {
    const lines = state.paragraphs
      .filter((p) => p.text)
      .map((p) => (p.speaker === undefined ? p.text : `[${speakerLabel(p.speaker)}] ${p.text}`));
    return lines.length ? `${lines.join("\n")}\n` : "";
  }

  function fileName(ext) {
    const t = new Date();
    const two = (x) => String(x).padStart(2, "0");
    const stamp = `${t.getFullYear()}${two(t.getMonth() + 1)}${two(t.getDate())}-${two(t.getHours())}${two(t.getMinutes())}${two(t.getSeconds())}`;
    return `whisperwire-${stamp}.${ext}`;
  }

  function download(kind) {
    let text;
    let type;
    if (kind === "txt") {
      text = transcriptText();
      type = "text/plain";
    } else {
      const cues = Subtitles.buildCues(state.words, undefined, speakerLabel);
      text = kind === "srt" ? Subtitles.srtDocument(cues, speakerLabel) : Subtitles.vttDocument(cues, speakerLabel);
      type = kind === "srt" ? "application/x-subrip" : "text/vtt";
    }
    const url = URL.createObjectURL(new Blob([text], { type: `${type};charset=utf-8` }));
    const a = document.createElement("a");
    a.href = url;
    a.download = fileName(kind);
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  }

  async function copyTranscript() {
    const text = transcriptText();
    try {
      await navigator.clipboard.writeText(text);
    } catch (err) {
      // No clipboard API (plain http from another host) or no permission: the old way.
      const area = document.createElement("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      const ok = document.execCommand("copy");
      area.remove();
      if (!ok) {
        ui.copied.textContent = "could not copy";
        return;
      }
    }
    ui.copied.textContent = "copied";
    setTimeout(() => { ui.copied.textContent = ""; }, 2000);
  }

  function setDownloads(enabled) {
    for (const button of [...ui.downloads, ui.copy]) button.disabled = !enabled;
  }

  // ------------------------------------------------------------------ stop

  function stop() {
    setPhase("stopping");
    setStatus("Finishing…");
    if (state.reconnectTimer !== null) {
      clearTimeout(state.reconnectTimer);
      state.reconnectTimer = null;
    }
    stopWaitTicker();
    if (state.node) {
      // The worklet sends what it holds, then {stopped: true}: finishAfterCapture runs.
      state.node.port.postMessage("stop");
    } else {
      finishAfterCapture();
    }
  }

  function finishAfterCapture() {
    if (state.media) state.media.getTracks().forEach((t) => t.stop());
    const ws = state.ws;
    if (ws && (ws.readyState === WebSocket.CONNECTING || ws.readyState === WebSocket.OPEN)) {
      // Before "ready", the ready handler sends the kept audio and then "end".
      if (state.session.ready) sendEnd();
      const s = state.session;
      setTimeout(() => {
        if (ws !== state.ws || ws.readyState === WebSocket.CLOSED) return;
        s.doneTimedOut = true; // the page gave up, not the server: onClose says so
        ws.close(1000);
      }, DONE_TIMEOUT_MS);
    } else {
      setConnection("closed");
      finishStopped("Stopped.");
    }
  }

  function sendEnd() {
    const s = state.session;
    if (s.endSent) return;
    s.endSent = true;
    state.ws.send(JSON.stringify({ type: "end" }));
  }

  function finishStopped(text) {
    releaseCapture();
    state.ws = null;
    setStatus(text);
    setPhase("idle");
  }

  function toggle() {
    if (state.phase === "idle") start();
    else if (state.phase === "running") stop();
  }

  ui.start.addEventListener("click", toggle);
  for (const button of ui.downloads) {
    button.addEventListener("click", () => download(button.dataset.download));
  }
  ui.copy.addEventListener("click", copyTranscript);
  document.addEventListener("keydown", (event) => {
    // Space starts and stops, except where it already means something (a focused button
    // is clicked by it, a text field types it).
    if (event.code !== "Space" || event.repeat || event.ctrlKey || event.metaKey || event.altKey) return;
    const target = event.target;
    if (target instanceof Element && target.closest("button, a, input, textarea, select, [contenteditable]")) return;
    event.preventDefault();
    toggle();
  });
  window.addEventListener("resize", () => Chart.draw(ui.chart, state.chart));
  setPhase("idle");
  setConnection("not connected");
  setDownloads(false);
  Chart.draw(ui.chart, state.chart);
})();
