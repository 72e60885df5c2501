// Whisperwire browser client: microphone -> AudioWorklet (16 kHz s16le) -> WebSocket,
// live captions back. Plain JavaScript, no build step. Protocol: docs/protocol.md.
//
// Stable hooks for tests and embedding: #start, #status, #transcript, #ttft, #latency,
// body[data-state] (idle | starting | running | stopping) and window.whisperwire (counters).
"use strict";

(() => {
  const TARGET_RATE = 16000;
  const CHUNK_MS = 100;
  const BACKLOG_MAX_CHUNKS = 50; // audio kept while (re)connecting: 5 s, then oldest dropped
  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 10000;
  const DONE_TIMEOUT_MS = 10000; // after "end", how long to wait for "done"
  // Close codes that retrying cannot fix: bad audio, policy (auth, Origin), frame too large.
  const NO_RETRY_CODES = new Set([1003, 1008, 1009]);
  const TIME_EPSILON_S = 1e-6;

  const ui = {
    start: document.getElementById("start"),
    status: document.getElementById("status"),
    transcript: document.getElementById("transcript"),
    ttft: document.getElementById("ttft"),
    latency: document.getElementById("latency"),
  };

  // Everything about the current capture; `session` is per WebSocket connection.
  const state = {
    phase: "idle",
    media: null,
    ctx: null,
    node: null,
    ws: null,
    session: null,
    backlog: [],
    retries: 0,
    reconnectTimer: null,
    partialEl: null,
  };

  // Read-only view for tests and curious users (the page never reads it).
  const exposed = {
    chunksSent: 0,
    chunksCaptured: 0,
    lastRms: 0,
    maxRms: 0,
    sessionId: null,
    finals: [],
    ttftS: null,
    latenciesS: [],
    reconnects: 0,
    lastClose: null,
  };
  Object.defineProperty(exposed, "phase", { get: () => state.phase, enumerable: true });
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
    state.backlog = [];
    setPhase("running");
    connect();
  }

  function releaseCapture() {
    if (state.media) state.media.getTracks().forEach((t) => t.stop());
    if (state.ctx) state.ctx.close().catch(() => {});
    state.media = null;
    state.ctx = null;
    state.node = null;
  }

  function onWorkletMessage(data) {
    if (data.stopped) {
      finishAfterCapture();
      return;
    }
    exposed.chunksCaptured += 1;
    exposed.lastRms = data.rms;
    exposed.maxRms = Math.max(exposed.maxRms, data.rms);
    const s = state.session;
    if (s && s.ready && state.ws.readyState === WebSocket.OPEN) {
      sendChunk(data.pcm, data.samples);
    } else {
      state.backlog.push(data);
      if (state.backlog.length > BACKLOG_MAX_CHUNKS) state.backlog.shift();
    }
  }

  function sendChunk(pcm, samples) {
    const s = state.session;
    state.ws.send(pcm);
    s.samplesSent += samples;
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
      samplesSent: 0,
      sentEndsS: [], // stream time at the end of each chunk sent
      sentWallMs: [], // performance.now() when each chunk was sent
      speechStartS: null,
      firstWordMs: null,
      latenciesS: [],
    };
  }

  function connect() {
    state.reconnectTimer = null;
    const ws = new WebSocket(streamUrl());
    ws.binaryType = "arraybuffer";
    state.ws = ws;
    state.session = newSession();
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
      scheduleReconnect(event);
      return;
    }
    if (state.phase === "stopping" || (s && s.done)) {
      let text = "Stopped (the server closed before its summary).";
      if (s && s.done) text = "Stopped.";
      else if (s && s.doneTimedOut) text = `Stopped (no summary from the server within ${DONE_TIMEOUT_MS / 1000} s).`;
      finishStopped(text);
      return;
    }
    if (state.phase !== "running") return;
    if (NO_RETRY_CODES.has(event.code)) {
      setStatus(`The server closed the connection (${event.code}${event.reason ? `: ${event.reason}` : ""}).`, true);
      releaseCapture();
      setPhase("idle");
      return;
    }
    scheduleReconnect(event);
  }

  function scheduleReconnect(event) {
    state.retries += 1;
    exposed.reconnects += 1;
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** (state.retries - 1));
    const delay = base * (0.8 + 0.4 * Math.random()); // jitter: clients do not return in step
    const why =
      event.code === 1013 ? "server busy"
      : event.code === 1000 ? "the server ended the session"
      : `connection lost (${event.code})`;
    setStatus(`${why}; reconnecting in ${(delay / 1000).toFixed(1)} s…`, true);
    state.reconnectTimer = setTimeout(connect, delay);
  }

  // ------------------------------------------------------------------ server messages

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

  function noteFirstWord(msg) {
    const s = state.session;
    if (s.firstWordMs !== null || !msg.text || !msg.text.trim()) return;
    s.firstWordMs = performance.now();
    const speechS = s.speechStartS !== null ? s.speechStartS : msg.start;
    const sent = sentAtMs(speechS);
    if (sent !== null) {
      exposed.ttftS = (s.firstWordMs - sent) / 1000;
      ui.ttft.textContent = `${exposed.ttftS.toFixed(2)} s`;
    }
  }

  function median(values) {
    const v = [...values].sort((a, b) => a - b);
    return v[Math.floor((v.length - 1) / 2)];
  }

  function removePartial() {
    if (state.partialEl) state.partialEl.remove();
    state.partialEl = null;
  }

  function onServerMessage(msg) {
    const s = state.session;
    switch (msg.type) {
      case "ready":
        s.ready = true;
        exposed.sessionId = msg.session_id;
        state.retries = 0;
        setStatus(`Listening (model ${msg.model}).`);
        for (const chunk of state.backlog.splice(0)) sendChunk(chunk.pcm, chunk.samples);
        if (state.phase === "stopping") sendEnd();
        break;
      case "speech_started":
        if (s.speechStartS === null) s.speechStartS = msg.start;
        break;
      case "partial":
        noteFirstWord(msg);
        if (!state.partialEl) {
          state.partialEl = document.createElement("span");
          state.partialEl.className = "partial";
          ui.transcript.appendChild(state.partialEl);
        }
        state.partialEl.textContent = msg.text.trim();
        break;
      case "final": {
        noteFirstWord(msg);
        removePartial();
        const text = msg.text.trim();
        if (!text) break;
        const span = document.createElement("span");
        span.className = "final";
        span.dataset.segmentId = String(msg.segment_id);
        span.textContent = `${text} `;
        ui.transcript.appendChild(span);
        exposed.finals.push(text);
        const sent = sentAtMs(msg.end);
        if (sent !== null) {
          const latency = (performance.now() - sent) / 1000;
          s.latenciesS.push(latency);
          exposed.latenciesS.push(latency);
          ui.latency.textContent =
            `${latency.toFixed(2)} s (median ${median(s.latenciesS).toFixed(2)} s, n=${s.latenciesS.length})`;
        }
        break;
      }
      case "error":
        setStatus(`Server ${msg.fatal ? "error" : "warning"}: ${msg.code}: ${msg.message}`, msg.fatal);
        break;
      case "done":
        s.done = true;
        state.ws.close(1000);
        break;
      default:
        break; // speech_ended, and anything newer: nothing to show
    }
  }

  // ------------------------------------------------------------------ stop

  function stop() {
    setPhase("stopping");
    setStatus("Finishing…");
    if (state.reconnectTimer !== null) {
      clearTimeout(state.reconnectTimer);
      state.reconnectTimer = null;
    }
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
      // Before "ready", the ready handler sends the backlog and then "end".
      if (state.session.ready) sendEnd();
      const s = state.session;
      setTimeout(() => {
        if (ws !== state.ws || ws.readyState === WebSocket.CLOSED) return;
        s.doneTimedOut = true; // the page gave up, not the server: onClose says so
        ws.close(1000);
      }, DONE_TIMEOUT_MS);
    } else {
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

  ui.start.addEventListener("click", () => {
    if (state.phase === "idle") start();
    else if (state.phase === "running") stop();
  });
  setPhase("idle");
})();
