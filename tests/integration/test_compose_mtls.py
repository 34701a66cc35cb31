"""The compose deployment, run for real on loopback over mutual TLS (issue 13).

``deploy/make-certs.sh`` writes a CA and the services' certificates; the services then run with
exactly the arguments and environment variables ``deploy/docker-compose.yml`` gives them (and
``deploy/docker-compose.one-gpu.yml``: the target hosting the draft, which it then calls in
process), rewritten only for loopback (``LoopbackRewrite`` lists every change, certificate paths
included), and their compose health checks (which present client certificates) must pass. A
greedy generation over mTLS through the orchestrator equals target-only decoding; plaintext
clients and clients without a certificate are refused; the env file's admin token and the
operators' certificate (CN specsplit-admin) both enable admin RPCs, and an in-place reload
reaches both workers (the orchestrator authenticates to them with its certificate).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.deploy_files import (COMPOSE_FILES, DEPLOY, REPO, compose_argv, compose_healthcheck, compose_service_env,
                                host_port, load_compose)
from tests.ports import free_port

START_TIMEOUT_S = 120.0               # each service's "listening" line
HEALTHY_TIMEOUT_S = 60.0              # health checks passing after listening
RPC_TIMEOUT_S = 60.0                  # deadline of every call in the tests
MAKE_CERTS = DEPLOY / "make-certs.sh"


def installed_backend() -> str:
    import importlib.util

    return "torch" if importlib.util.find_spec("torch") else "paddle"


@dataclass
class LoopbackRewrite:
    """The only changes made to the compose file's arguments and environment:

    - the ``specsplit`` entrypoint -> ``python -m specsplit`` of this checkout (same CLI);
    - listen host ``0.0.0.0`` -> ``127.0.0.1``; service host names (``draft:50061``) ->
      ``127.0.0.1`` with the port remapped like the service's own;
    - every port (gRPC and metrics) -> a free loopback port, mapped by its number so an
      address and the service that listens there stay paired;
    - ``--runtime-device cuda:N`` -> ``cpu`` (no GPU here);
    - ``--runtime-backend torch`` -> the installed backend (torch when importable);
    - ``/models/tiny`` -> a random tiny model written for the test (so the test does not
      depend on the bundled model), ``/models`` (checkpoint roots) -> its parent;
    - ``/certs/...`` (TLS settings and the health checks' ``--tls-*`` flags) -> the directory
      ``deploy/make-certs.sh`` wrote for the test.
    """

    model_dir: Path
    backend: str
    services: tuple[str, ...]
    certs_dir: Path
    ports: dict[int, int] = field(default_factory=dict)

    KINDS = {"server.port": "port", "server.metrics_port": "port", "server.host": "host",
             "runtime.device": "device", "runtime.backend": "backend", "target_path": "path",
             "draft_path": "path", "security.checkpoint_roots": "paths", "draft_address": "address",
             "target_address": "address", "security.tls_cert": "cert", "security.tls_key": "cert",
             "security.tls_client_ca": "cert", "tls_ca": "cert", "tls_client_cert": "cert", "tls_client_key": "cert"}
    HEALTH_FLAGS = ("--tls-ca", "--tls-cert", "--tls-key")

    def port(self, value: str) -> str:
        n = int(value)
        if n == 0:
            return "0"
        if n not in self.ports:
            self.ports[n] = free_port()
        return str(self.ports[n])

    def path(self, value: str) -> str:
        for old, new in (("/models/tiny", self.model_dir), ("/models", self.model_dir.parent)):
            if value == old or value.startswith(old + "/"):
                return str(new) + value[len(old):]
        return value

    def cert(self, value: str) -> str:
        assert value.startswith("/certs/"), f"certificate outside /certs: {value}"
        return str(self.certs_dir / value[len("/certs/"):])

    def value(self, kind: str, value: str) -> str:
        if kind == "cert":
            return self.cert(value)
        if kind == "port":
            return self.port(value)
        if kind == "host":
            return "127.0.0.1"
        if kind == "device":
            return "cpu" if value.startswith("cuda") else value
        if kind == "backend":
            return self.backend
        if kind == "path":
            return self.path(value)
        if kind == "paths":
            return ",".join(self.path(v.strip()) for v in value.split(","))
        host, port = host_port(value)
        assert host in self.services or host in ("127.0.0.1", "localhost"), f"unknown host in {value}"
        return f"127.0.0.1:{self.port(str(port))}"

    def argv(self, argv: list[str]) -> list[str]:
        assert Path(argv[0]).name == "specsplit"
        flags = {"--" + k.replace(".", "-").replace("_", "-"): kind for k, kind in self.KINDS.items()}
        out, kind = [sys.executable, "-m", "specsplit"], None
        for tok in argv[1:]:
            if kind is not None:
                out.append(self.value(kind, tok))
                kind = None
            elif tok.split("=", 1)[0] in flags and "=" in tok:
                name, val = tok.split("=", 1)
                out.append(f"{name}={self.value(flags[name], val)}")
            else:
                kind = flags.get(tok)
                out.append(tok)
        return out

    def healthcheck(self, argv: list[str]) -> list[str]:
        out = [sys.executable, "-m", "specsplit"] + argv[1:]
        i = out.index("healthcheck") + 1
        out[i] = self.value("address", out[i])
        for j in range(i, len(out) - 1):
            if out[j] in self.HEALTH_FLAGS:
                out[j + 1] = self.cert(out[j + 1])
        return out

    def env(self, env: dict[str, str]) -> dict[str, str]:
        by_env = {"SPECSPLIT_" + k.replace(".", "_").upper(): kind for k, kind in self.KINDS.items()}
        return {k: (self.value(by_env[k], v) if k in by_env else v) for k, v in env.items()}


_REFERENCE = """
import json, sys
from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
model, backend, prompt, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
eng = SpecEngine(EngineConfig(target_path=model, runtime=RuntimeConfig(backend=backend),
                              spec=SpecConfig(max_k=3, default_k=0), cache=CacheConfig(max_slots=2, max_len=256)),
                 use_draft=False)
res = eng.generate([GenRequest("ref", tuple(prompt), SamplingParams(max_tokens=n, ignore_eos=True), k=0)])[0]
print(json.dumps(list(res.tokens)))
"""


def listen_port(svc: dict[str, Any]) -> int:
    """The --server-port a compose service's command gives."""
    argv = compose_argv(svc)
    return int(argv[argv.index("--server-port") + 1])


def _wait_healthy(argv: list[str], env: dict[str, str], what: str) -> None:
    deadline, last = time.monotonic() + HEALTHY_TIMEOUT_S, ""
    while time.monotonic() < deadline:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=HEALTHY_TIMEOUT_S)
        if proc.returncode == 0:
            assert proc.stdout.strip() == "SERVING"
            return
        last = proc.stdout + proc.stderr
        time.sleep(0.5)
    raise AssertionError(f"{what} health check {argv} never passed: {last}")


