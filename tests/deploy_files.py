"""Readers for the deployment files and the CLI checks test_deploy.py applies to them.

Owns: parsing the compose file, env files, Dockerfiles and Kubernetes
manifests into command lines and environments, and checking a command line
against the real CLI parser and config options.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from core.config import ConfigError
from orchestrator.config import OrchestratorConfig
from worker.config import WorkerConfig
from core import config_loader
from specsplit import cli, configs

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"                    # two GPUs: a draft service on each its own
ONE_GPU_COMPOSE_FILE = DEPLOY / "docker-compose.one-gpu.yml"    # one GPU: the target hosts the draft
COMPOSE_FILES = (COMPOSE_FILE, ONE_GPU_COMPOSE_FILE)
K8S_DIR = DEPLOY / "k8s"
# SPECSPLIT_* variables read outside the config dataclasses (documented in the CLI / loader).
EXTRA_ENV = frozenset({"SPECSPLIT_CONFIG", "SPECSPLIT_ADDRESS", "SPECSPLIT_TOKEN", "SPECSPLIT_LOG_LEVEL",
                       "SPECSPLIT_RUNTIME_DIR", "SPECSPLIT_TOKEN_FILE", "SPECSPLIT_TARGET_TP"})
SERVICE_CLASSES: dict[str, type] = {"draft": WorkerConfig, "target": WorkerConfig, "orchestrator": OrchestratorConfig}


# --- reading the files ----------------------------------------------------------------------

_REF = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(:?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Resolve compose/shell ``${VAR:-default}`` to its default; ``$$`` is a literal ``$``."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(2) is None:
            raise AssertionError(f"{value!r}: ${{{m.group(1)}}} has no default; give one (${{VAR:-default}})")
        return m.group(3)

    return _REF.sub(sub, value)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):          # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_entrypoint(path: Path) -> list[str]:
    entry = [rest for word, rest in dockerfile_instructions(path) if word == "ENTRYPOINT"]
    assert entry, f"{path.name} has no ENTRYPOINT"
    argv = json.loads(entry[-1])         # exec form only: signals reach the service directly
    assert isinstance(argv, list), f"{path.name}: ENTRYPOINT must be the exec (JSON) form"
    return argv


def dockerfile_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions(path):
        if word == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"{path.name}: use ENV KEY=VALUE, got {item!r}"
                env[key] = value
    return env


def dockerfile_healthcheck(path: Path) -> list[str]:
    checks = [rest for word, rest in dockerfile_instructions(path) if word == "HEALTHCHECK"]
    assert checks, f"{path.name} has no HEALTHCHECK"
    _, sep, cmd = checks[-1].partition("CMD ")
    assert sep, f"{path.name}: HEALTHCHECK needs CMD"
    return [interpolate(t) for t in shlex.split(cmd)]


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def read_env_file(path: Path) -> dict[str, str]:
    """docker-compose v1 env_file syntax: KEY=VALUE lines, # comments, no quoting."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value
    return env


def compose_dockerfile(svc: dict[str, Any]) -> Path:
    build = svc["build"]
    return (COMPOSE_FILE.parent / interpolate(build["context"]) / interpolate(build.get("dockerfile", "Dockerfile"))).resolve()


def compose_env_files(svc: dict[str, Any]) -> list[Path]:
    files = svc.get("env_file", [])
    files = [files] if isinstance(files, str) else files
    return [(COMPOSE_FILE.parent / interpolate(f)).resolve() for f in files]


def compose_service_env(svc: dict[str, Any]) -> dict[str, str]:
    """What a compose container sees: image SPECSPLIT_* ENV < env_file < environment."""
    env = {k: v for k, v in dockerfile_env(compose_dockerfile(svc)).items() if k.startswith("SPECSPLIT_")}
    for path in compose_env_files(svc):
        env.update(read_env_file(path))
    environment = svc.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    env.update({k: interpolate(str(v)) for k, v in environment.items()})
    return env


def compose_argv(svc: dict[str, Any]) -> list[str]:
    entry = svc.get("entrypoint")
    entry = dockerfile_entrypoint(compose_dockerfile(svc)) if entry is None else entry
    entry = shlex.split(entry) if isinstance(entry, str) else list(entry)
    command = svc.get("command", [])
    command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    return [interpolate(t) for t in entry + command]


def compose_healthcheck(svc: dict[str, Any]) -> list[str]:
    test = svc["healthcheck"]["test"]
    if isinstance(test, str):
        return [interpolate(t) for t in shlex.split(test)]
    if test[0] == "CMD-SHELL":
        return [interpolate(t) for t in shlex.split(test[1])]
    assert test[0] == "CMD", f"unexpected healthcheck test {test!r}"
    return [interpolate(str(t)) for t in test[1:]]


def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def k8s_find(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in k8s_docs() if d["kind"] == kind]


# --- the CLI ----------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the specsplit parser has no subcommands")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def check_cli(argv: list[str], where: str) -> tuple[str, argparse.Namespace]:
    """Parse a ``specsplit ...`` command line with the real parser; every flag must be
    spelled exactly as the (sub)command defines it. Returns (subcommand, namespace)."""
    assert argv and Path(argv[0]).name == "specsplit", f"{where}: runs {argv[:1]}, not the specsplit CLI"
    parser = cli.build_parser()
    subs = _subparsers(parser)
    current, command, skip = _options(parser), None, False
    for tok in argv[1:]:
        if skip:
            skip = False
            continue
        if tok.startswith("--"):
            name = tok.split("=", 1)[0]
            scope = f"`specsplit {command}`" if command else "`specsplit` (before the subcommand)"
            assert name in current, f"{where}: {scope} has no flag {name} (command line: {argv})"
            action = current[name]
            skip = "=" not in tok and action.nargs != 0 and not isinstance(
                action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction))
        elif command is None:
            assert tok in subs, f"{where}: unknown subcommand {tok!r}"
            command, current = tok, _options(subs[tok])
    assert command is not None, f"{where}: no subcommand in {argv}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            raise AssertionError(f"{where}: the CLI rejects {argv}: {err.getvalue().strip()}") from None
    return command, args


def env_names(cls: type) -> set[str]:
    return {o.env for o in config_loader.options(cls)}


def check_env_names(env: dict[str, str], allowed: set[str], where: str) -> None:
    unknown = sorted(k for k in env if k.startswith("SPECSPLIT_") and k not in allowed | EXTRA_ENV)
    assert not unknown, f"{where}: {unknown} are not specsplit config options (docs/configuration.md)"


def build_config(command: str, args: argparse.Namespace, env: dict[str, str], where: str) -> Any:
    cls = SERVICE_CLASSES[command]
    overrides = {"role": command} if cls is WorkerConfig else None
    try:
        return configs.build(cls, args, env=env, overrides=overrides)
    except ConfigError as exc:
        raise AssertionError(f"{where}: invalid configuration: {exc}") from None


def toml_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in data.items():
        out += toml_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
