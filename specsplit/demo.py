"""``specsplit demo`` / ``make demo``: one streamed generation through the running stack.

Owns: picking a prompt (a held-out prompt of the bundled model unless one is
given), streaming the text as it arrives, then printing the acceptance
statistics of the speculative run and of a target-only run of the same
prompt, side by side, with whether the greedy outputs were identical.

Must not know: how the stack was started.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from orchestrator.client import SpecsplitClient

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "tiny" / "heldout_prompts.json"


def default_prompt() -> str:
    try:
        return json.loads(HELDOUT.read_text())[0]
    except (OSError, ValueError, IndexError):
        return "def fibonacci(n):\n    "


def run_demo(address: str, args) -> int:
    prompt = args.prompt or default_prompt()
    out = sys.stdout
    out.write(f"orchestrator at {address}\n--- prompt ---\n{prompt}\n--- speculative generation (k={args.k}) ---\n")
    with SpecsplitClient(address, timeout=300.0) as client:
        t0 = time.perf_counter()
        final = None
        for event in client.generate(prompt, max_tokens=args.max_tokens, k=args.k):
            if event.final:
                final = event
            elif event.text:
                out.write(event.text)
                out.flush()
        spec_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = client.generate_text(prompt, max_tokens=args.max_tokens, k=0)
        ref_s = time.perf_counter() - t0
    assert final is not None, "the stream ended without a final message"
    out.write("\n--- statistics ---\n")
    per_pos = " / ".join(f"{x:.2f}" for x in final.acceptance_per_position)
    out.write(f"speculative: {final.completion_tokens} tokens in {spec_s:.2f}s, acceptance {final.acceptance_rate:.2f}, "
              f"per position {per_pos}, {final.mean_accepted_length:.2f} tokens/round, finish={final.finish_reason}\n")
    out.write(f"target-only: {len(ref.tokens)} tokens in {ref_s:.2f}s\n")
    out.write(f"identical greedy output: {list(ref.tokens) == list(final.tokens)}\n")
    return 0
