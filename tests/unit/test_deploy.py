"""The deployment files stay valid and runnable: they cannot rot silently.

Checked here (each check fails when the file it guards goes wrong):

1. Debian's docker-compose (v1, 1.29) accepts ``deploy/docker-compose.yml`` and
   ``deploy/docker-compose.one-gpu.yml`` (``config -q``), and rejects a Compose-v2-only key
   (the validator is real).
2. ``kubernetes-validate --strict`` accepts every manifest in ``deploy/k8s``
   against the oldest Kubernetes with GA gRPC probes (1.27) and the newest
   schema the package bundles (1.37); it works offline from bundled schemas.
3. Every ``specsplit`` command line (compose commands and health checks,
   Kubernetes command/args and exec probes, the Dockerfiles' ENTRYPOINT and
   HEALTHCHECK) parses with the real CLI (``specsplit.cli.build_parser()``),
   every flag exists on its subcommand exactly (no prefix abbreviations),
   the service configurations build (values valid), every ``SPECSPLIT_*``
   variable is a real config option or one of the documented extras, and the
   addresses and ports that the files repeat agree with each other.
4. (slow, tests/integration/test_compose_mtls.py) The three services run with
   exactly the compose file's arguments and environment over mutual TLS with
   certificates from ``deploy/make-certs.sh``.
5. ``docs/configuration.md`` is the output of ``specsplit config-reference``.

Compose ``${VAR:-default}`` references are resolved to their defaults (not to
this machine's environment), so the checks are the same everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from orchestrator.config import OrchestratorConfig
from worker.config import WorkerConfig
from core import config_loader
from specsplit import cli
from tests.deploy_files import (COMPOSE_FILE, COMPOSE_FILES, DEPLOY, K8S_DIR, ONE_GPU_COMPOSE_FILE, REPO,
                                SERVICE_CLASSES, build_config, check_cli, check_env_names, compose_argv,
                                compose_env_files, compose_healthcheck, compose_service_env, dockerfile_entrypoint,
                                dockerfile_env, dockerfile_healthcheck,
                                dockerfile_instructions, env_names, host_port, interpolate, k8s_docs, k8s_find,
                                load_compose, read_env_file, toml_keys)

ENV_EXAMPLE = DEPLOY / "specsplit.env.example"
DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu")
INSTALL_TOOLS = REPO / "scripts" / "install_test_tools.sh"
CONFIG_DOC = REPO / "docs" / "configuration.md"

K8S_VERSIONS = ("1.27.0", "1.37.0")   # GA gRPC probes .. newest bundled schema
INSTALL_TIMEOUT_S = 300
TOOL_TIMEOUT_S = 120
START_TIMEOUT_S = 120.0               # each service's "listening" line
HEALTHY_TIMEOUT_S = 60.0              # health checks passing after listening
RPC_TIMEOUT_S = 60.0                  # deadline of every call in the tests


# --- 1. docker-compose ----------------------------------------------------------------------


def _compose_env() -> dict[str, str]:
    """This machine's environment minus variables that would change the compose file's meaning."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SPECSPLIT_", "COMPOSE_"))}


@pytest.fixture(scope="session")
def docker_compose() -> str:
    """Debian's docker-compose (v1); installed by scripts/install_test_tools.sh when root.
    Missing: the test fails under CI (CI is set) and is skipped elsewhere."""
    exe, why = shutil.which("docker-compose"), "docker-compose is not on PATH"
    if exe is None and not (hasattr(os, "geteuid") and os.geteuid() == 0):
        why += f"; not root, so {INSTALL_TOOLS.relative_to(REPO)} cannot install it (run it as root)"
    elif exe is None:
        try:
            proc = subprocess.run([shutil.which("bash") or "/bin/bash", str(INSTALL_TOOLS)], capture_output=True,
                                  text=True, timeout=INSTALL_TIMEOUT_S)
            why += f"; {INSTALL_TOOLS.name} exited {proc.returncode}: {proc.stderr.strip()[-400:]}"
        except subprocess.TimeoutExpired:
            why += f"; {INSTALL_TOOLS.name} did not finish within {INSTALL_TIMEOUT_S}s"
        except OSError as exc:
            why += f"; cannot run {INSTALL_TOOLS.name}: {exc}"
        exe = shutil.which("docker-compose")
    if exe is not None:
        version = subprocess.run([exe, "version", "--short"], capture_output=True, text=True,
                                 timeout=TOOL_TIMEOUT_S).stdout.strip()
        if version.startswith("1."):
            return exe
        exe, why = None, f"docker-compose {version!r} is not v1 (Debian's 1.29), which this file must suit"
    if os.environ.get("CI"):
        pytest.fail(f"cannot validate deploy/docker-compose.yml: {why}")
    pytest.skip(f"cannot validate deploy/docker-compose.yml: {why}")


