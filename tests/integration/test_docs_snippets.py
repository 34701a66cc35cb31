"""The documentation runs as written: every Python snippet and shell command in README.md, docs/
and models/tiny/README.md runs against a live stack on loopback (``live_stack``: `specsplit up` with
the bundled model, the HTTP API and PushWeights staging on).

Rules (stated here so a doc writer can follow them):
- Every fenced block names its language. ``python``, ``sh``/``bash`` and ``console`` (lines
  starting with ``$ ``) blocks are run; other languages (``text``, ``json``, ``toml``) are data.
- A run block may be preceded by ``<!-- docs-test: not run: <why> -->``, ``<!-- docs-test: gpu -->``
  or ``<!-- docs-test: docker -->``; those are skipped with their reason (CI has neither).
- Addresses in snippets are those of ``specsplit up --http-port 8000`` (its default port 50051):
  ``127.0.0.1:50051`` / ``127.0.0.1:PORT`` become the live orchestrator, ``127.0.0.1:8000`` its
  HTTP API, and a client command without ``--address`` reaches it through ``SPECSPLIT_ADDRESS``.
  ``.venv/bin/`` is this interpreter's directory. A ``specsplit up ... &`` line is the live stack
  itself and is not started again.
- Shell blocks run with ``bash -e -o pipefail`` from the repository root; Python blocks with this
  interpreter. Each has a deadline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "models" / "tiny" / "README.md"]
RUN_LANGS = {"python", "sh", "bash", "console"}
SNIPPET_TIMEOUT_S = 240.0
_MARK = re.compile(r"<!--\s*docs-test:\s*(not run:\s*(?P<why>.+?)|gpu|docker)\s*-->")
_UP_LINE = re.compile(r"^\s*(\.venv/bin/)?specsplit up\b.*&\s*(#.*)?$")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int                  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None           # why it is not run (None: run)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def collect(path: Path) -> list[Snippet]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(2), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(m.group(1)):])
            i += 1
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.search(prev)
        skip = None if mark is None else (mark.group("why") or f"needs {mark.group(1)}, which CI does not have")
        out.append(Snippet(path, start + 1, lang, "\n".join(body) + "\n", skip))
    return out


SNIPPETS = [s for p in DOCS for s in collect(p)]


def test_every_block_names_its_language_and_every_mark_has_a_reason():
    unnamed = [s.id for s in SNIPPETS if not s.lang]
    assert not unnamed, f"fenced blocks without a language (```text for diagrams): {unnamed}"
    run = [s for s in SNIPPETS if s.lang in RUN_LANGS]
    assert len(run) >= 10 and sum(s.skip is None for s in run) >= 8, "the collector found too little to run"
    for s in run:
        assert s.skip is None or len(s.skip.strip()) > 10, f"{s.id}: say why it is not run"


def _substitute(code: str, stack) -> str:
    http = stack.addresses()["http"].removeprefix("http://").removesuffix("/v1")
    venv_bin = str(Path(sys.executable).parent) + "/"
    for old, new in (("127.0.0.1:50051", stack.orchestrator_address), ("127.0.0.1:PORT", stack.orchestrator_address),
                     ("127.0.0.1:8000", http), (".venv/bin/", venv_bin)):
        code = code.replace(old, new)
    return code


def _shell(s: Snippet) -> str:
    lines = s.code.splitlines()
    if s.lang == "console":                  # transcripts: only the commands run
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    return "\n".join(ln for ln in lines if not _UP_LINE.match(ln)) + "\n"


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.lang in RUN_LANGS], ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, live_stack, tmp_path):
    if snippet.skip:
        pytest.skip(snippet.skip)
    # NOTE: snippets that leave --address out use the CLI's default (where `specsplit up` listens
    # by default); here that is the live stack's orchestrator, through SPECSPLIT_ADDRESS.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "SPECSPLIT_ADDRESS": live_stack.orchestrator_address,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if snippet.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(_substitute(snippet.code, live_stack))
        argv = [sys.executable, str(script)]
    else:
        script = tmp_path / "snippet.sh"
        script.write_text(_substitute(_shell(snippet), live_stack))
        argv = ["bash", "-e", "-o", "pipefail", str(script)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"{snippet.id} failed (exit {proc.returncode})\n--- ran:\n{script.read_text()}"
                                  f"\n--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-3000:]}")
