"""Worker lifecycle: the EMPTY -> LOADED -> READY state machine (DESIGN § Worker lifecycle).

Owns: the worker's lifecycle state, which transitions are allowed from which
state, the idempotent no-ops, the ordered event log of transitions (the last
256, reported by GetStatus) and notifying observers (metrics, health, logs)
of every transition attempt.

Also owns ``WorkerBase``: the part of a draft or target worker that both
roles share and that the lifecycle drives: the ops object, the graph
registry, the engine (None when EMPTY), loading / in-place updating /
releasing weights, capturing / clearing graphs in the right order, request
release, the ``WorkerStatus`` record and where recent weight versions came
from (so a rollback can reload the previous version by its tag). Roles add checkpoint checks, the
engine constructor and their per-item request handling.

Must not know: gRPC, frameworks (all device work goes through ``Ops``, the
registry and the engines), scheduling. The work a transition stands for is a
callable passed to ``Lifecycle.apply``; the state machine only decides
whether it may run and records the result.

    EMPTY ──load_weights──▶ LOADED ──capture_graphs──▶ READY (graphs live)
      ▲                       │  ▲                       │
      └──release_weights──────┘  └──────clear_graphs─────┘

Rules:
- A refused transition raises ``LifecycleError`` (FAILED_PRECONDITION at the
  service) and leaves the state unchanged; so does a transition whose work
  raised (the work's exception propagates).
- No-ops where repeating is safe: capture_graphs when READY, clear_graphs when
  LOADED or EMPTY, release_weights when EMPTY. They run no work and are not
  events.
- release_weights while READY is refused: graphs read the weights, so they must
  be cleared first (by construction, never weights-before-graphs teardown).
- load_weights_in_place (copy into the existing parameters, addresses kept)
  keeps the state (LOADED or READY); it needs weights to copy into.
- Serving (Prefill / Propose / Verify) needs LOADED or READY.
"""

from __future__ import annotations

import enum
import gc
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import structlog

from runtime.backends import make_ops
from runtime.checkpoint import CheckpointError
from runtime.config import ModelConfig, RuntimeConfig, WorkerConfig
from runtime.graphs import GraphRegistry, graph_backend_name
from runtime.device_thread import DeviceThread
from runtime.weights import CheckedCheckpoint, copy_in_place, read_arrays, to_device

MAX_EVENTS = 256
MAX_KEPT_SOURCES = 4     # weights sources a worker remembers for rollback (LoadWeights with empty target_path)


class State(enum.Enum):
    EMPTY = "EMPTY"      # no weights on the device
    LOADED = "LOADED"    # weights loaded; serving runs eagerly
    READY = "READY"      # weights loaded and graphs captured


class LifecycleError(RuntimeError):
    """A transition or request not allowed in the current state (FAILED_PRECONDITION)."""


# Action names double as event names in the event log and as metric labels.
LOAD_WEIGHTS = "load_weights"
LOAD_WEIGHTS_IN_PLACE = "load_weights_in_place"
CAPTURE_GRAPHS = "capture_graphs"
CLEAR_GRAPHS = "clear_graphs"
RELEASE_WEIGHTS = "release_weights"
ACTIONS = (LOAD_WEIGHTS, LOAD_WEIGHTS_IN_PLACE, CAPTURE_GRAPHS, CLEAR_GRAPHS, RELEASE_WEIGHTS)

_OK, _NOOP, _REFUSED = "ok", "noop", "refused"

