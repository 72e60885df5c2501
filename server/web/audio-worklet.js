// Whisperwire capture worklet: microphone audio at the context's rate (often 44100 or
// 48000 Hz) -> 16 kHz mono -> little-endian Int16 chunks of ~100 ms, posted to the page.
//
// The ratio is fractional (44100 / 16000 = 2.75625), so samples cannot just be dropped:
// a windowed-sinc low-pass is evaluated at each fractional output position. The filter
// history and the fractional position carry over between the 128-frame render blocks, so
// block boundaries leave no trace in the output.

const HALF_TAPS = 16; // filter half-length in input samples, each side of the output position
const CUTOFF = 0.9; // fraction of the output Nyquist kept; the rest is transition band

class SincResampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample
    this.passthrough = inRate === outRate;
    // Normalised cutoff relative to the input rate (1 = input Nyquist).
    this.fc = Math.min(1, outRate / inRate) * CUTOFF;
    // Input samples not yet consumed; starts with HALF_TAPS zeros of left context.
    this.buf = new Float32Array(HALF_TAPS);
    this.base = -HALF_TAPS; // absolute input index of buf[0]
    this.pos = 0; // absolute (fractional) input position of the next output sample
  }

  kernel(x) {
    // Hann-windowed sinc at distance x (input samples) from the output position.
    if (Math.abs(x) >= HALF_TAPS) return 0;
    const t = this.fc * x;
    const sinc = t === 0 ? 1 : Math.sin(Math.PI * t) / (Math.PI * t);
    const window = 0.5 * (1 + Math.cos((Math.PI * x) / HALF_TAPS));
    return this.fc * sinc * window;
  }

  // Returns the 16 kHz samples made available by this input block.
  process(input) {
    if (this.passthrough) return Float32Array.from(input);
    const joined = new Float32Array(this.buf.length + input.length);
    joined.set(this.buf);
    joined.set(input, this.buf.length);
    const end = this.base + joined.length; // one past the last input index held
    const out = [];
    while (Math.floor(this.pos) + HALF_TAPS < end) {
      const centre = Math.floor(this.pos);
      let acc = 0;
      let norm = 0;
      for (let k = centre - HALF_TAPS + 1; k <= centre + HALF_TAPS; k++) {
        const w = this.kernel(this.pos - k);
        acc += w * joined[k - this.base];
        norm += w;
      }
      // Dividing by the summed weights keeps DC gain exactly 1 at every fractional phase.
      out.push(norm > 0 ? acc / norm : 0);
      this.pos += this.step;
    }
    // Keep what the next output still needs: from floor(pos) - HALF_TAPS + 1 onwards.
    const keepFrom = Math.max(this.base, Math.floor(this.pos) - HALF_TAPS + 1);
    this.buf = joined.slice(keepFrom - this.base);
    this.base = keepFrom;
    return Float32Array.from(out);
  }
}

class Pcm16kCaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.targetRate = opts.targetRate || 16000;
    this.chunkSamples = Math.round((this.targetRate * (opts.chunkMs || 100)) / 1000);
    this.resampler = new SincResampler(sampleRate, this.targetRate); // sampleRate: worklet global
    this.pending = new Int16Array(this.chunkSamples);
    this.filled = 0;
    this.sumSquares = 0;
    this.running = true;
    this.port.onmessage = (event) => {
      if (event.data === "flush") this.emit();
      if (event.data === "stop") {
        // Send what is held, then tell the page that no more audio will come.
        this.emit();
        this.running = false;
        this.port.postMessage({ stopped: true });
      }
    };
  }

  emit() {
    if (this.filled === 0) return;
    // Explicit little-endian, whatever the platform's byte order.
    const bytes = new ArrayBuffer(this.filled * 2);
    const view = new DataView(bytes);
    for (let i = 0; i < this.filled; i++) view.setInt16(i * 2, this.pending[i], true);
    const rms = Math.sqrt(this.sumSquares / this.filled);
    this.port.postMessage({ pcm: bytes, samples: this.filled, rms }, [bytes]);
    this.filled = 0;
    this.sumSquares = 0;
  }

  process(inputs) {
    if (!this.running) return false;
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true; // no input connected yet
    let mono = channels[0];
    if (channels.length > 1) {
      // Average the channels; getUserMedia asks for one, but devices may ignore that.
      mono = new Float32Array(channels[0].length);
      for (const ch of channels) for (let i = 0; i < ch.length; i++) mono[i] += ch[i] / channels.length;
    }
    const out = this.resampler.process(mono);
    for (let i = 0; i < out.length; i++) {
      const s = Math.max(-1, Math.min(1, out[i]));
      this.sumSquares += s * s;
      this.pending[this.filled++] = Math.round(s < 0 ? s * 32768 : s * 32767);
      if (this.filled === this.chunkSamples) this.emit();
    }
    return true;
  }
}

registerProcessor("pcm16k-capture", Pcm16kCaptureProcessor);
