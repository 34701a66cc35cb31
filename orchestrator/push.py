"""PushWeights staging: named tensor chunks from a trainer -> a checkpoint directory on disk.

Owns: the push protocol's rules (one header, then chunks, then one commit; the
chunks of a tensor consecutive and in order; each tensor once), checking every
chunk against the tensors the header's config implies (name, shape, dtype,
offset, size) and the byte limit as it arrives, writing the target
(``config.json`` + ``model.safetensors``) and the MTP file (``mtp.safetensors``)
straight into their final files (no second copy), validating the result with
the same header checks the workers run, and keeping only the newest staged
versions under the staging root.

Must not know: gRPC (the servicer calls ``header`` / ``chunk`` / ``commit``),
frameworks, how the staged checkpoint is then applied (``orchestrator.reload``).

Layout: ``<root>/push-<version>-<8 hex>/{config.json, model.safetensors,
mtp.safetensors}``, built in ``<root>/.incoming-<hex>/`` and renamed at commit,
so a half-written push is never visible under a ``push-`` name.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from runtime.checkpoint import CheckpointError
from core.config import ConfigError
from runtime.config import ModelConfig
from runtime.model import MTP_PREFIX, mtp_tensor_shapes, target_tensor_shapes
from runtime.weights import MTP_FILE, check_draft, check_target

_DTYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}
_PREFIX, _INCOMING = "push-", ".incoming-"
_MAX_CONFIG_CHARS = 1 << 20


class PushError(Exception):
    """A push was refused; ``code`` is a gRPC status code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def _bad(message: str) -> PushError:
    return PushError("INVALID_ARGUMENT", message)


@dataclass(frozen=True)
class Staged:
    path: str
    version: str
    mode: str                        # orchestrator.reload RECAPTURE | IN_PLACE
    inflight: str                    # WAIT | ABORT | RECOMPUTE
    bytes_received: int
    num_tensors: int


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    start: int                       # offset in its file's data section
    received: int = 0


