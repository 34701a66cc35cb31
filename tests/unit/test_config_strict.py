"""Strict configuration: unknown TOML tables/keys and unknown SPECSPLIT_* variables are errors
naming the key and the closest valid one (issue 16: `[runtim]` or a top-level `cache_max_slots`
used to start the service on defaults without a word)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError
from orchestrator.config import OrchestratorConfig
from worker.config import WorkerConfig
from specsplit import configs

REPO = Path(__file__).resolve().parents[2]


def build(tmp_path: Path, toml: str, cls: type = WorkerConfig, env: dict | None = None):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    return configs.build(cls, argparse.Namespace(config=path), env=env or {},
                         overrides={"role": "target"} if cls is WorkerConfig else None)


@pytest.mark.parametrize("toml, cls, words", [
    ("[runtim]\nbackend = 'torch'\n", WorkerConfig, ["unknown table [runtim]", "did you mean [runtime]?"]),
    ("cache_max_slots = 4\n", WorkerConfig, ["unknown key 'cache_max_slots'", "did you mean [cache] max_slots?"]),
    ("[cache]\nmax_slot = 4\n", WorkerConfig, ["'max_slot' in table [cache]", "did you mean [cache] max_slots?"]),
    ("[server.tls]\nx = 1\n", WorkerConfig, ["unknown table [server.tls]"]),
    ("draft_adress = 'h:1'\n", OrchestratorConfig, ["'draft_adress'", "did you mean draft_address?"]),
    ("[cache]\nmax_slots = 4\n", OrchestratorConfig, ["unknown table [cache]"]),       # a worker-only table
])
def test_unknown_toml_keys_are_errors_with_the_closest_valid_key(tmp_path, toml, cls, words):
    with pytest.raises(ConfigError) as err:
        build(tmp_path, toml, cls)
    for w in words:
        assert w in str(err.value), str(err.value)
    assert str(tmp_path / "c.toml") in str(err.value)


def test_valid_files_and_shared_environments_still_build(tmp_path):
    cfg = build(tmp_path, "weights_version = 'v7'\n[cache]\nmax_slots = 4\n[server]\nport = 0\n",
                env={"SPECSPLIT_WORKER_ADMIN_TOKEN": "t", "SPECSPLIT_TOKEN": "t", "SPECSPLIT_MAX_BATCH": "2"})
    assert (cfg.cache.max_slots, cfg.weights_version) == (4, "v7")       # orchestrator-only vars are fine too


@pytest.mark.parametrize("name, hint", [("SPECSPLIT_CACHE_MAX_SLOT", "SPECSPLIT_CACHE_MAX_SLOTS"),
                                        ("SPECSPLIT_SECURITY_ADMIN_TOKN", "SPECSPLIT_SECURITY_ADMIN_TOKEN"),
                                        ("SPECSPLIT_FOO", None)])
def test_unknown_specsplit_env_vars_are_errors(tmp_path, name, hint):
    with pytest.raises(ConfigError) as err:
        build(tmp_path, "", OrchestratorConfig, env={name: "1"})
    msg = str(err.value)
    assert f"unknown environment variable {name}" in msg
    assert (f"did you mean {hint}?" in msg) if hint else ("did you mean" not in msg), msg


def test_the_cli_says_so_in_one_line_and_exits_2(tmp_path):
    (tmp_path / "o.toml").write_text("[runtim]\nbackend = 'paddle'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSPLIT_")}
    proc = subprocess.run([sys.executable, "-m", "specsplit", "orchestrator", "--config", str(tmp_path / "o.toml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("specsplit: configuration error: unknown table [runtim]")
