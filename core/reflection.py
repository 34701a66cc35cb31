"""Server reflection under both ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

Owns: registering reflection on a server for both service names. grpcio-
reflection ships only v1alpha; current grpcurl and Postman ask for v1 first.
The two protocols are the same messages with the same field numbers under
another package, so the v1 service is the v1alpha servicer behind a v1 name,
and the v1 file descriptor (the v1alpha one with its package renamed) is
added to the descriptor pool so that clients can describe the v1 service too.

Must not know: the services reflected.
"""

from __future__ import annotations

import threading

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection.SERVICE_NAME                               # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_lock = threading.Lock()


def _register_v1_descriptor() -> None:
    """Add grpc/reflection/v1/reflection.proto to the default pool (once per process)."""
    pool = descriptor_pool.Default()
    with _lock:
        try:
            pool.FindFileByName(_V1_FILE)
            return
        except KeyError:
            pass
        fdp = descriptor_pb2.FileDescriptorProto()
        reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
        fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
        for msg in fdp.message_type:
            for field in msg.field:
                if field.HasField("type_name"):
                        field.type_name = field.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
        for service in fdp.service:
            for method in service.method:
                method.input_type = method.input_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
                method.output_type = method.output_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
        fdp.options.Clear()
        pool.Add(fdp)


def enable_reflection(service_names: list[str], server: grpc.Server) -> None:
    """Reflection listing ``service_names`` plus both reflection services, under both versions."""
    _register_v1_descriptor()
    names = [*service_names, V1ALPHA, V1]
    servicer = reflection.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        # NOTE: same wire format as v1alpha (identical field numbers), so its classes decode v1.
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": handler}),))
