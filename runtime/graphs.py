"""CUDA-graph registry: the only owner of a worker's graphs, static buffers and pool.

Owns: step kinds (a step function plus its per-row input specs and, for
attention steps, its context-length spans), batch buckets, the static input
buffers (allocated once at the largest bucket;
smaller buckets use leading views of them), capture order (largest bucket
first so smaller graphs reuse its pool), padding/unpadding, replay vs eager
accounting and teardown.

Must not know: models, requests, gRPC, frameworks. The step functions are
opaque callables over framework tensors; recording a graph and its memory
pool are the backend's (``Ops.capture`` / ``Ops.graph_pool``).

On a device without CUDA graphs (CPU, or Paddle built without CUDA) the
registry runs the *same* code path with an eager stand-in for the graph
object: capture allocates the same buffers, replay re-runs the step on them.
So bucket choice, padding, capture order and clear are tested on CPU.
"""

from __future__ import annotations

import gc
import threading
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from runtime.backends.base import Ops, Tensor

StepFn = Callable[..., tuple]

# NOTE: one capture at a time per process. Two registries (draft and target
# workers in one process, as in tests and `bench reload`) capturing from two
# threads at once invalidate each other's capture (cudaErrorStreamCapture*).
_CAPTURE_LOCK = threading.Lock()


@dataclass(frozen=True)
class InputSpec:
    """One input of a step: per-row shape (after the batch dim), dtype and pad value."""

    name: str
    row_shape: tuple[int, ...]
    dtype: str            # "int64" or "compute" (the worker's compute dtype)
    pad: float | int = 0


@dataclass
class StepKind:
    name: str
    fn: StepFn
    inputs: tuple[InputSpec, ...]
    # Extra keyword arguments for eager runs only, computed from the numpy
    # inputs (e.g. a shorter attention span than the graphs' static one).
    eager_kwargs: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None
    # Context-length buckets: with spans, one graph is captured per (batch
    # bucket, span) with ``fn(..., attend_len=span)``, and a run replays the
    # smallest span >= ``span_of(inputs)`` (the rows a step must read; it reads
    # only numpy inputs), so attention cost follows the real context instead of
    # the cache length. A caller that knows the need passes ``run(..., need=)``.
    spans: tuple[int, ...] = ()
    span_of: Callable[[dict[str, Any]], int] | None = None
    # Warm-up runs before this kind's captures (None: capture_all's ``warmup``). A kind
    # built only of steps that other kinds captured first at the same shapes needs fewer.
    warmup: int | None = None
    # The largest batch bucket this kind is captured at (None: every bucket); a larger
    # batch runs eagerly. Wide steps (prefills) are captured at the small buckets only.
    max_batch: int | None = None


@dataclass
class _Captured:
    graph: Any                      # framework graph object or _EagerGraph
    inputs: dict[str, Tensor]       # views of the static input buffers, [bucket, ...]
    outputs: tuple                  # static outputs, [bucket, ...]
    # Views made once and reused (b = the batch's real rows): outputs[:b] by b, and
    # inputs[name][:b] by (name, b) for device inputs copied in place.
    out_rows: dict[int, tuple] = field(default_factory=dict)
    in_rows: dict[tuple[str, int], Tensor] = field(default_factory=dict)


@dataclass
class _Plan:
    """What ``run`` needs per kind, worked out once at capture (``_allocate_static``).

    ints: (name, offset in the packed buffer, elements per row, row shape, pad) per int64
    input; floats: (name, row shape, pad) per compute-dtype input; spans: sorted.
    """

    ints: tuple[tuple[str, int, int, tuple[int, ...], int], ...]
    floats: tuple[tuple[str, tuple[int, ...], float], ...]
    spans: tuple[int, ...]
    mirror: Any                     # host twin of the packed buffer (Ops.host_mirror), None without ints
    top: int                        # the kind's largest captured bucket (its static buffers' rows)
    # Host staging of numpy compute inputs, [top, ...] per (name, numpy dtype).
    host_rows: dict[tuple[str, Any], np.ndarray] = field(default_factory=dict)


