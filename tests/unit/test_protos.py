"""Generated protobuf code is up to date with protos/specsplit/v1/*.proto (regenerate: make protos)."""

import subprocess
import sys

from protos.generate import PACKAGE, ROOT


def test_generated_code_is_not_stale(tmp_path):
    # NOTE: protoc runs in a child process: its bundled libprotobuf loaded into this process
    # and Paddle's own loaded after it aborted the interpreter now and then (Paddle's import).
    subprocess.run([sys.executable, "-m", "protos.generate", "--out", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    fresh = sorted(p for p in (tmp_path / PACKAGE).iterdir() if p.suffix in (".py", ".pyi"))
    assert fresh, "codegen produced nothing"
    checked_in = ROOT / PACKAGE
    names = {p.name for p in fresh}
    assert names == {p.name for p in checked_in.iterdir() if p.suffix in (".py", ".pyi")}, \
        "generated file set differs: run `make protos`"
    for p in fresh:
        assert p.read_text() == (checked_in / p.name).read_text(), f"{p.name} is stale: run `make protos`"


def test_every_enum_has_an_unspecified_zero():
    from specsplit.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2

    for module in (common_pb2, draft_pb2, orchestrator_pb2, target_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name
