"""Where the dashboard listens by default: a constant of its own, so that the CLI can
name it in `--help` without importing the web server."""

DEFAULT_LISTEN = "127.0.0.1:8321"
"""Where `llmgw dashboard` and `llmgw up` serve it by default: loopback, no token."""