# action -> {from state: (to state, None) | (None, why refused) | "noop"}
_TABLE: dict[str, dict[State, object]] = {
    LOAD_WEIGHTS: {
        State.EMPTY: (State.LOADED, None),
        State.LOADED: (None, "weights are already loaded (state LOADED): call ReleaseWeights first, "
                             "or load with in_place=true"),
        State.READY: (None, "weights are already loaded and graphs are live (state READY): call ClearGraphs "
                            "and ReleaseWeights first, or load with in_place=true"),
    },
    LOAD_WEIGHTS_IN_PLACE: {
        State.EMPTY: (None, "an in-place load needs loaded weights to copy into (state EMPTY): "
                            "call LoadWeights with in_place=false"),
        State.LOADED: (State.LOADED, None),
        State.READY: (State.READY, None),
    },
    CAPTURE_GRAPHS: {
        State.EMPTY: (None, "cannot capture graphs without weights (state EMPTY): call LoadWeights first"),
        State.LOADED: (State.READY, None),
        State.READY: _NOOP,
    },
    CLEAR_GRAPHS: {
        State.EMPTY: _NOOP,
        State.LOADED: _NOOP,
        State.READY: (State.LOADED, None),
    },
    RELEASE_WEIGHTS: {
        State.EMPTY: _NOOP,
        State.LOADED: (State.EMPTY, None),
        # NOTE: refused, not done implicitly: the graphs read these weights, and
        # freeing weights under live graphs is the "teardown in the wrong order"
        # bug (a replay reads freed memory, or the clear hangs). Clear graphs first.
        State.READY: (None, "graphs are live (state READY): clear graphs first (ClearGraphs), "
                            "then ReleaseWeights"),
    },
}


@dataclass(frozen=True)
class Event:
    """One completed transition."""

    seq: int            # 1, 2, ... in order of completion
    action: str         # one of ACTIONS
    before: State
    after: State
    at: float           # time.time()
    detail: str = ""    # e.g. the weights version


# observer(action, outcome, before, after, detail): outcome in ok|noop|refused|failed
Observer = Callable[[str, str, State, State, str], None]


class Lifecycle:
    """The state machine. Thread-safe; callers serialize the work itself with their own lock."""

    def __init__(self, observers: list[Observer] | None = None, max_events: int = MAX_EVENTS) -> None:
        self._state = State.EMPTY
        self._events: deque[Event] = deque(maxlen=max_events)
        self._seq = 0
        self._observers: list[Observer] = list(observers or [])
        self._lock = threading.RLock()

    # --- reads (cheap, never block on work) ----------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def serving(self) -> bool:
        return self._state in (State.LOADED, State.READY)

    def events(self) -> list[Event]:
        return list(self._events)

    def event_names(self) -> list[str]:
        """Action names of the retained events, oldest first (GetStatus.lifecycle_events)."""
        return [e.action for e in list(self._events)]

    def add_observer(self, observer: Observer) -> None:
        self._observers.append(observer)

    # --- checks ----------------------------------------------------------------
    def check(self, action: str) -> State | None:
        """The state ``action`` would lead to, or None for a no-op; raises LifecycleError if refused.

        Advisory when called without holding the caller's lock (used to fail fast
        before slow work such as reading a checkpoint); ``apply`` checks again.
        """
        if action not in _TABLE:
            raise ValueError(f"unknown lifecycle action {action!r}; expected one of {ACTIONS}")
        rule = _TABLE[action][self._state]
        if rule == _NOOP:
            return None
        after, why = rule  # type: ignore[misc]
        if after is None:
            raise LifecycleError(f"{action} refused: {why}")
        return after

    def require_serving(self, what: str) -> None:
        """Raise LifecycleError unless the worker can serve ``what`` (LOADED or READY)."""
        state = self._state
        if state not in (State.LOADED, State.READY):
            raise LifecycleError(f"{what} needs loaded weights (state {state.value}): call LoadWeights first")

    # --- transitions -------------------------------------------------------------
    def apply(self, action: str, work: Callable[[], None] | None = None, detail: str = "") -> bool:
        """Run ``work`` for ``action`` if allowed, then commit the new state.

        Returns True for a transition, False for a no-op (``work`` not run).
        Raises LifecycleError when refused; re-raises ``work``'s exception. In
        both cases the state is unchanged and no event is recorded.
        """
        with self._lock:
            before = self._state
            try:
                after = self.check(action)
            except LifecycleError:
                self._notify(action, _REFUSED, before, before, detail)
                raise
            if after is None:
                self._notify(action, _NOOP, before, before, detail)
                return False
            try:
                if work is not None:
                    work()
            except BaseException:
                self._notify(action, "failed", before, before, detail)
                raise
            # NOTE: the state changes only after the work succeeded, so a failed
            # load/capture/clear never leaves a state that claims otherwise.
            self._state = after
            self._seq += 1
            self._events.append(Event(self._seq, action, before, after, time.time(), detail))
            self._notify(action, _OK, before, after, detail)
            return True

    def _notify(self, action: str, outcome: str, before: State, after: State, detail: str) -> None:
        for obs in list(self._observers):
            try:
                obs(action, outcome, before, after, detail)
            except Exception:  # an observer (metrics, health) must never break a transition
                pass


