"""Secure by default (issue 13) and the start-up behaviour of issue 16 (items 4 and 5).

- Admin RPCs are never open: a service with no admin token generates one, writes it to a
  0600 file (the Jupyter pattern) and the CLI finds it; ``specsplit up`` refuses an admin
  RPC without the token while ``specsplit reload`` succeeds with the token file alone.
- Plaintext on a non-loopback address is refused (one line, exit 2) unless ``--allow-insecure``,
  which warns at every start.
- Every admin RPC, allowed or refused, is one audit line and a counter increment.
- Reflection answers under grpc.reflection.v1 and v1alpha.
- One admin-token setting serves the orchestrator and its calls to the workers.
- Every start-up failure is ``specsplit: <what>: <why>`` with exit 2 and no traceback (unless
  ``--log-level debug``); client-side TLS mismatches say so; output to a closed pipe ends quietly.

Services run in this process where the test looks inside, as real processes where the test is
about the command line. Every stub call has a deadline; waits are bounded polls.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import structlog
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient
from orchestrator.server import create_server
from core.config import SecurityConfig, ServerConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from core.admin_token import default_token_path, fingerprint, process_token
from core.auth import admin_metadata
from core.reflection import V1
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import draft_pb2_grpc, orchestrator_pb2 as opb, orchestrator_pb2_grpc
from target_service.server import start as start_target
from tests.integration.hardening_utils import REPO, child_env, make_certs, make_model, read_json_line, wait_until

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
MAX_LEN = 256
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("secdef_model") / "model", MAX_LEN)


def wcfg(role: str, model: Path, security: SecurityConfig = SecurityConfig(), **server) -> WorkerConfig:
    server = {"port": 0, **server}
    return WorkerConfig(role=role, target_path=str(model), weights_version="v1", runtime=RuntimeConfig(backend="paddle"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=4, max_len=MAX_LEN),
                        graphs=GraphConfig(batch_buckets=(1, 4)), server=ServerConfig(max_workers=8, **server),
                        security=security)


def code_of(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def run_cli(args: list[str], env: dict[str, str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specsplit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def plain_lines(stderr: str) -> list[str]:
    """stderr without the JSON log lines."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.lstrip().startswith("{")]


# --- the generated admin token, in process --------------------------------------------------------


def test_a_service_without_credentials_generates_a_token_file_and_audits_admin_calls(model, tmp_path):
    """No admin token configured: admin RPCs are refused without the generated token, which is in
    a 0600 file at the configured path; each call is an audit line and a counter increment."""
    path = tmp_path / "tok" / "draft.token"
    svc = start_draft(wcfg("draft", model, SecurityConfig(admin_token_file=str(path))))
    try:
        assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert token == process_token() and len(token) >= 32
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch, structlog.testing.capture_logs() as logs:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            assert code_of(lambda: stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT)) == UNAUTH
            assert code_of(lambda: stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT,
                                                    metadata=admin_metadata("wrong"))) == UNAUTH
            stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT, metadata=admin_metadata(token))
            assert code_of(lambda: stub.LoadWeights(pb.LoadWeightsRequest(target_path="/nope", version="v9"),
                                                    timeout=TIMEOUT, metadata=admin_metadata(token))) \
                == grpc.StatusCode.FAILED_PRECONDITION                        # loaded already: refused
            stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)            # not an admin RPC: no audit line
        audit = [e for e in logs if e["event"] == "admin_rpc"]
        assert [(e["method"], e["outcome"], e["authorized"]) for e in audit] == [
            ("ClearGraphs", "UNAUTHENTICATED", False), ("ClearGraphs", "UNAUTHENTICATED", False),
            ("ClearGraphs", "OK", True), ("LoadWeights", "FAILED_PRECONDITION", True)]
        assert audit[0]["token"] is None and audit[1]["token"] == fingerprint("wrong")
        assert audit[2]["token"] == fingerprint(token) and token not in json.dumps(audit)
        assert audit[3]["version"] == "v9" and audit[3]["target_path"] == "/nope"
        assert all(e["peer"].startswith(("ipv4:127.0.0.1", "ipv6:")) for e in audit)
        from prometheus_client import REGISTRY

        def count(method: str, outcome: str) -> float:
            return REGISTRY.get_sample_value("specsplit_admin_rpcs_total", {"method": method, "outcome": outcome}) or 0
        assert count("ClearGraphs", "OK") >= 1 and count("ClearGraphs", "UNAUTHENTICATED") >= 2
    finally:
        svc.stop(grace=None)
    assert not path.exists()                    # the file goes with the service that wrote it


