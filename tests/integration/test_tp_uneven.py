"""A tensor-parallel target whose shares are uneven (TP=3 and TP=4, gloo on the CPU) gives TP=1's greedy tokens.

Its own module: rank 0 runs in the test process, which holds one default process group at a time
(test_tp_target.py's TP=2 stack keeps one for its whole module).
"""

from __future__ import annotations

import pytest

from core.admin_token import process_token
from orchestrator.round_client import RemoteRounds
from rounds.worker_clients import TargetClient
from tests.integration.test_tp_target import TIMEOUT, TINY, _cfg, _generate, _reference

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("tp", [3, 4])
def test_uneven_shares_greedy_equals_tp1_target_only_and_speculative(tp):
    """TP=3 divides neither the bundled model's 4 query / 2 K/V heads nor its 704 FFN rows: ranks
    hold 1, 1 and 2 query heads (ranks 0 and 1 share K/V head 0) and 235, 235, 234 FFN rows.
    TP=4 does not divide its 258-row vocabulary: 65, 65, 64, 64 head rows, each padded to 65 for
    the gather (runtime/tp_plan.py). The tokens are still TP=1's."""
    from draft_service import server as draft_server
    from target_service import server as target_server

    draft = draft_server.start(_cfg("draft"))
    target = target_server.start(_cfg("target", tp=tp))
    client = TargetClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26,
                          admin_token=process_token())
    rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
    try:
        ref = _reference(TINY)
        rounds.configure("", 4, 8, TIMEOUT)
        assert _generate(rounds, f"solo{tp}", 0) == ref
        assert rounds.configure(f"127.0.0.1:{draft.port}", 4, 8, TIMEOUT).speculation_available
        assert _generate(rounds, f"spec{tp}", 3) == ref
    finally:
        rounds.stop()
        client.close()
        target.stop(grace=None)
        draft.stop(grace=None)
