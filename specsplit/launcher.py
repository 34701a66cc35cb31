"""Start draft, target and orchestrator as child processes on loopback.

Owns: the command lines of the three services for ``specsplit up`` / ``demo``
and the tests, the stack's one admin token (given, or generated here) handed
to all three through ``SPECSPLIT_SECURITY_ADMIN_TOKEN`` (the orchestrator
presents its own token to the workers) and written to the token file of each
service's port so the CLI finds it, reading each child's "listening" line (so ports can be 0),
and stopping children cleanly: SIGTERM, a grace period, then SIGKILL. Children
get PR_SET_PDEATHSIG so none outlives a killed parent (no orphans).

Must not know: the services' internals.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 180.0
STOP_GRACE_S = 15.0


# NOTE: a child sets its own PR_SET_PDEATHSIG after exec (this bootstrap), never in a preexec_fn:
# a preexec_fn makes subprocess fork() instead of vfork(), which runs gRPC's fork handlers, and
# with other threads inside gRPC the child could abort before its exec (CI: a restarted draft
# "exited with code -6", "Mutex::Fer with pending CondVar queueing"). A parent already gone by
# then (getppid differs) means the child exits at once.
_BOOT = """import ctypes, os, runpy, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
except OSError:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
sys.argv = ["specsplit", *sys.argv[2:]]
runpy.run_module("specsplit", run_name="__main__", alter_sys=True)
"""


def _boot_argv(argv: list[str]) -> list[str]:
    """``python -m specsplit ARGS`` as a child that dies with this process (``_BOOT``)."""
    if argv[1:3] != ["-m", "specsplit"]:
        raise ValueError(f"not a specsplit command line: {argv[:3]}")
    return [argv[0], "-c", _BOOT, str(os.getpid()), *argv[3:]]


@dataclass(frozen=True)
class StackOptions:
    model: str
    backend: str = "paddle"
    draft_device: str = "cpu"
    target_device: str = "cpu"
    port: int = 0
    k: int = 3
    max_batch: int = 16
    no_draft: bool = False
    colocated_draft: bool = False            # the draft in the target's process (target --colocated-draft)
    capture_graphs: bool | None = None       # None: capture on cuda devices
    capture_draft: bool | None = None        # per-role overrides of capture_graphs
    capture_target: bool | None = None
    metrics: bool = False
    log_level: str = "WARNING"
    extra_env: dict[str, str] = field(default_factory=dict)
    max_slots: int = 32
    max_len: int = 1024
    admin_token: str | None = None
    ahead_drafting: bool = False             # target: draft past d_k while verifying (spec.ahead_drafting)
    micro_batches: bool = False              # target: two micro-batches overlapped (spec.micro_batches)
    adaptive_k: bool = False                 # target: per-request k follows acceptance and costs (spec.adaptive_k)
    watch_probes: bool = True                # target, with adaptive_k: probes watch, never verify (spec.watch_probes)
    worker_args: tuple[str, ...] = ()        # extra flags for both workers (e.g. --runtime-dtype bfloat16)
    draft_args: tuple[str, ...] = ()         # extra flags for the draft only, after worker_args
    target_tp: int = 1                       # the target's tensor-parallel ranks (cuda:N.. from target_device)
    stream_interval: int = 1                 # orchestrator: tokens a stream holds back (--stream-interval)
    host: str = "127.0.0.1"                  # the orchestrator's listen address (workers: always loopback)
    allow_insecure: bool = False             # let the orchestrator serve plaintext on a non-loopback host
    http_port: int | None = None             # orchestrator's OpenAI-compatible HTTP API (None = off, 0 = pick)


class Child:
    """One service process and the address it announced."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        # process_group=0: the child leads a process group of its own (what setpgrp did before).
        self.proc = subprocess.Popen(_boot_argv(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     text=True, process_group=0)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.failure: str | None = None      # the child's one-line start-up error, held back (see _pump_stderr)
        threading.Thread(target=self._pump, daemon=True).start()
        self._stderr_done = threading.Event()
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        self.address = ""
        self.metrics_port: int | None = None
        self.http_port: int | None = None

    def _pump_stderr(self) -> None:
        """Forward the child's stderr, except its ``specsplit: <what>: <why>`` line, which the
        parent reports once, naming the child (so a failed start is still one line)."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("specsplit: ") and not self.address:
                self.failure = line.strip()[len("specsplit: "):]
                continue
            sys.stderr.write(line)
            sys.stderr.flush()
        self._stderr_done.set()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                code = self.proc.wait()
                self._stderr_done.wait(5)
                raise RuntimeError(f"{self.name}: {self.failure}" if self.failure else
                                   f"{self.name} exited with code {code} before listening")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "listening":
                self.address = msg["address"]
                self.metrics_port = msg.get("metrics_port")
                self.http_port = msg.get("http_port")
                return self.address
        raise TimeoutError(f"{self.name} did not start listening within {timeout:.0f}s")

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def worker_argv(role: str, opts: StackOptions, device: str) -> list[str]:
    override = opts.capture_draft if role == "draft" else opts.capture_target
    capture = override if override is not None else (
        opts.capture_graphs if opts.capture_graphs is not None else device.startswith("cuda"))
    argv = [sys.executable, "-m", "specsplit", "--log-level", opts.log_level, role,
            "--target-path", opts.model, "--runtime-backend", opts.backend, "--runtime-device", device,
            "--spec-max-k", str(max(opts.k, 1)), "--spec-default-k", str(opts.k),
            "--cache-max-slots", str(opts.max_slots), "--cache-max-len", str(opts.max_len),
            "--server-host", "127.0.0.1", "--server-port", "0",
            "--capture-on-start" if capture else "--no-capture-on-start"]
    if opts.metrics:
        argv += ["--server-metrics-port", "0"]
    # NOTE: ahead drafting is set on both workers: the target asks for ahead drafts, the draft
    # captures the wider catch-up they lead to.
    argv += ["--spec-ahead-drafting" if opts.ahead_drafting else "--no-spec-ahead-drafting"]
    if role == "target":
        argv += ["--spec-adaptive-k" if opts.adaptive_k else "--no-spec-adaptive-k"]
        argv += ["--spec-watch-probes" if opts.watch_probes else "--no-spec-watch-probes"]
        argv += ["--spec-micro-batches" if opts.micro_batches else "--no-spec-micro-batches"]
        if opts.target_tp > 1:
            argv += ["--tp", str(opts.target_tp)]
    return argv + list(opts.worker_args) + (list(opts.draft_args) if role == "draft" else [])


def target_argv(opts: StackOptions) -> list[str]:
    """The target's command line; with ``colocated_draft``, the draft in its process on ``draft_device``
    (the draft then takes the target's settings: ``draft_args`` have no process to go to)."""
    argv = worker_argv("target", opts, opts.target_device)
    if not opts.colocated_draft or opts.no_draft:
        return argv
    if opts.draft_args:
        raise ValueError(f"draft_args {list(opts.draft_args)}: a colocated draft takes the target's settings")
    return argv + ["--colocated-draft", "--draft-device", opts.draft_device]


class Stack:
    """Context manager running the three services; ``addresses()`` says where."""

    def __init__(self, opts: StackOptions) -> None:
        self.opts = opts
        self.children: dict[str, Child] = {}
        self.admin_token = opts.admin_token
        self.token_files: dict[str, str] = {}

    def __enter__(self) -> "Stack":
        env = {**os.environ, **self.opts.extra_env}
        # NOTE: one token for the three services: the orchestrator presents its own admin token
        # to the workers when no separate worker token is set (core.admin_token.token_for_worker).
        self.admin_token = self.opts.admin_token or env.get("SPECSPLIT_SECURITY_ADMIN_TOKEN") or \
            secrets.token_urlsafe(32)
        env["SPECSPLIT_SECURITY_ADMIN_TOKEN"] = self.admin_token
        try:
            # NOTE: workers first: the orchestrator needs both addresses.
            self.children["target"] = Child("target", target_argv(self.opts), env)
            if not self.opts.no_draft and not self.opts.colocated_draft:
                self.children["draft"] = Child("draft", worker_argv("draft", self.opts, self.opts.draft_device), env)
            for c in self.children.values():
                c.wait_listening()
            argv = [sys.executable, "-m", "specsplit", "--log-level", self.opts.log_level, "orchestrator",
                    "--target-address", self.children["target"].address,
                    "--server-host", self.opts.host, "--server-port", str(self.opts.port), "--default-k", str(self.opts.k),
                    "--max-k", str(max(self.opts.k, 1)), "--max-batch", str(self.opts.max_batch)]
            if not self.opts.no_draft:
                argv += ["--draft-address", self.draft_address]
            if self.opts.allow_insecure:
                argv += ["--allow-insecure"]
            if (Path(self.opts.model) / "tokenizer.json").is_file():   # the model's own tokenizer, else bytes
                argv += ["--tokenizer", str(self.opts.model)]
            if self.opts.metrics:
                argv += ["--server-metrics-port", "0"]
            if self.opts.stream_interval != 1:
                argv += ["--stream-interval", str(self.opts.stream_interval)]
            if self.opts.http_port is not None:
                argv += ["--http-port", str(self.opts.http_port)]
            self.children["orchestrator"] = Child("orchestrator", argv, env)
            self.children["orchestrator"].wait_listening()
            self._write_token_files()
        except BaseException:
            self.close()
            raise
        return self

    def _write_token_files(self) -> None:
        """The stack's token in the token file of every service's port (0600), for the CLI."""
        from core.admin_token import default_token_path, split_address, write_token_file

        for name, c in self.children.items():
            port = split_address(c.address)[1]
            if port is not None:
                self.token_files[name] = str(write_token_file(default_token_path(port), self.admin_token))

    @property
    def orchestrator_address(self) -> str:
        return self.children["orchestrator"].address

    @property
    def draft_address(self) -> str:
        """Where the draft serves: its own process, or the target's with ``colocated_draft``."""
        return self.children["target" if self.opts.colocated_draft else "draft"].address

    def addresses(self) -> dict[str, object]:
        out: dict[str, object] = {name: c.address for name, c in self.children.items()}
        if self.opts.colocated_draft and not self.opts.no_draft:
            out["draft"] = self.draft_address
        orch = self.children.get("orchestrator")
        if orch is not None and orch.http_port is not None:
            out["http"] = f"http://{orch.address.rpartition(':')[0]}:{orch.http_port}/v1"
        if self.opts.metrics:
            out["metrics_ports"] = {name: c.metrics_port for name, c in self.children.items()}
        if "orchestrator" in self.token_files:
            out["admin_token_file"] = self.token_files["orchestrator"]
        return out

    def close(self) -> None:
        # NOTE: orchestrator first (stops admitting and drains), then the workers it calls.
        for name in ("orchestrator", "draft", "target"):
            c = self.children.get(name)
            if c is not None:
                c.stop()

    def __exit__(self, *exc) -> None:
        self.close()