def test_reflection_answers_under_v1_and_v1alpha(model):
    svc = start_target(wcfg("target", model))
    try:
        v1_req = message_factory.GetMessageClass(
            descriptor_pool.Default().FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
        v1_resp = message_factory.GetMessageClass(
            descriptor_pool.Default().FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            for service, req_cls, resp_cls in ((V1, v1_req, v1_resp), (
                    "grpc.reflection.v1alpha.ServerReflection", reflection_pb2.ServerReflectionRequest,
                    reflection_pb2.ServerReflectionResponse)):
                call = ch.stream_stream(f"/{service}/ServerReflectionInfo", request_serializer=req_cls.SerializeToString,
                                        response_deserializer=resp_cls.FromString)
                (listed,) = list(call(iter([req_cls(list_services="")]), timeout=TIMEOUT))
                names = {s.name for s in listed.list_services_response.service}
                assert {"specsplit.v1.TargetService", "grpc.health.v1.Health", V1,
                        "grpc.reflection.v1alpha.ServerReflection"} <= names, (service, names)
                (described,) = list(call(iter([req_cls(file_containing_symbol=V1)]), timeout=TIMEOUT))
                assert described.file_descriptor_response.file_descriptor_proto, service
    finally:
        svc.stop(grace=None)


def test_one_admin_token_setting_serves_the_orchestrator_and_its_workers(model):
    """Issue 16 item 4: the orchestrator's own admin token is also what it presents to the workers."""
    token = "one-setting-3f9c1e"
    sec = SecurityConfig(admin_token=token)
    # The target's port was served a moment ago by a target of this process with the generated
    # token (what CI's port reuse did by chance in stop 22): that one's token must not be sent.
    earlier = start_target(wcfg("target", model))
    reused = earlier.port
    earlier.stop(grace=None)
    target = start_target(wcfg("target", model, sec, port=reused))
    draft = start_draft(wcfg("draft", model, sec))
    orch, port = create_server(OrchestratorConfig(
        draft_address=f"127.0.0.1:{draft.port}", target_address=f"127.0.0.1:{target.port}", max_batch=4,
        worker_timeout_s=TIMEOUT, reload_call_timeout_s=TIMEOUT, server=ServerConfig(port=0), security=sec))
    try:
        assert orch.core.cfg.worker_admin_token is None
        with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT, token=token) as client:
            events = client.reload(str(model), "v2", mode="in_place")
            assert events[-1].done and events[-1].weights_version == "v2"
            assert client.status()["target"]["weights_version"] == "v2"
    finally:
        orch.stop(0).wait(5)
        target.stop(grace=None)
        draft.stop(grace=None)


# --- specsplit up, the CLI and the token file ---------------------------------------------------------


def test_fresh_up_refuses_admin_without_token_and_cli_reload_uses_the_token_file(model, tmp_path):
    env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path / "runtime"))
    env.pop("SPECSPLIT_SECURITY_ADMIN_TOKEN", None)
    env.pop("SPECSPLIT_TOKEN", None)
    up = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "up", "--model", str(model),
                           "--backend", "paddle", "--metrics", "--port", "0"], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = read_json_line(up.stdout, timeout=180)
        address = info["orchestrator"]
        token_file = Path(info["admin_token_file"])
        assert token_file == default_token_path(int(address.rsplit(":", 1)[1]), env)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        reload = opb.ReloadWeightsRequest(target_path=str(model), version="v2", mode=opb.RELOAD_MODE_IN_PLACE,
                                          inflight=opb.INFLIGHT_POLICY_WAIT)
        with grpc.insecure_channel(address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            assert code_of(lambda: list(stub.ReloadWeights(reload, timeout=TIMEOUT))) == UNAUTH
        with grpc.insecure_channel(info["draft"]) as ch:
            assert code_of(lambda: draft_pb2_grpc.DraftServiceStub(ch).ClearGraphs(
                pb.ClearGraphsRequest(), timeout=TIMEOUT)) == UNAUTH
        # The CLI with nothing but the token file (found by the address), through to both workers.
        res = run_cli(["reload", str(model), "--version", "v2", "--mode", "in_place", "--address", address, "--json"],
                      env)
        assert res.returncode == 0, res.stderr
        events = [json.loads(ln) for ln in res.stdout.splitlines()]
        assert events[-1]["done"] and events[-1]["weights_version"] == "v2", events[-1]
        status = run_cli(["status", "--json", "--address", address], env)
        assert json.loads(status.stdout)["draft"]["weights_version"] == "v2"
        # The audit counter of the orchestrator saw the refusal and the success.
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_ports']['orchestrator']}/metrics",
                                         timeout=TIMEOUT).read().decode()
        assert 'specsplit_admin_rpcs_total{method="ReloadWeights",outcome="UNAUTHENTICATED"} 1.0' in metrics
        assert 'specsplit_admin_rpcs_total{method="ReloadWeights",outcome="OK"} 1.0' in metrics
    finally:
        up.terminate()
        up.wait(60)
    assert "admin_rpc" in up.stderr.read()          # the refused call is a warning-level audit line


