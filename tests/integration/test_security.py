"""Security of the three services: TLS and mTLS everywhere, admin and generation tokens, admin
client certificates, checkpoint roots, message and tensor size limits, secrets kept out of logs.

Certificates are generated per module with ``cryptography`` (a test CA; server certificates
carry SAN localhost and 127.0.0.1). Servers run in this process, except the log-capture test,
which starts real service processes. Every stub call has a deadline.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient, SpecsplitError
from orchestrator.server import create_server
from core.config import ConfigError, SecurityConfig, ServerConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from core import wire
from core.auth import admin_metadata
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import draft_pb2 as dpb
from specsplit.v1 import draft_pb2_grpc
from specsplit.v1 import orchestrator_pb2 as opb
from specsplit.v1 import orchestrator_pb2_grpc
from specsplit.v1 import target_pb2 as tpb
from specsplit.v1 import target_pb2_grpc
from target_service.server import start as start_target
from tests.integration.hardening_utils import (REPO, Reference, child_env, make_certs, make_model, prompt_of,
                                               read_json_line, wait_until, worker_argv)

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
MAX_LEN, D = 256, 32
ADMIN, GEN = "admin-7f3c9e1d-token", "generate-52ab08c4-token"
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("sec_model") / "root" / "model", MAX_LEN)


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model, MAX_LEN)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"))


def worker_cfg(role: str, model: Path, security: SecurityConfig, **server) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version="v1", runtime=RuntimeConfig(backend="paddle"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=4, max_len=MAX_LEN),
                        graphs=GraphConfig(batch_buckets=(1, 4)),
                        server=ServerConfig(port=0, max_workers=8, **server), security=security)


def creds(certs, client: str | None = None) -> grpc.ChannelCredentials:
    read = lambda name: Path(certs[name]).read_bytes()  # noqa: E731
    if client is None:
        return grpc.ssl_channel_credentials(read("ca"))
    return grpc.ssl_channel_credentials(read("ca"), read(f"{client}.key"), read(f"{client}.pem"))


def code_of(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def generate(stub, md=None, prompt=None, n=12, **kw) -> list:
    req = opb.GenerateRequest(prompt_token_ids=prompt or prompt_of(1, 6), max_tokens=n, ignore_eos=True, **kw)
    return list(stub.Generate(req, timeout=TIMEOUT, metadata=md))


def tokens_of(responses) -> tuple[int, ...]:
    return tuple(t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids)


# --- TLS and mutual TLS on every service ----------------------------------------------------------------
@pytest.fixture(scope="module")
def mtls_stack(model, certs):
    """Workers and orchestrator all under mTLS; the orchestrator reaches the workers over mTLS with its
    own certificate, which the workers accept for admin RPCs (admin_client_cns) without any token."""
    wsec = SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca"],
                          admin_token=ADMIN, generate_token=GEN, admin_client_cns=("orchestrator",),
                          checkpoint_roots=(str(model.parent),))
    target, draft = start_target(worker_cfg("target", model, wsec)), start_draft(worker_cfg("draft", model, wsec))
    osec = SecurityConfig(tls_cert=certs["orchestrator.pem"], tls_key=certs["orchestrator.key"],
                          tls_client_ca=certs["ca"], admin_token=ADMIN, generate_token=GEN, admin_client_cns=("admin",))
    cfg = OrchestratorConfig(draft_address=f"127.0.0.1:{draft.port}", target_address=f"127.0.0.1:{target.port}",
                             tls_ca=certs["ca"], max_tokens_limit=64, server=ServerConfig(port=0), security=osec)
    orch, port = create_server(cfg)
    yield {"orch": port, "target": target.port, "draft": draft.port}
    orch.stop(0).wait(5)
    target.stop(grace=None)
    draft.stop(grace=None)


def test_mtls_everywhere_generation_is_exact_and_speculates(mtls_stack, certs, reference):
    with grpc.secure_channel(f"127.0.0.1:{mtls_stack['orch']}", creds(certs, "client")) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        out = generate(stub, admin_metadata(GEN), n=40, k=3)
        assert tokens_of(out) == reference(prompt_of(1, 6), 40)
        assert out[-1].final.stats.drafted > 0                # the orchestrator -> draft mTLS link works
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
        assert status.orchestrator.speculation_available and not status.target_error and not status.draft_error
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # The Python client and the CLI speak mTLS too.
    address = f"127.0.0.1:{mtls_stack['orch']}"
    with SpecsplitClient(address, timeout=TIMEOUT, tls_ca=certs["ca"], token=GEN, tls_cert=certs["client.pem"],
                         tls_key=certs["client.key"]) as client:
        assert client.generate_text(prompt_of(2, 5), 20, k=3, ignore_eos=True).tokens == reference(prompt_of(2, 5), 20)
    from specsplit.cli import main as cli_main
    tls = ["--tls-ca", certs["ca"], "--tls-cert", certs["client.pem"], "--tls-key", certs["client.key"]]
    for port in mtls_stack.values():
        assert cli_main(["healthcheck", f"127.0.0.1:{port}", *tls]) == 0


@pytest.mark.parametrize("service", ["orch", "target", "draft"])
def test_every_service_refuses_plaintext_missing_and_untrusted_client_certificates(mtls_stack, certs, service):
    address = f"127.0.0.1:{mtls_stack[service]}"

    def check(channel: grpc.Channel) -> grpc.StatusCode | None:
        with channel:
            return code_of(lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                             timeout=5))
    assert check(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert check(grpc.secure_channel(address, creds(certs))) == grpc.StatusCode.UNAVAILABLE     # no client cert
    assert check(grpc.secure_channel(address, creds(certs, "rogue"))) == grpc.StatusCode.UNAVAILABLE  # self-signed
    assert check(grpc.secure_channel(address, creds(certs, "client"))) is None


def test_generate_needs_a_token_when_a_generation_token_is_set(mtls_stack, certs):
    with grpc.secure_channel(f"127.0.0.1:{mtls_stack['orch']}", creds(certs, "client")) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        assert code_of(lambda: generate(stub)) == UNAUTH
        assert code_of(lambda: generate(stub, admin_metadata("guess"))) == UNAUTH
        assert code_of(lambda: generate(stub, (("authorization", GEN),))) == UNAUTH     # no "Bearer "
        assert code_of(lambda: generate(stub, admin_metadata(ADMIN))) is None           # admin may generate
        assert code_of(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)) is None   # status is open
    with grpc.secure_channel(f"127.0.0.1:{mtls_stack['orch']}", creds(certs, "admin")) as ch:
        assert code_of(lambda: generate(orchestrator_pb2_grpc.OrchestratorStub(ch))) is None  # admin certificate


def test_admin_rpcs_need_the_admin_token_or_an_admin_certificate(mtls_stack, certs, model):
    bad_reload = opb.ReloadWeightsRequest(target_path="/nonexistent", version="v9",
                                          mode=opb.RELOAD_MODE_RECAPTURE, inflight=opb.INFLIGHT_POLICY_WAIT)

    def reload(stub, md):
        return list(stub.ReloadWeights(bad_reload, timeout=TIMEOUT, metadata=md))

    def push(stub, md):
        return stub.PushWeights(iter([opb.PushWeightsRequest(commit=opb.PushWeightsCommit())]), timeout=TIMEOUT,
                                metadata=md)

    with grpc.secure_channel(f"127.0.0.1:{mtls_stack['orch']}", creds(certs, "client")) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        for rpc in (reload, push):
            assert code_of(lambda: rpc(stub, None)) == UNAUTH
            assert code_of(lambda: rpc(stub, admin_metadata("guess"))) == UNAUTH
            assert code_of(lambda: rpc(stub, admin_metadata(GEN))) == DENIED
            assert code_of(lambda: rpc(stub, admin_metadata(ADMIN))) not in (UNAUTH, DENIED, None)  # auth passed
    with grpc.secure_channel(f"127.0.0.1:{mtls_stack['orch']}", creds(certs, "admin")) as ch:
        code = code_of(lambda: reload(orchestrator_pb2_grpc.OrchestratorStub(ch), None))
        assert code not in (UNAUTH, DENIED, None), code                      # the handler refused the path

    for role in ("target", "draft"):
        address = f"127.0.0.1:{mtls_stack[role]}"
        stub_cls = target_pb2_grpc.TargetServiceStub if role == "target" else draft_pb2_grpc.DraftServiceStub
        calls = {"CaptureGraphs": pb.CaptureGraphsRequest(), "ClearGraphs": pb.ClearGraphsRequest(),
                 "ReleaseWeights": pb.ReleaseWeightsRequest(),
                 "LoadWeights": pb.LoadWeightsRequest(target_path=str(model), validate_only=True)}
        with grpc.secure_channel(address, creds(certs, "client")) as ch:
            stub = stub_cls(ch)
            for name, req in calls.items():
                rpc = getattr(stub, name)
                assert code_of(lambda: rpc(req, timeout=TIMEOUT)) == UNAUTH, name
                assert code_of(lambda: rpc(req, timeout=TIMEOUT, metadata=admin_metadata("guess"))) == UNAUTH, name
                assert code_of(lambda: rpc(req, timeout=TIMEOUT, metadata=admin_metadata(GEN))) == DENIED, name
            assert code_of(lambda: stub.LoadWeights(calls["LoadWeights"], timeout=TIMEOUT,
                                                    metadata=admin_metadata(ADMIN))) is None
        with grpc.secure_channel(address, creds(certs, "orchestrator")) as ch:   # an admin CN, no token
            stub = stub_cls(ch)
            assert stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT).status.state == \
                pb.LIFECYCLE_STATE_READY
            assert stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT).status.state == pb.LIFECYCLE_STATE_LOADED


def test_config_refuses_unsafe_combinations():
    with pytest.raises(ConfigError, match="admin_client_cns"):
        SecurityConfig(admin_client_cns=("admin",))                         # a CN means nothing without mTLS
    with pytest.raises(ConfigError, match="generate_token"):
        SecurityConfig(admin_token="same", generate_token="same")
    with pytest.raises(ConfigError, match="max_tensor_bytes"):
        SecurityConfig(max_tensor_bytes=0)


# --- checkpoint roots ------------------------------------------------------------------------------------
def test_load_weights_paths_must_resolve_under_the_roots(model, tmp_path):
    """``..``, absolute paths, directory and file symlinks out of the root are refused; a path that
    wanders but ends inside is fine."""
    root = model.parent
    outside = make_model(tmp_path / "outside", MAX_LEN, seed=3)
    for link, to in ((root / "link-out", outside), (root / "mtp-out.safetensors", outside / "mtp.safetensors")):
        if not link.is_symlink():
            link.symlink_to(to)
    sec = SecurityConfig(admin_token=ADMIN, checkpoint_roots=(str(root),))
    t, d = start_target(worker_cfg("target", model, sec)), start_draft(worker_cfg("draft", model, sec))
    md = admin_metadata(ADMIN)
    try:
        for port, stub_cls in ((t.port, target_pb2_grpc.TargetServiceStub), (d.port, draft_pb2_grpc.DraftServiceStub)):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = stub_cls(ch)

                def load(path: str, draft_path: str = "") -> tuple[grpc.StatusCode | None, str]:
                    try:
                        stub.LoadWeights(pb.LoadWeightsRequest(target_path=path, draft_path=draft_path,
                                                               validate_only=True), timeout=TIMEOUT, metadata=md)
                        return None, ""
                    except grpc.RpcError as exc:
                        return exc.code(), exc.details()

                for bad in (str(outside), str(root / ".." / ".." / "outside"), str(root / "link-out"),
                            str(root / "model" / ".." / ".."), "/", "/etc"):
                    code, details = load(bad)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the allowed" in details, (bad, details)
                assert load("model\x00")[0] == grpc.StatusCode.INVALID_ARGUMENT
                assert load(str(root / "model" / ".." / "model"))[0] is None               # ends inside
                if stub_cls is draft_pb2_grpc.DraftServiceStub:                           # the MTP file too
                    code, details = load(str(model), str(root / "mtp-out.safetensors"))
                    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the allowed" in details
                    assert load(str(model), str(outside / "mtp.safetensors"))[0] == grpc.StatusCode.INVALID_ARGUMENT
                status = stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT).status
                assert status.weights_version == "v1" and status.state == pb.LIFECYCLE_STATE_LOADED
    finally:
        t.stop(grace=None)
        d.stop(grace=None)


# --- size limits ----------------------------------------------------------------------------------------------
def test_message_and_tensor_size_limits(model):
    sec = SecurityConfig(max_tensor_bytes=4096)
    t = start_target(worker_cfg("target", model, sec, max_message_bytes=64 * 1024))
    d = start_draft(worker_cfg("draft", model, sec, max_message_bytes=64 * 1024))
    orch, port = create_server(OrchestratorConfig(draft_address=f"127.0.0.1:{d.port}",
                                                  target_address=f"127.0.0.1:{t.port}",
                                                  server=ServerConfig(port=0, max_message_bytes=64 * 1024)))
    try:
        with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as client:
            with pytest.raises(SpecsplitError) as info:
                client.generate_text("x" * 70_000, 4)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert client.generate_text("still serving", 4).finish_reason == "length"
        with grpc.insecure_channel(f"127.0.0.1:{t.port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            big = tpb.TargetPrefillRequest(items=[tpb.TargetPrefillItem(request_id="big", prompt=[1] * 70_000)])
            assert code_of(lambda: stub.Prefill(big, timeout=TIMEOUT)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            stub.Prefill(tpb.TargetPrefillRequest(items=[tpb.TargetPrefillItem(request_id="r", prompt=[1, 2])]),
                         timeout=TIMEOUT)
            probs = wire.encode_tensor(np.full((3, 258), 1 / 258, np.float32))          # 3096 bytes: allowed
            (ok,) = list(stub.Verify(iter([tpb.VerifyRequest(round=1, items=[
                tpb.VerifyItem(request_id="r", drafts=[1, 2, 3], draft_probs=probs)])]), timeout=TIMEOUT))
            assert ok.results[0].HasField("output")
            huge = wire.encode_tensor(np.full((4, 258), 1 / 258, np.float32))           # 4128 bytes: over
            (resp,) = list(stub.Verify(iter([tpb.VerifyRequest(round=2, items=[
                tpb.VerifyItem(request_id="r", drafts=[1, 2, 3, 4], draft_probs=huge)])]), timeout=TIMEOUT))
            err = resp.results[0].error
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "max_tensor_bytes=4096" in err.message
        with grpc.insecure_channel(f"127.0.0.1:{d.port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            hidden = wire.encode_tensor(np.ones((40, D), np.float32))                   # 5120 bytes: over
            res = stub.Prefill(dpb.DraftPrefillRequest(items=[dpb.DraftPrefillItem(
                request_id="h", tokens=[1] * 40, hidden=hidden)]), timeout=TIMEOUT).results[0]
            assert res.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "items[0].hidden" in res.error.message and "max_tensor_bytes" in res.error.message
    finally:
        orch.stop(0).wait(5)
        t.stop(grace=None)
        d.stop(grace=None)


# --- secrets never logged --------------------------------------------------------------------------------------
def _service(argv: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    out = log.open("w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out, env=env, text=True, cwd=REPO)
    line = read_json_line(proc.stdout, 60)
    assert line.get("event") == "listening", line
    return proc, line["address"]


def test_tokens_never_appear_in_logs(model, tmp_path):
    """Services started with tokens (flags and env), DEBUG logging, then right and wrong tokens
    are sent: no log line of any service contains any token string."""
    wrong = "wrong-guess-3e8d1a77"
    env = child_env(SPECSPLIT_SECURITY_ADMIN_TOKEN=ADMIN, SPECSPLIT_SECURITY_GENERATE_TOKEN=GEN)
    logs = {name: tmp_path / f"{name}.log" for name in ("target", "draft", "orchestrator")}
    procs = []
    try:
        def debug(argv: list[str]) -> list[str]:
            return [argv[0], "-m", "specsplit", "--log-level", "DEBUG", *argv[5:]]
        target, t_addr = _service(debug(worker_argv("target", model, max_len=MAX_LEN)), env, logs["target"])
        procs.append(target)
        draft, d_addr = _service(debug(worker_argv("draft", model, max_len=MAX_LEN)) +
                                 ["--security-admin-token", ADMIN], env, logs["draft"])
        procs.append(draft)
        orch, o_addr = _service([sys.executable, "-m", "specsplit", "--log-level", "DEBUG", "orchestrator",
                                 "--target-address", t_addr, "--draft-address", d_addr, "--server-port", "0",
                                 "--worker-admin-token", ADMIN], env, logs["orchestrator"])
        procs.append(orch)
        with grpc.insecure_channel(o_addr) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            wait_until(lambda: code_of(lambda: generate(stub, admin_metadata(GEN))) is None, "a generation")
            for md in (None, admin_metadata(wrong), admin_metadata(GEN)):
                code_of(lambda: list(stub.ReloadWeights(opb.ReloadWeightsRequest(target_path="/x", version="v2"),
                                                        timeout=TIMEOUT, metadata=md)))
            code_of(lambda: generate(stub, admin_metadata(wrong)))
        for address in (t_addr, d_addr):
            with grpc.insecure_channel(address) as ch:
                stub = target_pb2_grpc.TargetServiceStub(ch)
                for md in (admin_metadata(wrong), admin_metadata(GEN), admin_metadata(ADMIN)):
                    code_of(lambda: stub.LoadWeights(pb.LoadWeightsRequest(target_path="/nope"), timeout=TIMEOUT,
                                                     metadata=md))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    for name, path in logs.items():
        text = path.read_text() + ""
        assert len(text.splitlines()) > 3, f"{name} logged almost nothing: {text[:200]}"
        for secret in (ADMIN, GEN, wrong):
            assert secret not in text, f"{name} logged a token"
        assert "***" in text                                   # the config was logged, redacted
    for p in procs:
        assert p.stdout is not None
        rest = p.stdout.read()
        for secret in (ADMIN, GEN, wrong):
            assert secret not in rest
