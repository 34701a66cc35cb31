"""Fixtures shared by integration tests.

- ``live_stack`` (session): ``specsplit up``'s launcher with the bundled model
  (``models/tiny``, Paddle, CPU): three service processes on loopback, metrics
  on, the OpenAI-compatible HTTP API on, PushWeights staging in a temporary
  directory. Used by the HTTP API's end-to-end test and the docs test; started
  once for both (a few seconds of the suite's time).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specsplit.launcher import Stack, StackOptions

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory):
    staging = tmp_path_factory.mktemp("live_push_staging")
    opts = StackOptions(model=str(REPO / "models" / "tiny"), backend="paddle", max_batch=4, max_slots=8,
                        max_len=1024, metrics=True, http_port=0, log_level="WARNING",
                        extra_env={"SPECSPLIT_PUSH_STAGING_DIR": str(staging)})
    with Stack(opts) as stack:
        stack.staging = staging
        yield stack
