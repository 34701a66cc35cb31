"""The part of a draft or target worker that both roles share and the lifecycle drives.

Owns: ``Worker``, one class for both roles, parameterized by its engine: the
ops object, the graph registry, the engine (None when EMPTY), loading /
in-place updating / releasing weights and capturing / clearing graphs in the
right order (all on the worker's one device thread), running a batched step
(``run``: the engine's ``check_<step>`` refuses bad items, the engine's
``<step>`` runs the rest as one batch, per-item errors through ``core.wire``),
request release, the ``WorkerStatus`` record, the checkpoint-path policy, and
where recent weight versions came from (so a rollback can reload the previous
version by its tag). A reload's staged swap (prepare, commit, abort) is
``worker.swap``, built on these transitions. A role (``draft_service.worker``, ``target_service.worker``)
adds only its checkpoint rules, its engine constructor, its metrics and the
names of its steps.

Must not know: servicers, frameworks (all device work goes through ``Ops``,
the registry and the engines), scheduling, what a valid request of a role is
(the engine's).
"""

from __future__ import annotations

import gc
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import structlog

from core import heap
from core.serving import check_checkpoint_path
from core.wire import ItemError, item_error_for
from runtime import host_memory
from runtime.backends import make_ops
from runtime.checkpoint import CheckpointError
from runtime.config import ModelConfig, RuntimeConfig
from worker.config import WorkerConfig
from worker.swap import WeightSwaps
from runtime.device_thread import DeviceThread
from runtime.graphs import GraphRegistry
from runtime.lifecycle import (CAPTURE_GRAPHS, CLEAR_GRAPHS, LOAD_WEIGHTS, LOAD_WEIGHTS_IN_PLACE, RELEASE_WEIGHTS,
                               Lifecycle, State)
from runtime.weights import CheckedCheckpoint, CheckpointArrays, copy_in_place, read_arrays, to_device

MAX_KEPT_SOURCES = 4     # weights sources a worker remembers for rollback (LoadWeights with empty target_path)

GRAPHS_PADDLE_NO_CUDA = "eager (paddle without CUDA)"
GRAPHS_DISABLED = "disabled"


@dataclass(frozen=True)
class WorkerStatus:
    """What GetStatus reports (field meanings: ``common.proto`` WorkerStatus)."""

    role: str
    state: State
    weights_version: str
    graph_keys: tuple[str, ...]
    graph_pool_bytes: int
    graphs_mode: str
    max_k: int
    backend: str
    device: str
    free_slots: int
    used_slots: int
    graph_replays: int
    eager_runs: int
    device_memory_bytes: int
    active_request_ids: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    max_len: int
    eos_token_id: int | None
    lifecycle_events: tuple[str, ...]
    max_position_embeddings: int = 0
    eos_token_ids: tuple[int, ...] = ()
    instance_id: str = ""


