"""PushWeights staging (``orchestrator.push``) and the worker's remembered weight sources (rollback), on CPU.

The protocol's refusals each name the problem and leave nothing under the
staging root; a committed push is a checkpoint the workers' own validation
accepts, byte-identical in its tensors to what was sent.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from orchestrator.push import PushError, PushStaging
from runtime.checkpoint import index_checkpoint, load_tensors
from runtime.config import ModelConfig
from worker.base import MAX_KEPT_SOURCES
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes
from runtime.weights import check_draft, check_target

CFG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1)
CONFIG = json.dumps(CFG.to_hf_dict())


def tensors() -> dict[str, np.ndarray]:
    return {**init_params(CFG, 0, target_tensor_shapes(CFG)), **init_params(CFG, 1, mtp_tensor_shapes(CFG))}


def push(session, arrays, chunk: int = 100) -> None:
    for name, arr in arrays.items():
        data = arr.astype("<f4").tobytes()
        for off in range(0, len(data), chunk):
            session.chunk(name, "float32", arr.shape, off, data[off:off + chunk])


def test_commit_writes_a_checkpoint_the_workers_accept(tmp_path):
    staging = PushStaging(str(tmp_path), max_bytes=1 << 20, keep=2)
    s = staging.begin()
    s.header("v7", CONFIG, "in_place", "wait")
    arrays = tensors()
    push(s, arrays, chunk=37)
    staged = s.commit(len(arrays))
    assert staged.num_tensors == len(arrays) and staged.bytes_received == sum(a.nbytes for a in arrays.values())
    checked = check_draft(check_target(staged.path), f"{staged.path}/mtp.safetensors")
    assert checked.cfg == CFG
    got = {**load_tensors(index_checkpoint(staged.path)), **load_tensors(index_checkpoint(f"{staged.path}/mtp.safetensors"))}
    assert got.keys() == arrays.keys() and all(np.array_equal(got[k], arrays[k]) for k in arrays)
    assert [p.name for p in tmp_path.iterdir()] == [staged.path.rsplit("/", 1)[1]]


def test_bf16_and_prune_keeps_the_newest(tmp_path):
    staging = PushStaging(str(tmp_path), max_bytes=1 << 20, keep=2)
    paths = []
    for v in ("a", "b", "c"):
        s = staging.begin()
        s.header(v, CONFIG, "recapture", "abort")
        for name, arr in tensors().items():
            bits = (arr.astype(np.float32).view(np.uint32) >> 16).astype("<u2")
            s.chunk(name, "bfloat16", arr.shape, 0, bits.tobytes())
        paths.append(s.commit().path)
    assert staging.prune() == [paths[0]]
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["b", "c"]


CASES = [
    ("chunk_before_header", "FAILED_PRECONDITION", "first message must be the header"),
    ("twice_header", "FAILED_PRECONDITION", "sent twice"),
    ("bad_config", "INVALID_ARGUMENT", "target_config_json"),
    ("unknown", "INVALID_ARGUMENT", "not a tensor of this model"),
    ("shape", "INVALID_ARGUMENT", "the config implies"),
    ("dtype", "INVALID_ARGUMENT", "dtype 'int8'"),
    ("offset", "INVALID_ARGUMENT", "offset 8, expected 0"),
    ("overflow", "INVALID_ARGUMENT", "exceed the tensor"),
    ("incomplete", "INVALID_ARGUMENT", "incomplete"),
    ("repeat", "INVALID_ARGUMENT", "sent twice"),
    ("missing", "INVALID_ARGUMENT", "missing tensor"),
    ("count", "INVALID_ARGUMENT", "num_tensors"),
    ("too_big", "RESOURCE_EXHAUSTED", "push_max_bytes"),
]


@pytest.mark.parametrize("case,code,text", CASES)
def test_refusals_name_the_problem_and_leave_nothing(tmp_path, case, code, text):
    arrays = tensors()
    total = sum(a.nbytes for a in arrays.values())
    staging = PushStaging(str(tmp_path), max_bytes=total - 1 if case == "too_big" else 1 << 20, keep=2)
    s = staging.begin()
    name, arr = next(iter(arrays.items()))
    data = arr.astype("<f4").tobytes()
    with pytest.raises(PushError) as info:
        try:
            if case == "chunk_before_header":
                s.chunk(name, "float32", arr.shape, 0, data)
            s.header("v", "{}" if case == "bad_config" else CONFIG, "recapture", "wait")
            if case == "twice_header":
                s.header("v", CONFIG, "recapture", "wait")
            if case == "unknown":
                s.chunk("model.nope", "float32", (2,), 0, b"\0" * 8)
            if case == "shape":
                s.chunk(name, "float32", (1, *arr.shape), 0, data)
            if case == "dtype":
                s.chunk(name, "int8", arr.shape, 0, data)
            if case == "offset":
                s.chunk(name, "float32", arr.shape, 8, data[8:])
            if case == "overflow":
                s.chunk(name, "float32", arr.shape, 0, data + b"\0\0\0\0")
            if case in ("incomplete", "repeat"):
                s.chunk(name, "float32", arr.shape, 0, data[:8])
                if case == "repeat":
                    s.chunk(name, "float32", arr.shape, 8, data[8:])
                    push(s, {n: a for n, a in arrays.items() if n != name})
                    s.chunk(name, "float32", arr.shape, 0, data)
                push(s, {n: a for n, a in arrays.items() if n != name})
            if case == "missing":
                push(s, {n: a for n, a in arrays.items() if n != "mtp.hnorm.weight"})
            if case in ("count", "too_big"):
                push(s, arrays)
            s.commit(len(arrays) + 1 if case == "count" else 0)
        except PushError:
            s.abort()
            raise
    assert info.value.code == code and text in info.value.message, info.value.message
    assert list(tmp_path.iterdir()) == []


def test_no_staging_root_is_refused():
    with pytest.raises(PushError) as info:
        PushStaging(None, 1, 2).begin()
    assert info.value.code == "FAILED_PRECONDITION" and "push_staging_dir" in info.value.message


def test_worker_reloads_a_remembered_version_by_tag(worker_config, tiny_model_dir, tmp_path):
    """Rollback support: LoadWeights with an empty target_path reloads a version loaded here before."""
    from target_service.worker import TargetWorker

    w = TargetWorker(worker_config("target"))
    w.load_weights(str(tiny_model_dir), version="v1")
    w.release_weights()
    with pytest.raises(ValueError, match="was not loaded here before"):
        w.load_weights("", version="nope")
    w.load_weights("", version="v1")
    assert w.weights_version == "v1" and w.model_cfg is not None
    w.load_weights("", version="v1", in_place=True)              # in place, by tag, too
    for i in range(MAX_KEPT_SOURCES):
        w.load_weights(str(tiny_model_dir), version=f"v{i + 2}", in_place=True)
    with pytest.raises(ValueError, match="known"):                 # only the last MAX_KEPT_SOURCES are kept
        w.load_weights("", version="v1", in_place=True)
    w.close()
    fresh = TargetWorker(worker_config("target"))
    with pytest.raises(ValueError, match="target_path is required"):
        fresh.load_weights("")
