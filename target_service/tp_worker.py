"""The tensor-parallel target worker: rank 0 serves and drives, ranks > 0 follow.

Owns: ``TPTargetWorker``, the target worker of one rank of a TP group: it reads only
its rank's slices of a checkpoint, builds a ``TPTargetEngine``, and keeps the ranks in
step. Rank 0 is the ordinary target worker of the service (gRPC, round loop,
lifecycle); before each piece of device work it sends the others one command on the
group's control plane, and the lifecycle commands wait for every rank's reply. Ranks
> 0 run ``follow``: receive a command, do the same work on their shard, reply.

Commands (tuples, the verb first):
- ``run`` (kind, int64 inputs) / ``prefill`` (arrays, attend_len): a forward step; no reply
  (the step's collectives keep the ranks together).
- ``stage`` (checked checkpoint, in_place) reads this rank's slices; ``commit`` (version)
  installs or copies them in place; ``drop`` forgets staged slices; ``release``,
  ``capture``, ``clear``: the lifecycle transitions; ``stop`` ends ``follow``. Each replies
  None or (kind, message).

Must not know: frameworks (the group is ``runtime.backends.make_tp_group``'s),
protobuf, scheduling, how ranks were started (``target_service/tp_launch.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from core.errors import FailedPrecondition
from runtime import host_memory
from runtime.backends import make_tp_group
from runtime.checkpoint import CheckpointError
from runtime.config import ModelConfig
from runtime.graphs import GraphRegistry
from runtime.lifecycle import (CAPTURE_GRAPHS, CLEAR_GRAPHS, LOAD_WEIGHTS, LOAD_WEIGHTS_IN_PLACE, RELEASE_WEIGHTS,
                               LifecycleError)
from runtime.tp_engine import PREFILL, TPTargetEngine
from runtime.tp_plan import Rendezvous, TPPlan, read_sharded
from runtime.weights import CheckedCheckpoint
from target_service.worker import TargetWorker
from worker.config import WorkerConfig

RUN, STAGE, COMMIT, DROP, RELEASE, CAPTURE, CLEAR, STOP = (
    "run", "stage", "commit", "drop", "release", "capture", "clear", "stop")


class TPGroupBroken(FailedPrecondition):
    """The TP group lost a rank: the target cannot compute until it is restarted."""


class _Sharded(dict):
    """This rank's host arrays of one checkpoint, with the validated checkpoint they came from
    (rank 0 sends ``checked`` on, so each other rank reads its own slices of the same files)."""

    checked: CheckedCheckpoint


class _AnnouncingRegistry(GraphRegistry):
    """Rank 0's registry: every step it runs is first handed to the other ranks."""

    def __init__(self, ops: Any, buckets: tuple[int, ...], log: Any, announce: Callable[[Any], None]) -> None:
        super().__init__(ops, buckets, log=log)
        self._announce = announce

    def run(self, kind_name: str, inputs: dict[str, Any], need: int | None = None) -> tuple[tuple, bool]:
        if not all(isinstance(v, np.ndarray) for v in inputs.values()):
            raise TypeError(f"{kind_name}: a tensor-parallel step takes host inputs only")
        # NOTE: announce before running: the other ranks must replay the same (bucket, span)
        # graph, whose collectives pair with this rank's, or the group deadlocks. They derive
        # the span from the same inputs, so ``need`` (a shortcut of rank 0's caller) stays here.
        self._announce((RUN, kind_name, inputs))
        return super().run(kind_name, inputs, need=need)


def rank_config(cfg: WorkerConfig, rank: int) -> WorkerConfig:
    """Rank r's config: on CUDA, device cuda:(N + r) for ``runtime.device`` cuda:N."""
    dev = cfg.runtime.device
    if dev.startswith("cuda:"):
        dev = f"cuda:{int(dev[5:]) + rank}"
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=dev))