def test_up_accepts_one_admin_token(model, tmp_path):
    """``specsplit up --admin-token T``: T guards the orchestrator and the workers, and the
    orchestrator presents it to the workers (a reload reaches both)."""
    env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path / "runtime"))
    token = "up-token-5be1c0a7"
    up = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "up", "--model", str(model),
                           "--backend", "paddle", "--admin-token", token, "--port", "0"], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = read_json_line(up.stdout, timeout=180)
        with grpc.insecure_channel(info["target"]) as ch:
            from specsplit.v1 import target_pb2_grpc
            stub = target_pb2_grpc.TargetServiceStub(ch)
            stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT, metadata=admin_metadata(token))
        res = run_cli(["reload", str(model), "--version", "v3", "--mode", "in_place", "--address",
                       info["orchestrator"], "--token", token, "--token-file", "/nonexistent"], env)
        assert res.returncode == 0, res.stderr
    finally:
        up.terminate()
        up.wait(60)


# --- bind policy and one-line start-up errors --------------------------------------------------------


def test_non_loopback_plaintext_bind_is_refused_in_one_line(tmp_path):
    env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path))
    for role in ("draft", "orchestrator"):
        args = [role, "--server-host", "0.0.0.0", "--server-port", "0"]
        if role == "orchestrator":
            args += ["--target-address", "127.0.0.1:9"]
        res = run_cli(args, env)
        assert res.returncode == 2, res
        (line,) = plain_lines(res.stderr)
        assert line.startswith("specsplit: insecure bind: ") and "--allow-insecure" in line, line
        assert "Traceback" not in res.stderr


def test_allow_insecure_starts_and_warns(tmp_path):
    env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "draft", "--server-host",
                             "0.0.0.0", "--server-port", "0", "--allow-insecure"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening = read_json_line(proc.stdout, timeout=120)
        assert listening["event"] == "listening"
        assert Path(listening["admin_token_file"]).exists()
    finally:
        proc.terminate()
        proc.wait(30)
    events = [json.loads(ln)["event"] for ln in proc.stderr.read().splitlines() if ln.startswith("{")]
    assert "insecure_bind" in events and "admin_token_generated" in events


def _startup_failures(model: Path, tmp_path: Path) -> dict[str, tuple[list[str], str, dict[str, str]]]:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    fake = tmp_path / "nobackend"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    certs = make_certs(tmp_path / "certs", names=("server",), rogue=False)
    _startup_failures.busy = busy  # type: ignore[attr-defined] - kept open for the test's duration
    return {
        "missing TLS key": (["target", "--security-tls-cert", certs["server.pem"], "--security-tls-key",
                             str(tmp_path / "missing.key")], "specsplit: TLS material: ", {}),
        "port in use": (["draft", "--server-port", str(busy.getsockname()[1])], "specsplit: port: ", {}),
        "roots exclude the model": (["target", "--target-path", str(model), "--security-checkpoint-roots",
                                     str(tmp_path / "elsewhere")], "specsplit: start-up weights: ", {}),
        "backend not installed": (["draft", "--runtime-backend", "torch"], "specsplit: backend: torch is not installed",
                                  {"PYTHONPATH": f"{fake}{os.pathsep}{REPO}"}),
        "bad config value": (["draft", "--cache-max-slots", "0"], "specsplit: configuration error: ", {}),
        "orchestrator CA missing": (["orchestrator", "--target-address", "127.0.0.1:9", "--tls-ca",
                                     str(tmp_path / "nope.pem")], "specsplit: file: ", {}),
        # `up` reports its child's one line, naming the child (and the child's own line is not repeated).
        "up with a missing model": (["up", "--model", str(tmp_path / "no-model"), "--port", "0"],
                                    "specsplit: up: target: start-up weights: ", {}),
        "up on a public host in plaintext": (["up", "--model", str(model), "--host", "0.0.0.0", "--port", "0"],
                                             "specsplit: up: orchestrator: insecure bind: ", {}),
    }


