"""torch.distributed for a tensor-parallel target: the process group, its collectives, the control plane.

Owns: joining the group of one tensor-parallel target (NCCL between GPUs, gloo on
the CPU), the two collectives of the sharded forward (``all_reduce`` of a row
split's partial sums, ``gather_last`` of the vocabulary-parallel logits), and the
control plane by which rank 0 drives the others (``send`` / ``receive`` of one small
command, ``replies``), which runs on a separate gloo group.

Must not know: models, requests, gRPC, lifecycle, what a command means.

Two groups, because they wait differently: the data group's collectives run inside
a step (and inside CUDA graphs on GPUs) and time out after ``step_timeout_s``; the
control group's broadcast is where an idle rank waits for the next command, for as
long as the service stays idle. A rank that dies closes its sockets, so the others'
pending gloo calls fail at once instead of waiting out a timeout.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from runtime.tp_plan import Rendezvous

_IDLE_TIMEOUT = datetime.timedelta(days=365)


# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there).
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchGroup:
    """This process's place in the TP group (one per process: torch.distributed's default group)."""

    def __init__(self, rv: Rendezvous, device: str, step_timeout_s: float = 300.0) -> None:
        self.rank, self.size = rv.rank, rv.world_size
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        # NOTE: the default group first (every rank calls init in the same order), then the
        # control group: new_group is itself a collective over the default group.
        dist.init_process_group(backend, init_method=f"tcp://{rv.master_addr}:{rv.master_port}",
                                rank=rv.rank, world_size=rv.world_size,
                                timeout=datetime.timedelta(seconds=step_timeout_s))
        self._control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self.backend = backend

    # --- the sharded forward's collectives (captured into CUDA graphs on GPUs) ---------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (a row split's partial products), in place; returns x."""
        dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank -> [..., size*n], rank r's part at columns [r*n, (r+1)*n)."""
        x = x.contiguous()
        lead = x.shape[0] if x.dim() else 1
        out = torch.empty((self.size * lead, *x.shape[1:]), dtype=x.dtype, device=x.device)  # ranks along dim 0
        _gather_single(out, x)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    # --- control plane (rank 0 -> the others) ------------------------------------------
    def send(self, command: Any) -> None:
        """Rank 0: hand ``command`` (any picklable object) to every other rank."""
        dist.broadcast_object_list([command], src=0, group=self._control)

    def receive(self) -> Any:
        """Ranks > 0: wait (for as long as it takes) for rank 0's next command."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def replies(self, mine: Any) -> list[Any]:
        """Every rank's ``mine``, in rank order (each rank calls it after the same command)."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, mine, group=self._control)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
