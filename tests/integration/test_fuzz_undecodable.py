"""Undecodable request bytes on every RPC of every service: INVALID_ARGUMENT, never INTERNAL/UNKNOWN.

The RPCs are not listed by hand: they are read from the services' descriptors (the specsplit
services, grpc.health.v1 and both reflection versions, as every server registers them), so an
RPC added later is fuzzed without touching this file. Each one gets bytes that cannot decode
as its request type — invalid UTF-8 in every string field reachable from the request (nested
messages included), a truncated length-delimited field, a wire type that does not exist, an
end-group marker without a start — sent as the unary request or as the first message of the
request stream. The status must be INVALID_ARGUMENT, and its message must name the field
where one is to blame. Then Hypothesis sends random bytes to every RPC (admin RPCs without
a token, so that nothing is released): every answer is OK or a clear status.

Runs against draft, target and orchestrator in this process (127.0.0.1), with admin tokens
configured; a generation before and after shows the services unharmed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient
from orchestrator.server import create_server
from core.config import SecurityConfig, ServerConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from core.auth import ADMIN_METHODS, admin_metadata
from core.reflection import V1
from specsplit.v1 import draft_pb2, orchestrator_pb2, target_pb2
from target_service.server import start as start_target
from tests.integration.hardening_utils import make_model

pytestmark = pytest.mark.integration

TIMEOUT = 20.0
MAX_LEN = 128
TOKEN = "undecodable-admin-token"
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _reflection_v1_service():
    import core.reflection as refl
    from google.protobuf import descriptor_pool

    refl._register_v1_descriptor()
    return descriptor_pool.Default().FindServiceByName(V1)


def _common_services() -> list:
    return [health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"], _reflection_v1_service()]


SERVERS = {
    "orchestrator": [orchestrator_pb2.DESCRIPTOR.services_by_name[n] for n in orchestrator_pb2.DESCRIPTOR.services_by_name],
    "target": [target_pb2.DESCRIPTOR.services_by_name[n] for n in target_pb2.DESCRIPTOR.services_by_name],
    "draft": [draft_pb2.DESCRIPTOR.services_by_name[n] for n in draft_pb2.DESCRIPTOR.services_by_name],
}
METHODS = [(server, m) for server, services in SERVERS.items() for svc in services + _common_services()
           for m in svc.methods]


# --- malformed bytes for a message type ------------------------------------------------------------------


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _varint(len(payload)) + payload


def bad_utf8_payloads(desc, depth: int = 0, path: str = "") -> Iterator[tuple[str, bytes]]:
    """(dotted field path, bytes) with invalid UTF-8 in each string field reachable from ``desc``."""
    for f in desc.fields:
        name = f"{path}{f.name}"
        if f.type == FieldDescriptor.TYPE_STRING:
            yield name, _ld(f.number, b"ok\xff\xfe\xc3\x28")
        elif f.type == FieldDescriptor.TYPE_MESSAGE and depth < 3 and not f.message_type.GetOptions().map_entry:
            for inner, payload in bad_utf8_payloads(f.message_type, depth + 1, f"{name}."):
                yield inner, _ld(f.number, payload)


WIRE_GARBAGE = {
    "truncated field": _key(1, 2) + _varint(40) + b"short",
    "wire type 7": b"\x0f\x01",
    "lone end-group": _key(1, 4),
}


def _call(channel: grpc.Channel, m: MethodDescriptor, data: bytes, metadata=None) -> grpc.StatusCode:
    path = f"/{m.containing_service.full_name}/{m.name}"
    _call.details = ""  # type: ignore[attr-defined]
    raw = dict(request_serializer=None, response_deserializer=None)
    try:
        if m.client_streaming and m.server_streaming:
            list(channel.stream_stream(path, **raw)(iter([data]), timeout=TIMEOUT, metadata=metadata))
        elif m.client_streaming:
            channel.stream_unary(path, **raw)(iter([data]), timeout=TIMEOUT, metadata=metadata)
        elif m.server_streaming:
            for _ in channel.unary_stream(path, **raw)(data, timeout=TIMEOUT, metadata=metadata):
                if m.name == "Watch":
                    break                   # health Watch streams forever on a good request
        else:
            channel.unary_unary(path, **raw)(data, timeout=TIMEOUT, metadata=metadata)
    except grpc.RpcError as exc:
        _call.details = exc.details()  # type: ignore[attr-defined]
        return exc.code()
    return grpc.StatusCode.OK


# --- the stack ------------------------------------------------------------------------------------------------


def _wcfg(role: str, model: Path) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version="v1", runtime=RuntimeConfig(backend="paddle"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=4, max_len=MAX_LEN),
                        graphs=GraphConfig(batch_buckets=(1, 4)), server=ServerConfig(port=0, max_workers=8),
                        security=SecurityConfig(admin_token=TOKEN, checkpoint_roots=(str(model),)))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("undecodable_model"), MAX_LEN)
    target, draft = start_target(_wcfg("target", model)), start_draft(_wcfg("draft", model))
    orch, port = create_server(OrchestratorConfig(
        draft_address=f"127.0.0.1:{draft.port}", target_address=f"127.0.0.1:{target.port}", max_batch=4,
        max_tokens_limit=16, worker_timeout_s=TIMEOUT, server=ServerConfig(port=0, max_workers=32),
        push_staging_dir=str(tmp_path_factory.mktemp("push")),       # PushWeights on: it reads its stream
        security=SecurityConfig(admin_token=TOKEN, checkpoint_roots=(str(model),))))
    channels = {"orchestrator": grpc.insecure_channel(f"127.0.0.1:{port}"),
                "target": grpc.insecure_channel(f"127.0.0.1:{target.port}"),
                "draft": grpc.insecure_channel(f"127.0.0.1:{draft.port}")}
    client = SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT, token=TOKEN)
    before = client.generate_text([256, 1, 2, 3], 8, ignore_eos=True)
    yield channels, client, before
    client.close()
    for ch in channels.values():
        ch.close()
    orch.stop(0).wait(5)
    target.stop(grace=None)
    draft.stop(grace=None)


@pytest.mark.parametrize("server,method", METHODS, ids=[f"{s}:{m.containing_service.name}.{m.name}" for s, m in METHODS])
def test_undecodable_payloads_are_invalid_argument_naming_the_field(stack, server, method):
    channels, _, _ = stack
    md = admin_metadata(TOKEN)
    cases = [(f"invalid UTF-8 in {path}", data, path) for path, data in bad_utf8_payloads(method.input_type)]
    cases += [(name, data, None) for name, data in WIRE_GARBAGE.items()]
    for what, data, field in cases:
        code = _call(channels[server], method, data, md)
        details = getattr(_call, "details", "")
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
        assert "does not decode" in details, (what, details)
        if field is not None:
            # The whole path, repeated fields indexed: "items[0].request_id: invalid UTF-8 in a string field".
            pattern = r"\.".join(re.escape(part) + r"(\[0\])?" for part in field.split(".")) + ": invalid UTF-8"
            assert re.search(r"decode: " + pattern, details), (what, details)


def test_every_rpc_of_every_service_is_covered():
    """The method list comes from the descriptors: all specsplit RPCs, health and both reflections."""
    names = {f"{m.containing_service.full_name}/{m.name}" for _, m in METHODS}
    assert {"specsplit.v1.Orchestrator/Generate", "specsplit.v1.Orchestrator/ReloadWeights",
            "grpc.health.v1.Health/Check", f"{V1}/ServerReflectionInfo",
            "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"} <= names
    assert ADMIN_METHODS & {m.name for _, m in METHODS} == ADMIN_METHODS


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64), pick=st.integers(0, len(METHODS) - 1))
def test_random_bytes_on_every_rpc_get_a_clear_status(stack, data, pick):
    channels, _, _ = stack
    server, method = METHODS[pick]
    # Admin RPCs without a token: they must not change the workers (UNAUTHENTICATED at most).
    md = None if method.name in ADMIN_METHODS else admin_metadata(TOKEN)
    code = _call(channels[server], method, data, md)
    assert code not in NEVER, (server, method.full_name, data, code, getattr(_call, "details", ""))


def test_zz_services_still_generate_the_same_tokens(stack):
    _, client, before = stack
    after = client.generate_text([256, 1, 2, 3], 8, ignore_eos=True)
    assert after.tokens == before.tokens
