"""Errors of the dashboard: why it cannot serve, and why it refuses one request.

Raised by `services.dashboard` (the server, its query parser and its replays) and shown
as one line: `DashboardError` by `llmgw dashboard` and `llmgw up`, the others as the
body of the answer to the request that caused them. This module does no I/O.
"""

from __future__ import annotations


class DashboardError(Exception):
    """Why the dashboard cannot serve; str() is the one line to show."""


class BadRequest(Exception):
    """A query the dashboard does not take (400): str() names the parameter, what it
    was given and what it takes."""


class Busy(Exception):
    """Too many replays of past moments running and waiting at once (503): try again
    after `retry_after_s`."""

    def __init__(self, running: int, retry_after_s: int) -> None:
        self.running = running
        self.retry_after_s = retry_after_s
        super().__init__(
            f"busy: {running} replays of past moments are running or waiting; "
            f"try again in {retry_after_s} s"
        )


class Unlisted(Exception):
    """The dashboard has not listed the log yet (503): the broker does not answer."""

    WHY = "the dashboard has not read the log yet (the broker does not answer?)"