def _creds(certs: Path, client: str | None) -> grpc.ChannelCredentials:
    ca = (certs / "ca.pem").read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, (certs / f"{client}.key").read_bytes(),
                                        (certs / f"{client}.pem").read_bytes())


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def test_make_certs_writes_the_names_the_deployment_expects(tmp_path):
    """One command, a CA and the certificates (CN = the names the configurations list), keys 0600,
    and a second run refuses to replace the CA without --force."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    out = tmp_path / "certs"
    proc = subprocess.run(["bash", str(MAKE_CERTS), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for name in ("specsplit-draft", "specsplit-target", "specsplit-orchestrator", "specsplit-admin",
                 "specsplit-client"):
        cert = x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        assert (out / f"{name}.key").stat().st_mode & 0o777 == 0o600
    sans = x509.load_pem_x509_certificate((out / "specsplit-draft.pem").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"draft", "specsplit-draft", "localhost"} <= set(sans)
    again = subprocess.run(["bash", str(MAKE_CERTS), str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--force" in again.stderr


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("compose_file", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_services_generate_over_mtls(tiny_model_dir, tmp_path, compose_file):
    """See the module docstring."""
    from orchestrator.client import SpecsplitClient
    from specsplit.launcher import Child
    from specsplit.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

    certs = tmp_path / "certs"
    made = subprocess.run(["bash", str(MAKE_CERTS), str(certs)], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    services = load_compose(compose_file)["services"]
    rw = LoopbackRewrite(tiny_model_dir, installed_backend(), tuple(services), certs)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_")}
    base_env["PYTHONUNBUFFERED"] = "1"
    plan = {name: (rw.argv(compose_argv(svc)), {**base_env, **rw.env(compose_service_env(svc))},
                   rw.healthcheck(compose_healthcheck(svc)), set(svc.get("depends_on") or {}))
            for name, svc in services.items()}
    for name, (_, env, health, _) in plan.items():       # the compose file really asks for mTLS
        assert env["SPECSPLIT_SECURITY_TLS_CLIENT_CA"] == str(certs / "ca.pem"), name
        assert "--tls-cert" in health, name
    prompt, n = [3, 14, 15, 9, 26, 5, 35, 8], 32
    ref_proc = subprocess.Popen([sys.executable, "-c", _REFERENCE, str(tiny_model_dir), rw.backend, json.dumps(prompt),
                                 str(n)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: dict[str, Child] = {}
    try:
        # Start in depends_on order; a dependent starts once its dependencies' health checks
        # pass (compose: condition service_healthy).
        healthy: set[str] = set()
        while len(healthy) < len(plan):
            wave = [s for s, (_, _, _, deps) in plan.items() if s not in healthy and deps <= healthy]
            assert wave, f"depends_on cycle among {set(plan) - healthy}"
            for s in wave:
                children[s] = Child(s, plan[s][0], plan[s][1])
            for s in wave:
                address = children[s].wait_listening(START_TIMEOUT_S)
                assert address == f"127.0.0.1:{rw.port(str(listen_port(services[s])))}", (s, address)
            for s in wave:
                _wait_healthy(plan[s][2], plan[s][1], s)
                healthy.add(s)

        orch_address = f"127.0.0.1:{rw.port(str(listen_port(services['orchestrator'])))}"
        tls = dict(tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "specsplit-client.pem"),
                   tls_key=str(certs / "specsplit-client.key"))
        with SpecsplitClient(orch_address, timeout=RPC_TIMEOUT_S, token="", **tls) as client:
            spec = client.generate_text(prompt, max_tokens=n, ignore_eos=True)
            target_only = client.generate_text(prompt, max_tokens=n, ignore_eos=True, k=0)
            status = client.status()
        out, err = ref_proc.communicate(timeout=START_TIMEOUT_S)
        assert ref_proc.returncode == 0, err[-2000:]
        reference = json.loads(out.strip().splitlines()[-1])
        assert len(reference) == n
        assert list(target_only.tokens) == reference
        assert list(spec.tokens) == reference, (spec.tokens, reference)
        assert spec.finish_reason == "length" and spec.drafted > 0, spec
        assert target_only.drafted == 0
        assert "draft" in status and "target" in status, status
        # One GPU: the target hosts the draft and its round loop calls it in process.
        assert status["orchestrator"].get("draft_in_process", False) == ("draft" not in services), status

        # Without TLS, or without a client certificate, nothing gets through.
        get_status = lambda ch: orchestrator_pb2_grpc.OrchestratorStub(ch).GetStatus(  # noqa: E731
            common_pb2.GetStatusRequest(), timeout=10)
        with grpc.insecure_channel(orch_address) as ch:
            assert _code(lambda: get_status(ch)) == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(orch_address, _creds(certs, None)) as ch:
            assert _code(lambda: get_status(ch)) == grpc.StatusCode.UNAVAILABLE

        # Admin RPCs: a client certificate alone is not enough; the env file's token or the
        # operators' certificate is. The reload runs through to both workers.
        token = plan["orchestrator"][1]["SPECSPLIT_SECURITY_ADMIN_TOKEN"]
        reload = lambda v: orchestrator_pb2.ReloadWeightsRequest(  # noqa: E731
            target_path=str(tiny_model_dir), version=v, mode=orchestrator_pb2.RELOAD_MODE_IN_PLACE,
            inflight=orchestrator_pb2.INFLIGHT_POLICY_WAIT)
        with grpc.secure_channel(orch_address, _creds(certs, "specsplit-client")) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            assert _code(lambda: list(stub.ReloadWeights(reload("v2"), timeout=RPC_TIMEOUT_S))) == \
                grpc.StatusCode.UNAUTHENTICATED
            events = list(stub.ReloadWeights(reload("v2"), timeout=RPC_TIMEOUT_S,
                                             metadata=(("authorization", f"Bearer {token}"),)))
            assert events and events[-1].done and events[-1].weights_version == "v2", events[-1:]
        with grpc.secure_channel(orch_address, _creds(certs, "specsplit-admin")) as ch:
            events = list(orchestrator_pb2_grpc.OrchestratorStub(ch).ReloadWeights(reload("v3"),
                                                                                  timeout=RPC_TIMEOUT_S))
            assert events and events[-1].done and events[-1].weights_version == "v3", events[-1:]
        with grpc.secure_channel(children.get("draft", children["target"]).address,
                                 _creds(certs, "specsplit-client")) as ch:
            assert _code(lambda: draft_pb2_grpc.DraftServiceStub(ch).ClearGraphs(
                common_pb2.ClearGraphsRequest(), timeout=RPC_TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
        with SpecsplitClient(orch_address, timeout=RPC_TIMEOUT_S, token="", **tls) as client:
            again = client.generate_text(prompt, max_tokens=n, ignore_eos=True)
        assert list(again.tokens) == reference and again.weights_version == "v3", again
    finally:
        for name in ("orchestrator", "draft", "target"):
            if name in children:
                children[name].stop()
        if ref_proc.poll() is None:
            ref_proc.kill()
            ref_proc.wait(5)
