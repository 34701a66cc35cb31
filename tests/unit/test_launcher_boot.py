"""The launcher's child bootstrap (specsplit/launcher.py ``_BOOT``): PR_SET_PDEATHSIG is set after
exec (no preexec_fn, so subprocess never forks with gRPC's fork handlers), a child whose parent is
already gone exits at once, and otherwise it is ``python -m specsplit`` with the same arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit import launcher

REPO = Path(__file__).resolve().parents[2]


def test_boot_argv_keeps_the_arguments_and_names_this_process():
    argv = launcher._boot_argv([sys.executable, "-m", "specsplit", "--log-level", "INFO", "draft"])
    assert argv[:2] == [sys.executable, "-c"] and argv[3] == str(os.getpid()) and argv[4:] == ["--log-level", "INFO",
                                                                                               "draft"]
    with pytest.raises(ValueError, match="not a specsplit command line"):
        launcher._boot_argv([sys.executable, "-m", "other"])


def test_a_child_runs_specsplit_and_one_whose_parent_is_gone_exits_at_once():
    def run(parent: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", launcher._BOOT, str(parent), "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    mine = run(os.getpid())                       # our pid is the child's parent: it runs
    assert mine.returncode == 0 and "usage" in mine.stdout.lower() and "orchestrator" in mine.stdout
    gone = run(1 if os.getpid() != 1 else 2)      # not its parent: as if the launcher had died already
    assert gone.returncode == 0 and gone.stdout == "" and gone.stderr == ""
