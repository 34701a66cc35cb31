"""Unit tests for core/wire.py: tensors, sampling params, error mapping, status."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from runtime.checkpoint import CheckpointError
from core.config import ConfigError
from core.params import SamplingParams
from runtime.kv_cache import CapacityError, UnknownRequestError
from runtime.lifecycle import LifecycleError, State
from worker.base import WorkerStatus
from core import wire
from worker.service import status_to_proto
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import target_pb2 as tpb

RNG = np.random.default_rng(0)


# --- tensors -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (1, 0, 4), (2, 3, 4)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_round_trip_exact(dtype: str, shape: tuple[int, ...]):
    if dtype == "int64":
        arr = RNG.integers(-(2**62), 2**62, size=shape, dtype=np.int64)
    else:
        arr = RNG.standard_normal(shape).astype(dtype)
    t = wire.encode_tensor(arr)
    assert t.dtype == {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "int64": pb.DTYPE_INT64}[dtype]
    assert list(t.shape) == list(shape)
    back = wire.decode_tensor(pb.Tensor.FromString(t.SerializeToString()), "x")
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)
    assert back.flags.writeable  # a copy, not a view of the message's bytes


def test_bf16_round_trip_of_representable_values_is_exact():
    # Values with at most 8 significant bits are exact in bfloat16.
    arr = (RNG.integers(-128, 128, size=(4, 7)) * 2.0 ** RNG.integers(-20, 20, size=(4, 7))).astype(np.float32)
    t = wire.encode_tensor(arr, "bfloat16")
    assert t.dtype == pb.DTYPE_BFLOAT16 and len(t.data) == arr.size * 2
    back = wire.decode_tensor(t, "x")
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, arr)


def test_bf16_rounds_to_nearest_even_and_keeps_specials():
    one_ulp = np.float32(2.0 ** -7)  # bf16 spacing at 1.0
    arr = np.array([1.0 + one_ulp / 2, 1.0 + 1.5 * one_ulp, 1.0 + 0.3 * one_ulp, np.inf, -np.inf, np.nan, -0.0],
                   dtype=np.float32)
    back = wire.decode_tensor(wire.encode_tensor(arr, "bfloat16"), "x")
    np.testing.assert_array_equal(back[:5], [1.0, 1.0 + 2 * one_ulp, 1.0, np.inf, -np.inf])
    assert np.isnan(back[5]) and np.signbit(back[6])
    # Relative error of a general array is within half a bf16 ulp.
    x = RNG.standard_normal(1000).astype(np.float32)
    y = wire.decode_tensor(wire.encode_tensor(x, "bfloat16"), "x")
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0 ** -8)


def test_bf16_bit_patterns_pass_through():
    bits = RNG.integers(0, 2**16, size=(3, 5)).astype(np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0  # no NaN/inf patterns
    t = wire.encode_tensor(bits, "bfloat16")
    np.testing.assert_array_equal(wire.decode_tensor(t, "x", bf16_bits=True), bits)
    widened = wire.decode_tensor(t, "x")
    np.testing.assert_array_equal(widened.view(np.uint32) >> 16, bits.astype(np.uint32))


def test_float64_is_sent_as_float32_and_bool_as_int64():
    assert wire.encode_tensor(np.ones(2, dtype=np.float64)).dtype == pb.DTYPE_FLOAT32
    assert wire.encode_tensor(np.array([True, False])).dtype == pb.DTYPE_INT64
    with pytest.raises(ValueError, match="cannot encode"):
        wire.encode_tensor(np.array(["a"]))


def test_wrong_byte_count_names_field_and_sizes():
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 256], data=b"\0" * 1000)
    with pytest.raises(ValueError) as info:
        wire.decode_tensor(t, "items[2].hidden")
    assert str(info.value) == "items[2].hidden: 1000 bytes, expected 1024 for shape [1, 256] float32"


@pytest.mark.parametrize(("tensor", "match"), [
    (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), r"items\[0\]\.hidden: DTYPE_UNSPECIFIED"),
    (pb.Tensor(dtype=99, shape=[1], data=b"\0" * 4), r"items\[0\]\.hidden: unknown dtype 99"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, 4], data=b""), r"items\[0\]\.hidden: shape \[-1, 4\] has a negative"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**40, 2**40], data=b"\0" * 4),
     r"items\[0\]\.hidden: 4 bytes, expected \d+ for shape"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1] * 9, data=b"\0" * 4), r"items\[0\]\.hidden: 9 dimensions"),
    (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2], data=b"\0" * 16), r"items\[0\]\.hidden: dtype int64 is not allowed"),
])
def test_malformed_tensors_name_the_field(tensor: pb.Tensor, match: str):
    with pytest.raises(ValueError, match=match):
        wire.decode_tensor(tensor, "items[0].hidden", allowed=wire.FLOAT_DTYPES)


def test_optional_tensor():
    item = tpb.VerifyItem(request_id="r")
    assert wire.decode_optional_tensor(item, "draft_probs", "items[0].draft_probs") is None
    item.draft_probs.CopyFrom(pb.Tensor())                     # set but the "no tensor" value
    assert wire.decode_optional_tensor(item, "draft_probs", "items[0].draft_probs") is None
    item.draft_probs.CopyFrom(wire.encode_tensor(np.eye(2, dtype=np.float32)))
    np.testing.assert_array_equal(wire.decode_optional_tensor(item, "draft_probs", "f"), np.eye(2))
    item.draft_probs.data = b"123"
    with pytest.raises(ValueError, match=r"items\[0\]\.draft_probs: 3 bytes"):
        wire.decode_optional_tensor(item, "draft_probs", "items[0].draft_probs")


# --- sampling params ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.5, top_k=7, top_p=0.875, seed=2**62, draft_sampling=True),
    SamplingParams(temperature=2.0, top_p=1.0, seed=0),
    SamplingParams(temperature=0.75, seed=5, sampling_mode="coupled"),
])
def test_params_round_trip(params: SamplingParams):
    back = wire.params_from_proto(pb.SamplingParams.FromString(wire.params_to_proto(params).SerializeToString()),
                                  default_mode="coupled" if params.sampling_mode == "rejection" else "rejection")
    assert (back.temperature, back.top_k, back.top_p, back.seed, back.draft_sampling, back.sampling_mode) == \
           (params.temperature, params.top_k, params.top_p, params.seed, params.draft_sampling, params.sampling_mode)


def test_params_defaults_top_p_zero_means_off_and_seed_unset():
    p = wire.params_from_proto(pb.SamplingParams())
    assert p.greedy and p.top_p == 1.0 and p.seed is None and p.top_k == 0 and p.sampling_mode == "rejection"
    # An unset sampling_mode takes the caller's default (the orchestrator's default_sampling_mode).
    assert wire.params_from_proto(pb.SamplingParams(), default_mode="coupled").sampling_mode == "coupled"


def test_unknown_sampling_mode_names_the_field():
    with pytest.raises(ValueError, match=r"sampling\.sampling_mode: 7 is not a known SamplingMode"):
        wire.params_from_proto(pb.SamplingParams(temperature=1.0, sampling_mode=7), "sampling")


@pytest.mark.parametrize(("proto", "match"), [
    (pb.SamplingParams(temperature=-1.0), r"items\[3\]\.params\.temperature"),
    (pb.SamplingParams(temperature=float("nan")), r"items\[3\]\.params\.temperature"),
    (pb.SamplingParams(temperature=1000.0), r"items\[3\]\.params\.temperature"),
    (pb.SamplingParams(top_k=-2), r"items\[3\]\.params\.top_k"),
    (pb.SamplingParams(top_p=1.5), r"items\[3\]\.params\.top_p"),
    (pb.SamplingParams(top_p=-0.1), r"items\[3\]\.params\.top_p"),
    (pb.SamplingParams(seed=2**64 - 1), r"items\[3\]\.params\.seed"),
])
def test_bad_params_name_the_field(proto: pb.SamplingParams, match: str):
    with pytest.raises(ValueError, match=match):
        wire.params_from_proto(proto, "items[3].params")


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "code"), [
    (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (CheckpointError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownRequestError("request_id 'a' is unknown"), grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LifecycleError("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    (KeyError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_code_mapping(exc: Exception, code: grpc.StatusCode):
    assert wire.status_code_for(exc) == code
    err = wire.item_error_for(exc)
    assert err.code == code
    proto = wire.item_error_to_proto(err)
    assert proto.code == code.value[0] and proto.message == err.message


def test_unknown_request_message_is_not_quoted_twice():
    err = wire.item_error_for(UnknownRequestError("request_id 'a' is unknown here"))
    assert err.message == "request_id 'a' is unknown here"


def test_status_to_proto_fills_every_field():
    s = WorkerStatus(role="draft", state=State.READY, weights_version="v2", graph_keys=("catchup4@1", "substep@1"),
                     graph_pool_bytes=5, graphs_mode="cuda", max_k=3, backend="torch", device="cuda:0", free_slots=6,
                     used_slots=2, graph_replays=11, eager_runs=12, device_memory_bytes=13,
                     active_request_ids=("a", "b"), vocab_size=64, hidden_size=32, max_len=128, eos_token_id=0,
                     lifecycle_events=("load_weights", "capture_graphs"), max_position_embeddings=2048,
                     eos_token_ids=(0, 7), instance_id="0f3a")
    data_plane = type("DataPlane", (), {"port": 4321, "frames": 17})()     # what a draft's DataPlaneServer shows
    p = status_to_proto(s, data_plane, propose_hidden_rows=True)
    assert (p.data_plane_port, p.data_plane_frames) == (4321, 17)
    assert status_to_proto(s).data_plane_port == 0                          # none: the Propose stream only
    assert not status_to_proto(s).propose_hidden_rows                      # a target's, or an older draft's
    for field in pb.WorkerStatus.DESCRIPTOR.fields:
        assert p.HasField(field.name) if field.has_presence else bool(getattr(p, field.name)), field.name
    assert p.state == pb.LIFECYCLE_STATE_READY and p.eos_token_id == 0 and list(p.graph_keys) == list(s.graph_keys)
    empty = status_to_proto(WorkerStatus("target", State.EMPTY, "", (), 0, "eager (cpu)", 3, "paddle", "cpu", 0, 0,
                                              0, 0, 0, (), 0, 0, 0, None, ()))
    assert empty.state == pb.LIFECYCLE_STATE_EMPTY and not empty.HasField("eos_token_id")
