"""Tensor backends: the only place that imports a framework (device-graph capture included).

Owns: choosing and constructing an ``Ops`` object for a ``RuntimeConfig``.
Each backend module imports its framework lazily, so a Torch worker never
loads Paddle and vice versa (they live in separate processes).
"""

from __future__ import annotations

from typing import Any

from core.config import ConfigError
from runtime.backends.base import Ops
from runtime.config import RuntimeConfig


def make_ops(cfg: RuntimeConfig) -> Ops:
    """Build the ops layer for ``cfg.backend`` on ``cfg.device``."""
    if cfg.backend == "paddle":
        from runtime.backends.paddle_ops import PaddleOps

        return PaddleOps(cfg.device, cfg.dtype, cfg.cpu_threads)
    if cfg.backend == "torch":
        from runtime.backends.torch_ops import TorchOps

        return TorchOps(cfg.device, cfg.dtype, cfg.cpu_threads, compile_steps=cfg.compile,
                        fused_kernels=cfg.fused_kernels, batch_invariant=cfg.batch_invariant)
    raise ValueError(f"runtime.backend={cfg.backend!r} is invalid: must be 'paddle' or 'torch'")


def make_tp_group(cfg: RuntimeConfig, rendezvous: Any, step_timeout_s: float = 300.0) -> Any:
    """Join the tensor-parallel group of a target (``runtime.tp_plan.Rendezvous``): Torch only."""
    if cfg.backend != "torch":
        raise ConfigError(f"tp > 1 needs runtime.backend='torch' (tensor parallelism runs on torch.distributed); "
                          f"runtime.backend is {cfg.backend!r}")
    from runtime.backends.torch_dist import TorchGroup

    return TorchGroup(rendezvous, cfg.device, step_timeout_s)


__all__ = ["Ops", "make_ops", "make_tp_group"]
