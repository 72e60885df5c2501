"""Models that decide about turns: Silero VAD (is this 32 ms frame speech?) and Smart Turn
v3.2 (has the speaker finished?). Both run on onnxruntime from ONNX files that the
``pipecat-ai`` wheel ships; neither imports torch nor pipecat.

    onnx.py        finding the packaged ONNX files, building a CPU inference session
    smart_turn.py  Smart Turn v3.2: the last 8 s of audio in, P(turn complete) out
    silero_vad.py  Silero VAD: per-frame speech probability and a segmenter beside
                   server/core/vad.py's, with the same events
"""
