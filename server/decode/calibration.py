"""The speech the startup calibration decodes (``Pipeline._calibrate``), shipped with the server.

``calibration_speech.wav``, package data next to this module, is 11.62 s of LJ Speech 1.1
(Keith Ito and Linda Johnson, 2017; public domain): the end of LJ001-0003 to the middle of
LJ001-0005, "... by a similar process produced the block books, which were the immediate
predecessors of the true printed book, the invention of movable metal letters in the middle
of the fifteenth century may just...", cut at quiet points, samples unchanged (19.725 s to
31.345 s of the shared corpus's ``ljspeech/long/LJ001-0001_to_0032.concat.wav``, which
holds LJ Speech resampled from 22.05 kHz to 16 kHz mono 16-bit PCM).

Why speech: the cost of a window is mostly its decode loop, one step per token. Faint noise,
which the calibration decoded before, decodes to no text with tiny.en, where a 4 s window of
this recording gives 13-17 tokens; on a 2-core CPU a 4 s window cost 0.11-0.19 s as noise and
0.24-0.37 s as speech, so seeds timed on noise under-costed a stream, and the estimate at
startup said 6-10 streams where the machine carries 4 (issue #32).
"""

from __future__ import annotations

import functools
import importlib.resources
import wave

import numpy as np
import numpy.typing as npt

from server.protocol.formats import SAMPLE_RATE_HZ

Float32Array = npt.NDArray[np.float32]

SPEECH_FILE = "calibration_speech.wav"  # package data of server.decode


@functools.cache
def calibration_speech() -> Float32Array:
    """The recording as float32 in [-1, 1), read once per process."""
    resource = importlib.resources.files("server.decode").joinpath(SPEECH_FILE)
    with resource.open("rb") as f, wave.open(f) as w:
        shape = (w.getframerate(), w.getnchannels(), w.getsampwidth())
        if shape != (SAMPLE_RATE_HZ, 1, 2):
            raise ValueError(f"{SPEECH_FILE}: need 16 kHz mono 16-bit PCM; got {shape}")
        data = w.readframes(w.getnframes())
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0)


def speech_windows(count: int, audio_s: float) -> list[Float32Array]:
    """``count`` windows of ``audio_s`` seconds of the recording, their starts spread evenly
    from its start to as late as the last one still fits: a batch holds different speech in
    each window, as several streams' windows do, not one window decoded ``count`` times.

    Raises ``ValueError`` for a window longer than the recording.
    """
    speech = calibration_speech()
    length = round(audio_s * SAMPLE_RATE_HZ)
    if count < 1 or not 0 < length <= speech.size:
        raise ValueError(
            f"need count >= 1 and 0 < audio_s <= {speech.size / SAMPLE_RATE_HZ:.2f} s "
            f"(the calibration recording); got {count}, {audio_s}"
        )
    last = speech.size - length
    starts = [round(last * k / max(count - 1, 1)) for k in range(count)]
    return [speech[start : start + length] for start in starts]
