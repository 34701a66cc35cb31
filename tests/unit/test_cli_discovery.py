"""Truthful discovery (issue 16): ``specsplit --version``, the CPU training recipe, progress on stderr."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_version():
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = subprocess.run([sys.executable, "-m", "specsplit", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"specsplit {want}", proc.stdout + proc.stderr


def test_train_on_cpu_without_sizes_takes_the_cpu_recipe(capsys):
    pytest.importorskip("torch")
    from training.torch_train import RECIPES, add_train_args, apply_recipe

    args = add_train_args(argparse.ArgumentParser()).parse_args(["--out", "x"])
    assert apply_recipe(args) == "cpu"
    assert {k: getattr(args, k) for k in RECIPES["cpu"]} == RECIPES["cpu"]
    assert args.target_budget_s > 0 and args.mtp_budget_s > 0          # capped: finishes in minutes
    assert "cpu recipe" in capsys.readouterr().err
    # explicit sizes win; a GPU device takes the GPU recipe (the one that made models/tiny)
    args = add_train_args(argparse.ArgumentParser()).parse_args(["--out", "x", "--device", "cuda", "--steps", "5"])
    assert apply_recipe(args) == "gpu" and args.steps == 5 and args.hidden_size == RECIPES["gpu"]["hidden_size"]


def test_progress_goes_to_stderr_only(capsys):
    from core.progress import progress

    bar = progress(range(3), desc="x", disable=False)
    assert list(bar) == [0, 1, 2]
    bar.close()
    out = capsys.readouterr()
    assert out.out == "" and "x" in out.err
