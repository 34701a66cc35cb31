"""``specsplit train-mtp``: an MTP draft head for an existing target, on the command line.

Owns: the command's arguments (defaults from ``runtime.distill_options``), turning
them into ``DistillOptions``, the progress bar (``specsplit.progress``, on a
terminal; plain lines otherwise) and the one-line errors of a bad target,
corpus or option.

Must not know: how the head is trained (``runtime/backends/torch_mtp_distill.py``);
Torch is imported only when the command runs, never for ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from runtime.config import ConfigError
from runtime.distill_options import DistillOptions

_DEFAULTS = DistillOptions(target="", corpus=[])
_HELP = {
    "out": "directory of the outputs: mtp.safetensors (where `specsplit up` loads the draft), "
           "mtp_acceptance.json, mtp_train_log.json and mtp_checkpoints/ (default: the target directory)",
    "steps": "training steps in all (a resumed run continues to this count)",
    "batch": "sequences per step",
    "seq_len": "tokens per sequence",
    "unroll": "substeps the head is unrolled on its own hidden state (the k it is trained for)",
    "distill": "weight of the target's own distribution in the label (0: the corpus token only)",
    "lr": "peak learning rate (linear warm-up, cosine decay)",
    "warmup": "warm-up steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip",
    "init": "last-layer: the MTP block starts as a copy of the target's last decoder layer; random",
    "device": "cpu | cuda | cuda:N",
    "seed": "seed of the initialisation and of the batches",
    "save_every": "steps between checkpoints (one is also written at the end)",
    "keep": "checkpoints kept in mtp_checkpoints/",
    "budget_s": "stop after this many seconds, checkpointed (the same command resumes; 0: no limit)",
    "cpu_threads": "Torch intra-op threads (0: Torch's default; on a shared CPU one thread is often faster)",
    "heldout_frac": "fraction of the corpus held out for the acceptance measurement",
    "eval_prompts": "held-out prompts of the greedy acceptance measurement (0: skip it)",
    "eval_prompt_len": "tokens per held-out prompt",
    "eval_tokens": "tokens generated per held-out prompt",
    "eval_k": "drafts per round of the acceptance measurement",
    "log_every": "steps between loss lines",
}


def add_train_mtp_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", default=None, help="the target checkpoint directory (frozen; any model "
                                                   "specsplit serves, e.g. one saved by transformers)")
    p.add_argument("--corpus", nargs="+", default=None, metavar="PATH",
                   help="text files and/or directories (searched for .txt .md .rst .py .json .jsonl .html .c .h "
                        "files), tokenized with the target's tokenizer")
    for f in dataclasses.fields(DistillOptions):
        if f.name in ("target", "corpus"):
            continue
        default = getattr(_DEFAULTS, f.name)
        kind = type(default) if default is not None else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default,
                       help=_HELP[f.name] + ("" if default is None else f" (default: {default})"))
    return p


def options_from_args(args: argparse.Namespace) -> DistillOptions:
    if not args.target:
        raise ConfigError("train-mtp: --target: give the target checkpoint directory")
    if not args.corpus:
        raise ConfigError("train-mtp: --corpus: give at least one text file or directory")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillOptions)}
    return DistillOptions(**values)


def cmd_train_mtp(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    from runtime.checkpoint import CheckpointError
    from runtime.hf_tokenizer import TokenizerError

    try:
        from runtime.backends.torch_mtp_distill import run_distill
    except ImportError as exc:
        raise ConfigError(f"train-mtp needs Torch: {exc}") from None
    bar = None
    if sys.stderr.isatty():
        from specsplit.progress import progress as bar
    try:
        run_distill(opts, progress=bar, say=lambda line: print(line, flush=True))
    except (CheckpointError, TokenizerError, OSError) as exc:
        print(f"specsplit: train-mtp: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0