# =============================================================================
# The worker part both roles share
# =============================================================================

MAX_REQUEST_ID_CHARS = 256
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


def check_request_id(request_id: str, field: str) -> None:
    if not request_id:
        raise ValueError(f"{field}: request_id is required (empty)")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"{field}: request_id is {len(request_id)} characters, at most {MAX_REQUEST_ID_CHARS}")


def check_token_range(tokens: np.ndarray, vocab_size: int, field: str) -> None:
    """Every id in [0, vocab_size); names the first offender."""
    if tokens.size == 0:
        return
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{field}[{i}]: token id {int(tokens[i])} is out of range [0, {vocab_size})")


def check_hidden(hidden: np.ndarray, rows: int, width: int, field: str) -> None:
    """hidden must be float [rows, width] and finite."""
    if hidden.dtype.kind != "f":
        raise ValueError(f"{field}: dtype {hidden.dtype} is not a float type")
    if hidden.shape != (rows, width):
        raise ValueError(f"{field}: shape {list(hidden.shape)}, expected [{rows}, {width}]")
    if not np.isfinite(hidden).all():
        raise ValueError(f"{field}: contains NaN or infinite values")


def repeated_ids(ids: list[str]) -> set[str]:
    seen: set[str] = set()
    dup: set[str] = set()
    for rid in ids:
        (dup if rid in seen else seen).add(rid)
    return dup


