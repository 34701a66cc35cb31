"""The harness of the reload tests (``test_reload.py``, ``test_reload_policies.py``, the soak and the
seeded-sampling tests): two random tiny checkpoints A and B (every tensor differs, embedding and head
included) served by Paddle workers in this process, the in-process stack, the target-only reference,
and the helpers that run generations next to a reload and check what they produced.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from draft_service.server import colocated as colocated_draft
from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient, SpecsplitError
from orchestrator.config import OrchestratorConfig
from orchestrator.server import create_server
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from specsplit.v1 import common_pb2
from target_service.server import start as start_target
from tests.byte_model import write_byte_model
from tests.waiting import wait_until
from worker.config import WorkerConfig

TIMEOUT = 30.0
MAX_LEN = 512
REPO = Path(__file__).resolve().parents[2]
SHARED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
READY, LOADED = common_pb2.LIFECYCLE_STATE_READY, common_pb2.LIFECYCLE_STATE_LOADED


def make_model(path: Path, seed: int, ffn: int = 64) -> Path:
    """tests/byte_model.py's model; the final norm varies too, so versions differ in every shared tensor."""
    write_byte_model(path, seed, MAX_LEN, ffn, vary_final_norm=True)
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reload_models")
    return {"A": make_model(root / "A", 0), "B": make_model(root / "B", 10)}


class Reference:
    """Target-only greedy decoding per checkpoint, in process (memoized)."""

    def __init__(self) -> None:
        self.engines: dict[Path, SpecEngine] = {}
        self.memo: dict = {}

    def __call__(self, model: Path, prompt, n: int) -> tuple[int, ...]:
        key = (model, tuple(prompt), n)
        if key not in self.memo:
            if model not in self.engines:
                self.engines[model] = SpecEngine(EngineConfig(
                    target_path=str(model), runtime=RuntimeConfig(backend="paddle"),
                    spec=SpecConfig(max_k=3, default_k=0), cache=CacheConfig(max_slots=2, max_len=MAX_LEN)),
                    use_draft=False)
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            self.memo[key] = self.engines[model].generate([GenRequest("ref", tuple(prompt), params, k=0)])[0].tokens
        return self.memo[key]


@pytest.fixture(scope="session")
def ref() -> Reference:
    return Reference()


def wcfg(role: str, model: Path, version: str, graphs: bool = True, port: int = 0) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version=version, capture_on_start=graphs,
                        runtime=RuntimeConfig(backend="paddle"), spec=SpecConfig(max_k=3, default_k=3),
                        cache=CacheConfig(max_slots=8, max_len=MAX_LEN), graphs=GraphConfig(batch_buckets=(1, 4, 8)),
                        server=ServerConfig(port=port, max_workers=8))


@dataclasses.dataclass
class HostedDraft:
    """A target's colocated draft, as the tests see a draft service (its port is the target's)."""

    worker: Any
    port: int

    def stop(self, grace: float | None = None) -> None:
        """Nothing: the target's stop tears its hosted draft down."""