class _SafetensorsWriter:
    """Writes a safetensors file whose header is only known at the end: the header
    space is reserved up front (worst case for the known names and shapes) and
    padded with spaces when written, so the tensor bytes land in place once."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        self.path = path
        worst = {n: {"dtype": "BF16", "shape": list(s), "data_offsets": [10**19, 10**19]} for n, s in shapes.items()}
        reserved = len(json.dumps(worst, separators=(",", ":")).encode())
        self.header_len = reserved + (-reserved % 8)
        self.tensors: list[_Tensor] = []
        self.size = 0                                # data bytes announced so far
        self._f: BinaryIO = open(path, "wb")

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> _Tensor:
        nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][1]
        t = _Tensor(name, dtype, shape, nbytes, self.size)
        self.tensors.append(t)
        self.size += nbytes
        return t

    def write(self, t: _Tensor, data: bytes) -> None:
        self._f.seek(8 + self.header_len + t.start + t.received)
        self._f.write(data)
        t.received += len(data)

    def finish(self) -> None:
        header = {t.name: {"dtype": _DTYPES[t.dtype][0], "shape": list(t.shape),
                           "data_offsets": [t.start, t.start + t.nbytes]} for t in self.tensors}
        raw = json.dumps(header, separators=(",", ":")).encode()
        assert len(raw) <= self.header_len, "reserved safetensors header too small"
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self.header_len) + raw + b" " * (self.header_len - len(raw)))
        self._f.truncate(8 + self.header_len + self.size)
        self._f.close()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class PushSession:
    """One PushWeights call. Call ``header`` once, ``chunk`` per chunk, then ``commit``;
    ``abort`` (always safe) removes what was written unless committed."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.dir = root / f"{_INCOMING}{uuid.uuid4().hex}"
        self.cfg: ModelConfig | None = None
        self.version = self.mode = self.inflight = ""
        self.expected: dict[str, tuple[int, ...]] = {}
        self.files: dict[str, _SafetensorsWriter] = {}
        self.seen: dict[str, _Tensor] = {}
        self.current: _Tensor | None = None
        self.bytes = 0
        self.committed = False

    def header(self, version: str, config_json: str, mode: str, inflight: str) -> None:
        if self.cfg is not None:
            raise PushError("FAILED_PRECONDITION", "header: sent twice (one header, then chunks, then commit)")
        if not version:
            raise _bad("header.version: required (empty)")
        if len(version) > 256:
            raise _bad(f"header.version: {len(version)} characters, at most 256")
        if len(config_json) > _MAX_CONFIG_CHARS:
            raise _bad(f"header.target_config_json: {len(config_json)} characters, at most {_MAX_CONFIG_CHARS}")
        try:
            raw = json.loads(config_json)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            cfg = ModelConfig.from_hf_dict(raw)
        except (ValueError, ConfigError, TypeError) as exc:
            raise _bad(f"header.target_config_json: {exc}") from None
        target, mtp = target_tensor_shapes(cfg), mtp_tensor_shapes(cfg)
        least = sum(int(np.prod(s)) * 2 for s in (*target.values(), *mtp.values()))
        if least > self.max_bytes:
            raise PushError("RESOURCE_EXHAUSTED", f"header.target_config_json: the model needs at least {least} "
                                                  f"bytes (bf16), over push_max_bytes={self.max_bytes}")
        self.cfg, self.version, self.mode, self.inflight = cfg, version, mode, inflight
        self.expected = {**target, **mtp}
        self.dir.mkdir(parents=True)
        self.files = {"target": _SafetensorsWriter(self.dir / "model.safetensors", target),
                      "mtp": _SafetensorsWriter(self.dir / MTP_FILE, mtp)}

    def chunk(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, data: bytes) -> None:
        if self.cfg is None:
            raise PushError("FAILED_PRECONDITION", "chunk before header: the first message must be the header")
        t = self.current
        if t is None or t.name != name:
            self._close_current(next_name=name)
            t = self._open(name, dtype, tuple(shape))
        elif dtype != t.dtype or tuple(shape) != t.shape:
            raise _bad(f"chunk {name!r}: dtype/shape {dtype} {list(shape)} differ from its first chunk's "
                       f"{t.dtype} {list(t.shape)}")
        if offset != t.received:
            raise _bad(f"chunk {name!r}: offset {offset}, expected {t.received} (chunks of a tensor come in order)")
        if t.received + len(data) > t.nbytes:
            raise _bad(f"chunk {name!r}: {t.received + len(data)} bytes exceed the tensor's {t.nbytes}")
        if self.bytes + len(data) > self.max_bytes:
            raise PushError("RESOURCE_EXHAUSTED", f"chunk {name!r}: the push exceeds push_max_bytes={self.max_bytes}")
        self.files["mtp" if name.startswith(MTP_PREFIX) else "target"].write(t, data)
        self.bytes += len(data)

    def _open(self, name: str, dtype: str, shape: tuple[int, ...]) -> _Tensor:
        if name not in self.expected:
            raise _bad(f"chunk {name!r}: not a tensor of this model (config) nor of its MTP layer")
        if name in self.seen:
            raise _bad(f"chunk {name!r}: tensor sent twice (its chunks must come one after another)")
        if dtype not in _DTYPES:
            raise _bad(f"chunk {name!r}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        if shape != tuple(self.expected[name]):
            raise _bad(f"chunk {name!r}: shape {list(shape)}, the config implies {list(self.expected[name])}")
        t = self.files["mtp" if name.startswith(MTP_PREFIX) else "target"].add(name, dtype, shape)
        self.seen[name] = self.current = t
        return t

    def _close_current(self, next_name: str | None) -> None:
        t = self.current
        if t is not None and t.received != t.nbytes:
            after = f" before {next_name!r} started" if next_name else " at commit"
            raise _bad(f"chunk {t.name!r}: incomplete, {t.received} of {t.nbytes} bytes{after}")
        self.current = None

    def commit(self, num_tensors: int = 0) -> Staged:
        if self.cfg is None:
            raise PushError("FAILED_PRECONDITION", "commit before header: nothing was pushed")
        self._close_current(None)
        missing = [n for n in self.expected if n not in self.seen]
        if missing:
            raise _bad(f"commit: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                  if len(missing) > 1 else ""))
        if num_tensors and num_tensors != len(self.seen):
            raise _bad(f"commit.num_tensors: {num_tensors}, but {len(self.seen)} tensors arrived")
        for w in self.files.values():
            w.finish()
        hf = self.cfg.to_hf_dict()
        (self.dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        try:
            # NOTE: the same header checks the workers run, here first: a push that
            # would fail validation on a worker is refused before any reload starts.
            check_draft(check_target(self.dir), self.dir / MTP_FILE)
        except (CheckpointError, ConfigError) as exc:
            raise _bad(f"commit: the staged checkpoint is invalid: {exc}") from None
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.version)[:64]
        final = self.root / f"{_PREFIX}{safe}-{uuid.uuid4().hex[:8]}"
        self.dir.rename(final)
        self.dir, self.committed = final, True
        return Staged(str(final), self.version, self.mode, self.inflight, self.bytes, len(self.seen))

    def abort(self) -> None:
        for w in self.files.values():
            w.close()
        if not self.committed:
            shutil.rmtree(self.dir, ignore_errors=True)


class PushStaging:
    """The staging root: starts sessions, prunes old staged versions."""

    def __init__(self, root: str | None, max_bytes: int, keep: int) -> None:
        self.root = Path(root).resolve() if root else None
        self.max_bytes, self.keep = max_bytes, keep

    def begin(self) -> PushSession:
        if self.root is None:
            raise PushError("FAILED_PRECONDITION", "PushWeights is off: no push_staging_dir is configured")
        self.root.mkdir(parents=True, exist_ok=True)
        return PushSession(self.root, self.max_bytes)

    def discard(self, path: str) -> None:
        """Remove a staged checkpoint that was never served (its reload failed)."""
        p = Path(path)
        if self.root is not None and p.parent == self.root and p.name.startswith(_PREFIX):
            shutil.rmtree(p, ignore_errors=True)

    def prune(self) -> list[str]:
        """Keep the newest ``keep`` staged versions (the serving one and those a rollback
        may return to); remove older ones. Returns the removed paths."""
        if self.root is None or not self.root.is_dir():
            return []
        staged = sorted((p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)),
                        key=lambda p: p.stat().st_mtime)
        removed = staged[:-self.keep] if len(staged) > self.keep else []
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return [str(p) for p in removed]
