"""The training corpus of the bundled tiny model: Python's own standard library.

Owns: finding the corpus (every ``.py`` file under a directory, by default
``sysconfig.get_paths()["stdlib"]`` minus ``site-packages``), the
deterministic held-out split (by a hash of each file's path relative to the
corpus root, so the split is the same on every machine and Python version),
turning files into one byte-token stream (each file = BOS + bytes + EOS),
random training windows, and the held-out prompts used to measure acceptance.

Must not know: frameworks (numpy only), models, training loops.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.tokenizer import ByteTokenizer

HELDOUT_FRAC = 0.05
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_corpus_dir() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: str | Path) -> list[str]:
    """Relative POSIX paths of every ``.py`` file under ``root``, sorted.

    Installed third-party packages (``site-packages``/``dist-packages``) and
    bytecode caches are skipped, so only the standard library's own sources count.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {root} does not exist")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


def is_heldout(relpath: str, frac: float = HELDOUT_FRAC) -> bool:
    """Deterministic split: sha1 of the relative path, as a fraction of 2^32, below ``frac``."""
    h = int.from_bytes(hashlib.sha1(relpath.encode("utf-8")).digest()[:4], "big")
    return h / 2**32 < frac


@dataclass
class Corpus:
    root: Path
    train_files: list[str]
    heldout_files: list[str]
    train: np.ndarray       # uint16 [N] token stream: BOS f1 EOS BOS f2 EOS ...
    heldout: np.ndarray     # uint16 [M]

    def summary(self) -> dict:
        return {"root": str(self.root), "train_files": len(self.train_files),
                "heldout_files": len(self.heldout_files), "train_tokens": int(self.train.size),
                "heldout_tokens": int(self.heldout.size)}


def _stream(root: Path, files: list[str], tok: ByteTokenizer) -> np.ndarray:
    parts = []
    for rel in files:
        data = np.frombuffer((root / rel).read_bytes(), dtype=np.uint8).astype(np.uint16)
        parts += [np.array([tok.bos_token_id], np.uint16), data, np.array([tok.eos_token_id], np.uint16)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def load_corpus(root: str | Path | None = None, heldout_frac: float = HELDOUT_FRAC) -> Corpus:
    """Read every source file under ``root`` (default: the stdlib) into train/held-out streams."""
    root = Path(root) if root is not None else default_corpus_dir()
    files = list_sources(root)
    if not files:
        raise FileNotFoundError(f"corpus directory {root} holds no .py files")
    held = [f for f in files if is_heldout(f, heldout_frac)]
    train = [f for f in files if not is_heldout(f, heldout_frac)]
    tok = ByteTokenizer()
    return Corpus(root, train, held, _stream(root, train, tok), _stream(root, held, tok))


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from a stream: int64 [B, seq_len + 1].

    Column t is the input at position t and the label of position t-1.
    Seeded, so a run is reproducible.
    """

    def __init__(self, stream: np.ndarray, batch: int, seq_len: int, seed: int) -> None:
        if stream.size < seq_len + 2:
            raise ValueError(f"corpus stream of {stream.size} tokens is shorter than seq_len+2={seq_len + 2}")
        self.stream, self.batch, self.seq_len = stream, batch, seq_len
        self.rng = np.random.default_rng(seed)
        self._cols = np.arange(seq_len + 1, dtype=np.int64)

    def next(self) -> np.ndarray:
        starts = self.rng.integers(0, self.stream.size - self.seq_len - 1, size=self.batch)
        return self.stream[starts[:, None] + self._cols[None, :]].astype(np.int64)   # [B, T+1]


def heldout_prompts(corpus: Corpus, n: int = 64, min_bytes: int = 64, max_bytes: int = 200,
                    seed: int = 0) -> list[str]:
    """``n`` ASCII prompts from held-out files, each ``min_bytes..max_bytes`` long, cut at
    line boundaries (whole lines, trailing newline kept), at most one per file while
    files last, deterministic for a given corpus and seed."""
    rng = np.random.default_rng(seed)
    files = list(corpus.heldout_files)
    rng.shuffle(files)
    out: list[str] = []
    for rnd in range(8):                      # a few passes in case files yield nothing
        for rel in files:
            if len(out) >= n:
                return out
            try:
                text = (corpus.root / rel).read_bytes().decode("ascii")
            except (OSError, UnicodeDecodeError):
                continue
            lines = text.splitlines(keepends=True)
            if len(lines) < 4:
                continue
            for _ in range(10):               # try a few start lines in this file
                i = int(rng.integers(0, len(lines)))
                chunk = ""
                while i < len(lines) and len(chunk) + len(lines[i]) <= max_bytes:
                    chunk += lines[i]
                    i += 1
                    if len(chunk) >= min_bytes and rng.random() < 0.35:
                        break
                if min_bytes <= len(chunk) <= max_bytes and chunk.strip() and chunk not in out:
                    out.append(chunk)
                    break
    if len(out) < n:
        raise ValueError(f"only {len(out)} held-out prompts could be cut from {len(files)} files (wanted {n})")
    return out
