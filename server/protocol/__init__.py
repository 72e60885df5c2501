"""What the client shares with the server: audio formats, v1's messages, errors, audio files.

Nothing here imports the rest of the server, MLX, webrtcvad or the websockets server.
"""