class TPTargetWorker(TargetWorker):
    # NOTE: every step of a TP group (and its collectives) stays on the device thread.
    inline_steps, allow_inline = (), False

    def __init__(self, cfg: WorkerConfig, log: Any = None, rendezvous: Rendezvous | None = None,
                 after_close: Callable[[], None] | None = None) -> None:
        if rendezvous is None or rendezvous.world_size != cfg.tp:
            raise ValueError(f"tp={cfg.tp}: the rendezvous has world size "
                             f"{rendezvous.world_size if rendezvous else None}")
        self.rank = rendezvous.rank
        super().__init__(rank_config(cfg, self.rank), log)
        # NOTE: before any step: TP ranks run the plain ops. The fused kernels
        # (runtime/backends/torch_kernels.py) have not been shown on a TP group on GPUs yet;
        # the two-GPU TP run (docs/gpu.md) was made with the plain ops.
        self.ops.kernels = None
        self.log = self.log.bind(tp_rank=self.rank, tp=cfg.tp)
        self._broken = ""
        self._after_close = after_close          # e.g. wait for the ranks this process spawned
        self._staged: tuple[_Sharded, ModelConfig, bool] | None = None     # ranks > 0: read, not yet live
        if self.rank == 0:
            self.registry = _AnnouncingRegistry(self.ops, cfg.graphs.batch_buckets,
                                                lambda msg: self.log.debug("graph_registry", detail=msg), self._send)
        # NOTE: joined on the device thread: every collective of this rank then runs on the
        # thread (and CUDA device) that made the group.
        self.group = self.device.run(lambda: make_tp_group(self.cfg.runtime, rendezvous))

    # --- sharding ------------------------------------------------------------------------
    def _plan(self, model_cfg: ModelConfig) -> TPPlan:
        return TPPlan(model_cfg, self.cfg.tp, self.rank)

    def validate_checkpoint(self, target: Any, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
        checked = super().validate_checkpoint(target, draft_path, running)
        self._plan(checked.cfg)                 # ConfigError naming tp when the model cannot be split so
        return checked

    def read_weights(self, checked: CheckedCheckpoint) -> dict[str, np.ndarray]:
        arrays = _Sharded(read_sharded(checked.infos, list(checked.names), self._plan(checked.cfg), bf16_bits=True))
        arrays.checked = checked
        return arrays

    def in_place_source(self, checked: CheckedCheckpoint) -> dict[str, np.ndarray]:
        # NOTE: this rank's slices, read first (rank 0 then stages the same checkpoint on the
        # other ranks, each reading its own), not the whole tensors streamed from the files.
        return self.read_weights(checked)

    def _new_engine(self, model_cfg: ModelConfig, params: dict[str, Any]) -> TPTargetEngine:
        g = self.cfg.graphs
        engine = TPTargetEngine(self.ops, self._plan(model_cfg), params, self.cfg.cache, self.cfg.spec.max_k,
                                self.registry, self.group, prefill_widths=g.prefill_widths_on(self.cfg.runtime.device),
                                prefill_tokens=g.prefill_tokens)
        if self.rank == 0:
            engine.announce = self._send
        return engine

    # --- rank 0: the lifecycle on every rank ------------------------------------------------
    def _send(self, command: tuple) -> None:
        if self._broken:
            raise TPGroupBroken(self._broken)
        try:
            self.group.send(command)
        except Exception as exc:  # noqa: BLE001 - a rank is gone: say so from now on
            self._broken = f"tensor-parallel group broken ({exc}); restart the target service"
            self.log.error("tp_group_broken", error=str(exc))
            raise TPGroupBroken(self._broken) from exc

    def _replies(self, verb: str) -> None:
        """Every rank's reply to the command just sent; the first failure raised, naming its rank."""
        for rank, reply in enumerate(self.group.replies(None)):
            if reply is not None:
                kind, message = reply
                cls = {"value": CheckpointError, "precondition": LifecycleError}.get(kind, RuntimeError)
                raise cls(f"tensor-parallel rank {rank} ({verb}): {message}")

    def _lead(self, verb: str, *args: Any) -> None:
        self._send((verb, *args))
        self._replies(verb)

    def _install(self, model_cfg: ModelConfig, arrays: dict[str, np.ndarray], version: str) -> None:
        if self.rank != 0:
            return super()._install(model_cfg, arrays, version)
        # NOTE: two phases: every rank first reads its slices (what fails: files, memory), and
        # only when all have them do the ranks install; a failure before the commit leaves
        # every rank as it was.
        try:
            self._lead(STAGE, arrays.checked, False)
        except Exception:
            self._lead(DROP)
            raise
        try:
            super()._install(model_cfg, arrays, version)
        except BaseException:
            self._lead(DROP)
            raise
        try:
            self._lead(COMMIT, version)
        except BaseException:
            # NOTE: undo on every rank: the ones that installed release again; the registry
            # holds no graphs yet (a load is EMPTY -> LOADED), so dropping the engine is safe.
            self._lead(RELEASE)
            self.registry.unregister_all()
            self.engine, self.model_cfg, self.weights_version = None, None, ""
            raise
        return None

    def _copy_in_place(self, new_cfg: ModelConfig, arrays: dict[str, np.ndarray], version: str) -> None:
        if self.rank != 0:
            return super()._copy_in_place(new_cfg, arrays, version)
        try:
            self._lead(STAGE, arrays.checked, True)
        except Exception:
            self._lead(DROP)
            raise
        try:
            super()._copy_in_place(new_cfg, arrays, version)   # checks every name and shape before copying
        except BaseException:
            self._lead(DROP)
            raise
        # The other ranks copy the same checkpoint's slices; their checks passed on the same
        # headers, so a failure here is I/O or memory and leaves the ranks on different weights.
        try:
            self._lead(COMMIT, version)
        except Exception as exc:
            self._broken = f"an in-place update failed on a rank after rank 0 copied ({exc}); restart the target"
            raise TPGroupBroken(self._broken) from exc
        return None

    def _drop_engine(self) -> None:
        if self.rank == 0:
            # NOTE: the lifecycle refused this while graphs were live, and every rank's graphs
            # follow rank 0's (capture and clear run on all), so no rank holds a graph that
            # reads these weights: the other ranks release first, then this one.
            self._lead(RELEASE)
        super()._drop_engine()

    def _capture(self) -> None:
        if self.rank != 0:
            return super()._capture()
        # NOTE: every rank captures at once, in the same order of (bucket, kind, span): the
        # collectives inside each step pair up across the ranks (and are recorded into each
        # rank's CUDA graphs on GPUs). The replies come after this rank's capture.
        self._send((CAPTURE,))
        try:
            super()._capture()
        finally:
            self._replies(CAPTURE)
        return None

    def _clear(self) -> None:
        if self.rank == 0:
            self._send((CLEAR,))
            try:
                super()._clear()
            finally:
                self._replies(CLEAR)
            return
        super()._clear()

    def close(self) -> None:
        """Rank 0: the ordered teardown on every rank (graphs, then weights), then stop the others."""
        try:
            super().close()
            if self.rank == 0 and not self._broken:
                try:
                    self.device.run(lambda: self.group.send((STOP,)))
                except Exception as exc:  # noqa: BLE001 - a rank already gone: nothing to stop
                    self.log.warning("tp_stop_failed", error=str(exc))
            self.device.run(self.group.close)
        finally:
            if self._after_close is not None:
                self._after_close()

    # --- ranks > 0 -------------------------------------------------------------------------
    def follow(self) -> None:
        """Run rank 0's commands until ``stop`` (or until rank 0 is gone: the receive fails)."""
        self.device.run(self._follow_loop)

    def _follow_loop(self) -> None:
        while True:
            command = self.group.receive()
            verb = command[0]
            if verb == STOP:
                self.log.info("tp_stop")
                return
            if verb in (RUN, PREFILL):
                try:
                    self.engine.run_announced(command)
                except Exception:  # noqa: BLE001 - logged; rank 0's collective fails or times out
                    self.log.exception("tp_step_failed", verb=verb)
                continue
            reply = None
            try:
                self._follow_lifecycle(verb, command[1:])
            except Exception as exc:  # noqa: BLE001 - rank 0 raises it, naming this rank
                kind = ("precondition" if isinstance(exc, FailedPrecondition)
                        else "value" if isinstance(exc, ValueError) else "other")
                reply = (kind, f"{type(exc).__name__}: {exc}")
                self.log.warning("tp_command_failed", verb=verb, error=str(exc))
            self.group.replies(reply)

    def _follow_lifecycle(self, verb: str, args: tuple) -> None:
        if verb == STAGE:
            checked, in_place = args
            with host_memory.loading():
                self._staged = (self.read_weights(checked), checked.cfg, in_place)
        elif verb == DROP:
            self._staged = None
        elif verb == COMMIT:
            (version,) = args
            if self._staged is None:
                raise LifecycleError("commit without staged weights")
            arrays, cfg, in_place = self._staged
            self._staged = None
            with host_memory.loading():
                if in_place:
                    self.lifecycle.apply(LOAD_WEIGHTS_IN_PLACE, lambda: self._copy_in_place(cfg, arrays, version),
                                         version)
                else:
                    self.lifecycle.apply(LOAD_WEIGHTS, lambda: self._install(cfg, arrays, version), version)
        elif verb == RELEASE:
            self.lifecycle.apply(RELEASE_WEIGHTS, self._drop_engine)
        elif verb == CAPTURE:
            self.lifecycle.apply(CAPTURE_GRAPHS, self._capture)
        elif verb == CLEAR:
            self.lifecycle.apply(CLEAR_GRAPHS, self._clear)
        else:
            raise ValueError(f"unknown tensor-parallel command {verb!r}")
