"""Training the target and its MTP draft head (``specsplit train``), with Torch autograd.

Owns: the training recipe of the bundled tiny model — parameter init, the
next-token loss of the target, the *unrolled* MTP loss (the head trained on
its own output hidden states for k substeps, exactly as the draft engine runs
it), AdamW with warmup + cosine, a time budget, checkpoint export in the
serving layout, and an optional held-out acceptance check through the real
inference path (``runtime.engine.SpecEngine``).

Every forward goes through ``runtime/model.py`` over ``TorchOps``: what is
trained is exactly what is served. Must not know: gRPC, services, Paddle,
structlog (this runs on machines that have neither).

The unrolled MTP loss itself is ``runtime/backends/torch_unroll.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from runtime import checkpoint
from runtime.backends.torch_ops import TorchOps
from runtime.backends.torch_unroll import causal_mask, mtp_unrolled_loss, target_hidden
from runtime.config import ModelConfig
from runtime.corpus import BatchSampler, Corpus, heldout_prompts, load_corpus
from runtime.model import Rope, init_params, lm_head, mtp_tensor_shapes, target_forward, target_tensor_shapes
from runtime.tokenizer import ByteTokenizer

try:  # optional: plain prints without it (the GPU image may lack it)
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover
    _tqdm = None

MTP_NAIVE_FILE = "mtp_naive.safetensors"
PROMPTS_FILE = "heldout_prompts.json"
LOG_FILE = "train_log.json"


# ---------------------------------------------------------------------------
# Model construction
# ---------------------------------------------------------------------------


def tiny_config(hidden_size: int = 256, num_hidden_layers: int = 8, num_attention_heads: int = 4,
                num_key_value_heads: int = 2, intermediate_size: int = 704) -> ModelConfig:
    """The bundled default: byte vocabulary, Llama architecture, untied head, fp32."""
    tok = ByteTokenizer()
    return ModelConfig(vocab_size=tok.vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                       num_key_value_heads=num_key_value_heads, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32",
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def make_params(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], seed: int, device: str,
                n_residual_layers: int) -> dict[str, torch.nn.Parameter]:
    """Trainable params: norms 1, projections N(0, 0.02); the projections that write
    into the residual stream (o_proj, down_proj) scaled by 1/sqrt(2 * layers)."""
    arrays = init_params(cfg, seed, shapes)
    scale = 1.0 / math.sqrt(2.0 * n_residual_layers)
    out = {}
    for name, arr in arrays.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            arr = arr * scale
        out[name] = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(arr)).to(device))
    return out


def to_arrays(params: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: t.detach().float().cpu().numpy() for n, t in params.items()}


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


def target_loss(ops: TorchOps, p: dict[str, torch.Tensor], cfg: ModelConfig, rope: Rope,
                batch: torch.Tensor) -> torch.Tensor:
    """batch int64 [B, T+1] -> mean next-token cross-entropy (nats)."""
    inp, lab = batch[:, :-1], batch[:, 1:]
    b, t = inp.shape
    cos_sin = rope.tables(ops, torch.arange(t, device=inp.device)[None])
    hidden = target_forward(ops, p, cfg, inp, None, None, train_mask=causal_mask(t, inp.device).expand(b, t, t),
                            cos_sin=cos_sin)                                              # [B, T, d]
    logits = lm_head(ops, p, cfg, hidden)                                                 # [B, T, V]
    return F.cross_entropy(logits.reshape(b * t, -1), lab.reshape(b * t))


# ---------------------------------------------------------------------------
# Optimisation
# ---------------------------------------------------------------------------


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float = 0.1) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, cosine down to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(params: dict[str, torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    fused = all(p.is_cuda for p in params.values())
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


class _Progress:
    """tqdm when available (and wanted), plain periodic prints otherwise."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.bar = _tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0) if (enabled and _tqdm) else None
        self._last = time.time()

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def update(self, post: dict[str, Any] | None) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            if post:
                self.bar.set_postfix(post, refresh=False)
        elif post and (time.time() - self._last > 10 or self.n == self.total):
            self._last = time.time()
            print(f"{self.desc} {self.n}/{self.total} " + " ".join(f"{k}={v}" for k, v in post.items()), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit(desc: str, groups: list[tuple[dict[str, torch.nn.Parameter], torch.optim.Optimizer]],
        step_fn: Callable[[int], tuple[list[torch.Tensor], dict[str, torch.Tensor]]],
        steps: int, warmup: int, lrs: list[float], clip: float, budget_s: float, device: torch.device,
        progress: bool, log_every: int = 25) -> dict[str, Any]:
    """Generic loop: ``step_fn(step)`` returns one loss per (params, optimizer) group
    plus detached metrics. With ``budget_s`` > 0 the step count is cut, after a short
    timing, so the stage ends within the budget (the cosine follows the new count)."""
    history: list[dict[str, Any]] = []
    bar = _Progress(steps, desc, progress)
    t0 = time.time()
    t_mark, mark_step = None, 3
    step = 0
    while step < steps:
        for (params, opt), peak in zip(groups, lrs):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, warmup, peak)
        losses, metrics = step_fn(step)
        for (params, opt), loss in zip(groups, losses):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
            opt.step()
        if step == mark_step:
            _sync(device)
            t_mark = time.time()
        if budget_s > 0 and step == mark_step + 10:
            _sync(device)
            per_step = (time.time() - t_mark) / 10
            fit_steps = int((budget_s - (time.time() - t0)) / per_step) + step + 1
            if fit_steps < steps:
                fit_steps = max(fit_steps, step + 2)
                print(f"{desc}: {per_step * 1e3:.1f} ms/step; cutting {steps} steps to {fit_steps} "
                      f"to fit the {budget_s:.0f} s budget", flush=True)
                steps = fit_steps
                bar.set_total(steps)
        post = None
        if step % log_every == 0 or step == steps - 1:
            row = {"step": step, "lr": round(lr_at(step, steps, warmup, lrs[0]), 6),
                   "time_s": round(time.time() - t0, 1)}
            row.update({f"loss{i}": round(float(loss.detach()), 4) for i, loss in enumerate(losses)})
            row.update({k: [round(x, 4) for x in v.detach().float().cpu().reshape(-1).tolist()]
                        if v.numel() > 1 else round(float(v), 4) for k, v in metrics.items()})
            history.append(row)
            post = {k: v for k, v in row.items() if k.startswith("loss")}
        bar.update(post)
        step += 1
    _sync(device)
    bar.close()
    return {"steps": steps, "wall_s": round(time.time() - t0, 1), "history": history}


