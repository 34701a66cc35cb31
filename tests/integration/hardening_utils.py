"""Helpers of the hardening tests (failures, fuzzing, security, shutdown).

- ``make_model``: the peaked byte-vocabulary tiny target + MTP of
  ``test_orchestrator`` with a configurable context length (no near-ties, so
  greedy comparisons are exact).
- ``Reference``: target-only greedy decoding in-process (memoized).
- ``WorkerProcs``: draft / target services as real subprocesses
  (``python -m specsplit draft|target``) that tests kill -9, SIGSTOP, restart.
- ``make_certs``: a CA plus server / client certificates (``cryptography``).
- ``wait_until``, ``Stream``: bounded waiting and a Generate stream consumed on
  a thread with timestamps.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, RuntimeConfig, SpecConfig
from specsplit.launcher import Child
from tests.byte_model import write_byte_model
from tests.waiting import wait_until  # noqa: F401 (used by the tests that import this module too)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0


def make_model(path: Path, max_len: int = 1024, seed: int = 0) -> Path:
    """The shared byte-vocabulary tiny target + MTP (tests/byte_model.py) in ``path``."""
    write_byte_model(path, seed, max_len)
    return path


def prompt_of(i: int, n: int) -> list[int]:
    return [256, *(int(x) for x in np.random.default_rng(900 + i).integers(0, 256, n - 1))]


class Reference:
    """Target-only greedy tokens, computed in this process (Paddle) and memoized."""

    def __init__(self, model: Path, max_len: int) -> None:
        from runtime.engine import SpecEngine

        self._engine = SpecEngine(EngineConfig(target_path=str(model), runtime=RuntimeConfig(backend="paddle"),
                                               spec=SpecConfig(max_k=3, default_k=0),
                                               cache=CacheConfig(max_slots=2, max_len=max_len)), use_draft=False)
        self._memo: dict = {}

    def __call__(self, prompt: list[int] | str, max_tokens: int) -> tuple[int, ...]:
        from runtime.engine import GenRequest
        from runtime.tokenizer import ByteTokenizer

        ids = tuple(ByteTokenizer().encode(prompt)) if isinstance(prompt, str) else tuple(prompt)
        key = (ids, max_tokens)
        if key not in self._memo:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self._memo[key] = self._engine.generate([GenRequest("ref", ids, params, k=0)])[0].tokens
        return self._memo[key]


# --- worker subprocesses -----------------------------------------------------------------------
def worker_argv(role: str, model: Path, port: int = 0, max_len: int = 1024, slots: int = 8,
                extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "specsplit", "--log-level", "WARNING", role, "--target-path", str(model),
            "--runtime-backend", "paddle", "--spec-max-k", "3", "--spec-default-k", "3",
            "--cache-max-slots", str(slots), "--cache-max-len", str(max_len), "--server-port", str(port),
            "--no-capture-on-start", *extra]


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


class WorkerProcs:
    """Draft / target services as subprocesses; everything started is killed at ``close``."""

    def __init__(self, model: Path, max_len: int = 1024, slots: int = 8) -> None:
        self.model, self.max_len, self.slots = model, max_len, slots
        self.children: list[Child] = []

    def start(self, role: str, port: int = 0, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
              wait: bool = True) -> Child:
        c = Child(role, worker_argv(role, self.model, port, self.max_len, self.slots, extra), env or child_env())
        self.children.append(c)
        if wait:
            c.wait_listening(60)
        return c

    @staticmethod
    def port(c: Child) -> int:
        return int(c.address.rsplit(":", 1)[1])

    @staticmethod
    def kill9(c: Child) -> None:
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(10)

    def close(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                try:
                    c.proc.send_signal(signal.SIGCONT)  # a stopped child cannot handle SIGTERM
                except ProcessLookupError:
                    pass
                c.stop(grace=5)


# --- a Generate stream on a thread ------------------------------------------------------------------
@dataclass
class Stream:
    """Consume ``client.generate(...)`` on a thread: chunks with arrival times, final or error."""

    client: Any
    prompt: Any
    max_tokens: int
    kw: dict = field(default_factory=dict)
    chunks: list = field(default_factory=list)      # (monotonic time, GenerateEvent)
    final: Any = None
    error: Any = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.client.generate(self.prompt, self.max_tokens, **self.kw):
                if ev.final:
                    self.final = ev
                else:
                    self.chunks.append((time.monotonic(), ev))
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc

    def join(self, timeout: float = 120.0) -> "Stream":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end in time"
        return self

    def drafted_after(self, t: float) -> int:
        return sum(ev.num_drafted for at, ev in list(self.chunks) if at > t)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for _, ev in list(self.chunks) for t in ev.tokens)


# --- certificates ---------------------------------------------------------------------------------------
def make_cert(name: str, issuer_key=None, issuer_name=None, ca: bool = False):
    """(key, subject, PEM key, PEM certificate) for CN ``name``, self-signed when no issuer;
    leaf certificates carry SAN localhost + 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key, subject, pem_key, cert.public_bytes(serialization.Encoding.PEM)


def make_certs(directory: Path, names: tuple[str, ...] = ("server", "orchestrator", "admin", "client"),
               rogue: bool = True) -> dict[str, str]:
    """``ca.pem`` plus ``<name>.pem`` / ``<name>.key`` (CN = name, SAN localhost + 127.0.0.1) signed by it;
    ``rogue.pem`` / ``rogue.key``: a self-signed certificate no CA vouches for. Returns name -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_name, _, ca_pem = make_cert("specsplit-test-ca", ca=True)
    out = {"ca": str(directory / "ca.pem")}
    (directory / "ca.pem").write_bytes(ca_pem)
    for name in names:
        _, _, key, pem = make_cert(name, ca_key, ca_name)
        (directory / f"{name}.key").write_bytes(key)
        (directory / f"{name}.pem").write_bytes(pem)
        out[f"{name}.key"], out[f"{name}.pem"] = str(directory / f"{name}.key"), str(directory / f"{name}.pem")
    if rogue:
        _, _, key, pem = make_cert("admin")                 # self-signed, claims the admin CN
        (directory / "rogue.key").write_bytes(key)
        (directory / "rogue.pem").write_bytes(pem)
        out["rogue.key"], out["rogue.pem"] = str(directory / "rogue.key"), str(directory / "rogue.pem")
    return out


def read_json_line(stream, timeout: float = 60.0) -> dict:
    """The next JSON object line of a text stream (other lines skipped), bounded in time."""
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = stream.readline()
        if not line:
            raise RuntimeError("stream closed")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise TimeoutError("no JSON line in time")
