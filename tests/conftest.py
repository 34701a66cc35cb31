"""Shared test fixtures.

- ``tiny_model_cfg`` / ``tiny_model_dir`` (session): a random tiny Llama target
  (vocab 64, d 64, 2 layers, 4 heads / 2 KV heads, ffn 128, no EOS) in Hugging
  Face layout plus its ``mtp.safetensors``. The 2-D weights are scaled by 10 so
  logits are spread out and argmaxes are never near-ties.
- ``worker_config``: a ``WorkerConfig`` for that model on CPU with small buckets
  and cache (keyword overrides for any field).
- ``worker_server``: a factory that starts a draft or target service on
  127.0.0.1 port 0 with ``create_server``'s machinery and stops it (and closes
  its channel) after the test. Its channel presents the service's admin token
  (the generated one when the config sets none) unless a call brings its own.

Services started by the tests write generated admin-token files to a
temporary ``SPECSPLIT_RUNTIME_DIR`` (children inherit it), never to ``~``.

Paddle is imported after collection, before any test runs (a test process that
had started threads could abort while loading Paddle's library).

After collection the objects that exist then (the imported frameworks and test
modules, ~500k objects) are moved out of the cyclic garbage collector's reach
with ``gc.freeze()``: the workers' teardown and reload paths call
``gc.collect()``, which would otherwise walk them all each time (about a second
per call on CI's CPUs). Objects created by the tests are collected as before.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from runtime.checkpoint import save_safetensors, save_target
from core.config import SecurityConfig, ServerConfig
from runtime.config import CacheConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes

TIMEOUT = 30.0  # seconds: deadline of every stub call in the tests
os.environ.setdefault("SPECSPLIT_RUNTIME_DIR", tempfile.mkdtemp(prefix="specsplit-test-runtime-"))


def pytest_collection_finish(session: pytest.Session) -> None:
    # NOTE: Paddle is imported here, before any test starts a thread: loading its library in a
    # process where earlier tests left gRPC, scheduler and device threads running aborted about
    # one run in three ("terminate called after throwing an instance of 'std::system_error':
    # Invalid argument", inside paddle/base/core.py's import; tests/unit in one process).
    # After collection, so the import is in the frozen set below too.
    try:
        import runtime.backends.paddle_ops  # noqa: F401
    except ImportError:
        pass                                    # a checkout without Paddle runs the torch tests
    gc.collect()
    gc.freeze()


class _AdminToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call that carries no authorization of its own."""

    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        md = list(details.metadata or ())
        if not any(k == "authorization" for k, _ in md):
            md.append(self._md)
        return details._replace(metadata=md)      # grpc's _ClientCallDetails is a namedtuple

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def _spread(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: (v * 10.0 if v.ndim == 2 else v) for k, v in params.items()}


def write_tiny_model(path: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """A random target (seed) + MTP (seed + 1) pair in ``path``."""
    save_target(path, cfg, _spread(init_params(cfg, seed, target_tensor_shapes(cfg))))
    save_safetensors(path / "mtp.safetensors", _spread(init_params(cfg, seed + 1, mtp_tensor_shapes(cfg))))
    return path


@pytest.fixture(scope="session")
def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_cfg: ModelConfig) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"), tiny_model_cfg)


@pytest.fixture
def worker_config(tiny_model_dir: Path) -> Callable[..., WorkerConfig]:
    """worker_config(role, backend="paddle", load=True, **field overrides) -> WorkerConfig."""

    def make(role: str, backend: str = "paddle", load: bool = True, **overrides: Any) -> WorkerConfig:
        base = WorkerConfig(
            role=role, target_path=str(tiny_model_dir) if load else None, weights_version="v1",
            runtime=RuntimeConfig(backend=backend, device="cpu"), spec=SpecConfig(max_k=3, default_k=3),
            cache=CacheConfig(max_slots=4, max_len=64), graphs=GraphConfig(batch_buckets=(1, 2, 4)),
            server=ServerConfig(host="127.0.0.1", port=0, max_workers=8), security=SecurityConfig())
        return dataclasses.replace(base, **overrides)

    return make


@dataclass
class RunningWorker:
    service: Any            # worker.service.WorkerService
    channel: grpc.Channel | None   # None for a TLS server (tests bring credentials)
    stub: Any                      # DraftServiceStub | TargetServiceStub
    health: Any                    # HealthStub
    address: str

    @property
    def worker(self) -> Any:
        return self.service.worker


@pytest.fixture
def worker_server(worker_config: Callable[..., WorkerConfig]) -> Callable[..., RunningWorker]:
    """worker_server(role, backend="paddle", load=True, cfg=None, **overrides) -> RunningWorker.

    ``cfg`` (a full WorkerConfig) wins over the other arguments. Everything started
    is stopped after the test (server first, then the worker's ordered teardown).
    """
    from grpc_health.v1 import health_pb2_grpc

    from draft_service import server as draft_server
    from specsplit.v1 import draft_pb2_grpc, target_pb2_grpc
    from target_service import server as target_server

    started: list[RunningWorker] = []

    def start(role: str, backend: str = "paddle", load: bool = True, cfg: WorkerConfig | None = None,
              **overrides: Any) -> RunningWorker:
        cfg = cfg or worker_config(role, backend, load, **overrides)
        module, stub_cls = ((draft_server, draft_pb2_grpc.DraftServiceStub) if cfg.role == "draft"
                            else (target_server, target_pb2_grpc.TargetServiceStub))
        svc = module.start(cfg)
        address = f"127.0.0.1:{svc.port}"
        if cfg.security.tls_cert:   # TLS: the test brings its own channel credentials
            running = RunningWorker(svc, None, None, None, address)
        else:
            channel = grpc.insecure_channel(address)
            grpc.channel_ready_future(channel).result(timeout=TIMEOUT)
            if not (cfg.security.admin_token or cfg.security.admin_client_cns):
                from core.admin_token import process_token

                channel = grpc.intercept_channel(channel, _AdminToken(process_token()))
            running = RunningWorker(svc, channel, stub_cls(channel), health_pb2_grpc.HealthStub(channel), address)
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        if running.channel is not None:
            running.channel.close()
        running.service.stop(grace=None)