@pytest.mark.parametrize("compose_file", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_v1_accepts_the_compose_file(docker_compose, compose_file):
    proc = subprocess.run([docker_compose, "-f", str(compose_file), "config", "-q"], cwd=REPO, env=_compose_env(),
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert proc.returncode == 0, f"docker-compose config -q failed:\n{proc.stdout}{proc.stderr}"
    resolved = subprocess.run([docker_compose, "-f", str(compose_file), "config"], cwd=REPO, env=_compose_env(),
                              capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=True)
    services = yaml.safe_load(resolved.stdout)["services"]
    # The admin token reaches every service from the env file.
    for name, svc in services.items():
        assert svc["environment"].get("SPECSPLIT_SECURITY_ADMIN_TOKEN"), f"{name}: no admin token from env_file"


def test_docker_compose_v1_rejects_keys_it_does_not_know(docker_compose, tmp_path):
    """Control: the validator really checks keys (``develop`` exists only in Compose v2)."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    shutil.copy(ENV_EXAMPLE, deploy / ENV_EXAMPLE.name)
    text = COMPOSE_FILE.read_text()
    assert "\n  orchestrator:\n" in text
    (deploy / "docker-compose.yml").write_text(text.replace("\n  orchestrator:\n", "\n  orchestrator:\n    develop: {}\n"))
    proc = subprocess.run([docker_compose, "-f", str(deploy / "docker-compose.yml"), "config", "-q"], cwd=tmp_path,
                          env=_compose_env(), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert proc.returncode != 0 and "develop" in proc.stderr, proc.stderr


def test_compose_layout():
    """Draft on GPU 0, target on GPU 1, orchestrator exposes the client port after both are healthy."""
    services = load_compose()["services"]
    assert set(services) == {"draft", "target", "orchestrator"}
    for name, gpu in (("draft", "0"), ("target", "1")):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert [d["device_ids"] for d in devices] == [[gpu]] and devices[0]["capabilities"] == ["gpu"], name
    orch = services["orchestrator"]
    assert "deploy" not in orch, "the orchestrator needs no GPU"
    assert orch["depends_on"] == {"draft": {"condition": "service_healthy"},
                                  "target": {"condition": "service_healthy"}}
    assert any(interpolate(p).endswith(":50051") for p in orch["ports"])
    for name, svc in services.items():
        assert svc["restart"] in ("always", "unless-stopped", "on-failure"), name
        assert compose_env_files(svc) == [ENV_EXAMPLE], f"{name}: env_file should default to the example"
        assert any(v.split(":")[1] == "/models" for v in svc["volumes"]), f"{name}: no shared model volume"
    assert "models" in load_compose()["volumes"]


def test_one_gpu_compose_layout():
    """The target hosts the draft on GPU 0; the orchestrator's draft address is the target's; the
    rest (image, env file, volumes, certificates, health checks) as in the two-GPU file."""
    one, two = load_compose(ONE_GPU_COMPOSE_FILE), load_compose()
    services = one["services"]
    assert set(services) == {"target", "orchestrator"}
    target, orch = services["target"], services["orchestrator"]
    devices = target["deploy"]["resources"]["reservations"]["devices"]
    assert [d["device_ids"] for d in devices] == [["0"]]
    assert "--colocated-draft" in compose_argv(target) and "--tp" not in compose_argv(target)
    assert orch["depends_on"] == {"target": {"condition": "service_healthy"}}
    argv = compose_argv(orch)
    assert argv[argv.index("--draft-address") + 1] == argv[argv.index("--target-address") + 1] == "target:50062"
    assert one["volumes"] == two["volumes"]
    for name in ("target", "orchestrator"):
        for key in ("image", "build", "env_file", "volumes", "environment", "healthcheck", "restart"):
            assert services[name][key] == two["services"][name][key], (name, key)


# --- 2. Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_validate_strict(version):
    exe = Path(sys.executable).with_name("kubernetes-validate")
    assert exe.exists(), "kubernetes-validate is missing from the venv (requirements-dev.txt)"
    files = sorted(K8S_DIR.glob("*.yaml"))
    assert files, "deploy/k8s has no manifests"
    proc = subprocess.run([str(exe), "--strict", "--kubernetes-version", version, *map(str, files)],
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(k8s_docs()), proc.stdout


def test_kubernetes_layout():
    """Three Deployments + Services, GPU limits on the workers, gRPC probes, ConfigMap, Secret, PDB."""
    deployments = {d["metadata"]["name"]: d for _, d in k8s_find("Deployment")}
    assert set(deployments) == {"specsplit-draft", "specsplit-target", "specsplit-orchestrator"}
    services = {d["metadata"]["name"]: d for _, d in k8s_find("Service")}
    assert set(services) == {"specsplit-draft", "specsplit-target", "specsplit"}
    assert k8s_find("ConfigMap") and k8s_find("Secret") and k8s_find("PodDisruptionBudget")
    secrets = {d["metadata"]["name"]: d for _, d in k8s_find("Secret")}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, name
        (container,) = pod["spec"]["containers"]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (None if name.endswith("orchestrator") else 1), f"{name}: nvidia.com/gpu limit {gpus}"
        grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
        # mTLS: kubelet gRPC probes cannot present a client certificate, so the probes run
        # `specsplit healthcheck` over mTLS with the pod's own certificate from its TLS secret.
        tls_mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tls"]
        (tls_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "tls"]
        assert tls_volume["secret"]["secretName"] == f"{name}-tls", f"{name}: TLS secret {tls_volume}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command, args = check_cli(container[probe]["exec"]["command"], f"{name} {probe}")
            assert command == "healthcheck" and args.address == f"127.0.0.1:{grpc_port}", f"{name}: {probe}"
            assert (args.tls_ca, args.tls_cert, args.tls_key) == tuple(
                f"{tls_mount}/{f}" for f in ("ca.crt", "tls.crt", "tls.key")), f"{name}: {probe} is not mTLS"
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: {ref} does not exist"
        # Its Service selects this pod template and no other.
        svc = services["specsplit" if name.endswith("orchestrator") else name]
        selected = [n for n, d in deployments.items() if all(
            d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())]
        assert selected == [name], f"Service {svc['metadata']['name']} selects {selected}"
    (pdb,) = [d for _, d in k8s_find("PodDisruptionBudget")]
    for dep in deployments.values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())


def test_kubernetes_services_use_mtls_and_cert_manager_matches():
    """Every service serves mTLS with the certificate its secret mounts; the workers accept the
    orchestrator's CN as an admin; the cert-manager option writes exactly those secrets with the
    common names the configuration lists."""
    configs = {d["metadata"]["name"]: d["data"] for _, d in k8s_find("ConfigMap")}["specsplit-config"]
    tomls = {name.removesuffix(".toml"): tomllib.loads(text) for name, text in configs.items()}
    for role, data in tomls.items():
        sec = data["security"]
        assert sec["tls_client_ca"].endswith("/ca.crt") and sec["tls_cert"].endswith("/tls.crt"), role
    assert "specsplit-orchestrator" in tomls["draft"]["security"]["admin_client_cns"]
    assert "specsplit-orchestrator" in tomls["target"]["security"]["admin_client_cns"]
    assert tomls["orchestrator"]["tls_ca"].endswith("/ca.crt")
    certs = [d for d in yaml.safe_load_all((K8S_DIR / "cert-manager" / "certificates.yaml").read_text())
             if d["kind"] == "Certificate" and not d["spec"].get("isCA")]
    by_secret = {c["spec"]["secretName"]: c["spec"] for c in certs}
    for role, host in (("draft", "specsplit-draft"), ("target", "specsplit-target"), ("orchestrator", "specsplit")):
        spec = by_secret[f"specsplit-{role}-tls"]
        assert spec["commonName"] == f"specsplit-{role}" and host in spec["dnsNames"], spec
        assert {"server auth", "client auth"} <= set(spec["usages"])
    cns = {c["spec"]["commonName"] for c in certs}
    for role, data in tomls.items():
        assert set(data["security"].get("admin_client_cns", ())) <= cns, role


# --- 3. every command line and variable exists in the real CLI --------------------------------


@pytest.mark.parametrize("compose_file", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_commands_env_and_healthchecks_match_the_cli(compose_file):
    services = load_compose(compose_file)["services"]
    configs: dict[str, Any] = {}
    for name, svc in services.items():
        where = f"{compose_file.name} service {name}"
        argv, env = compose_argv(svc), compose_service_env(svc)
        command, args = check_cli(argv, where)
        assert command == name, f"{where} runs `specsplit {command}`"
        check_env_names({k: v for k, v in (svc.get("environment") or {}).items()},
                        env_names(SERVICE_CLASSES[command]), where)
        configs[name] = build_config(command, args, env, where)
    ports = {name: cfg.server.port for name, cfg in configs.items()}
    # A target that hosts the draft (colocated_draft) is where the orchestrator finds the draft.
    draft_at = "draft" if "draft" in services else "target"
    assert draft_at == "draft" or configs["target"].colocated_draft, f"{compose_file.name}: no draft anywhere"
    for name, svc in services.items():
        where, cfg, command = f"{compose_file.name} service {name}", configs[name], name
        assert cfg.server.host == "0.0.0.0", f"{where}: listens on {cfg.server.host}, unreachable from other containers"
        if command == "orchestrator":
            for worker, address in ((draft_at, cfg.draft_address), ("target", cfg.target_address)):
                assert address is not None, f"{where}: no {worker} address"
                host, port = host_port(address)
                assert host == worker and port == ports[worker], f"{where}: {worker} address {address}"
        hc_command, hc_args = check_cli(compose_healthcheck(svc), f"{where} healthcheck")
        assert hc_command == "healthcheck" and hc_args.address == f"127.0.0.1:{cfg.server.port}", \
            f"{where}: health check {hc_args} does not probe the service port {cfg.server.port}"
    for path in {p for svc in services.values() for p in compose_env_files(svc)}:
        check_env_names(read_env_file(path), env_names(WorkerConfig) | env_names(OrchestratorConfig), path.name)


def test_env_example_names_real_options():
    env = read_env_file(ENV_EXAMPLE)
    check_env_names(env, env_names(WorkerConfig) | env_names(OrchestratorConfig), ENV_EXAMPLE.name)
    # One admin-token setting: the orchestrator presents its own token to the workers (issue 16 item 4).
    assert "SPECSPLIT_SECURITY_ADMIN_TOKEN" in env and "SPECSPLIT_WORKER_ADMIN_TOKEN" not in env


def test_kubernetes_commands_env_and_config_match_the_cli(tmp_path):
    configmaps = {d["metadata"]["name"]: d["data"] for _, d in k8s_find("ConfigMap")}
    service_ports = {d["metadata"]["name"]: {p["port"]: p for p in d["spec"]["ports"]} for _, d in k8s_find("Service")}
    seen = set()
    for path, dep in k8s_find("Deployment"):
        spec = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            where = f"{path.name} {dep['metadata']['name']} container {container['name']}"
            argv = list(container.get("command", [])) + list(container.get("args", []))
            command, args = check_cli(argv, where)
            seen.add(command)
            env = {e["name"]: e.get("value", "<from a secret>") for e in container.get("env", [])}
            check_env_names(env, env_names(SERVICE_CLASSES[command]), where)
            # --config / SPECSPLIT_CONFIG must name a key of a mounted ConfigMap; its TOML
            # keys must all be real options, and the resulting configuration must build.
            config_path = args.config or (Path(env["SPECSPLIT_CONFIG"]) if "SPECSPLIT_CONFIG" in env else None)
            assert config_path is not None, f"{where}: no --config"
            text = None
            for mount in container.get("volumeMounts", []):
                cm = volumes[mount["name"]].get("configMap")
                if cm and config_path.parent == Path(mount["mountPath"]):
                    text = configmaps[cm["name"]].get(config_path.name)
            assert text is not None, f"{where}: {config_path} is not a key of a mounted ConfigMap"
            data = tomllib.loads(text)
            known = {o.key for o in config_loader.options(SERVICE_CLASSES[command])}
            unknown = sorted(set(toml_keys(data)) - known)
            assert not unknown, f"{where}: {config_path.name} has keys that are no config option: {unknown}"
            local = tmp_path / f"{command}.toml"
            local.write_text(text)
            args.config = local
            env.pop("SPECSPLIT_CONFIG", None)
            cfg = build_config(command, args, env, where)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert (ports["grpc"], ports["metrics"]) == (cfg.server.port, cfg.server.metrics_port), \
                f"{where}: container ports {ports} but the configuration listens on " \
                f"{cfg.server.port} (gRPC) and {cfg.server.metrics_port} (metrics)"
            assert cfg.server.host == "0.0.0.0", f"{where}: listens on {cfg.server.host}"
            if command in ("draft", "target"):
                assert cfg.runtime.device.startswith("cuda:"), f"{where}: a GPU worker on {cfg.runtime.device}"
            else:
                for address in (cfg.draft_address, cfg.target_address):
                    host, port = host_port(address)
                    assert port in service_ports.get(host, {}), f"{where}: {address} is no Service port"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "exec" in container.get(probe, {}):
                    check_cli(container[probe]["exec"]["command"], f"{where} {probe}")
    assert seen == {"draft", "target", "orchestrator"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_healthcheck_user_and_sources(dockerfile):
    instr = dockerfile_instructions(dockerfile)
    entry = dockerfile_entrypoint(dockerfile)
    assert entry == ["specsplit"], entry
    command, args = check_cli(dockerfile_healthcheck(dockerfile), f"{dockerfile.name} HEALTHCHECK")
    assert command == "healthcheck" and args.address.startswith("127.0.0.1:")
    check_env_names(dockerfile_env(dockerfile), env_names(WorkerConfig) | env_names(OrchestratorConfig), dockerfile.name)
    users = [rest for word, rest in instr if word == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{dockerfile.name}: must run as a non-root user"
    runs = " ".join(rest for word, rest in instr if word == "RUN")
    assert "requirements" in runs and "-r " in runs, f"{dockerfile.name}: dependencies must come from requirements.txt"
    for word, rest in instr:
        if word == "COPY":
            sources = [t for t in shlex.split(rest) if not t.startswith("--")][:-1]
            for src in sources:
                if src == "models/tiny" and not (REPO / src / "config.json").exists():
                    continue   # the bundled model lands separately; its absence is not this file's fault
                assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src} does not exist in the repository"


def test_gpu_dockerfile_backend_arg():
    text = (DEPLOY / "Dockerfile").read_text()
    instr = dockerfile_instructions(DEPLOY / "Dockerfile")
    assert ("ARG", "BACKEND=torch") in instr
    run = " ".join(rest for word, rest in instr if word == "RUN")
    assert re.search(r"torch\)\s+pip install .*torch==", run) and re.search(r"paddle\)\s+.*paddlepaddle-gpu==", run)
    pins = dict(line.split("==") for line in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert f"PADDLE_VERSION={pins['paddlepaddle']}" in text, "paddlepaddle-gpu should match the requirements.txt pin"
    dev_pins = dict(line.split("==") for line in (REPO / "requirements-dev.txt").read_text().splitlines()
                    if "==" in line and not line.startswith("#"))
    for dockerfile in DOCKERFILES:
        assert f"TORCH_VERSION={dev_pins['torch']}" in dockerfile.read_text(), \
            f"{dockerfile.name}: torch should match the requirements-dev.txt pin"


def doc_command_lines(path: Path) -> list[list[str]]:
    """``specsplit ...`` lines of the sh code blocks of a Markdown file (comments and a trailing & dropped)."""
    out, in_sh = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_sh = line.strip() == "```sh"
            continue
        words = line.split()
        if in_sh and words and Path(words[0]).name == "specsplit":
            out.append([t for t in shlex.split(line, comments=True) if t != "&"])
    return out


@pytest.mark.parametrize("doc", ("quickstart.md", "operations.md"))
def test_doc_command_lines_match_the_cli(doc):
    lines = doc_command_lines(REPO / "docs" / doc)
    assert doc != "quickstart.md" or len(lines) >= 8, "the quick start's commands were not found"
    for argv in lines:
        check_cli(argv, f"docs/{doc}")


# --- 5. the configuration reference cannot drift ----------------------------------------------


def test_configuration_doc_is_generated(capsys):
    assert cli.main(["config-reference"]) == 0
    expected = capsys.readouterr().out
    assert CONFIG_DOC.exists(), "docs/configuration.md is missing: specsplit config-reference > docs/configuration.md"
    assert CONFIG_DOC.read_text() == expected, \
        "docs/configuration.md is stale: run `.venv/bin/specsplit config-reference > docs/configuration.md`"
