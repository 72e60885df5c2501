"""Serving: the WebSocket and HTTP server, one connection's state machine, the routes, access
checks and the command line."""
