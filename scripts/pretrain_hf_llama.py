"""Pre-train a small transformers ``LlamaForCausalLM`` on the bundled corpus, with transformers itself.

A target that specsplit's own trainer never touched, for showing ``specsplit
train-mtp`` on a Hugging Face checkpoint (docs/models.md): random init by
transformers, a plain AdamW loop over the model's own forward (``labels=``),
the byte vocabulary of the bundled model (ids 0..255 bytes, 256 BOS, 257 EOS;
no tokenizer.json, so specsplit uses its byte tokenizer) and the bundled
corpus (this Python's standard library, ``runtime/corpus.py``). Written with
``save_pretrained``.

    python scripts/pretrain_hf_llama.py --out /tmp/hf-llama --budget-s 240

Needs transformers (a test dependency, requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.corpus import BatchSampler, load_corpus  # noqa: E402
from runtime.tokenizer import ByteTokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (save_pretrained)")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000, help="step count of the schedule (the budget may cut it)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop after this many seconds (0: none)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="Torch threads (one is fastest on a shared CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = ByteTokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(cfg).to(args.device)
    model.train()
    corpus = load_corpus()
    sampler = BatchSampler(corpus.train, args.batch, args.seq_len, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    t0 = time.time()
    step, loss = 0, float("nan")
    for step in range(args.steps):
        if args.budget_s and time.time() - t0 > args.budget_s:
            break
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = torch.from_numpy(sampler.next()).to(args.device)
        out = model(input_ids=batch, labels=batch)          # transformers shifts the labels itself
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = float(out.loss.detach())
        if step % 50 == 0:
            print(f"step {step} loss {loss:.3f} ({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    model.save_pretrained(args.out)
    summary = {"steps": step + 1, "final_loss_nats": round(loss, 4), "wall_s": round(time.time() - t0, 1),
               "transformers": transformers.__version__, "torch": torch.__version__, "out": args.out}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
