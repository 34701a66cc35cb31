"""A tensor-parallel target (TP=2, gloo on the CPU) gives TP=1's greedy tokens, through the lifecycle.

The bundled model in fp32: rank 0 is an in-process target service (gRPC, round loop),
rank 1 a process it spawned (``target_service/tp_launch.py``). Greedy output must equal
the single-device engine's token for token: target-only and speculative (the draft is an
ordinary one-device draft service), after a RECAPTURE driven by the public lifecycle RPCs
(ClearGraphs, ReleaseWeights, LoadWeights, CaptureGraphs) and after IN_PLACE reloads to a
different checkpoint and back.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from core.admin_token import process_token
from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from orchestrator.round_client import RemoteRounds
from rounds.scheduler_types import FinalEvent, GenerationRequest
from rounds.worker_clients import TargetClient
from tests.integration.test_round_loop import _drain
from runtime.checkpoint import index_checkpoint, load_tensors, save_target
from runtime.batch_layout import prefill_width
from runtime.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.tokenizer import ByteTokenizer
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import target_pb2_grpc
from worker.config import WorkerConfig

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
TIMEOUT = 60.0
MAX_TOKENS = 24
N_PROMPTS = 3


def _cfg(role: str, tp: int = 1) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(TINY), weights_version="A", tp=tp,
                        runtime=RuntimeConfig(backend="torch", device="cpu"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=4, max_len=256),
                        # Prefill graphs on the CPU too: rank 0's prefills replay on every rank.
                        graphs=GraphConfig(batch_buckets=(1, 4), prefill_graphs=True),
                        server=ServerConfig(host="127.0.0.1", port=0),
                        security=SecurityConfig())


def _prompts() -> list[tuple[int, ...]]:
    tok = ByteTokenizer()
    return [tuple(tok.encode(p)) for p in json.loads((TINY / "heldout_prompts.json").read_text())[:N_PROMPTS]]


def _reference(model: Path) -> list[list[int]]:
    """TP=1 greedy target-only tokens of the in-process engine (fp32, Torch, CPU)."""
    eng = SpecEngine(EngineConfig(str(model), runtime=RuntimeConfig(backend="torch"), spec=SpecConfig(max_k=0, default_k=0),
                                  cache=CacheConfig(max_slots=4, max_len=256), graphs=GraphConfig(batch_buckets=(1,))),
                     use_draft=False)
    reqs = [GenRequest(f"ref{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), k=0)
            for i, p in enumerate(_prompts())]
    return [list(r.tokens) for r in eng.generate(reqs)]


def _variant(root: Path) -> Path:
    """The bundled model with every tensor perturbed (a different checkpoint of the same shapes)."""
    arrays = load_tensors(index_checkpoint(TINY))
    rng = np.random.default_rng(7)
    arrays = {n: (a * (1.0 + 0.05 * rng.standard_normal(a.shape))).astype(np.float32) for n, a in arrays.items()}
    save_target(root, ModelConfig.from_json_file(TINY / "config.json"), arrays, shard_bytes=1 << 21)
    return root


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    from draft_service import server as draft_server
    from target_service import server as target_server

    draft = draft_server.start(_cfg("draft"))
    target = target_server.start(_cfg("target", tp=2))
    client = TargetClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26,
                          admin_token=process_token())
    rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{target.port}")
    stub = target_pb2_grpc.TargetServiceStub(channel)
    yield rounds, f"127.0.0.1:{draft.port}", stub, target
    rounds.stop()
    client.close()
    channel.close()
    target.stop(grace=None)
    draft.stop(grace=None)


def _generate(rounds, tag: str, k: int) -> list[list[int]]:
    handles = [rounds.submit(GenerationRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                               k)) for i, p in enumerate(_prompts())]
    out = []
    for h in handles:
        tokens, final = _drain(h)
        assert isinstance(final, FinalEvent), final
        out.append(tokens)
    return out


def _admin(stub, rpc: str, request) -> pb.WorkerStatus:
    return getattr(stub, rpc)(request, timeout=TIMEOUT, metadata=[("authorization", f"Bearer {process_token()}")]).status


def test_tp2_greedy_equals_tp1_target_only_and_speculative(tp_stack):
    rounds, draft_address, _stub, target = tp_stack
    ref = _reference(TINY)
    rounds.configure("", 4, 8, TIMEOUT)                               # no draft: target-only
    assert _generate(rounds, "solo", 0) == ref
    st = rounds.configure(draft_address, 4, 8, TIMEOUT)
    assert st.speculation_available
    assert _generate(rounds, "spec", 3) == ref
    assert target.worker.status().active_request_ids == ()


def test_tp2_through_recapture_and_in_place_reloads(tp_stack, tmp_path):
    rounds, draft_address, stub, target = tp_stack
    rounds.configure("", 4, 8, TIMEOUT)
    ref_a, variant = _reference(TINY), _variant(tmp_path / "B")
    ref_b = _reference(variant)
    assert ref_b != ref_a                                            # the reload must show
    # RECAPTURE, in the order the lifecycle demands, on every rank.
    assert _admin(stub, "CaptureGraphs", pb.CaptureGraphsRequest()).state == pb.LIFECYCLE_STATE_READY
    with pytest.raises(grpc.RpcError) as err:
        _admin(stub, "ReleaseWeights", pb.ReleaseWeightsRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    _admin(stub, "ClearGraphs", pb.ClearGraphsRequest())
    assert _admin(stub, "ReleaseWeights", pb.ReleaseWeightsRequest()).state == pb.LIFECYCLE_STATE_EMPTY
    st = _admin(stub, "LoadWeights", pb.LoadWeightsRequest(target_path=str(variant), version="B"))
    assert st.state == pb.LIFECYCLE_STATE_LOADED and st.weights_version == "B"
    st = _admin(stub, "CaptureGraphs", pb.CaptureGraphsRequest())
    assert st.state == pb.LIFECYCLE_STATE_READY and st.graph_keys
    assert any(k.startswith("prefill") for k in st.graph_keys), st.graph_keys
    engine = target.worker.engine                                    # the prompts' prefill replays a graph
    w = prefill_width(engine._prefill_widths, max(len(p) for p in _prompts()), N_PROMPTS)
    assert w is not None and engine.registry.can_replay(f"prefill{w}", N_PROMPTS)
    replays = target.worker.status().graph_replays
    assert _generate(rounds, "recap", 0) == ref_b
    assert target.worker.status().graph_replays > replays            # rank 0 replayed its graphs
    # IN_PLACE under live graphs: back to A, then speculative on A.
    st = _admin(stub, "LoadWeights", pb.LoadWeightsRequest(target_path=str(TINY), version="A2", in_place=True))
    assert st.state == pb.LIFECYCLE_STATE_READY and st.weights_version == "A2"
    assert _generate(rounds, "inplace", 0) == ref_a
    rounds.configure(draft_address, 4, 8, TIMEOUT)
    assert _generate(rounds, "inplace-spec", 3) == ref_a
    # The reload path (worker-owned swaps): prepare, then one commit stream, on every rank.
    client = rounds.target
    rounds.configure("", 4, 8, TIMEOUT)
    client.prepare_weights(str(variant), "", "B2", "recapture", timeout=TIMEOUT)
    st = client.commit_weights("B2", "recapture", timeout=TIMEOUT)
    assert st.state == pb.LIFECYCLE_STATE_READY and st.weights_version == "B2"
    assert _generate(rounds, "swap-recap", 0) == ref_b
    client.prepare_weights(str(TINY), "", "A3", "in_place", preload=True, timeout=TIMEOUT)
    st = client.commit_weights("A3", "in_place", timeout=TIMEOUT)
    assert st.state == pb.LIFECYCLE_STATE_READY and st.weights_version == "A3"
    assert _generate(rounds, "swap-inplace", 0) == ref_a