@dataclass
class GraphStats:
    replays: int = 0
    eager_runs: int = 0
    captures: int = 0
    clears: int = 0
    last_span: int = 0              # context span of the latest replay (0: a kind without spans)
    events: list[str] = field(default_factory=list)


class _EagerGraph:
    """Stand-in for a CUDA graph on devices without one: replay re-runs the step."""

    def __init__(self, ops: Ops, fn: StepFn, inputs: dict[str, Tensor], outputs: tuple) -> None:
        self.ops, self.fn, self.inputs, self.outputs = ops, fn, inputs, outputs

    def replay(self) -> None:
        fresh = self.fn(**self.inputs)
        for dst, src in zip(self.outputs, fresh):
            self.ops.copy_(dst, src)

    def reset(self) -> None:
        self.fn = None


class GraphRegistry:
    def __init__(self, ops: Ops, buckets: tuple[int, ...], log: Callable[[str], None] | None = None) -> None:
        self.ops = ops
        self.buckets = tuple(sorted(buckets))
        self.kinds: dict[str, StepKind] = {}
        self._captured: dict[tuple[int, str, int], _Captured] = {}   # (bucket, kind, span; 0 = no spans)
        self._static: dict[str, dict[str, Tensor]] = {}   # kind -> name -> [max_bucket, ...]
        # kind -> one flat int64 device buffer holding every int64 input (one
        # host->device copy per step instead of one per input).
        self._packed: dict[str, Tensor] = {}
        self._plans: dict[str, _Plan] = {}          # kind -> its run plan (while graphs are live)
        # batch size -> its bucket, for 0..largest bucket (one list index per run)
        self._bucket_of = [next(x for x in self.buckets if x >= n) for n in range(self.buckets[-1] + 1)]
        self._pool: Any = None
        self.stats = GraphStats()
        self._log = log or (lambda msg: None)
        self._lock = threading.RLock()

    # --- registration ----------------------------------------------------
    def register(self, kind: StepKind) -> None:
        with self._lock:
            if self.live:
                raise RuntimeError("cannot register a step kind while graphs are live")
            self.kinds[kind.name] = kind

    def unregister_all(self) -> None:
        with self._lock:
            if self.live:
                raise RuntimeError("clear graphs before dropping the step functions they read")
            self.kinds.clear()

    @property
    def live(self) -> bool:
        return bool(self._captured)

    def keys(self) -> list[tuple[int, str]]:
        """(bucket, kind) pairs with live graphs (each may hold several context spans)."""
        return sorted({(b, k) for b, k, _ in self._captured}, key=lambda k: (k[1], k[0]))

    def span_keys(self) -> list[tuple[int, str, int]]:
        """Every captured (bucket, kind, span); span 0 for kinds without context spans."""
        return sorted(self._captured, key=lambda k: (k[1], k[0], k[2]))

    @staticmethod
    def span_for(kind: StepKind, need: int) -> int:
        """Smallest captured span >= need (0 for kinds without spans); the largest one if none is."""
        if not kind.spans:
            return 0
        for s in sorted(kind.spans):
            if s >= need:
                return s
        return max(kind.spans)

    def bucket_for(self, batch: int) -> int | None:
        """Smallest bucket >= batch, or None above the largest bucket (run eagerly)."""
        return self._bucket_of[batch] if 0 <= batch < len(self._bucket_of) else None

    def can_replay(self, kind_name: str, batch: int, need: int = 0) -> bool:
        """Whether ``run`` of ``batch`` rows reading ``need`` context rows would replay a graph."""
        with self._lock:
            plan = self._plans.get(kind_name)
            return plan is not None and self._graph_key(plan, kind_name, batch, need) in self._captured

    def _graph_key(self, plan: "_Plan", kind_name: str, batch: int, need: int) -> tuple[int, str, int] | None:
        """(bucket, kind, span) a run of ``batch`` rows reading ``need`` rows replays; None when
        the batch is above the largest bucket or the need above the largest span (eager)."""
        if batch >= len(self._bucket_of):
            return None
        span = 0
        if plan.spans:
            i = bisect_left(plan.spans, need)
            if i == len(plan.spans):
                return None
            span = plan.spans[i]
        return self._bucket_of[batch], kind_name, span

    # --- capture / clear -------------------------------------------------
    def capture_all(self, warmup: int = 2) -> None:
        """Capture every registered kind at every bucket, largest bucket first."""
        with self._lock, _CAPTURE_LOCK:
            if self.live:
                return  # idempotent
            try:
                self._pool = self._new_pool()
                tops = {name: self._top_bucket(kind) for name, kind in self.kinds.items()}
                for kind in self.kinds.values():
                    if tops[kind.name] is not None:
                        self._allocate_static(kind, tops[kind.name])
                # NOTE: largest bucket (and largest span) first, so the smaller
                # graphs' allocations fit inside the pool memory the largest one
                # already reserved.
                for bucket in sorted(self.buckets, reverse=True):
                    # NOTE: kinds in registration order within a bucket: a kind with a
                    # short warm-up (StepKind.warmup) relies on the kinds registered before
                    # it having run its inner steps at this bucket's shapes already.
                    for kind in self.kinds.values():
                        if tops[kind.name] is None or bucket > tops[kind.name]:
                            continue
                        for span in sorted(kind.spans or (0,), reverse=True):
                            self._capture_one(kind, bucket, span, warmup if kind.warmup is None else kind.warmup)
            except Exception:
                self.clear()
                raise

    def _top_bucket(self, kind: StepKind) -> int | None:
        """The largest bucket ``kind`` is captured at (None: none is small enough)."""
        fit = [b for b in self.buckets if kind.max_batch is None or b <= kind.max_batch]
        return fit[-1] if fit else None

    def _allocate_static(self, kind: StepKind, max_b: int) -> None:
        """Static inputs at the kind's largest bucket: int64 inputs as views of one flat
        buffer (one upload per step, see ``_replay``), compute-dtype inputs as their own buffers."""
        static: dict[str, Tensor] = {}
        ints = [s for s in kind.inputs if s.dtype == "int64"]
        packed = self.ops.from_numpy(self._pad_template(kind, max_b), "int64")
        self._packed[kind.name] = packed
        int_plan, offset = [], 0
        for s in ints:
            n = int(np.prod(s.row_shape, dtype=np.int64))
            int_plan.append((s.name, offset, n, tuple(s.row_shape), int(s.pad)))
            static[s.name] = self.ops.reshape(packed[offset: offset + max_b * n], (max_b, *s.row_shape))
            offset += max_b * n
        floats = []
        for s in kind.inputs:
            if s.dtype != "int64":
                static[s.name] = self.ops.from_numpy(np.full((max_b, *s.row_shape), s.pad, dtype=np.float32))
                floats.append((s.name, tuple(s.row_shape), s.pad))
        self._static[kind.name] = static
        self._plans[kind.name] = _Plan(tuple(int_plan), tuple(floats), tuple(sorted(kind.spans)),
                                       self.ops.host_mirror(packed) if ints else None, max_b)

    @staticmethod
    def _pad_template(kind: StepKind, max_b: int) -> np.ndarray:
        """Flat int64 host array: each int64 input's [max_b, *row] block, filled with its pad value."""
        blocks = [np.full(max_b * int(np.prod(s.row_shape, dtype=np.int64)), s.pad, dtype=np.int64)
                  for s in kind.inputs if s.dtype == "int64"]
        return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)

    def _capture_one(self, kind: StepKind, bucket: int, span: int, warmup: int) -> None:
        views = {name: buf[:bucket] for name, buf in self._static[kind.name].items()}
        fn = kind.fn if not span else (lambda _fn=kind.fn, _s=span, **kw: _fn(**kw, attend_len=_s))
        with self.ops.no_grad():
            # NOTE: warm-up runs before capture: lazy framework initialisation
            # (kernel selection, workspace allocation) must not happen inside
            # the captured region.
            for _ in range(warmup):
                fn(**views)
            graph, outputs = self._record(fn, views)
        self._captured[(bucket, kind.name, span)] = _Captured(graph, views, outputs)
        self.stats.captures += 1
        label = f"{kind.name}@{bucket}" + (f"/ctx{span}" if span else "")
        self.stats.events.append(f"capture {label}")
        self._log(f"captured {label}")

    def _new_pool(self) -> Any:
        return self.ops.graph_pool()

    def _record(self, fn: StepFn, views: dict[str, Tensor]) -> tuple[Any, tuple]:
        graph, outputs = self.ops.capture(fn, views, self._pool)
        if graph is None:                 # no device graphs here: replay re-runs the step
            graph = _EagerGraph(self.ops, fn, views, outputs)
        return graph, outputs

    def clear(self) -> None:
        """Destroy every graph, drop static buffers and the pool, empty the framework cache."""
        with self._lock:
            had = bool(self._captured)
            for cap in self._captured.values():
                reset = getattr(cap.graph, "reset", None)
                if reset is not None:
                    reset()
            self._captured.clear()
            self._static.clear()
            self._packed.clear()
            self._plans.clear()
            self._pool = None
            gc.collect()
            self.ops.synchronize()
            self.ops.empty_cache()
            if had:
                self.stats.clears += 1
                self.stats.events.append("clear")
                self._log("graphs cleared")

    # --- execution -------------------------------------------------------
    def run(self, kind_name: str, inputs: dict[str, Any], need: int | None = None) -> tuple[tuple, bool]:
        """Run a step for a batch of B rows. inputs: name -> numpy [B, ...] or a
        device tensor [B, ...] (e.g. a hidden state produced by the previous step).
        need: the context rows the step reads, when the caller knows it (else
        ``span_of(inputs)``; kinds without spans ignore it).

        Returns (outputs sliced to [B, ...], replayed?). With graphs live and
        B within a bucket, rows are padded to the bucket with each input's pad
        value, copied in place into the static buffers, and the graph replays.
        Otherwise the step runs eagerly on the given rows.
        """
        kind = self.kinds[kind_name]
        first = next(iter(inputs.values()))
        b = first.shape[0] if type(first) is np.ndarray else self.ops.shape(first)[0]
        with self._lock:
            plan = self._plans.get(kind_name)
            key = cap = None
            if plan is not None:
                if need is None and plan.spans:
                    need = kind.span_of(inputs)
                key = self._graph_key(plan, kind_name, b, need or 0)
                cap = self._captured.get(key) if key is not None else None
            if cap is not None:
                return self._replay(kind_name, plan, cap, inputs, b, key[0], key[2]), True
            return self._eager(kind, inputs), False

    def _replay(self, kind_name: str, plan: _Plan, cap: _Captured, inputs: dict[str, Any], b: int,
                bucket: int, span: int) -> tuple:
        device_ints = []
        if plan.mirror is not None:
            # The packed buffer's host twin, written in place: each int input's rows
            # [0, b), its pad value on rows [b, bucket). Rows past the bucket are not
            # read by this graph (it reads [:bucket] views), so they are left as they are.
            host = plan.mirror.array()
            for name, off, n, row_shape, pad in plan.ints:
                value = inputs[name]
                if type(value) is np.ndarray:
                    if value.shape[1:] != row_shape:
                        raise ValueError(f"{kind_name}.{name}: row shape {value.shape[1:]} != {row_shape}")
                    host[off: off + b * n] = value.reshape(-1)
                else:                    # device ids (e.g. the previous substep's argmax)
                    self._check_rows(kind_name, name, value, row_shape)
                    device_ints.append((name, value))
                if b < bucket:
                    host[off + b * n: off + bucket * n] = pad
            # NOTE: one asynchronous upload of the whole packed buffer, before any device
            # copy into it below (it rewrites every row of it).
            plan.mirror.upload()
        for name, row_shape, pad in plan.floats:
            value = inputs[name]
            # NOTE: copy *into* the static buffers; never rebind them. The
            # graph reads those addresses: a new tensor would be freed memory.
            if type(value) is np.ndarray:
                if value.shape[1:] != row_shape:
                    raise ValueError(f"{kind_name}.{name}: row shape {value.shape[1:]} != {row_shape}")
                # uint16 rows are bf16 bit patterns: padded as bits (0 = 0.0).
                dt = np.uint16 if value.dtype == np.uint16 else np.float32
                rows = plan.host_rows.get((name, dt))
                if rows is None:
                    rows = plan.host_rows[(name, dt)] = np.full((plan.top, *row_shape), pad, dtype=dt)
                rows[:b] = value
                if b < bucket:
                    rows[b:bucket] = pad
                # NOTE: copy_from_numpy has read the host rows when it returns (CUDA
                # stages them in its pinned ring first), so they are reused at once.
                self.ops.copy_from_numpy(cap.inputs[name], rows[:bucket])
            else:
                # Device rows: rows past b keep finite values from earlier
                # steps; their outputs are sliced away below.
                self._check_rows(kind_name, name, value, row_shape)
                self.ops.copy_(self._in_rows(cap, name, b), value)
        # NOTE: device ids go in after the packed upload, which rewrites
        # the whole packed buffer (their rows included).
        for name, value in device_ints:
            self.ops.copy_(self._in_rows(cap, name, b), value)
        cap.graph.replay()
        self.stats.replays += 1
        self.stats.last_span = span
        if b == bucket:
            return cap.outputs
        out = cap.out_rows.get(b)
        if out is None:
            out = cap.out_rows[b] = tuple(o[:b] for o in cap.outputs)
        return out

    def _check_rows(self, kind_name: str, name: str, value: Any, row_shape: tuple[int, ...]) -> None:
        shape = tuple(self.ops.shape(value)[1:])
        if shape != row_shape:
            raise ValueError(f"{kind_name}.{name}: row shape {shape} != {row_shape}")

    @staticmethod
    def _in_rows(cap: _Captured, name: str, b: int) -> Tensor:
        """inputs[name][:b] of a captured graph, made once per (name, b)."""
        view = cap.in_rows.get((name, b))
        if view is None:
            view = cap.in_rows[(name, b)] = cap.inputs[name][:b]
        return view

    def _eager(self, kind: StepKind, inputs: dict[str, Any]) -> tuple:
        tensors = {}
        for s in kind.inputs:
            value = inputs[s.name]
            if isinstance(value, np.ndarray):
                value = self.ops.from_numpy(value, "int64" if s.dtype == "int64" else None)
            tensors[s.name] = value
        np_inputs = {k: v for k, v in inputs.items() if isinstance(v, np.ndarray)}
        extra = kind.eager_kwargs(np_inputs) if kind.eager_kwargs is not None else {}
        # NOTE: eager steps (widths and spans outside the captured graphs) run the plain
        # ops: the fused kernels compile once per new shape class, which only the
        # captures should pay (runtime/backends/torch_kernels.py attention_plan).
        with self.ops.no_grad(), self.ops.plain_ops():
            outputs = kind.fn(**tensors, **extra)
        self.stats.eager_runs += 1
        return tuple(outputs)

    def static_addresses(self) -> dict[str, int]:
        """Addresses of every static input buffer and captured output (for leak/rebind tests)."""
        out = {}
        for kind, bufs in self._static.items():
            for name, t in bufs.items():
                out[f"{kind}.{name}"] = self.ops.data_ptr(t)
        for (bucket, kind, span), cap in self._captured.items():
            for i, o in enumerate(cap.outputs):
                out[f"{kind}@{bucket}" + (f"/ctx{span}" if span else "") + f".out{i}"] = self.ops.data_ptr(o)
        return out
