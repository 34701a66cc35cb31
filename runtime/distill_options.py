"""Settings of ``specsplit train-mtp`` (training an MTP head for an existing target).

Owns: the options and their defaults, in one place for the trainer
(``runtime/backends/torch_mtp_distill.py``) and the command line
(``specsplit/cli_train.py``), which must not import Torch to print its help.

Must not know: frameworks, training.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DistillOptions:
    target: str                         # target checkpoint directory (frozen)
    corpus: list[str]                   # text files / directories
    out: str | None = None              # mtp.safetensors, checkpoints, JSON (default: the target directory)
    steps: int = 1000
    batch: int = 8
    seq_len: int = 256
    unroll: int = 3                     # substeps the head is unrolled on its own hidden state
    distill: float = 1.0                # weight of the target's distribution in the label (0: data token)
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    init: str = "last-layer"            # "last-layer": the block starts as the target's last layer; "random"
    device: str = "cpu"
    seed: int = 0
    save_every: int = 100               # steps between checkpoints (and one at the end)
    keep: int = 2                       # checkpoints kept
    budget_s: float = 0.0               # stop (checkpointed, resumable) after this many seconds (0: none)
    cpu_threads: int = 0                # Torch intra-op threads (0: Torch's default)
    heldout_frac: float = 0.05
    eval_prompts: int = 16              # held-out prompts for the acceptance measurement (0: skip it)
    eval_prompt_len: int = 64
    eval_tokens: int = 64
    eval_k: int = 3
    log_every: int = 25
