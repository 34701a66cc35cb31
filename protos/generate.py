"""Regenerate the Python protobuf/gRPC code and .pyi stubs from protos/specsplit/v1/*.proto.

Usage: python -m protos.generate [--out DIR]   (default: the repository root,
so files land in specsplit/v1/). tests/unit/test_protos.py runs this into a
temporary directory and fails if the checked-in code differs (stale).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = "specsplit/v1"


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    out.mkdir(parents=True, exist_ok=True)
    # protoc finds the mypy plugins (protoc-gen-mypy*) on PATH: the venv's bin.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--mypy_out={out}", f"--mypy_grpc_out={out}", *proto_files()]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = out / PACKAGE
    (pkg / "__init__.py").write_text('"""Generated protobuf and gRPC code for specsplit.v1 (see protos/generate.py)."""\n')
    return sorted(p for p in pkg.iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    for p in generate(args.out):
        print(p.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