class Stack:
    """In-process target + draft (Paddle) + orchestrator + client; ``close`` stops everything.
    ``colocated``: the draft in the target's service (``colocated_draft``; its graphs follow the
    target's), the orchestrator's draft address the target's."""

    def __init__(self, model: Path, version: str, *, draft_graphs: bool = True, target_graphs: bool = True,
                 target_port: int | None = None, draft_port: int | None = None, draft_model: Path | None = None,
                 colocated: bool = False, **orch) -> None:
        # target_port / draft_port: a worker started by the caller (which also stops it).
        if colocated:
            # Rounds queued ahead as on a GPU (graphs.round_ahead; the CPU's graphs are the eager
            # stand-in): a reload drops what is queued before its graphs go.
            base = wcfg("target", model, version, target_graphs)
            cfg = dataclasses.replace(base, colocated_draft=True,
                                      graphs=dataclasses.replace(base.graphs, round_ahead=True))
            self.target = start_target(cfg, draft=colocated_draft(cfg))
            self.draft = HostedDraft(self.target.hosted.worker, self.target.port)
        else:
            self.target = None if target_port else start_target(wcfg("target", model, version, target_graphs))
            self.draft = None if draft_port else start_draft(wcfg("draft", draft_model or model, version,
                                                                  draft_graphs))
        kw = dict(draft_address=f"127.0.0.1:{draft_port or self.draft.port}",
                  target_address=f"127.0.0.1:{target_port or self.target.port}", max_batch=8, max_queue=32,
                  max_tokens_limit=MAX_LEN, worker_timeout_s=TIMEOUT, reload_call_timeout_s=TIMEOUT,
                  reload_wait_timeout_s=TIMEOUT, reload_rollback_wait_s=TIMEOUT, generate_wait_during_reload_s=TIMEOUT,
                  server=ServerConfig(port=0))
        kw.update(orch)
        self.server, port = create_server(OrchestratorConfig(**kw))
        self.address = f"127.0.0.1:{port}"
        self.client = SpecsplitClient(self.address, timeout=TIMEOUT, token=(kw.get("security") or SecurityConfig()).admin_token)

    def workers(self) -> dict:
        return {"target": self.target.worker, "draft": self.draft.worker}

    def status(self) -> dict:
        return self.client.status()

    def slow_rounds(self, seconds: float) -> None:
        """Each Verify takes at least ``seconds`` (so requests are still running when a reload comes)."""
        w = self.target.worker
        orig = type(w).verify.__get__(w)
        w.verify = lambda items, round_=0: (time.sleep(seconds), orig(items, round_))[1]

    def close(self) -> None:
        self.client.close()
        self.server.stop(0).wait(5)
        for svc in (self.target, self.draft):
            if svc is not None:
                svc.stop(grace=None)


@pytest.fixture
def stacks():
    made: list[Stack] = []

    def make(*a, **kw) -> Stack:
        made.append(Stack(*a, **kw))
        return made[-1]
    yield make
    for s in reversed(made):
        s.close()


def prompt_of(i: int, n: int) -> list[int]:
    return [256, *(int(x) for x in np.random.default_rng(900 + i).integers(0, 256, n - 1))]


PROMPTS = [prompt_of(0, 1), prompt_of(1, 7), prompt_of(2, 30)]


def run_gen(client: SpecsplitClient, prompt, n: int, **kw):
    """(chunk events, final event) or (chunks, SpecsplitError)."""
    chunks = []
    try:
        for ev in client.generate(prompt, n, ignore_eos=True, **kw):
            if ev.final:
                return chunks, ev
            chunks.append(ev)
    except SpecsplitError as exc:
        return chunks, exc
    raise AssertionError("stream ended without a final event")


def in_thread(fn):
    out: dict = {}

    def wrap():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            out["error"] = exc
    t = threading.Thread(target=wrap, daemon=True)
    t.start()

    def join(timeout: float = 120.0):
        t.join(timeout)
        assert not t.is_alive(), "thread did not finish in time"
        if "error" in out:
            raise out["error"]
        return out["value"]
    return join


def check_segments(ref: Reference, models: dict, prompt, chunks, versions: dict | None = None) -> None:
    """Tokens produced under each weights version equal that version's target-only
    greedy continuation of everything before them (honest version labels)."""
    versions = versions or models
    done: list[int] = []
    i = 0
    while i < len(chunks):
        v, seg = chunks[i].weights_version, []
        while i < len(chunks) and chunks[i].weights_version == v:
            seg.extend(chunks[i].tokens)
            i += 1
        assert tuple(seg) == ref(versions[v], list(prompt) + done, len(seg)), (v, len(done))
        done.extend(seg)


def acceptance_pattern(client, prompt, n) -> list[tuple]:
    chunks, final = run_gen(client, prompt, n, k=3)
    return [(c.tokens, c.num_accepted, c.num_drafted) for c in chunks] + [final.tokens]


def assert_serving(stack: Stack, version: str, graphs: dict[str, bool] | None = None) -> None:
    # NOTE: the last request's slots are free before its final event (rounds.scheduler._end), but
    # a stream that ended while others still ran frees its draft slot a round later: the slots
    # are waited for (bounded), then checked.
    wait_until(lambda: all(stack.status()[r]["used_slots"] == 0 for r in ("target", "draft")),
               f"every slot to be released (serving {version})")
    st = stack.status()
    for role in ("target", "draft"):
        assert st[role]["weights_version"] == version, (role, st[role])
        want = "LIFECYCLE_STATE_READY" if (graphs or {}).get(role, True) else "LIFECYCLE_STATE_LOADED"
        assert st[role]["state"] == want, (role, st[role]["state"])
        assert st[role]["used_slots"] == 0, st[role]["active_request_ids"]


