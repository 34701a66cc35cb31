"""The services' configuration trees, as the application sees them all at once.

Owns: ``SERVICE_CONFIGS``, the config trees of every service, which share one environment
under ``specsplit up`` and compose (so each service accepts the others' ``SPECSPLIT_*``
variables), and ``build``, ``core.config_loader.build`` with that list.
Must not know: what the services do with their settings.
"""

from __future__ import annotations

import argparse
from typing import Any

from core import config_loader
from orchestrator.config import OrchestratorConfig
from worker.config import WorkerConfig

SERVICE_CONFIGS: tuple[type, ...] = (WorkerConfig, OrchestratorConfig)


def build(cls: type, args: argparse.Namespace | None, env: dict[str, str] | None = None,
          overrides: dict[str, Any] | None = None) -> Any:
    """``cls`` from overrides > flags > env > TOML > defaults; every service's variables are known."""
    return config_loader.build(cls, args, env=env, overrides=overrides, trees=SERVICE_CONFIGS)
