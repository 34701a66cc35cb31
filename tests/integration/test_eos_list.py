"""A model with several EOS ids (config.json ``eos_token_id`` as a list), target worker called directly.

Regression: the target's round loop stopped only on the first EOS id; the
others stopped a request only when the orchestrator had added them as stop
tokens, so a client calling the target's ``Decode`` directly ran past them.
"""

from __future__ import annotations

import dataclasses

import pytest

from runtime.checkpoint import save_target
from runtime.config import CacheConfig, GraphConfig, ModelConfig, RuntimeConfig, ServerConfig, SpecConfig, WorkerConfig
from runtime.model import init_params, target_tensor_shapes
from specsplit.v1 import target_pb2 as tpb
from target_service.server import start as start_target

pytestmark = pytest.mark.integration

TIMEOUT = 60.0
PROMPT = (1, 2, 3)


def _decode(port: int, **fields) -> tpb.DecodeFinal:
    import grpc

    from specsplit.v1 import target_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        finals = [ev.final for ev in stub.Decode(tpb.DecodeRequest(request_id="r", prompt=list(PROMPT), **fields),
                                                 timeout=TIMEOUT) if ev.HasField("final")]
    assert len(finals) == 1
    return finals[0]


def _serve(path) -> object:
    return start_target(WorkerConfig(role="target", target_path=str(path), weights_version="v1",
                                     runtime=RuntimeConfig(backend="torch", device="cpu"),
                                     spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=2, max_len=64),
                                     graphs=GraphConfig(batch_buckets=(1, 2)), server=ServerConfig(host="127.0.0.1",
                                                                                                     port=0)))


def test_decode_on_the_target_stops_on_every_eos_of_a_list(tmp_path):
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    weights = {k: v * 20 for k, v in init_params(cfg, 0, target_tensor_shapes(cfg)).items()}
    save_target(tmp_path / "a", cfg, weights)
    svc = _serve(tmp_path / "a")
    try:
        free = list(_decode(svc.port, max_tokens=12, ignore_eos=True).output)
    finally:
        svc.stop(grace=None)
    stop_at = free[6]
    other = next(t for t in range(cfg.vocab_size) if t not in free)
    # The second id of the list is the one generation reaches; the first never comes.
    save_target(tmp_path / "b", dataclasses.replace(cfg, eos_token_id=other, eos_token_ids=(other, stop_at)), weights)
    svc = _serve(tmp_path / "b")
    try:
        final = _decode(svc.port, max_tokens=12)
        assert list(final.output) == free[:free.index(stop_at) + 1] and final.finish_reason == "stop"
        kept = _decode(svc.port, max_tokens=12, ignore_eos=True)        # ignore_eos: neither id stops it
        assert list(kept.output) == free and kept.finish_reason == "length"
    finally:
        svc.stop(grace=None)