def test_every_startup_failure_is_one_line_exit_2(model, tmp_path):
    cases = _startup_failures(model, tmp_path)
    try:
        for name, (args, prefix, extra) in cases.items():
            env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path / "rt"), **extra)
            res = run_cli(args, env)
            lines = plain_lines(res.stderr)
            assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(prefix), (name, res.returncode,
                                                                                             res.stderr[-3000:])
            assert "Traceback" not in res.stderr, name
        # --log-level debug shows the traceback too, and still ends with the one line.
        args, prefix, extra = cases["missing TLS key"]
        res = run_cli(["--log-level", "debug", *args], child_env(**extra))
        assert res.returncode == 2 and "Traceback" in res.stderr and plain_lines(res.stderr)[-1].startswith(prefix)
    finally:
        _startup_failures.busy.close()  # type: ignore[attr-defined]


# --- client side: TLS mismatches and closed pipes ------------------------------------------------------------


def test_client_tls_mismatch_is_named(model, tmp_path):
    certs = make_certs(tmp_path / "certs", names=("server", "client"), rogue=False)
    tls = start_target(wcfg("target", model, SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"])))
    mtls = start_target(wcfg("target", model, SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"],
                                                             tls_client_ca=certs["ca"])))
    plain = start_target(wcfg("target", model))
    env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path / "rt"))
    try:
        cases = [
            ([f"127.0.0.1:{tls.port}"], "speaks TLS and this client does not"),
            ([f"127.0.0.1:{plain.port}", "--tls-ca", certs["ca"]], "does not speak TLS"),
            ([f"127.0.0.1:{mtls.port}", "--tls-ca", certs["ca"]], "requires a client certificate"),
        ]
        for args, says in cases:
            res = run_cli(["healthcheck", *args, "--service", ""], env, timeout=60)
            assert res.returncode == 1 and "TLS mismatch" in res.stderr and says in res.stderr, (args, res.stderr)
        ok = run_cli(["healthcheck", f"127.0.0.1:{mtls.port}", "--tls-ca", certs["ca"], "--tls-cert",
                      certs["client.pem"], "--tls-key", certs["client.key"]], env, timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
        # The orchestrator client commands say it too.
        res = run_cli(["status", "--address", f"127.0.0.1:{tls.port}", "--timeout", "5"], env, timeout=60)
        assert res.returncode == 1 and "TLS mismatch" in res.stderr and "Traceback" not in res.stderr, res.stderr
    finally:
        for svc in (tls, mtls, plain):
            svc.stop(grace=None)


def test_output_to_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "config-reference"], cwd=REPO, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                               # the reader is gone before anything is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err[-2000:]


def test_audit_lines_of_a_fresh_service_process_never_carry_the_token(tmp_path):
    """The generated token is written to the file and nowhere else (stdout, stderr)."""
    env = child_env(SPECSPLIT_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "DEBUG", "draft"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening = read_json_line(proc.stdout, timeout=120)
        token = wait_until(lambda: Path(listening["admin_token_file"]).read_text().strip(), "the token file")
        with grpc.insecure_channel(listening["address"]) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT, metadata=admin_metadata(token))
            assert code_of(lambda: stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT)) == UNAUTH
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert token not in out and token not in err
    audit = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{") and '"admin_rpc"' in ln]
    assert [(a["outcome"], a["token"]) for a in audit] == [("OK", fingerprint(token)), ("UNAUTHENTICATED", None)]