# ---------------------------------------------------------------------------
# The two stages
# ---------------------------------------------------------------------------


def train_target(cfg: ModelConfig, corpus: Corpus, args: argparse.Namespace, ops: TorchOps,
                 device: torch.device) -> tuple[dict[str, torch.nn.Parameter], dict[str, Any]]:
    params = make_params(cfg, target_tensor_shapes(cfg), args.seed, str(device), cfg.num_hidden_layers)
    rope = Rope(ops, cfg, args.seq_len + 1)
    sampler = BatchSampler(corpus.train, args.batch, args.seq_len, args.seed)
    opt = make_optimizer(params, args.lr, args.weight_decay)

    def step_fn(step):
        batch = torch.from_numpy(sampler.next()).to(device, non_blocking=True)
        return [target_loss(ops, params, cfg, rope, batch)], {}

    warmup = min(args.warmup, max(1, args.steps // 10))
    log = fit("target", [(params, opt)], step_fn, args.steps, warmup, [args.lr], args.grad_clip,
              args.target_budget_s, device, args.progress)
    return params, log


def train_mtp_heads(cfg: ModelConfig, target: dict[str, torch.Tensor], corpus: Corpus, unrolls: list[int],
                    args: argparse.Namespace, ops: TorchOps, device: torch.device
                    ) -> tuple[list[dict[str, torch.nn.Parameter]], dict[str, Any]]:
    """Train one MTP head per entry of ``unrolls`` on the same batches (one frozen
    target forward per batch serves all of them)."""
    frozen = {n: t.detach().requires_grad_(False) for n, t in target.items()}
    rope = Rope(ops, cfg, args.seq_len + 1)
    sampler = BatchSampler(corpus.train, args.batch, args.seq_len, args.seed + 1)
    heads = [make_params(cfg, mtp_tensor_shapes(cfg), args.seed + 100 + i, str(device), 1)
             for i, _ in enumerate(unrolls)]
    groups = [(h, make_optimizer(h, args.mtp_lr, args.weight_decay)) for h in heads]

    def step_fn(step):
        batch = torch.from_numpy(sampler.next()).to(device, non_blocking=True)
        hidden, tlogits = target_hidden(ops, frozen, cfg, rope, batch[:, :-1])
        losses, metrics = [], {}
        for i, (head, n) in enumerate(zip(heads, unrolls)):
            out = mtp_unrolled_loss(ops, {**frozen, **head}, cfg, rope, batch, hidden, tlogits, n, args.mtp_distill)
            losses.append(out.loss)
            metrics[f"hard{i}_u{n}"] = out.hard
            metrics[f"agree{i}_u{n}"] = out.agree
        return losses, metrics

    warmup = min(args.warmup, max(1, args.mtp_steps // 10))
    log = fit("mtp", groups, step_fn, args.mtp_steps, warmup, [args.mtp_lr] * len(heads), args.grad_clip,
              args.mtp_budget_s, device, args.progress)
    log["unrolls"] = unrolls
    return heads, log


@torch.no_grad()
def heldout_metrics(cfg: ModelConfig, target: dict[str, torch.Tensor], heads: list[dict[str, torch.Tensor]],
                    unrolls: list[int], corpus: Corpus, args: argparse.Namespace, ops: TorchOps,
                    device: torch.device, batches: int = 4) -> dict[str, Any]:
    """Held-out target loss (nats/byte) and, per head, each pass's argmax agreement
    with the target (a teacher-forced proxy of per-substep acceptance, evaluated 3 deep)."""
    rope = Rope(ops, cfg, args.seq_len + 1)
    sampler = BatchSampler(corpus.heldout, min(args.batch, 16), args.seq_len, 12345)
    losses, agree = [], [[] for _ in heads]
    for _ in range(batches):
        batch = torch.from_numpy(sampler.next()).to(device)
        losses.append(float(target_loss(ops, target, cfg, rope, batch)))
        hidden, tlogits = target_hidden(ops, target, cfg, rope, batch[:, :-1])
        for i, head in enumerate(heads):
            out = mtp_unrolled_loss(ops, {**target, **head}, cfg, rope, batch, hidden, tlogits, max(3, unrolls[i]))
            agree[i].append(out.agree.cpu().numpy())
    return {"target_loss_nats": round(float(np.mean(losses)), 4),
            "target_bits_per_byte": round(float(np.mean(losses)) / math.log(2), 4),
            "mtp_agree_per_pass": {f"unroll{n}": [round(float(x), 4) for x in np.mean(a, 0)]
                                   for n, a in zip(unrolls, agree)}}


# ---------------------------------------------------------------------------
# Acceptance through the real inference path
# ---------------------------------------------------------------------------


def measure_acceptance(target_dir: str | Path, draft_path: str | Path, prompts: list[str], device: str = "cpu",
                       k: int = 3, max_tokens: int = 128) -> dict[str, Any]:
    """Greedy generation with SpecEngine (torch backend) over text ``prompts`` (byte tokenizer)."""
    tok = ByteTokenizer()
    return measure_acceptance_ids(target_dir, draft_path, [tok.encode(p) for p in prompts], device, k, max_tokens)


def measure_acceptance_ids(target_dir: str | Path, draft_path: str | Path, prompts: list[list[int]],
                           device: str = "cpu", k: int = 3, max_tokens: int = 128) -> dict[str, Any]:
    """Greedy generation with SpecEngine (torch backend) over token-id ``prompts``; pooled stats
    (``per_position``: the fraction of drafts at position 1..k that were accepted)."""
    from runtime.config import CacheConfig, EngineConfig, RuntimeConfig, SamplingParams, SpecConfig
    from runtime.engine import GenRequest, SpecEngine
    from runtime.round_driver import SeqStats

    max_len = max(len(i) for i in prompts) + max_tokens + k + 8
    max_len = 1 << max(8, (max_len - 1).bit_length())
    dev = "cuda:0" if device == "cuda" else device
    eng = SpecEngine(EngineConfig(str(target_dir), draft_path=str(draft_path),
                                  runtime=RuntimeConfig(backend="torch", device=dev),
                                  spec=SpecConfig(max_k=k, default_k=k),
                                  cache=CacheConfig(max_slots=len(prompts), max_len=max_len)))
    t0 = time.time()
    results = eng.generate([GenRequest(f"p{i}", tuple(x), SamplingParams(max_tokens=max_tokens), k=k)
                            for i, x in enumerate(prompts)])
    stats = SeqStats()
    for r in results:
        stats.merge(r.stats)
    return {"k": k, "prompts": len(prompts), "max_tokens": max_tokens,
            "per_position": [round(x, 4) for x in stats.per_position()],
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_round": round(stats.mean_accepted_length, 4),
            "spec_rounds": stats.spec_rounds, "wall_s": round(time.time() - t0, 1)}


# ---------------------------------------------------------------------------
# CLI surface (specsplit/cli.py calls add_train_args + run_train)
# ---------------------------------------------------------------------------


# Size settings and their values per recipe. A setting left out on the command line takes the
# recipe of the device: the GPU recipe made models/tiny (230 s on one H200; ~27 h on a 2-core CPU,
# 32 s/step); the CPU recipe trains a smaller model whose time budgets cut the step counts so that
# it finishes in about 5 minutes on 2 cores (fewer steps on a slower or busier machine). It runs
# Torch on one thread: with one thread per core, a busy neighbour made steps ~20x slower (measured:
# 11 s vs 0.47 s a step of this recipe on a loaded 2-core machine).
RECIPES: dict[str, dict[str, Any]] = {
    "gpu": dict(steps=3000, batch=64, seq_len=512, mtp_steps=1500, hidden_size=256, layers=8, heads=4, kv_heads=2,
                ffn=704, warmup=150, target_budget_s=0.0, mtp_budget_s=0.0, cpu_threads=0),
    "cpu": dict(steps=300, batch=8, seq_len=128, mtp_steps=200, hidden_size=128, layers=4, heads=4, kv_heads=2,
                ffn=352, warmup=30, target_budget_s=180.0, mtp_budget_s=90.0, cpu_threads=1),
}


def apply_recipe(args: argparse.Namespace) -> str:
    """Fill every size setting the command line left unset from the device's recipe; returns its name."""
    name = "cpu" if str(args.device).startswith("cpu") else "gpu"
    unset = [k for k in RECIPES[name] if getattr(args, k, None) is None]
    for key in unset:
        setattr(args, key, RECIPES[name][key])
    if unset:
        print(f"specsplit train: {name} recipe for {', '.join(unset)} (give them to override)", file=sys.stderr,
              flush=True)
    return name


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def sized(flag: str, kind: type, what: str) -> None:
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, default=None,
                       help=f"{what} (default: {RECIPES['gpu'][key]!r} on GPU, {RECIPES['cpu'][key]!r} on CPU)")

    p.add_argument("--out", required=True, help="output directory (target checkpoint + mtp files)")
    sized("--steps", int, "target training steps (0: load the target from --out)")
    sized("--batch", int, "sequences per step")
    sized("--seq-len", int, "bytes per sequence")
    sized("--mtp-steps", int, "MTP training steps (0: no MTP)")
    p.add_argument("--mtp-unroll", type=int, default=3, help="substeps the MTP is unrolled on its own hidden state")
    p.add_argument("--naive-head", action="store_true",
                   help=f"also train a one-step (unroll 1) head on the same batches into {MTP_NAIVE_FILE}")
    p.add_argument("--mtp-distill", type=float, default=1.0,
                   help="weight of the target's distribution in the MTP label (0: data token only)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the target")
    p.add_argument("--mtp-lr", type=float, default=2e-3, help="peak learning rate of the MTP head")
    sized("--warmup", int, "warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--corpus", default=None, help="directory of .py files (default: this Python's stdlib)")
    p.add_argument("--heldout-frac", type=float, default=0.05)
    sized("--hidden-size", int, "model width")
    sized("--layers", int, "decoder layers")
    sized("--heads", int, "attention heads")
    sized("--kv-heads", int, "key/value heads")
    sized("--ffn", int, "SwiGLU hidden width")
    sized("--target-budget-s", float, "cut target steps to fit this many seconds (0: no cut)")
    sized("--mtp-budget-s", float, "cut MTP steps to fit this many seconds (0: no cut)")
    sized("--cpu-threads", int, "Torch intra-op threads (0: Torch's default, one per core; on a shared CPU "
                                "one thread is many times faster)")
    p.add_argument("--shard-bytes", type=int, default=None, help="shard model.safetensors at this size")
    p.add_argument("--prompts", type=int, default=64, help=f"held-out prompts written to {PROMPTS_FILE}")
    p.add_argument("--eval-acceptance", action="store_true",
                   help="measure greedy k=3 acceptance on the held-out prompts with SpecEngine at the end")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="plain prints instead of tqdm")
    return p


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """Train (target, then MTP head[s]) and write the checkpoint to ``args.out``. Returns the log."""
    recipe = apply_recipe(args)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True      # training only; serving stays strict fp32
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    ops = TorchOps(str(device), "float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    corpus = load_corpus(args.corpus, args.heldout_frac)
    log: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if not callable(v)},
                           "recipe": recipe, "corpus": corpus.summary(), "torch": torch.__version__, "device": str(device),
                           "python": sys.version.split()[0]}
    if device.type == "cuda":
        log["gpu"] = torch.cuda.get_device_name(device)
    print(f"corpus: {json.dumps(corpus.summary())}", flush=True)
    prompts: list[str] = []
    if args.prompts:
        try:
            prompts = heldout_prompts(corpus, n=args.prompts, seed=args.seed)
        except ValueError as exc:  # a small corpus must not stop training
            print(f"warning: no held-out prompts: {exc}", flush=True)
    if prompts:
        (out / PROMPTS_FILE).write_text(json.dumps(prompts, indent=1) + "\n")

    if args.steps > 0:
        cfg = tiny_config(args.hidden_size, args.layers, args.heads, args.kv_heads, args.ffn)
        target, log["target"] = train_target(cfg, corpus, args, ops, device)
        checkpoint.save_target(out, cfg, to_arrays(target), shard_bytes=args.shard_bytes)
        print(f"target: {log['target']['steps']} steps in {log['target']['wall_s']} s, "
              f"final loss {log['target']['history'][-1]['loss0']}", flush=True)
    else:
        from runtime.weights import check_target, read_arrays
        ck = check_target(out)
        cfg = ck.cfg
        target = {n: torch.from_numpy(a).to(device) for n, a in read_arrays(ck).items()}

    unrolls = ([args.mtp_unroll] + ([1] if args.naive_head and args.mtp_unroll != 1 else [])) if args.mtp_steps else []
    if unrolls:
        heads, log["mtp"] = train_mtp_heads(cfg, target, corpus, unrolls, args, ops, device)
        files = ["mtp.safetensors", MTP_NAIVE_FILE]
        for head, fname in zip(heads, files):
            checkpoint.save_safetensors(out / fname, to_arrays(head))
        print(f"mtp: {log['mtp']['steps']} steps in {log['mtp']['wall_s']} s, last "
              f"{ {k: v for k, v in log['mtp']['history'][-1].items() if k != 'lr'} }", flush=True)
        log["heldout"] = heldout_metrics(cfg, target, heads, unrolls, corpus, args, ops, device)
        print(f"held-out: {json.dumps(log['heldout'])}", flush=True)
        if args.eval_acceptance and prompts:
            log["acceptance"] = {}
            for n, fname in zip(unrolls, files):
                try:
                    acc = measure_acceptance(out, out / fname, prompts, args.device, k=3, max_tokens=128)
                except Exception as exc:  # the check must never cost the trained weights
                    acc = {"error": f"{type(exc).__name__}: {exc}"}
                log["acceptance"][f"unroll{n}"] = acc
                print(f"acceptance unroll{n} ({fname}): {json.dumps(acc)}", flush=True)
    log["total_wall_s"] = round(time.time() - t_start, 1)
    (out / LOG_FILE).write_text(json.dumps(log, indent=1, default=str) + "\n")
    return log


def main_train(argv: list[str] | None = None) -> int:
    parser = add_train_args(argparse.ArgumentParser(prog="specsplit train", description=__doc__.split("\n")[0]))
    run_train(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main_train())
