"""Undecodable requests become INVALID_ARGUMENT naming the field, on every RPC of a server.

Owns: ``RequestGuard``, a server interceptor that wraps every method handler
of a server (so RPCs added later are covered without a line of their own):
its request deserializer never raises — bytes that do not parse become an
``Undecodable`` record — and its behavior aborts the call with
INVALID_ARGUMENT when it meets one, for unary requests before the servicer
runs and for request streams at the message that failed. ``describe``
finds which field of which message failed (invalid UTF-8 in a string, a
truncated field, a wrong wire type), walking nested messages, e.g.
``items[0].request_id: invalid UTF-8 in a string field``.

Without it, grpc answers INTERNAL ("Exception deserializing request!").

Must not know: any particular service or message; tokens (``core.auth``
runs before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_MAX_DEPTH = 32


@dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse; ``message`` says where and why."""

    message: str


# --- finding the field --------------------------------------------------------------------------


class _WireError(ValueError):
    def __init__(self, message: str, number: int | None = None) -> None:
        super().__init__(message)
        self.number = number


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise _WireError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise _WireError("varint longer than 10 bytes")


def _scan(data: bytes, pos: int = 0, group: int | None = None) -> tuple[list[tuple[int, int, int, int, int]], int]:
    """(field number, wire type, start of the tag, start of the payload, end) per field on the wire,
    and where scanning stopped (after the END_GROUP of ``group``, or the end of ``data``)."""
    out = []
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _WireError(f"field number 0 at byte {start}")
        if wire == _EGROUP:
            if number != group:
                raise _WireError(f"unexpected end of group {number} at byte {start}")
            return out, pos
        if wire == _VARINT:
            payload, (_, end) = pos, _varint(data, pos)
        elif wire == _I64:
            payload, end = pos, pos + 8
        elif wire == _I32:
            payload, end = pos, pos + 4
        elif wire == _LEN:
            length, payload = _varint(data, pos)
            end = payload + length
        elif wire == _SGROUP:
            payload, end = pos, _scan(data, pos, number)[1]
        else:
            raise _WireError(f"wire type {wire} does not exist (byte {start})", number)
        if end > len(data):
            raise _WireError(f"truncated ({end - len(data)} bytes missing)", number)
        out.append((number, wire, start, payload, end))
        pos = end
    if group is not None:
        raise _WireError(f"group {group} is not closed")
    return out, pos


def _fields(data: bytes) -> list[tuple[int, int, int, int, int]]:
    return _scan(data)[0]


def _parses(cls: type[Message], data: bytes) -> bool:
    try:
        cls.FromString(data)
        return True
    except Exception:  # noqa: BLE001 - any parse failure
        return False


def describe(cls: type[Message], data: bytes, depth: int = 0) -> str:
    """Which field of a ``cls`` message encoded as ``data`` fails to decode, and why."""
    desc = cls.DESCRIPTOR
    counts: dict[int, int] = {}
    try:
        for number, wire, start, payload, end in _fields(data):
            field = desc.fields_by_number.get(number)
            index = counts.get(number, 0)
            counts[number] = index + 1
            if field is None:
                if not _parses(cls, data[start:end]):
                    return f"unknown field {number}: malformed"
                continue
            if _parses(cls, data[start:end]):
                continue
            name = field.name
            if _repeated(field) and wire == _LEN and \
                    field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                name = f"{name}[{index}]"
            if field.type == FieldDescriptor.TYPE_MESSAGE and wire == _LEN and depth < _MAX_DEPTH:
                inner = describe(field.message_type._concrete_class, data[payload:end], depth + 1)
                return f"{name}.{inner}" if not inner.startswith("malformed") else f"{name}: {inner}"
            if field.type == FieldDescriptor.TYPE_STRING and wire == _LEN:
                return f"{name}: invalid UTF-8 in a string field"
            return f"{name}: malformed value (wire type {wire} for a {_type_name(field)} field)"
    except _WireError as exc:
        field = desc.fields_by_number.get(exc.number) if exc.number is not None else None
        if field is not None:
            return f"{field.name}: {exc}"
        return f"malformed message: {exc}" + (f" (field number {exc.number})" if exc.number is not None else "")
    return "malformed message"


def _repeated(field: FieldDescriptor) -> bool:
    rep = getattr(field, "is_repeated", None)     # protobuf >= 6; ``label`` is gone in 7
    return bool(rep) if rep is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _type_name(field: FieldDescriptor) -> str:
    for name in dir(FieldDescriptor):
        if name.startswith("TYPE_") and getattr(FieldDescriptor, name) == field.type:
            return name[5:].lower()
    return "?"


def safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize`` that returns an ``Undecodable`` instead of raising."""
    if deserialize is None:
        return None
    cls = getattr(deserialize, "__self__", None)

    def run(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - every parse failure becomes a clear status
            if isinstance(cls, type) and issubclass(cls, Message):
                try:
                    where = describe(cls, data)
                except Exception:  # noqa: BLE001 - the diagnosis must never fail the call
                    where = "malformed message"
                return Undecodable(f"request {cls.DESCRIPTOR.full_name} does not decode: {where}")
            return Undecodable(f"the request does not decode: {type(exc).__name__}")
    return run


# --- the interceptor ------------------------------------------------------------------------------


def _refuse(context: grpc.ServicerContext, bad: Undecodable) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)


def _checked(requests: Iterator[Any], context: grpc.ServicerContext, seen: list[Undecodable]) -> Iterator[Any]:
    for i, msg in enumerate(requests):
        if isinstance(msg, Undecodable):
            bad = Undecodable(f"message {i} of the request stream: {msg.message}")
            seen.append(bad)
            _refuse(context, bad)
        yield msg


def guard_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a safe deserializer and the INVALID_ARGUMENT check in front of its behavior.

    NOTE: for request streams the guard keeps the last word: if the servicer catches the
    abort raised inside its loop and ends some other way, the call still ends INVALID_ARGUMENT.
    """
    kw = dict(request_deserializer=safe_deserializer(handler.request_deserializer),
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        inner_ss = handler.stream_stream

        def stream_stream(requests: Any, context: grpc.ServicerContext) -> Any:
            seen: list[Undecodable] = []
            try:
                yield from inner_ss(_checked(requests, context, seen), context)
            finally:
                if seen:
                    _refuse(context, seen[0])
        return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
    if handler.request_streaming:
        inner_su = handler.stream_unary

        def stream_unary(requests: Any, context: grpc.ServicerContext) -> Any:
            seen: list[Undecodable] = []
            try:
                return inner_su(_checked(requests, context, seen), context)
            finally:
                if seen:
                    _refuse(context, seen[0])
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    if handler.response_streaming:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                _refuse(context, request)
            yield from inner_us(request, context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    inner_uu = handler.unary_unary

    def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            _refuse(context, request)
        return inner_uu(request, context)
    return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


class RequestGuard(grpc.ServerInterceptor):
    """Installs ``guard_handler`` on every method of the server (all services, present and future)."""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        return None if handler is None else guard_handler(handler)
