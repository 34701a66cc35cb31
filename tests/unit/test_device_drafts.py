"""Greedy drafts handed to the verify on the device (``runtime/device_drafts.py``), Torch and Paddle on the CPU.

What is shown: the verify's token rows built from a drafts tensor put each request's drafts in
its columns 1..k whatever the tensor's row order, with the host's columns around them; a verify
reads them there only when every drafting request's drafts are rows of one tensor and it
verifies greedily (else they come to the host first); each request's greedy count comes from its
row of the tensor's host copy; and the engine gives target-only's tokens
with its drafts on the device, with mixed k, in a batch that also samples, on both backends.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.params import SamplingParams
from runtime import device_drafts
from runtime.acceptance import accept_greedy_ids
from runtime.backends import make_ops
from runtime.config import CacheConfig, EngineConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.tokenizer import ByteTokenizer
from runtime.types import DeviceDrafts, VerifyRequest

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GREEDY, SAMPLED = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.7, seed=1)


@pytest.fixture(scope="module", params=["torch", "paddle"])
def ops(request):
    return make_ops(RuntimeConfig(backend=request.param))


def _drafts(ops, rows):
    return ops.from_numpy(np.asarray(rows, dtype=np.int64))


def _vreq(rid, k, dev=None):
    return VerifyRequest(rid, np.zeros(k, np.int64), None, device=dev)


def test_the_verify_tokens_take_each_requests_row_of_the_drafts(ops):
    drafts = _drafts(ops, [[11, 12], [21, 22]])                    # the propose's rows: request b, then a
    host = np.array([[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]], np.int64)   # [t_n, 3 draft columns]; c: k = 0
    got = ops.to_numpy(device_drafts.verify_tokens(ops, host, drafts, np.array([1, 0, 0])))
    # Columns past kmax = 2 keep the host's; request c's columns are padding (k = 0): row 0's drafts.
    assert got.tolist() == [[1, 21, 22, 0], [2, 11, 12, 0], [3, 11, 12, 0]]
    same = ops.to_numpy(device_drafts.verify_tokens(ops, host[:2, :3], drafts, np.array([0, 1])))
    assert same.tolist() == [[1, 11, 12], [2, 21, 22]]


def test_accepted_counts_read_each_requests_row_of_the_drafts(ops):
    """Request i's drafts are row rows[i] of the host copy, its first k_i columns; its count is
    the leading run of them equal to its argmax row (the per-row rule's)."""
    drafts = ops.to_numpy(_drafts(ops, [[5, 6, 7], [8, 9, 10]]))
    best = np.array([[8, 9, 4, 0], [1, 2, 3, 4], [5, 0, 7, 7]], np.int64)       # [B, k + 1]
    rows, ks = np.array([1, 0, 0]), np.array([2, 0, 3])
    got = device_drafts.accepted(drafts, rows, ks, best)
    assert got.tolist() == [2, 0, 1]
    for i in range(3):
        want = accept_greedy_ids(drafts[rows[i], : ks[i]].tolist(), best[i, : ks[i] + 1])
        assert got[i] == want.num_accepted


def test_a_verify_reads_device_drafts_only_when_all_of_them_can_be(ops):
    t, other = _drafts(ops, [[5, 6], [8, 9]]), _drafts(ops, [[3, 4]])
    params = {"a": GREEDY, "b": GREEDY, "s": SAMPLED}
    greedy = [_vreq("a", 2, DeviceDrafts(t, 1)), _vreq("b", 1, DeviceDrafts(t, 0))]
    reqs, chain = device_drafts.chain_or_fetch(ops, greedy, params.get)
    assert reqs is greedy and chain[0] is t and chain[1].tolist() == [1, 0]
    # A sampled request, drafts of two tensors, or host drafts beside device ones: to the host first.
    for case in ([_vreq("a", 2, DeviceDrafts(t, 1)), _vreq("s", 2, DeviceDrafts(t, 0))],
                 [_vreq("a", 2, DeviceDrafts(t, 1)), _vreq("b", 2, DeviceDrafts(other, 0))],
                 [_vreq("a", 2, DeviceDrafts(t, 1)), VerifyRequest("b", np.array([7, 7]), None)]):
        reqs, chain = device_drafts.chain_or_fetch(ops, case, params.get)
        assert chain is None and all(r.device is None for r in reqs)
        assert reqs[0].drafts.tolist() == [8, 9] and len(reqs[1].drafts) == 2


@pytest.mark.parametrize("backend", ["torch", "paddle"])
def test_the_engine_with_drafts_on_the_device_gives_target_only_tokens(backend):
    """Mixed k in one batch, then greedy and sampled requests in one batch (the sampled one's drafts,
    and so those rounds', go through the host): the same tokens with drafts on the device or not,
    and greedy ones equal to target-only; a sampled request alone never leaves them there."""
    tok = ByteTokenizer()
    prompts = [tuple(tok.encode(p)) for p in json.loads((TINY / "heldout_prompts.json").read_text())[:4]]

    def engine(on_device: bool) -> SpecEngine:
        cfg = EngineConfig(str(TINY), runtime=RuntimeConfig(backend=backend), spec=SpecConfig(max_k=3, default_k=3),
                           cache=CacheConfig(max_slots=8, max_len=512))
        return SpecEngine(cfg, device_drafts=on_device)

    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    mixed_k = [GenRequest(f"g{i}", p, greedy, 1 + i % 3) for i, p in enumerate(prompts)]
    with_sampled = mixed_k[:2] + [GenRequest("s", prompts[2], SamplingParams(max_tokens=32, ignore_eos=True,
                                                                             temperature=0.8, seed=4), 3)]
    on, off = engine(True), engine(False)
    ref = [r.tokens for r in off.generate([GenRequest(r.request_id, r.prompt, r.params, 0) for r in mixed_k])]
    got = [r.tokens for r in on.generate(mixed_k, max_batch=4)]
    assert got == ref and on.target.device_draft_verifies > 0
    assert [r.tokens for r in on.generate(with_sampled)] == [r.tokens for r in off.generate(with_sampled)]
    chained = on.target.device_draft_verifies
    on.generate(with_sampled[2:])                                  # sampled alone: every round through the host
    assert on.target.device_draft_verifies == chained and off.target.device_draft_verifies == 0
