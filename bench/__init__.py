"""``specsplit bench ...``: benchmarks that print ratios measured side by side in one run.

Owns: the bench subcommand's arguments and dispatch; each benchmark lives in
its own module and is imported only when run (so the CLI stays light).
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "engine": "bench.engine",      # in-process spec vs target-only (issue 2)
    "services": "bench.services",  # through the gRPC services (issue 3)
    "graphs": "bench.graphs",      # CUDA graphs vs eager vs bare floor (issue 4)
    "reload": "bench.reload",      # weight reload phases, IN_PLACE vs RECAPTURE vs reading the checkpoint (issue 5)
    "load": "bench.load",          # N concurrent clients for T seconds: latency percentiles, throughput, RSS (issue 6)
    "profile": "bench.profile_round",  # torch.profiler summary of one round at batch 1 (issue 10)
    "attention": "bench.attention",  # decode attention variants, torch.compile of the verify step (issue 10)
    "round-parts": "bench.round_parts",  # one round's parts: engine vs worker vs service (issue 10)
    "peer": "bench.peer",          # transformers static cache vs engine vs services, bandwidth floor (issue 10)
    "sampling-modes": "bench.sampling_modes",  # rejection vs coupled speculative sampling: acceptance (issue 17)
    "tp": "bench.tp",              # target verify step, one device vs tensor-parallel (issue 14)
    "propose-host": "bench.propose_host",  # host µs per registry step and per greedy Propose, replays stubbed
    "gemm": "bench.gemm",          # the ~1B projections at decode shapes: cuBLAS layouts / libraries (issue 10)
    "gemm-pdl": "bench.gemm_pdl",  # decode GEMMs as programmatic dependent launches that read ahead (issue 10)
    "prefill": "bench.prefill",    # a prefill eager vs replayed from a prefill graph, target and draft (issue 10)
    "adaptive": "bench.adaptive",  # adaptive k vs every fixed k on prompts where drafting pays and where not (issue 10)
}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=sorted(BENCHES))
    p.add_argument("--backend", default="paddle", choices=("paddle", "torch"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="target dir (default: the bundled tiny model)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts to decode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="*", default=None, help="batch sizes (services bench)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--small", action="store_true", help="reload bench: a small config instead of ~1B (CPU); peer: the bundled model only; "
                   "profile: the bundled model in process at each --batch; gemm: the bundled model's float32 projections")
    p.add_argument("--large", action="store_true", help="peer: the ~1B random bf16 config only (not the bundled model)")
    p.add_argument("--compile", action="store_true", help="attention: also time torch.compile of the verify step; graphs / profile / peer: "
                   "run the engines and services with runtime.compile on")
    p.add_argument("--sweep", action="store_true", help="gemm: also time a grid of split-K launch shapes for each "
                   "projection at 4 rows and print the best ones")
    p.add_argument("--repeats", type=int, default=1, help="adaptive bench: interleaved repeats of every cell (medians)")
    p.add_argument("--drafting-probes", action="store_true",
                   help="adaptive bench: also a column of adaptive k whose probes draft and verify (spec.watch_probes "
                        "off), on a stack of its own")
    p.add_argument("--fresh-stacks", action="store_true",
                   help="adaptive bench: start both stacks anew for every repeat, the adaptive one first on "
                        "odd repeats (default: one pair of stacks, fixed k first, for all repeats)")
    p.add_argument("--same-stack", action="store_true",
                   help="adaptive bench: the fixed-k columns as requests with fixed_k on the adaptive stack, not on "
                        "a stack of their own (no stack-to-stack speed difference in the ratios)")
    p.add_argument("--seconds", type=float, default=40.0, help="load bench: how long the clients run; gemm --sweep: "
                   "the seconds of grid timed per projection")
    p.add_argument("--draft-device", default=None, help="services bench: the draft's device (default: --device)")
    p.add_argument("--dtype", default=None, help="services bench: the workers' compute dtype (default: theirs)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="services bench: the workers with runtime.batch_invariant (Torch on CUDA)")
    p.add_argument("--draft-dtype", nargs="+", default=None,
                   help="services bench: the draft's compute dtype alone, side by side (after --dtype; the "
                        "target's output does not depend on it, only the acceptance does)")
    p.add_argument("--temperatures", type=float, nargs="*", default=[1.0, 0.7],
                   help="sampling-modes bench: the sampling temperatures")
    p.add_argument("--tp", type=int, nargs="+", default=None,
                   help="tp bench: tensor-parallel rank counts to time side by side (default 2; one GPU per rank "
                        "from --device); services bench: the target's rank counts, side by side (default 1)")
    p.add_argument("--stream-interval", type=int, nargs="+", default=None,
                   help="services bench: the orchestrator's stream_interval values, side by side (default 1)")
    p.add_argument("--poll-us", type=int, nargs="+", default=None,
                   help="services bench: the workers' data_plane_poll_us values, side by side (default: theirs, -1 = auto)")
    p.add_argument("--colocated-draft", action="store_true",
                   help="peer: also the services with the draft in the target's process (colocated_draft); "
                        "adaptive: every stack so")
    p.add_argument("--variants", nargs="*", default=None,
                   help="services bench: round-loop variants side by side: fixed, ahead, adaptive, ahead+adaptive, "
                        "micro, micro+adaptive; colocated (the draft in the target's process), colocated+ahead, "
                        "colocated+adaptive, colocated+micro, colocated+host-drafts (its drafts through the host)")


def run_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHES[args.which]).main(args)
