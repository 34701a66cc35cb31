"""Layers point down: no module imports a module of a higher layer, nor a sibling package of its
own layer (issue 12). Every import counts, lazy ones inside functions too (parsed with ``ast``).

Bottom to top:
  core         what every service shares (wire format, serving plumbing, auth, metric families,
               config loading) + the generated protos ``specsplit.v1``
  runtime      the model, engines, KV cache, graphs, checkpoints, backends
  shells       ``worker`` (the model-worker shell), ``rounds`` (the round loop and the worker
               clients), ``training`` (MTP-head training)
  services     ``draft_service``, ``target_service``, ``orchestrator``
  application  ``specsplit`` (CLI, launcher, demo), ``bench``, ``protos`` (code generators),
               ``scripts``, and every package's ``__main__`` (an entry point nothing imports)
Within the application layer, packages may use each other (it is the top: nothing depends on it).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core", "specsplit.v1")),
    ("runtime", ("runtime",)),
    ("shells", ("worker", "rounds", "training")),
    ("services", ("draft_service", "target_service", "orchestrator")),
    ("application", ("specsplit", "bench", "protos", "scripts")),
]
TOP = len(LAYERS) - 1
SAME_PACKAGE = {"specsplit.v1": "core"}   # the generated protos are part of the core package's wire format


def _owner(module: str) -> tuple[int, str] | None:
    """(layer index, package prefix) of a project module; None for a third-party module."""
    if module.split(".")[-1] == "__main__":
        return TOP, module.split(".")[0]
    best: tuple[int, str] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return None if best is None else (best[0], SAME_PACKAGE.get(best[1], best[1]))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``source``, relative ones resolved; for
    ``from X import name``, both X and X.name (a submodule, when it is one)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return out


def violations_in(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of ``module`` that points up a layer or sideways into a sibling package."""
    me = _owner(module)
    if me is None:
        return []
    found = []
    for line, target in imports_of(source, module, is_package):
        other = _owner(target)
        if other is None or other[1] == me[1]:
            continue
        if other[0] > me[0] or (other[0] == me[0] and me[0] != TOP):
            way = "up" if other[0] > me[0] else "sideways"
            found.append(f"{module}:{line} imports {target} ({way}: {LAYERS[me[0]][0]} -> {LAYERS[other[0]][0]})")
    return sorted(set(found))


def project_files() -> list[Path]:
    roots = {p.split(".")[0] for _, prefixes in LAYERS for p in prefixes}
    return sorted(f for r in roots for f in (REPO / r).rglob("*.py"))


def test_no_import_points_up_or_sideways():
    files = project_files()
    assert len(files) > 100, "the scan found too few files: wrong repository root?"
    bad = []
    for f in files:
        bad += violations_in(f.read_text(), _module_name(f), f.name == "__init__.py")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_every_project_package_has_a_layer():
    """A new top-level package must be given a layer here, or the scan would skip it."""
    known = {p.split(".")[0] for _, prefixes in LAYERS for p in prefixes} | {"tests", "models", "docs", "deploy"}
    packages = {d.name for d in REPO.iterdir() if (d / "__init__.py").is_file() or d.name == "scripts"}
    assert packages <= known, f"packages without a layer: {sorted(packages - known)}"


def test_the_checker_sees_upward_sideways_and_lazy_imports():
    src = "import numpy\nfrom core import wire\n\ndef f():\n    from orchestrator.server import x\n"
    assert violations_in(src, "runtime.model") == [
        "runtime.model:5 imports orchestrator.server (up: runtime -> services)",
        "runtime.model:5 imports orchestrator.server.x (up: runtime -> services)"]
    assert violations_in("from orchestrator import reload\n", "target_service.rounds") == [
        "target_service.rounds:1 imports orchestrator (sideways: services -> services)",
        "target_service.rounds:1 imports orchestrator.reload (sideways: services -> services)"]
    assert violations_in("from ..backends import torch_ops\n", "runtime.graphs") == []
    assert violations_in("from specsplit.cli import main\n", "draft_service.__main__") == []
    assert violations_in("from specsplit.v1 import common_pb2\n", "core.wire") == []
    assert violations_in("from specsplit import cli\n", "core.wire") != []
