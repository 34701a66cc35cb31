"""An in-process stack for the client-facing tests: Paddle target + draft + orchestrator on 127.0.0.1.

The byte model of ``tests/byte_model.py`` (checkpoints A and B differ in every
tensor); tokens: ``ADMIN`` (admin RPCs; the orchestrator presents it to the
workers) and ``GEN`` (Generate). PushWeights stages under ``staging``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_service.server import start as start_draft
from orchestrator.server import create_server
from core.config import SecurityConfig, ServerConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from target_service.server import start as start_target
from tests.byte_model import write_byte_model
from tests.waiting import wait_until  # noqa: F401 (used by the tests that import this module too)

TIMEOUT = 30.0
MAX_LEN = 256
ADMIN, GEN = "admin-token-for-tests", "generate-token-for-tests"


def make_models(root: Path) -> dict[str, Path]:
    out = {}
    for name, seed in (("A", 0), ("B", 10)):
        write_byte_model(root / name, seed, MAX_LEN, vary_final_norm=True)
        out[name] = root / name
    return out


def _worker(role: str, model: Path) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version="A", capture_on_start=False,
                        runtime=RuntimeConfig(backend="paddle"), spec=SpecConfig(max_k=3, default_k=3),
                        cache=CacheConfig(max_slots=8, max_len=MAX_LEN), graphs=GraphConfig(batch_buckets=(1, 4, 8)),
                        server=ServerConfig(port=0, max_workers=8), security=SecurityConfig(admin_token=ADMIN))


@dataclass
class InprocStack:
    target: Any
    draft: Any
    server: Any
    address: str
    port: int
    staging: Path

    def close(self) -> None:
        self.server.stop(0).wait(5)
        self.target.stop(grace=None)
        self.draft.stop(grace=None)


def start_stack(models: dict[str, Path], staging: Path) -> InprocStack:
    target, draft = start_target(_worker("target", models["A"])), start_draft(_worker("draft", models["A"]))
    cfg = OrchestratorConfig(draft_address=f"127.0.0.1:{draft.port}", target_address=f"127.0.0.1:{target.port}",
                             max_batch=4, max_queue=16, max_tokens_limit=MAX_LEN - 8, worker_timeout_s=TIMEOUT,
                             reload_call_timeout_s=TIMEOUT, reload_wait_timeout_s=TIMEOUT,
                             server=ServerConfig(port=0), worker_admin_token=ADMIN, push_staging_dir=str(staging),
                             security=SecurityConfig(admin_token=ADMIN, generate_token=GEN))
    server, port = create_server(cfg)
    return InprocStack(target, draft, server, f"127.0.0.1:{port}", port, staging)


