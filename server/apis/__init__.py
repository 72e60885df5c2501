"""The streaming APIs: the adapter seam, protocol v1, OpenAI Realtime and Deepgram live, and
the registry that maps each one's path to it (``registry.py``)."""
