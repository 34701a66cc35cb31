"""Waiting on a condition in tests: poll, bounded, never a fixed sleep standing in for an event."""

from __future__ import annotations

import time
from typing import Any, Callable

TIMEOUT_S = 30.0


def wait_until(cond: Callable[[], Any], what: str, timeout: float = TIMEOUT_S, every: float = 0.02) -> Any:
    """Poll ``cond`` every ``every`` seconds until it returns something truthy (returned), or fail the
    test after ``timeout`` seconds naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
