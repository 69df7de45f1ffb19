"""The gateway's errors."""

from __future__ import annotations


class GatewayError(Exception):
    """Why the gateway cannot serve (it cannot listen where asked, say); str() is the one
    line to show."""