class Worker:
    """Lifecycle-driven weights and graphs of one worker, and the batched steps of its engine.

    Threading: gRPC calls arrive on many threads. All model work (steps, loads,
    capture, clear, release) runs on one ``DeviceThread``, which also serializes
    it; ``status()`` never waits for it, so GetStatus answers during a long step
    or load. Reading checkpoint files stays on the caller's thread.
    """

    role = "worker"
    # The role's metrics adapter (duck-typed): on_transition(...), step(...), graphs(...),
    # slots(...), results(step, items, results) (the role's own counters). None: no metrics.
    metrics_cls: Callable[[], Any] | None = None
    # Per-round steps that may run on the caller's thread while the device thread is idle
    # (``DeviceThread.run(inline=True)``): no hop to the device thread and back (issue 10).
    inline_steps: tuple[str, ...] = ()
    # False: no device work ever runs on a caller's thread, whatever the caller asks (TP ranks).
    allow_inline = True

    def __init__(self, cfg: WorkerConfig, log: Any = None) -> None:
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex     # GetStatus: tells this worker object from any other
        self.metrics = self.metrics_cls() if self.metrics_cls is not None else None
        self.log = (log or structlog.get_logger()).bind(role=self.role)
        self.ops, self.graphs_mode = self._make_ops(cfg.runtime)
        if not cfg.graphs.enabled:
            self.graphs_mode = GRAPHS_DISABLED
        self.registry = GraphRegistry(self.ops, cfg.graphs.batch_buckets,
                                      log=lambda msg: self.log.debug("graph_registry", detail=msg))
        self.lifecycle = Lifecycle([self._log_transition, self._count_transition])
        self.device = DeviceThread(f"{self.role}-device", self.ops.bind_thread)
        self.engine: Any = None                 # role engine; None when EMPTY
        self.model_cfg: ModelConfig | None = None
        self.weights_version = ""
        self._pool_bytes = 0
        self.check_path = lambda p: check_checkpoint_path(p, cfg.security.checkpoint_roots)
        # version -> (target_path, draft_path) of the last MAX_KEPT_SOURCES loads, newest
        # last: what a rollback reloads (LoadWeights with an empty target_path).
        self._sources: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.swaps = WeightSwaps(self)          # PrepareWeights / CommitWeights / AbortWeights

    # --- role hooks ----------------------------------------------------------
    def validate_checkpoint(self, target: Path, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
        """Validate the role's checkpoint from headers only (no tensor data read)."""
        raise NotImplementedError

    def _new_engine(self, model_cfg: ModelConfig, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    # --- construction ----------------------------------------------------------
    def _make_ops(self, rt: RuntimeConfig) -> tuple[Any, str]:
        try:
            ops = make_ops(rt)
        except RuntimeError as exc:
            if rt.backend != "paddle" or not rt.device.startswith("cuda"):
                raise
            # Paddle built without CUDA cannot use the GPU at all: run on the CPU
            # and say so in GetStatus (device "cpu", graphs "eager (paddle without
            # CUDA)") rather than pretend to be on the GPU.
            self.log.warning("paddle_without_cuda", requested_device=rt.device, error=str(exc))
            return make_ops(RuntimeConfig(backend="paddle", device="cpu", dtype=rt.dtype)), GRAPHS_PADDLE_NO_CUDA
        return ops, ops.graphs_mode

    def _log_transition(self, action: str, outcome: str, before: State, after: State, detail: str) -> None:
        level = self.log.info if outcome in ("ok", "noop") else self.log.warning
        level("lifecycle", action=action, outcome=outcome, state=after.value, previous_state=before.value,
              weights_version=detail or self.weights_version)

    def _count_transition(self, *args: Any) -> None:
        if self.metrics is not None:
            self.metrics.on_transition(*args)

    # --- lifecycle operations ----------------------------------------------------
    def load_weights(self, target_path: str, draft_path: str = "", version: str = "",
                     in_place: bool = False, validate_only: bool = False) -> None:
        """Load (EMPTY -> LOADED), update in place (LOADED/READY, graphs kept) or only validate.

        An empty ``target_path`` reloads the weights loaded here earlier as ``version``
        (the last MAX_KEPT_SOURCES are remembered): how a failed reload rolls back.
        Raises ValueError/CheckpointError for a bad path or checkpoint, LifecycleError
        for a wrong state. On any failure the previous weights, version and state are intact.
        """
        if not target_path:
            target_path, draft_path, version = self.known_source(version)
        target = self.check_path(target_path)          # ValueError outside the configured roots
        version = version or target_path
        action = LOAD_WEIGHTS_IN_PLACE if in_place else LOAD_WEIGHTS
        if not validate_only:
            self.lifecycle.check(action)                # fail fast, before reading gigabytes
        # NOTE: validate the whole checkpoint (config, every name/shape/dtype) from
        # the headers before any live weight is touched: a bad checkpoint must leave
        # the running weights and graphs exactly as they were.
        checked = self.validate_checkpoint(target, draft_path, self.model_cfg if in_place else None)
        if validate_only:
            self.log.info("weights_validated", target_path=target_path, weights_version=version)
            return
        with host_memory.loading():
            self.apply_weights(checked, self.in_place_source(checked) if in_place else self.read_weights(checked),
                               version, in_place, (target_path, draft_path))

    def read_weights(self, checked: CheckedCheckpoint) -> dict[str, np.ndarray]:
        """A validated checkpoint's tensors in host memory (on the caller's thread: serving goes
        on meanwhile). bf16 stays raw bits (no float32 host copy): both backends reinterpret
        them on the device and cast there. A role may read only its share (tensor parallel)."""
        return read_arrays(checked, bf16_bits=True)

    def in_place_source(self, checked: CheckedCheckpoint) -> Mapping[str, np.ndarray]:
        """What an in-place update copies from: the tensors read on access, one at a time
        (``CheckpointArrays``: the backend streams them straight from the files through pinned
        buffers where it can), so the checkpoint is never whole in host memory."""
        return CheckpointArrays(checked)

    def apply_weights(self, checked: CheckedCheckpoint, arrays: Mapping[str, np.ndarray], version: str,
                      in_place: bool, source: tuple[str, str]) -> None:
        """Make the tensors of a validated checkpoint the live weights (one lifecycle transition
        on the device thread): a new load (EMPTY -> LOADED; ``arrays`` read into host memory,
        consumed) or a copy into the live tensors (``arrays`` may be ``CheckpointArrays``,
        read as it goes); ``source`` (target_path, draft_path) is remembered for rollbacks."""
        action = LOAD_WEIGHTS_IN_PLACE if in_place else LOAD_WEIGHTS
        def apply() -> None:
            if in_place:
                self.lifecycle.apply(action, lambda: self._copy_in_place(checked.cfg, arrays, version), version)
            else:
                self.lifecycle.apply(action, lambda: self._install(checked.cfg, arrays, version), version)
            self._sources.pop(version, None)
            self._sources[version] = source
            while len(self._sources) > MAX_KEPT_SOURCES:
                self._sources.popitem(last=False)

        try:
            self.device.run(apply)
        finally:
            # NOTE: after the new weights are live and the host arrays are gone (to_device /
            # copy_in_place consumed them): give the freed host pages back (runtime/host_memory.py).
            if isinstance(arrays, dict):
                arrays.clear()
            host_memory.trim()

    def known_source(self, version: str) -> tuple[str, str, str]:
        """(target_path, draft_path, version) of weights loaded here earlier as ``version``.

        An empty target_path in LoadWeights means "reload version X from where it came
        from": the orchestrator's rollback after a failed reload (it may not know the
        paths the worker was started with). Empty ``version``: the newest known.
        """
        if not self._sources:
            raise ValueError("target_path is required (this worker has loaded no weights it could reload)")
        if not version:
            version = next(reversed(self._sources))
        if version not in self._sources:
            raise ValueError(f"target_path is empty and version {version!r} was not loaded here before "
                             f"(known: {list(self._sources)})")
        target_path, draft_path = self._sources[version]
        return target_path, draft_path, version

    def _copy_in_place(self, new_cfg: ModelConfig, arrays: Mapping[str, np.ndarray], version: str) -> None:
        diff = [f for f in self.model_cfg.compatible_with(new_cfg) if f != "torch_dtype"]
        if diff:
            raise CheckpointError(f"in-place update: config differs from the running model in {diff}")
        # NOTE: copy_ into the existing parameter tensors (addresses unchanged), so
        # live graphs stay valid; copy_in_place checks every name and shape before
        # the first copy, so a mismatch changes nothing.
        self._drop_pending()
        copy_in_place(self.ops, self.engine.params, arrays)
        self.weights_version = version

    def _install(self, model_cfg: ModelConfig, arrays: dict[str, np.ndarray], version: str) -> None:
        try:
            engine = self._new_engine(model_cfg, to_device(self.ops, arrays))
        except BaseException:
            # The engine may have registered step kinds before failing; the registry
            # is not live in EMPTY, so dropping them is allowed.
            self.registry.unregister_all()
            raise
        if self.engine is not None and self.metrics is not None:
            self.metrics.engine_retired()
        self.engine, self.model_cfg, self.weights_version = engine, model_cfg, version

    def release_weights(self) -> bool:
        """LOADED -> EMPTY (refused while READY; no-op when EMPTY). Drops every request."""
        return self.device.run(lambda: self.lifecycle.apply(RELEASE_WEIGHTS, self._drop_engine))

    def _drop_engine(self) -> None:
        # NOTE: order matters. The lifecycle refused this while graphs were live, so
        # the registry holds no graph that reads these weights or caches; only then
        # drop the step kinds (they close over the engine), then the engine (its
        # params and KV cache), then return the memory to the device. Dropping the
        # engine under live graphs would free memory a replay still reads.
        assert not self.registry.live, "graphs must be cleared before weights are released"
        dropped = len(self.engine.cache.request_ids()) if self.engine is not None else 0
        self.registry.unregister_all()
        if self.engine is not None and self.metrics is not None:
            self.metrics.engine_retired()
        self.engine = None
        self.model_cfg = None
        self.weights_version = ""
        heap.thaw()                    # NOTE: before the collection: settled cycles are found only thawed
        gc.collect()
        self.ops.synchronize()
        self.ops.empty_cache()
        host_memory.trim()
        if dropped:
            self.log.warning("requests_dropped_with_weights", count=dropped)

    def capture_graphs(self) -> bool:
        """LOADED -> READY (no-op when READY; refused when EMPTY). No-op when graphs are disabled."""
        if not self.cfg.graphs.enabled:
            self.lifecycle.require_serving("CaptureGraphs")
            self.log.info("capture_skipped", reason="graphs.enabled is false")
            return False
        return self.device.run(lambda: self.lifecycle.apply(CAPTURE_GRAPHS, self._capture))

    def _capture(self) -> None:
        before = self.ops.memory_allocated()
        self.registry.capture_all()
        # The registry does not expose its pool; the allocator's growth over the
        # capture is the pool plus static buffers (0 on CPU).
        self._pool_bytes = max(0, self.ops.memory_allocated() - before)
        heap.settle()              # serving state built: out of the collector's full walks (core/heap.py)

    def clear_graphs(self) -> bool:
        """READY -> LOADED (no-op when LOADED or EMPTY)."""
        return self.device.run(lambda: self.lifecycle.apply(CLEAR_GRAPHS, self._clear))

    def _clear(self) -> None:
        # NOTE: a step the engine queued ahead (runtime/decode_ahead.py) holds views of the
        # graphs' static outputs, and after an in-place copy it read the old weights: both
        # drop it before the change.
        self._drop_pending()
        heap.thaw()                    # NOTE: before the registry's collection (core/heap.py)
        self.registry.clear()
        self._pool_bytes = 0

    def _drop_pending(self) -> None:
        drop = getattr(self.engine, "drop_pending", None)
        if drop is not None:
            drop()

    def close(self) -> None:
        """Shutdown teardown: graphs first, then weights."""
        # NOTE: clear graphs before releasing weights, always (also at exit): the
        # graphs read the weights and caches that release frees.
        self.clear_graphs()
        self.release_weights()

    # --- requests ----------------------------------------------------------------
    def release(self, request_ids: list[str], inline: bool = False) -> list[str]:
        """Free the caches of these requests; unknown ids are ignored. Returns those that were held.
        ``inline``: the caller is on the per-round path (``DeviceThread.run(inline=True)``)."""
        def work() -> list[str]:
            eng = self.engine
            if eng is None:
                return []
            released = [rid for rid in dict.fromkeys(request_ids) if eng.release(rid)]
            if self.metrics is not None:
                self.metrics.slots(eng.cache.used_slots, eng.cache.free_slots)
            return released

        return self.device.run(work, inline=inline and self.allow_inline)

    def prefill(self, items: list[Any], inline: bool | None = None) -> list[Any]:
        """The engine's prefill of each valid item (target: prompt -> first token and hidden rows;
        draft: prompt pairs into its cache, None = success), one batch; errors per item.
        Raises LifecycleError (whole batch) when no weights are loaded."""
        return self.run("prefill", items, inline=inline)

    def run(self, step: str, items: list[Any], round_: int | None = None, inline: bool | None = None) -> list[Any]:
        """Answer every item of a batched ``step`` ("prefill", "propose", "verify"), in order.

        The engine's ``check_<step>`` refuses the items it cannot run (each gets its error);
        its ``<step>`` runs the rest as one batch (a result per item; None where the step
        returns nothing). Items that are already errors (the servicer could not decode them)
        pass through. If the batch itself fails, each of its items gets that error; the
        worker goes on. Raises LifecycleError for the whole batch when no weights are loaded.
        ``inline``: may run on the caller's thread (``DeviceThread.run``); None: the role's
        ``inline_steps`` decide.
        """
        t0 = time.perf_counter()
        may = self.allow_inline and (step in self.inline_steps if inline is None else inline)
        return self._answered(step, items, round_, t0, self.device.run(self._step_work(step, items, round_), may))

    def run_async(self, step: str, items: list[Any], round_: int | None = None) -> Callable[[], list[Any]]:
        """``run`` queued on the device thread without waiting (``DeviceThread.submit``): the caller
        goes on (e.g. verifies on another worker) and calls the returned function once for the
        answers (LifecycleError, as ``run`` raises it, comes from that call)."""
        t0 = time.perf_counter()
        wait = self.device.submit(self._step_work(step, items, round_))
        return lambda: self._answered(step, items, round_, t0, wait())

    def _step_work(self, step: str, items: list[Any], round_: int | None) -> Callable[[], list[Any]]:
        """The device work of one batched step (``run``'s doc): the answers, in order."""
        def work() -> list[Any]:
            engine = self._serving_engine(step.capitalize())
            out: list[Any] = list(items)
            ok = [(i, it) for i, it in enumerate(items) if not isinstance(it, ItemError)]
            good, refused = getattr(engine, f"check_{step}")(ok)
            for i, exc in refused.items():
                out[i] = item_error_for(exc)
            if good:
                batch = [it for _, it in good]
                try:
                    results = getattr(engine, step)(batch)
                except Exception as exc:  # noqa: BLE001 - the batch failed: every item says why
                    err = item_error_for(exc)
                    self.log.exception("batch_failed", step=step, round=round_, items=len(good))
                    for i, _ in good:
                        out[i] = err
                else:
                    results = [None] * len(batch) if results is None else results
                    for (i, _), res in zip(good, results):
                        out[i] = res
                    if self.metrics is not None:
                        self.metrics.results(step, batch, results)
            stats = self.registry.stats
            if self.metrics is not None:
                self.metrics.graphs(stats.replays, stats.eager_runs)
                self.metrics.slots(engine.cache.used_slots, engine.cache.free_slots)
            return out
        return work

    def _answered(self, step: str, items: list[Any], round_: int | None, t0: float, out: list[Any]) -> list[Any]:
        """A step's answers, after its metrics and a log line per refused item."""
        errors = [(i, e) for i, e in enumerate(out) if isinstance(e, ItemError)]
        if self.metrics is not None:
            self.metrics.step(step, time.perf_counter() - t0, len(items), [e.code.name for _, e in errors])
        for i, e in errors:
            self.log.info("item_error", step=step, round=round_, request_id=getattr(items[i], "request_id", ""),
                          code=e.code.name, error=e.message)
        return out

    def _serving_engine(self, what: str) -> Any:
        """The engine, or LifecycleError when EMPTY. Call on the device thread."""
        self.lifecycle.require_serving(what)
        return self.engine

    # --- status ----------------------------------------------------------------------
    def status(self) -> WorkerStatus:
        """Cheap snapshot; never waits for model work."""
        eng, mc = self.engine, self.model_cfg
        cache = eng.cache if eng is not None else None
        stats = self.registry.stats
        return WorkerStatus(
            role=self.role, state=self.lifecycle.state, weights_version=self.weights_version,
            graph_keys=tuple(f"{kind}@{bucket}" for bucket, kind in self.registry.keys()),
            graph_pool_bytes=self._pool_bytes, graphs_mode=self.graphs_mode, max_k=self.cfg.spec.max_k,
            backend=self.ops.name, device=self.ops.device,
            free_slots=cache.free_slots if cache is not None else 0,
            used_slots=cache.used_slots if cache is not None else 0,
            graph_replays=stats.replays, eager_runs=stats.eager_runs,
            device_memory_bytes=int(self.ops.memory_allocated()),
            active_request_ids=tuple(cache.request_ids()) if cache is not None else (),
            vocab_size=mc.vocab_size if mc is not None else 0, hidden_size=mc.hidden_size if mc is not None else 0,
            max_len=cache.max_len if cache is not None else 0,
            eos_token_id=mc.eos_token_id if mc is not None else None,
            lifecycle_events=tuple(self.lifecycle.event_names()),
            max_position_embeddings=mc.max_position_embeddings if mc is not None else 0,
            eos_token_ids=mc.eos_token_ids if mc is not None else (), instance_id=self.instance_id)
