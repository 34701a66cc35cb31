"""The configuration of a model worker service (draft or target).

Owns: ``WorkerConfig``: the role, the weights to load at start, and the runtime, cache,
graph, server, data-plane and security settings of one worker process.
Must not know: how values are read (``core.config_loader``) or the orchestrator's settings.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from core.config import SecurityConfig, ServerConfig
from core.config import check as _check
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig, is_device


# The automatic data-plane poll (docs/performance.md § Session 9): on the 16-core H200 host,
# polling 2 ms took a batch-1 round's overhead from 0.44 to 0.27 ms (+18 % tokens/s); on a
# 2-core host the polling core is the one the relay needs, and it bought nothing.
AUTO_POLL_US = 2000
AUTO_POLL_CPUS = 8


def usable_cpus(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    CPU limit leaves the affinity at the whole node's cores)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max" or int(period) <= 0:
        return cpus
    return max(1, min(cpus, -(-int(quota) // int(period))))


def poll_seconds(poll_us: int, cpus: int | None = None) -> float:
    """Seconds a data-plane reader polls before it blocks, for ``data_plane_poll_us`` (-1 = auto)."""
    if poll_us >= 0:
        return poll_us / 1e6
    cpus = usable_cpus() if cpus is None else cpus
    return AUTO_POLL_US / 1e6 if cpus >= AUTO_POLL_CPUS else 0.0


@dataclass(frozen=True)
class WorkerConfig:
    """A draft or target worker service."""

    role: str                            # "draft" | "target"
    target_path: str | None              # load at start when set (else start EMPTY)
    draft_path: str | None = None
    weights_version: str = ""
    capture_on_start: bool = False       # capture graphs after the start-up load
    tp: int = 1                          # target: tensor-parallel ranks (one process per device; target_service/tp_*)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # --- draft only: the per-round data plane beside gRPC (worker/data_plane.py), on server.host ---
    data_plane_port: int = 0             # 0 = pick a free port (advertised in GetStatus), -1 = off (gRPC stream only)
    # --- both: how long a data-plane reader polls for the next frame before it blocks (microseconds) ---
    # -1 = auto: AUTO_POLL_US where this process may use AUTO_POLL_CPUS or more CPUs (usable_cpus), else 0.
    data_plane_poll_us: int = -1
    # --- target only: how the round loop reaches the draft service (address: ControlRounds CONFIGURE) ---
    draft_tls_ca: str | None = None      # CA to verify the draft's certificate (TLS to the draft); unset with
                                         # mTLS serving: security.tls_client_ca, showing security.tls_cert
    draft_client_cert: str | None = None  # client certificate shown to an mTLS draft
    draft_client_key: str | None = None
    # --- target only: host the draft worker in this process (one GPU, or two GPUs of one host) ---
    colocated_draft: bool = False        # the draft worker lives here and serves DraftService on this port
    draft_device: str = ""               # the colocated draft's device ("" = runtime.device)
    colocated_device_drafts: bool = True  # on the target's device: greedy drafts reach the verify there

    def __post_init__(self) -> None:
        _check(self.role in ("draft", "target"), "role", "'draft' or 'target'", self.role)
        _check(isinstance(self.tp, int) and 1 <= self.tp <= 64, "tp", "an integer in [1, 64]", self.tp)
        _check(isinstance(self.data_plane_port, int) and -1 <= self.data_plane_port <= 65535, "data_plane_port",
               "an integer in [-1, 65535] (0 = pick a free port, -1 = off)", self.data_plane_port)
        _check(isinstance(self.data_plane_poll_us, int) and -1 <= self.data_plane_poll_us <= 1_000_000,
               "data_plane_poll_us", "an integer in [-1, 1000000] (0 = block at once, -1 = auto)",
               self.data_plane_poll_us)
        _check(self.tp == 1 or self.role == "target", "tp",
               "1 for the draft (the draft runs on one device; only the target is tensor-parallel)", self.tp)
        _check(self.tp == 1 or not self.runtime.batch_invariant, "tp",
               "1 with runtime.batch_invariant (the tensor-parallel sums follow the batch's size)", self.tp)
        _check(self.tp == 1 or self.runtime.backend == "torch", "tp",
               "1 with runtime.backend='paddle' (tensor parallelism runs on torch.distributed: use "
               "runtime.backend='torch')", self.tp)
        _check((self.draft_client_cert is None) == (self.draft_client_key is None),
               "draft_client_cert/draft_client_key", "both set or both unset",
               (self.draft_client_cert, self.draft_client_key))
        _check(self.draft_client_cert is None or self.draft_tls_ca is not None, "draft_client_cert",
               "used only together with draft_tls_ca", self.draft_client_cert)
        _check(not self.colocated_draft or self.role == "target", "colocated_draft",
               "false for the draft (the target hosts a colocated draft)", self.colocated_draft)
        _check(not self.colocated_draft or self.tp == 1, "colocated_draft",
               "false with tp > 1 (a tensor-parallel target's ranks do not host a draft)", self.colocated_draft)
        _check(not self.draft_device or self.colocated_draft, "draft_device",
               "empty unless colocated_draft is on (a draft service names its own runtime.device)", self.draft_device)
        _check(not self.draft_device or is_device(self.draft_device), "draft_device",
               "'cpu', 'cuda:N' or empty (= runtime.device)", self.draft_device)

    def colocated_draft_config(self) -> "WorkerConfig":
        """The settings of the draft worker a ``colocated_draft`` target hosts: the target's (weights,
        spec, cache, graphs, security), on ``draft_device``, serving no data plane of its own (its
        rounds are calls in this process; the gRPC server is the target's)."""
        rt = dataclasses.replace(self.runtime, device=self.draft_device or self.runtime.device)
        return dataclasses.replace(self, role="draft", runtime=rt, data_plane_port=-1, colocated_draft=False,
                                   draft_device="")


