"""Weight swaps owned by the worker: prepare (validate and stage), commit (apply in order), abort.

Owns: the one staged version of a worker (its validated checkpoint headers and,
with ``preload``, its tensors already in host memory), the checks a swap makes
before anything live changes (version not already serving, IN_PLACE needs
weights of the same config), and the commit of one worker as an ordered list of
phases, each one lifecycle transition of ``worker.base.Worker``:

    RECAPTURE: clear_graphs -> [held] -> release -> [held] -> load -> [held] -> capture
               ([held]: with a hold asked for there, wait for the caller's go)
    IN_PLACE:  load (copy into the live tensors; graphs stay valid)

The lifecycle state machine (``runtime.lifecycle``) stays the one place that
refuses an out-of-order step (a release while graphs are live); this module
only asks for the steps in the right order. A commit of a version loaded here
before (the worker remembers where its last versions came from) is how a failed
reload rolls back, without the orchestrator choreographing single steps.

Must not know: gRPC, the other worker, the round loop, frameworks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Mapping

import numpy as np

from core.errors import FailedPrecondition
from runtime import host_memory
from runtime.lifecycle import State
from runtime.weights import CheckedCheckpoint

if TYPE_CHECKING:  # the worker is passed in; importing it here would be circular
    from worker.base import Worker

RECAPTURE, IN_PLACE = "recapture", "in_place"
MODES = (RECAPTURE, IN_PLACE)
CLEAR, HELD, RELEASE, LOAD, CAPTURE = "clear_graphs", "held", "release", "load", "capture"
HOLD_POINTS = (CLEAR, RELEASE, LOAD)


@dataclass
class Staged:
    """A prepared version: validated, not applied."""

    version: str
    mode: str
    source: tuple[str, str]                   # (target_path, draft_path)
    checked: CheckedCheckpoint
    arrays: dict[str, np.ndarray] | None      # read at prepare (preload), else at commit


@dataclass(frozen=True)
class Phase:
    """One finished phase of a commit (``error``: it failed, and nothing after it ran)."""

    name: str
    seconds: float
    held: bool = False
    after: str = ""                           # held: the phase it holds after (one of HOLD_POINTS)
    error: BaseException | None = None


# A commit: yields each Phase as it ends; after a ``held`` phase it is sent True (go on) or
# False (stop: held after the clear, the graphs are put back and the old weights kept; held
# later, the worker stays as it is until a rollback commit).
Commit = Generator[Phase, "bool | None", None]


class WeightSwaps:
    """The staged version of one worker and its commit. Thread-safe for prepare / abort;
    a commit runs its phases on the worker's device thread (through the worker)."""

    def __init__(self, worker: "Worker") -> None:
        self.w = worker
        self._staged: Staged | None = None
        self._lock = threading.Lock()

    @property
    def staged_version(self) -> str:
        st = self._staged
        return st.version if st is not None else ""

    # --- prepare / abort --------------------------------------------------------------
    def prepare(self, target_path: str, draft_path: str, version: str, mode: str, preload: bool = False) -> None:
        """Validate the checkpoint from its headers (read once) and stage it; nothing live changes.

        Raises ValueError / CheckpointError (INVALID_ARGUMENT) for a bad request or
        checkpoint, FailedPrecondition when IN_PLACE cannot apply to what is loaded.
        """
        w = self.w
        if not target_path:
            raise ValueError("target_path: required (empty)")
        if not version:
            raise ValueError("version: required (empty); tag the new weights")
        _check_mode(mode)
        if w.lifecycle.serving and w.weights_version == version:
            raise ValueError(f"version: {version!r} is already serving on {w.role}; "
                             "tag the new weights with a new version")
        if mode == IN_PLACE and not w.lifecycle.serving:
            raise FailedPrecondition(f"mode IN_PLACE needs loaded weights to copy into; the {w.role} holds none "
                                     "(state EMPTY): use RECAPTURE")
        target = w.check_path(target_path)
        # NOTE: the whole checkpoint (config, every name/shape/dtype) is validated from
        # its headers before anything live changes, and only here: the commit reuses it.
        checked = w.validate_checkpoint(target, draft_path, None)
        running = w.model_cfg
        if mode == IN_PLACE and running is not None:
            diff = [f for f in running.compatible_with(checked.cfg) if f != "torch_dtype"]
            if diff:
                raise FailedPrecondition(f"the new checkpoint does not fit the {w.role}'s running tensors "
                                         f"(config differs in {diff})")
        with host_memory.loading():
            arrays = w.read_weights(checked) if preload else None
        with self._lock:
            old, self._staged = self._staged, Staged(version, mode, (target_path, draft_path), checked, arrays)
        if old is not None and old.arrays is not None:
            old.arrays.clear()
            host_memory.trim()
        w.log.info("weights_prepared", target_path=target_path, weights_version=version, mode=mode,
                   preloaded=preload)

    def abort(self, version: str = "") -> bool:
        """Drop the staged version (``version`` empty: whatever is staged). True if one was dropped."""
        with self._lock:
            st = self._staged
            if st is None or (version and st.version != version):
                return False
            self._staged = None
        if st.arrays is not None:
            st.arrays.clear()
            host_memory.trim()
        self.w.log.info("weights_prepare_aborted", weights_version=st.version)
        return True

    # --- commit -------------------------------------------------------------------------
    def commit(self, version: str, mode: str, capture: bool | None = None, holds: tuple[str, ...] = ()) -> Commit:
        """The commit of ``version`` as a generator of phases (see ``Commit``).

        ``version``: the staged one, or one loaded here before (rollback), or "" with
        RECAPTURE (hold nothing). ``capture``: graphs live afterwards (None: as before).
        ``holds``: the phases (of HOLD_POINTS) after which to wait for the caller.
        Raises (before any phase) ValueError for a version neither staged nor known, or a
        mode other than the staged one.
        """
        _check_mode(mode)
        if holds and mode == IN_PLACE:
            raise ValueError("hold_after: only with mode RECAPTURE (IN_PLACE neither clears, releases nor loads anew)")
        unknown = [h for h in holds if h not in HOLD_POINTS]
        if unknown:
            raise ValueError(f"hold_after: {unknown} are not among {list(HOLD_POINTS)}")
        w = self.w
        with self._lock:
            staged = self._staged if self._staged is not None and self._staged.version == version else None
            if staged is not None:
                if staged.mode != mode:
                    raise ValueError(f"mode: {version!r} was prepared for {staged.mode.upper()}, "
                                     f"not {mode.upper()}")
                self._staged = None
        if not version and mode == IN_PLACE:
            raise ValueError("version: required with mode IN_PLACE")
        serving_it = w.lifecycle.serving and w.weights_version == version
        if staged is None and version and not (serving_it and mode == RECAPTURE):
            # NOTE: not prepared: a version loaded here before (a rollback). A RECAPTURE of
            # the version that is serving needs no source (only its graphs may be restored);
            # an IN_PLACE one always copies (a failed copy leaves the label but mixed tensors).
            target_path, draft_path, version = w.known_source(version)
            checked = w.validate_checkpoint(w.check_path(target_path), draft_path, None)
            staged = Staged(version, mode, (target_path, draft_path), checked, None)
        had_graphs = w.lifecycle.state == State.READY
        graphs_after = had_graphs if capture is None else capture
        return self._steps(staged, version, mode, had_graphs, graphs_after, holds)

    def _steps(self, staged: Staged | None, version: str, mode: str, had_graphs: bool, graphs_after: bool,
               holds: tuple[str, ...]) -> Commit:
        w = self.w
        if mode == IN_PLACE:
            assert staged is not None
            if not (yield from _phase(LOAD, lambda: self._load(staged, in_place=True))):
                return
        else:
            # staged None and a version given: it is serving (a rollback to it): only its
            # graphs may need restoring. staged None and no version: hold nothing.
            swap = staged is not None or not version
            if swap and not (yield from _phase(CLEAR, w.clear_graphs, only_if_changed=True)):
                return
            if CLEAR in holds:
                proceed = yield Phase(HELD, 0.0, held=True, after=CLEAR)
                if not proceed:
                    # NOTE: stopped before any release: the old weights are intact; put
                    # back the graphs this commit cleared.
                    if had_graphs and w.lifecycle.serving:
                        yield from _phase(CAPTURE, w.capture_graphs, only_if_changed=True)
                    return
            # NOTE: release before load: a RECAPTURE never holds two versions on the
            # device; the lifecycle refuses the release while graphs are still live.
            if swap and not (yield from _phase(RELEASE, w.release_weights, only_if_changed=True)):
                return
            if RELEASE in holds and not (yield Phase(HELD, 0.0, held=True, after=RELEASE)):
                return
            if staged is not None and not (yield from _phase(LOAD, lambda: self._load(staged, in_place=False))):
                return
            if LOAD in holds and not (yield Phase(HELD, 0.0, held=True, after=LOAD)):
                return
        if w.lifecycle.serving and graphs_after != (w.lifecycle.state == State.READY):
            # NOTE: capture only after the load: graphs record the new tensors' addresses.
            name, fn = (CAPTURE, w.capture_graphs) if graphs_after else (CLEAR, w.clear_graphs)
            if not (yield from _phase(name, fn, only_if_changed=True)):
                return
        yield Phase("done", 0.0)

    def _load(self, staged: Staged, in_place: bool) -> None:
        arrays: Mapping[str, np.ndarray]
        with host_memory.loading():
            if staged.arrays is not None:
                arrays = staged.arrays
            else:
                # NOTE: an in-place copy streams the tensors (read on access, straight from the
                # files through pinned buffers where the backend can); a new load reads them first.
                arrays = self.w.in_place_source(staged.checked) if in_place else self.w.read_weights(staged.checked)
            staged.arrays = None
            self.w.apply_weights(staged.checked, arrays, staged.version, in_place, staged.source)


def _phase(name: str, fn: Callable[[], Any], only_if_changed: bool = False) -> Generator[Phase, Any, bool]:
    """Run one phase; yield its Phase (unless it changed nothing and ``only_if_changed``).
    Returns False when it failed (its Phase carries the error)."""
    t0 = time.monotonic()
    try:
        changed = fn()
    except Exception as exc:  # noqa: BLE001 - reported as this phase's error
        yield Phase(name, time.monotonic() - t0, error=exc)
        return False
    if not (only_if_changed and changed is False):
        yield Phase(name, time.monotonic() - t0)
    return True


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of RECAPTURE, IN_PLACE")
