"""Starting the ranks of a tensor-parallel target.

Owns: how ``specsplit target --tp N`` gets its N processes: either torchrun started
them (each process got RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, read by the
CLI into a ``Rendezvous``), or rank 0 spawns ranks 1..N-1 itself on a free loopback
port (``spawn_ranks``); ``leader_worker`` (rank 0's worker, handed to the target
server) and ``follower_main`` (what every rank > 0 runs until rank 0 stops it).

Must not know: frameworks, protobuf, what the commands mean (``tp_worker``).

A spawned rank watches its parent: when rank 0's process is gone it exits, so no
orphan keeps a GPU. (Its pending receive also fails when rank 0's sockets close.)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import threading
import time
from typing import Any, Callable

import structlog

from runtime.tp_plan import Rendezvous
from target_service.tp_worker import TPTargetWorker
from worker.config import WorkerConfig

PARENT_POLL_S = 1.0
JOIN_TIMEOUT_S = 30.0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def spawn_ranks(cfg: WorkerConfig, host: str = "127.0.0.1") -> tuple[Rendezvous, list[Any]]:
    """Start ranks 1..tp-1 as child processes; rank 0's rendezvous and the children."""
    rv = Rendezvous(0, cfg.tp, host, _free_port(host))
    # NOTE: "spawn", not fork: a forked child would inherit rank 0's threads (gRPC, the
    # device thread) and its framework state half-initialised.
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, cfg.tp):
        p = ctx.Process(target=follower_main, args=(cfg, dataclasses.replace(rv, rank=rank), os.getpid()),
                        name=f"specsplit-target-tp{rank}", daemon=True)
        p.start()
        procs.append(p)
    return rv, procs


def leader_worker(rendezvous: Rendezvous | None) -> Callable[..., TPTargetWorker]:
    """Rank 0's worker constructor for ``new_worker``: under torchrun (``rendezvous`` given) it
    joins the group; otherwise it first spawns the other ranks, and stops them on close."""

    def make(cfg: WorkerConfig, log: Any = None) -> TPTargetWorker:
        if rendezvous is not None:
            if rendezvous.rank != 0 or rendezvous.world_size != cfg.tp:
                raise ValueError(f"tp={cfg.tp}: torchrun started rank {rendezvous.rank} of "
                                 f"{rendezvous.world_size} (WORLD_SIZE must equal tp; rank 0 serves)")
            return TPTargetWorker(cfg, log, rendezvous)
        rv, procs = spawn_ranks(cfg)
        try:
            return TPTargetWorker(cfg, log, rv, after_close=lambda: _stop(procs))
        except BaseException:
            _stop(procs)
            raise

    return make


def _stop(procs: list[Any]) -> None:
    """Wait for the spawned ranks to exit (they do after ``stop``); terminate stragglers."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(5.0)


def follower_main(cfg: WorkerConfig, rendezvous: Rendezvous, parent_pid: int | None = None) -> None:
    """A rank > 0: join the group, follow rank 0's commands until it says stop."""
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True,
                         name="tp-parent-watch").start()
    log = structlog.get_logger(service="target").bind(tp_rank=rendezvous.rank)
    worker = TPTargetWorker(cfg, log, rendezvous)
    try:
        worker.follow()
    finally:
        worker.device.run(worker.group.close)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(PARENT_POLL_S)
