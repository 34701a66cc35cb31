"""An MTP draft head for an existing target (``specsplit train-mtp``), with Torch autograd.

Owns: loading a frozen target with specsplit's own loaders (any checkpoint it
serves: Llama / Mistral / Qwen2 / Qwen3 written by transformers, or one of
specsplit's), initialising the head, the training loop of the unrolled,
distilled MTP loss (``torch_unroll``: the head trained on its own hidden states
for k substeps against the target's own next-token distribution), resumable
checkpoints (head + AdamW state + step, the latest in ``OUT/mtp_checkpoints``),
and the outputs: ``mtp.safetensors`` in the serving layout and the held-out
per-position acceptance measured through the real inference path
(``runtime.engine.SpecEngine``), printed and written as JSON.

Batches are a pure function of (seed, step), so a resumed run sees exactly the
batches an uninterrupted one would.

Must not know: argument parsing (``specsplit/cli_train.py``), gRPC, Paddle.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from runtime import checkpoint
from runtime.backends.torch_ops import TorchOps
from runtime.backends.torch_train import lr_at, make_optimizer, measure_acceptance_ids, to_arrays
from runtime.backends.torch_unroll import mtp_unrolled_loss, target_hidden
from runtime.checkpoint import CheckpointError
from runtime.config import ConfigError, ModelConfig
from runtime.distill_options import DistillOptions
from runtime.model import MTP_LAYER_PREFIX, Rope, init_params, mtp_tensor_shapes
from runtime.token_corpus import collect_files, load_token_corpus, target_tokenizer
from runtime.weights import MTP_FILE, check_target, read_arrays

CKPT_DIR = "mtp_checkpoints"
ACCEPTANCE_FILE = "mtp_acceptance.json"
LOG_FILE = "mtp_train_log.json"
_CKPT = re.compile(r"^step-(\d{8})\.pt$")
_HELDOUT_SEED = 12345


def _device(name: str) -> torch.device:
    dev = torch.device("cuda:0" if name == "cuda" else name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available to this Torch ({torch.__version__})")
    return dev


def load_frozen_target(target_dir: str | Path, device: torch.device) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The target's config and tensors (float32, on ``device``, no gradients), validated as serving does."""
    ck = check_target(target_dir)
    arrays = read_arrays(ck)
    params: dict[str, torch.Tensor] = {}
    for name in list(arrays):
        params[name] = torch.from_numpy(arrays.pop(name)).to(device).requires_grad_(False)
    return ck.cfg, params


def init_head(cfg: ModelConfig, target: dict[str, torch.Tensor], how: str, seed: int,
              device: torch.device) -> dict[str, torch.nn.Parameter]:
    """The head's trainable tensors. ``last-layer``: the block is a copy of the target's last decoder
    layer and ``eh_proj`` passes the normed hidden state through ([I | 0] plus small noise), so the
    untrained head already predicts roughly what the target's last layer does; ``random``: N(0, 0.02)."""
    shapes = mtp_tensor_shapes(cfg)
    arrays = init_params(cfg, seed, shapes)
    if how == "last-layer":
        last = f"model.layers.{cfg.num_hidden_layers - 1}."
        for name in shapes:
            if name.startswith(MTP_LAYER_PREFIX):
                arrays[name] = target[last + name[len(MTP_LAYER_PREFIX):]].detach().float().cpu().numpy().copy()
        d = cfg.hidden_size
        arrays["mtp.eh_proj.weight"][:, :d] += np.eye(d, dtype=np.float32)
    elif how != "random":
        raise ConfigError(f"--init={how!r} is invalid: must be 'last-layer' or 'random'")
    return {n: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(a)).to(device)) for n, a in arrays.items()}


def batch_at(stream: np.ndarray, batch: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Random windows int64 [batch, seq_len + 1] of ``stream``, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch)
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int64)


# --- checkpoints --------------------------------------------------------------------------------
def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(p for p in ckpt_dir.glob("step-*.pt") if _CKPT.match(p.name)) if ckpt_dir.is_dir() else []
    return found[-1] if found else None


def _identity(cfg: ModelConfig, opts: DistillOptions) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the target (its config.json) and the loss's layout."""
    config = (Path(opts.target) / "config.json").read_bytes()
    return {"target_config_sha256": hashlib.sha256(config).hexdigest(),
            "head_shapes": {n: list(s) for n, s in mtp_tensor_shapes(cfg).items()}, "unroll": opts.unroll}


