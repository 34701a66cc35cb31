"""Print the package-level import graph of the tree (every import, lazy ones too, parsed with ast).

``python scripts/import_graph.py [--detail]``: one line per package, ``a -> b, c`` (a imports b
and c); ``--detail`` adds the module-level imports behind each arrow. The layering these edges
must respect is checked by ``tests/unit/test_layers.py``; the picture is in docs/architecture.md.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "runtime", "worker", "rounds", "training", "draft_service", "target_service",
            "orchestrator", "specsplit", "bench", "protos", "scripts")


def graph() -> dict[tuple[str, str], set[str]]:
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            if "v1" in path.relative_to(REPO).parts or path.name == "__main__.py":
                continue    # generated protocol code; entry points (application layer, nothing imports them)
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    other = "specsplit.v1" if name.startswith("specsplit.v1") else name.split(".")[0]
                    if other in PACKAGES + ("specsplit.v1",) and other != top:
                        edges[(top, other)].add(f"{module} -> {name}")
    return edges


def main(argv: list[str]) -> int:
    edges = graph()
    for top in PACKAGES:
        targets = sorted(b for a, b in edges if a == top)
        if targets:
            print(f"{top} -> {', '.join(targets)}")
            if "--detail" in argv:
                for b in targets:
                    for line in sorted(edges[(top, b)]):
                        print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
