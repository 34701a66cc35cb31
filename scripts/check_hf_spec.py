"""Serve a transformers checkpoint with ``specsplit up`` and compare three greedy outputs per prompt.

Starts ``specsplit up --model DIR`` (with the directory's ``mtp.safetensors``,
Torch backend, a free port), then for held-out prompts of the bundled corpus
(or ``--prompt``) generates greedily through the orchestrator speculatively
(k=3) and target-only (k=0), and with transformers' own ``generate`` on the
same directory; prints one JSON object and exits 1 unless all three agree on
every prompt.

    python scripts/check_hf_spec.py --model /tmp/hf-llama

Needs transformers (a test dependency, requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.client import SpecsplitClient  # noqa: E402
from runtime.corpus import heldout_prompts, load_corpus  # noqa: E402
from runtime.tokenizer import load_tokenizer  # noqa: E402


def _first_json_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The ``up`` addresses line (bounded in time; other lines skipped)."""
    import select

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"specsplit up exited ({proc.poll()})")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "orchestrator" in obj:
            return obj
    raise TimeoutError("specsplit up printed no addresses in time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory with mtp.safetensors")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts of the bundled corpus")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt of your own (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    import torch
    import transformers

    tok = load_tokenizer(args.model if (Path(args.model) / "tokenizer.json").is_file() else "byte")
    prompts = args.prompt or heldout_prompts(load_corpus(), n=args.prompts, seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    up = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "up", "--model", args.model,
                           "--backend", "torch", "--port", "0"], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    rows, same = [], True
    try:
        address = _first_json_line(up, 300)["orchestrator"]
        with SpecsplitClient(address, timeout=300) as client:
            for p in prompts:
                ids = tok.encode(p)
                spec = client.generate_text(ids, args.max_tokens, k=3, ignore_eos=True)
                plain = client.generate_text(ids, args.max_tokens, k=0, ignore_eos=True)
                with torch.no_grad():
                    x = torch.tensor([ids])
                    hf = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_tokens,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
                ok = list(spec.tokens) == list(plain.tokens) == hf
                same &= ok
                rows.append({"prompt_tokens": len(ids), "identical": ok,
                             "acceptance_rate": round(spec.acceptance_rate, 4),
                             "tokens_per_round": round(spec.mean_accepted_length, 3)})
    finally:
        up.terminate()
        up.wait(60)
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "all_identical": same, "prompts": rows}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
