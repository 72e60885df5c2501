// The page's latency chart: final latency per final and time to first token per utterance,
// against the time in the recording, on a plain canvas. Defines window.WhisperwireChart.
"use strict";

(() => {
  const COLORS = Object.freeze({
    latency: "#1f6feb", // final latency: line and dots
    ttft: "#d9822b", // time to first token: squares
    grid: "#dde1e6",
    text: "#555",
    background: "#ffffff",
  });
  const PAD = { left: 38, right: 18, top: 10, bottom: 22 };
  const MIN_SPAN_S = 30; // the x axis shows at least this much of the recording
  const WINDOW_S = 300; // and at most the last five minutes of it
  const DOT = 3.5;

  function niceStep(range) {
    for (const step of [0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600]) {
      if (range / step <= 6) return step;
    }
    return 1200;
  }

  // Size the canvas's pixels to its CSS box, so lines stay crisp on any screen.
  function fit(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    return ratio;
  }

  // points: {latency: [{x, y}], ttft: [{x, y}]}, x and y in seconds.
  function draw(canvas, points) {
    const ratio = fit(canvas);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const w = canvas.width / ratio;
    const h = canvas.height / ratio;
    ctx.fillStyle = COLORS.background;
    ctx.fillRect(0, 0, w, h);
    const all = [...points.latency, ...points.ttft];
    const xMax = Math.max(MIN_SPAN_S, ...all.map((p) => p.x));
    const xMin = Math.max(0, xMax - WINDOW_S);
    const yMax = Math.max(1, Math.ceil(Math.max(0, ...all.map((p) => p.y)) * 1.15 * 2) / 2);
    const plotW = w - PAD.left - PAD.right;
    const plotH = h - PAD.top - PAD.bottom;
    const px = (x) => PAD.left + ((x - xMin) / (xMax - xMin)) * plotW;
    const py = (y) => PAD.top + plotH - (y / yMax) * plotH;

    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.strokeStyle = COLORS.grid;
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const yStep = niceStep(yMax);
    for (let y = 0; y <= yMax + 1e-9; y += yStep) {
      ctx.beginPath();
      ctx.moveTo(PAD.left, Math.round(py(y)) + 0.5);
      ctx.lineTo(w - PAD.right, Math.round(py(y)) + 0.5);
      ctx.stroke();
      ctx.fillText(`${y} s`, PAD.left - 4, py(y));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const xStep = niceStep(xMax - xMin);
    for (let x = Math.ceil(xMin / xStep) * xStep; x <= xMax + 1e-9; x += xStep) {
      ctx.fillText(`${x} s`, px(x), PAD.top + plotH + 5);
    }

    const latency = points.latency.filter((p) => p.x >= xMin);
    ctx.strokeStyle = COLORS.latency;
    ctx.fillStyle = COLORS.latency;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    latency.forEach((p, i) => (i ? ctx.lineTo(px(p.x), py(p.y)) : ctx.moveTo(px(p.x), py(p.y))));
    ctx.stroke();
    for (const p of latency) {
      ctx.beginPath();
      ctx.arc(px(p.x), py(p.y), DOT, 0, 2 * Math.PI);
      ctx.fill();
    }
    ctx.fillStyle = COLORS.ttft;
    for (const p of points.ttft.filter((q) => q.x >= xMin)) {
      ctx.fillRect(px(p.x) - DOT - 0.5, py(p.y) - DOT - 0.5, 2 * DOT + 1, 2 * DOT + 1);
    }
  }

  window.WhisperwireChart = Object.freeze({ draw, COLORS });
})();