class WorkerBase:
    """Lifecycle-driven weights and graphs of one worker; subclasses add the role's work.

    Threading: gRPC calls arrive on many threads. All model work (steps, loads,
    capture, clear, release) runs on one ``DeviceThread``, which also serializes
    it; ``status()`` never waits for it, so GetStatus answers during a long step
    or load. Reading checkpoint files stays on the caller's thread.
    """

    role = "worker"
    # Role hooks for per-item errors: the error record type and exception -> error.
    # (Set by the service; kept abstract here so this module stays free of gRPC.)
    error_type: type = type("NoItemErrors", (), {})
    error_for: Callable[[BaseException], Any] = staticmethod(lambda exc: exc)
    # Duck-typed metrics adapter: on_transition(...), step(...), graphs(...), slots(...).
    metrics: Any = None

    def __init__(self, cfg: WorkerConfig, check_path: Callable[[str], Path] | None = None,
                 log: Any = None) -> None:
        self.cfg = cfg
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
        self._check_path = check_path or (lambda p: Path(p))
        # version -> (target_path, draft_path) of the last MAX_KEPT_SOURCES loads, newest
        # last: what a rollback reloads (LoadWeights with an empty target_path).
        self._sources: OrderedDict[str, tuple[str, str]] = OrderedDict()

    # --- role hooks ----------------------------------------------------------
    def _checkpoint(self, target: Path, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
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
        return ops, graph_backend_name(ops)

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
            target_path, draft_path, version = self._known_source(version)
        target = self._check_path(target_path)          # ValueError outside the configured roots
        version = version or target_path
        action = LOAD_WEIGHTS_IN_PLACE if in_place else LOAD_WEIGHTS
        if not validate_only:
            self.lifecycle.check(action)                # fail fast, before reading gigabytes
        # NOTE: validate the whole checkpoint (config, every name/shape/dtype) from
        # the headers before any live weight is touched: a bad checkpoint must leave
        # the running weights and graphs exactly as they were.
        checked = self._checkpoint(target, draft_path, self.model_cfg if in_place else None)
        if validate_only:
            self.log.info("weights_validated", target_path=target_path, weights_version=version)
            return
        # host memory; serving goes on meanwhile. bf16 stays raw bits for a bf16 Torch worker.
        arrays = read_arrays(checked, bf16_bits=(self.ops.name == "torch" and self.ops.dtype == "bfloat16"))
        def apply() -> None:
            if in_place:
                self.lifecycle.apply(action, lambda: self._copy_in_place(checked.cfg, arrays, version), version)
            else:
                self.lifecycle.apply(action, lambda: self._install(checked.cfg, arrays, version), version)
            self._sources.pop(version, None)
            self._sources[version] = (target_path, draft_path)
            while len(self._sources) > MAX_KEPT_SOURCES:
                self._sources.popitem(last=False)

        self.device.run(apply)

    def _known_source(self, version: str) -> tuple[str, str, str]:
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

    def _copy_in_place(self, new_cfg: ModelConfig, arrays: dict[str, np.ndarray], version: str) -> None:
        diff = [f for f in self.model_cfg.compatible_with(new_cfg) if f != "torch_dtype"]
        if diff:
            raise CheckpointError(f"in-place update: config differs from the running model in {diff}")
        # NOTE: copy_ into the existing parameter tensors (addresses unchanged), so
        # live graphs stay valid; copy_in_place checks every name and shape before
        # the first copy, so a mismatch changes nothing.
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
        self.engine = None
        self.model_cfg = None
        self.weights_version = ""
        gc.collect()
        self.ops.synchronize()
        self.ops.empty_cache()
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

    def clear_graphs(self) -> bool:
        """READY -> LOADED (no-op when LOADED or EMPTY)."""
        return self.device.run(lambda: self.lifecycle.apply(CLEAR_GRAPHS, self._clear))

    def _clear(self) -> None:
        self.registry.clear()
        self._pool_bytes = 0

    def close(self) -> None:
        """Shutdown teardown: graphs first, then weights."""
        # NOTE: clear graphs before releasing weights, always (also at exit): the
        # graphs read the weights and caches that release frees.
        self.clear_graphs()
        self.release_weights()

    # --- requests ----------------------------------------------------------------
    def release(self, request_ids: list[str]) -> list[str]:
        """Free the caches of these requests; unknown ids are ignored. Returns those that were held."""
        def work() -> list[str]:
            eng = self.engine
            if eng is None:
                return []
            released = [rid for rid in dict.fromkeys(request_ids) if eng.release(rid)]
            if self.metrics is not None:
                self.metrics.slots(eng.cache.used_slots, eng.cache.free_slots)
            return released

        return self.device.run(work)

    def _batch(self, step: str, items: list[Any], validate: Callable, run: Callable,
               round_: int | None = None) -> list[Any]:
        """Answer every item of a batch, in order.

        ``validate(engine, [(i, item)], out)`` returns the valid (i, item) pairs and
        writes an error into ``out[i]`` for the others; ``run(engine, valid, out)``
        runs the valid ones as one batch and writes their results. Items that are
        already errors (the servicer could not decode them) pass through. If the
        batch itself fails, each of its items gets that error; the worker goes on.
        Raises LifecycleError for the whole batch when no weights are loaded.
        """
        t0 = time.perf_counter()

        def work() -> list[Any]:
            engine = self._serving_engine(step.capitalize())
            out: list[Any] = list(items)
            ok = [(i, it) for i, it in enumerate(items) if not isinstance(it, self.error_type)]
            good = validate(engine, ok, out)
            if good:
                try:
                    run(engine, good, out)
                except Exception as exc:  # noqa: BLE001 - the batch failed: every item says why
                    err = self.error_for(exc)
                    self.log.exception("batch_failed", step=step, round=round_, items=len(good))
                    for i, _ in good:
                        out[i] = err
            stats = self.registry.stats
            if self.metrics is not None:
                self.metrics.graphs(stats.replays, stats.eager_runs)
                self.metrics.slots(engine.cache.used_slots, engine.cache.free_slots)
            return out

        out = self.device.run(work)
        errors = [(i, e) for i, e in enumerate(out) if isinstance(e, self.error_type)]
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
            lifecycle_events=tuple(self.lifecycle.event_names()))