def save_checkpoint(ckpt_dir: Path, step: int, head: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
                    identity: dict[str, Any], history: list[dict[str, Any]], keep: int) -> Path:
    """``step-NNNNNNNN.pt`` (``step`` = steps done), written to a temporary name and renamed."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:08d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "head": {n: t.detach().cpu() for n, t in head.items()}, "opt": opt.state_dict(),
                "identity": identity, "history": history}, tmp)
    tmp.replace(path)
    # NOTE: older checkpoints are removed only after the new one is in place (a crash keeps one).
    for old in sorted(p for p in ckpt_dir.glob("step-*.pt") if _CKPT.match(p.name))[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path, head: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
                    identity: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("identity") != identity:
        raise CheckpointError(f"{path}: was written for another target or --unroll; use another --out "
                              f"or remove {path.parent}")
    with torch.no_grad():
        for name, t in head.items():
            t.copy_(state["head"][name].to(t.device))
    opt.load_state_dict(state["opt"])
    return int(state["step"]), list(state.get("history", []))


# --- held-out measurement -----------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_agreement(cfg: ModelConfig, target: dict[str, torch.Tensor], head: dict[str, torch.Tensor],
                             held: np.ndarray, opts: DistillOptions, ops: TorchOps, rope: Rope,
                             device: torch.device, batches: int = 4) -> list[float]:
    """Per pass 1..max(3, unroll): how often the head's argmax equals the target's (a proxy of
    per-position acceptance with true tokens fed back)."""
    n = max(3, opts.unroll)
    agree = []
    for b in range(batches):
        batch = torch.from_numpy(batch_at(held, min(opts.batch, 8), opts.seq_len, _HELDOUT_SEED, b)).to(device)
        hidden, logits = target_hidden(ops, target, cfg, rope, batch[:, :-1])
        res = mtp_unrolled_loss(ops, {**target, **head}, cfg, rope, batch, hidden, logits, n)
        agree.append(res.agree.cpu().numpy())
    return [round(float(x), 4) for x in np.mean(agree, 0)]


def heldout_prompts_ids(held: np.ndarray, n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens of the held-out stream, evenly spread, deterministic."""
    if length < 1 or held.size < length + 1 or n <= 0:
        return []
    starts = np.linspace(0, held.size - length - 1, num=n).astype(np.int64)
    return [held[s:s + length].astype(np.int64).tolist() for s in starts]


# --- the run ------------------------------------------------------------------------------------
def _check(opts: DistillOptions, cfg: ModelConfig) -> None:
    for name in ("steps", "batch", "seq_len", "unroll", "save_every", "keep"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(opts, name)} is invalid: must be >= 1")
    if opts.unroll >= opts.seq_len:
        raise ConfigError(f"--unroll={opts.unroll} is invalid: must be below --seq-len={opts.seq_len}")
    if opts.seq_len + 1 > cfg.max_position_embeddings:
        raise ConfigError(f"--seq-len={opts.seq_len} is invalid: must be below the target's "
                          f"max_position_embeddings={cfg.max_position_embeddings}")
    if opts.eval_prompts > 0 and opts.eval_k < 1:
        raise ConfigError(f"--eval-k={opts.eval_k} is invalid: must be >= 1 (or --eval-prompts 0)")
    if not 0.0 <= opts.distill <= 1.0:
        raise ConfigError(f"--distill={opts.distill} is invalid: must be in [0, 1]")


