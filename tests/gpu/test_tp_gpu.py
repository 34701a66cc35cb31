"""A tensor-parallel target on several GPUs (NCCL, CUDA graphs with the collectives inside) gives TP=1's tokens.

Run on an ``nvidia-h200-x2`` host (TP=2) or an ``nvidia-h200-x4`` one (TP=2 and TP=3, the latter
with uneven shares: 1, 1 and 2 query heads): ``python3 -m pytest -m gpu tests/gpu/test_tp_gpu.py -s``.
The target's ranks on cuda:0..tp-1 (rank 0 in this process, the others spawned), the draft on
cuda:tp when there is one, else sharing cuda:0; bundled model, fp32. Greedy output, target-only and speculative, with the
target's graphs captured on both ranks, must equal the single-GPU engine's tokens; so must
it after a RECAPTURE through the lifecycle RPCs.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

from core.admin_token import process_token  # noqa: E402
from orchestrator.round_client import RemoteRounds  # noqa: E402
from rounds.worker_clients import TargetClient  # noqa: E402
from runtime.config import EngineConfig, GraphConfig, RuntimeConfig  # noqa: E402
from specsplit.v1 import common_pb2 as pb  # noqa: E402
from specsplit.v1 import target_pb2_grpc  # noqa: E402
from tests.integration.test_tp_target import MAX_TOKENS, TIMEOUT, TINY, _cfg, _generate, _prompts  # noqa: E402


def _reference_cuda() -> list[list[int]]:
    from core.params import SamplingParams
    from runtime.config import CacheConfig, SpecConfig
    from runtime.engine import GenRequest, SpecEngine

    eng = SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device="cuda:0"),
                                  spec=SpecConfig(max_k=0, default_k=0), cache=CacheConfig(max_slots=4, max_len=256),
                                  graphs=GraphConfig(batch_buckets=(1, 4))), use_draft=False)
    eng.capture_graphs()
    reqs = [GenRequest(f"ref{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), k=0)
            for i, p in enumerate(_prompts())]
    return [list(r.tokens) for r in eng.generate(reqs)]


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_on_gpus_equals_tp1_with_graphs_and_through_recapture(tp):
    import grpc

    from draft_service import server as draft_server
    from target_service import server as target_server

    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} CUDA GPUs")
    ref = _reference_cuda()
    cuda = lambda c, dev: dataclasses.replace(c, runtime=dataclasses.replace(c.runtime, device=dev),  # noqa: E731
                                              capture_on_start=True)
    draft_device = f"cuda:{tp}" if torch.cuda.device_count() > tp else "cuda:0"
    draft = draft_server.start(cuda(_cfg("draft"), draft_device))
    target = target_server.start(cuda(_cfg("target", tp=tp), "cuda:0"))
    client = TargetClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26,
                          admin_token=process_token())
    rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{target.port}")
    stub = target_pb2_grpc.TargetServiceStub(channel)
    auth = [("authorization", f"Bearer {process_token()}")]
    try:
        st = target.worker.status()
        assert st.graphs_mode == "cuda" and st.graph_keys and st.device == "cuda:0"
        print(f"[gpu] TP={tp}: target cuda:0..{tp - 1}, draft {draft_device}")
        rounds.configure("", 4, 8, TIMEOUT)
        assert _generate(rounds, "solo", 0) == ref
        rounds.configure(f"127.0.0.1:{draft.port}", 4, 8, TIMEOUT)
        assert _generate(rounds, "spec", 3) == ref
        assert target.worker.status().graph_replays > 0
        for rpc, req in (("ClearGraphs", pb.ClearGraphsRequest()), ("ReleaseWeights", pb.ReleaseWeightsRequest()),
                         ("LoadWeights", pb.LoadWeightsRequest(target_path=str(TINY), version="A2")),
                         ("CaptureGraphs", pb.CaptureGraphsRequest())):
            getattr(stub, rpc)(req, timeout=TIMEOUT, metadata=auth)
        assert _generate(rounds, "recap", 3) == ref
    finally:
        rounds.stop()
        client.close()
        channel.close()
        target.stop(grace=None)
        draft.stop(grace=None)
