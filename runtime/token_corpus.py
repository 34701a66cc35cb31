"""A text corpus tokenized with a model's own tokenizer (``specsplit train-mtp``).

Owns: turning ``--corpus`` paths (files, or directories searched for text files)
into train / held-out token streams — each document = the tokenizer's encoding
(with its BOS where it adds one) + EOS — with the same deterministic held-out
split as the bundled corpus (``runtime/corpus.is_heldout`` on each file's path
relative to the path given), and picking the tokenizer of a target directory.

Must not know: frameworks (numpy only), models, training loops.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from runtime.config import ConfigError, ModelConfig
from runtime.corpus import Corpus, is_heldout
from runtime.tokenizer import ByteTokenizer, Tokenizer

# Files a corpus directory contributes (explicitly named files are read whatever their suffix).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".html", ".c", ".h")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def target_tokenizer(target_dir: str | Path, cfg: ModelConfig) -> Tokenizer:
    """The target's ``tokenizer.json``; the byte tokenizer only for a model of its vocabulary size."""
    d = Path(target_dir)
    if (d / "tokenizer.json").is_file():
        from runtime.hf_tokenizer import HFTokenizer

        return HFTokenizer(d)
    if cfg.vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise ConfigError(f"{d}: no tokenizer.json to tokenize the corpus with (the byte tokenizer fits only a "
                      f"{ByteTokenizer.vocab_size}-token vocabulary; this model has vocab_size={cfg.vocab_size})")


def collect_files(paths: list[str | Path]) -> list[tuple[Path, str]]:
    """(file, split key) of every corpus file: each named file, and every text file under each
    named directory (sorted; the key is the path relative to that directory)."""
    if not paths:
        raise ConfigError("--corpus: give at least one text file or directory")
    out: list[tuple[Path, str]] = []
    for raw in paths:
        root = Path(raw)
        if root.is_file():
            out.append((root, root.name))
        elif root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
                for name in sorted(filenames):
                    if name.endswith(TEXT_SUFFIXES):
                        f = Path(dirpath, name)
                        out.append((f, f.relative_to(root).as_posix()))
        else:
            raise ConfigError(f"--corpus {raw}: no such file or directory")
    if not out:
        raise ConfigError(f"--corpus {' '.join(map(str, paths))}: no text files ({', '.join(TEXT_SUFFIXES)})")
    return out


def _encode(tok: Tokenizer, path: Path) -> np.ndarray | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    ids = list(tok.encode(text))
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int32)


def load_token_corpus(paths: list[str | Path], tok: Tokenizer, heldout_frac: float = 0.05,
                      min_heldout_tokens: int = 0) -> Corpus:
    """Tokenize every corpus file; files held out by ``is_heldout`` form the held-out stream.
    When that leaves either side (nearly) empty — a corpus of one or a few files — the last
    ``heldout_frac`` of the whole stream is held out instead."""
    files = collect_files(paths)
    train_parts, held_parts, train_names, held_names = [], [], [], []
    for f, key in files:
        ids = _encode(tok, f)
        if ids is None or ids.size == 0:
            continue
        if is_heldout(key, heldout_frac):
            held_parts.append(ids)
            held_names.append(str(f))
        else:
            train_parts.append(ids)
            train_names.append(str(f))
    if not train_parts and not held_parts:
        raise ConfigError("--corpus: no readable UTF-8 text in " + " ".join(map(str, paths)))
    train = np.concatenate(train_parts) if train_parts else np.zeros(0, np.int32)
    held = np.concatenate(held_parts) if held_parts else np.zeros(0, np.int32)
    if held.size <= max(min_heldout_tokens, 0) or train.size == 0:
        # NOTE: split the joined stream (train first, then held-out files) so no token is in both.
        stream = np.concatenate([train, held])
        cut = int(stream.size * (1.0 - heldout_frac))
        train, held = stream[:cut], stream[cut:]
        train_names, held_names = train_names + held_names, [f"last {held.size} tokens of the stream"]
    return Corpus(Path(paths[0]), train_names, held_names, train, held)
