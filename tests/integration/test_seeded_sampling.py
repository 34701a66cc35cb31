"""A seed means the same tokens, through the services.

- Both sampling modes: a seeded sampling request that lives through a
  RECOMPUTE reload with the same weights (re-prefill of prompt + output)
  gives exactly the tokens it gives without the reload.
- Coupled mode: speculative (k=3) == target-only (k=0), and == a request
  whose draft is killed (kill -9) mid-request, so that it finishes
  target-only.
- Both modes: a seed gives the same tokens (and acceptance) with the draft in the target's
  process (``colocated_draft``) as with a draft service.
- The orchestrator's default_sampling_mode applies to requests that leave the
  mode unset; an unknown mode is INVALID_ARGUMENT.
Every stub call has a deadline; every wait is bounded.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from orchestrator.client import SpecsplitClient, SpecsplitError
from orchestrator.server import create_server
from core.config import ServerConfig
from orchestrator.config import OrchestratorConfig
from tests.integration import hardening_utils as hu
from tests.integration.reload_harness import in_thread, models, prompt_of, run_gen, stacks, wait_until  # noqa: F401

pytestmark = pytest.mark.integration

SAMPLED = dict(temperature=1.5, top_k=50)
LONG = 1000
KILL_MAX_LEN = 1100


def tokens_of(chunks) -> tuple[int, ...]:
    return tuple(t for c in chunks for t in c.tokens)


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_recompute_reload_with_the_same_weights_keeps_a_seeds_tokens(stacks, models, mode):
    s = stacks(models["A"], "A", default_sampling_mode="coupled")
    p, n = prompt_of(1, 7), 160
    kw = dict(k=3, seed=1234, sampling_mode=mode, **SAMPLED)
    _, plain = run_gen(s.client, p, n, **kw)
    _, other = run_gen(s.client, p, n, **{**kw, "seed": 1235})
    assert plain.tokens != other.tokens, "the seed must matter (sampling, not greedy)"
    assert plain.drafted > 0 and 0 < plain.accepted < plain.drafted
    s.slow_rounds(0.004)
    inflight = in_thread(lambda: run_gen(s.client, p, n, **kw))
    wait_until(lambda: s.status()["orchestrator"]["active_requests"] == 1, "the request to be running")
    s.client.reload(str(models["A"]), "A-again", mode="recapture", inflight="recompute")
    chunks, final = inflight()
    versions = [c.weights_version for c in chunks]
    assert versions[0] == "A" and versions[-1] == "A-again", "the request must have been resumed by the reload"
    assert final.finish_reason == "length" and final.tokens == plain.tokens == tokens_of(chunks)
    if mode == "coupled":
        # The server default (coupled here) for an unset mode; target-only gives the same tokens.
        _, unset = run_gen(s.client, p, n, **{k: v for k, v in kw.items() if k != "sampling_mode"})
        _, alone = run_gen(s.client, p, n, **{**kw, "k": 0})
        assert unset.tokens == alone.tokens == plain.tokens and alone.drafted == 0


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_a_seed_gives_the_same_tokens_with_the_draft_in_the_targets_process(stacks, models, mode):
    """The colocated draft (``colocated_draft``) proposes and the target accepts exactly as with a
    draft service: a seeded sampled request's tokens and acceptance are the same both ways."""
    remote, colocated = stacks(models["A"], "A"), stacks(models["A"], "A", colocated=True)
    for i in range(3):
        kw = dict(k=3, seed=700 + i, sampling_mode=mode, **SAMPLED)
        _, a = run_gen(remote.client, prompt_of(i, 9), 64, **kw)
        _, b = run_gen(colocated.client, prompt_of(i, 9), 64, **kw)
        assert a.tokens == b.tokens and (a.drafted, a.accepted) == (b.drafted, b.accepted) and b.drafted > 0
    assert colocated.status()["orchestrator"].get("draft_in_process")
    assert not remote.status()["orchestrator"].get("draft_in_process")


def test_unknown_sampling_mode_is_invalid_argument(stacks, models):
    s = stacks(models["A"], "A")
    req = SpecsplitClient.build_request(prompt_of(2, 5), 8, temperature=1.0)
    req.sampling.sampling_mode = 9
    with pytest.raises(SpecsplitError) as err:
        list(s.client.stream(req))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling_mode" in err.value.details


# --- coupled mode through a draft killed mid-request (real processes, as tests/integration/test_failures.py) ---
@pytest.fixture(scope="module")
def kill_model(tmp_path_factory) -> Path:
    return hu.make_model(tmp_path_factory.mktemp("seeded_kill_model"), KILL_MAX_LEN)


def test_coupled_tokens_survive_a_draft_killed_mid_request(kill_model):
    procs = hu.WorkerProcs(kill_model, KILL_MAX_LEN)
    server = client = None
    try:
        target, draft = procs.start("target"), procs.start("draft")
        server, port = create_server(OrchestratorConfig(
            draft_address=draft.address, target_address=target.address, max_batch=8, max_tokens_limit=LONG,
            worker_timeout_s=30.0, server=ServerConfig(port=0)))
        client = SpecsplitClient(f"127.0.0.1:{port}", timeout=120)
        prompt = hu.prompt_of(1, 7)
        kw = dict(k=3, seed=77, sampling_mode="coupled", ignore_eos=True, **SAMPLED)
        a = hu.Stream(client, prompt, LONG, kw)
        hu.wait_until(lambda: sum(ev.num_drafted for _, ev in list(a.chunks)) > 0 and len(a.chunks) >= 5,
                      "the request to speculate")
        procs.kill9(draft)
        hu.wait_until(lambda: not client.status(timeout=10)["orchestrator"]["speculation_available"],
                      "the orchestrator to notice the dead draft", timeout=10)
        assert a.final is None and a.error is None, "the request must outlive the kill (make LONG larger)"
        a.join()
        assert a.error is None, a.error
        # Speculative until the kill, target-only after it: the same tokens as target-only decoding
        # (tests/unit/test_seeded_determinism.py shows k=0 equals the in-process target-only engine).
        alone = client.generate_text(prompt, LONG, **{**kw, "k": 0})
        assert a.final.tokens == alone.tokens and alone.drafted == 0
        assert a.final.drafted > 0 and len(set(alone.tokens)) > 20, "speculated, and really sampled"
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop(0).wait(5)
        procs.close()