def run_distill(opts: DistillOptions, progress: Callable[..., Any] | None = None,
                say: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) the head, write ``mtp.safetensors`` and the acceptance JSON; returns the log.

    ``progress(total=, desc=, unit=, initial=)``: a tqdm-like bar factory (update, set_postfix, close).
    """
    target_dir = Path(opts.target)
    if not target_dir.is_dir():
        raise ConfigError(f"--target {target_dir}: no such directory")
    collect_files(opts.corpus)                          # a bad --corpus fails before the target is read
    out = Path(opts.out) if opts.out else target_dir
    device = _device(opts.device)
    if opts.cpu_threads:
        torch.set_num_threads(opts.cpu_threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True      # training only; serving stays strict fp32
    cfg, target = load_frozen_target(target_dir, device)
    _check(opts, cfg)
    tok = target_tokenizer(target_dir, cfg)
    corpus = load_token_corpus(opts.corpus, tok, opts.heldout_frac, min_heldout_tokens=opts.seq_len + 2)
    for name, stream in (("training", corpus.train), ("held-out", corpus.heldout)):
        if stream.size < opts.seq_len + 2:
            raise ConfigError(f"--corpus: the {name} stream has {stream.size} tokens, fewer than --seq-len+2="
                              f"{opts.seq_len + 2}")
    say(f"train-mtp: corpus {json.dumps(corpus.summary())}")
    ops = TorchOps(str(device), "float32")
    rope = Rope(ops, cfg, opts.seq_len + 1)
    torch.manual_seed(opts.seed)
    head = init_head(cfg, target, opts.init, opts.seed + 100, device)
    opt = make_optimizer(head, opts.lr, opts.weight_decay)
    identity = _identity(cfg, opts)
    ckpt_dir = out / CKPT_DIR
    start, history = 0, []
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        start, history = load_checkpoint(latest, head, opt, identity)
        say(f"train-mtp: resuming from {latest} (step {start} of {opts.steps})")
    warmup = min(opts.warmup, max(1, opts.steps // 10))
    bar = progress(total=opts.steps, desc="train-mtp", unit="step", initial=start) if progress else None
    t0 = time.time()
    step = start
    stopped_early = False
    while step < opts.steps:
        if opts.budget_s > 0 and time.time() - t0 > opts.budget_s:
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, opts.steps, warmup, opts.lr)
        batch = torch.from_numpy(batch_at(corpus.train, opts.batch, opts.seq_len, opts.seed, step)).to(device)
        hidden, logits = target_hidden(ops, target, cfg, rope, batch[:, :-1])
        res = mtp_unrolled_loss(ops, {**target, **head}, cfg, rope, batch, hidden, logits, opts.unroll, opts.distill)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(list(head.values()), opts.grad_clip)
        opt.step()
        step += 1
        if step % opts.log_every == 0 or step == opts.steps or step == start + 1:
            row = {"step": step, "loss": round(float(res.loss.detach()), 4),
                   "agree": [round(float(x), 3) for x in res.agree.cpu()], "time_s": round(time.time() - t0, 1)}
            history.append(row)
            if bar is None:
                say(f"train-mtp: step {step}/{opts.steps} loss={row['loss']} agree={row['agree']}")
            else:
                bar.set_postfix(loss=row["loss"], agree=row["agree"][0], refresh=False)
        if bar is not None:
            bar.update(1)
        if step % opts.save_every == 0 and step < opts.steps:
            save_checkpoint(ckpt_dir, step, head, opt, identity, history, opts.keep)
    if bar is not None:
        bar.close()
    if step > start or latest is None:
        save_checkpoint(ckpt_dir, step, head, opt, identity, history, opts.keep)
    if stopped_early:
        say(f"train-mtp: --budget-s {opts.budget_s:g} reached at step {step} of {opts.steps}; the same command "
            "resumes from the checkpoint")
    mtp_path = out / MTP_FILE
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.save_safetensors(mtp_path, to_arrays(head))
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "target": str(target_dir), "mtp": str(mtp_path),
        "steps_done": step, "steps": opts.steps, "resumed_from": start or None, "wall_s": round(time.time() - t0, 1),
        "device": str(device), "torch": torch.__version__, "corpus": corpus.summary(),
        "teacher_forced_agree_per_pass": teacher_forced_agreement(cfg, target, head, corpus.heldout, opts, ops, rope,
                                                                  device)}
    say(f"train-mtp: wrote {mtp_path}; held-out teacher-forced agreement per pass "
        f"{report['teacher_forced_agree_per_pass']}")
    room = cfg.max_position_embeddings - opts.eval_tokens - opts.eval_k     # prompt positions the model has left
    prompts = heldout_prompts_ids(corpus.heldout, opts.eval_prompts, min(opts.eval_prompt_len, room))
    if prompts:
        del target, head                                # the engine loads its own copy from the files
        acc = measure_acceptance_ids(target_dir, mtp_path, prompts, str(device), k=opts.eval_k,
                                     max_tokens=opts.eval_tokens)
        report["acceptance"] = acc
        say(f"train-mtp: held-out greedy acceptance per position (k={acc['k']}, {acc['prompts']} prompts x "
            f"{acc['max_tokens']} tokens): {acc['per_position']}; tokens/round {acc['tokens_per_round']}")
    (out / ACCEPTANCE_FILE).write_text(json.dumps(report, indent=1) + "\n")
    (out / LOG_FILE).write_text(json.dumps({"options": asdict(opts), "history": history, **report}, indent=1,
                                           default=str) + "\n")
    return report
