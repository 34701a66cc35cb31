#!/usr/bin/env bash
# Session 23 on one GPU (issue 10): why adaptive k loses to the best fixed k on the GPU (0.85-0.92 on an H100 in
# session 23's first call, where the trace simulation of the same regime says ~0.98-1.07), and why a target-only round
# through the services at batch 8 takes ~2 ms of target step where the in-process step takes ~0.5.
#
#   bash bench/gpu_session23.sh OUT_DIR trace    # bench adaptive --drafting-probes with every request-round recorded
#                                                # (scripts/round_probe: the cost model's T(0), T(k) and each
#                                                # request's E(k) too), summarized by scripts/round_trace.py; then
#                                                # the target's round host in process at batch 8, target-only;
#                                                # REPEATS=N: bench adaptive --repeats N, and nothing after it
#   bash bench/gpu_session23.sh OUT_DIR profile  # Torch profiler passes: the round host at batch 8 target-only against
#                                                # the in-process engine (bench profile --small); at batch 1 on a
#                                                # random prompt, target-only against adaptive k with a draft service
#   bash bench/gpu_session23.sh OUT_DIR k0       # at batch 1 on a random prompt, every round recorded: adaptive k
#                                                # with a draft service, then k = 0 requests beside a draft service;
#                                                # then bench adaptive --drafting-probes
#   bash bench/gpu_session23.sh OUT_DIR split    # the target's verify timed in parts (before the host copy's wait,
#                                                # the wait, after), k = 0 requests beside a draft against adaptive
#                                                # k, twice in turn; then bench adaptive --drafting-probes --repeats 2
#   bash bench/gpu_session23.sh OUT_DIR same     # bench adaptive --same-stack --repeats 3 (the fixed columns as
#                                                # fixed_k requests on the adaptive stack), traced: what session 24
#                                                # should run first
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-trace}"
gpu_prologue
if [ "$mode" = trace ]; then
  mkdir -p "$out/rt"
  ROUND_PROBE_DIR="$out/rt" PYTHONPATH="$PWD/scripts/round_probe:$PYTHONPATH" timeout 300 python3 -m specsplit \
    bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 --drafting-probes \
    --repeats "${REPEATS:-1}" 2>&1 | quiet | tee "$out/adaptive.txt" | tail -10
  python3 scripts/round_trace.py "$out/rt" 2>&1 | tee "$out/round_trace.txt"
  if [ -z "${REPEATS:-}" ] && [ "$(left)" -gt 60 ]; then
    timeout "$(left)" python3 scripts/round_host_probe.py models/tiny cuda:0 8 128 --outbox --profile 25 2>&1 | quiet \
      | tee "$out/probe_b8_target_only.txt" | head -40
  fi
elif [ "$mode" = profile ]; then
  probe() { local name="$1" limit="$2"; shift 2
    timeout "$limit" python3 scripts/round_host_probe.py models/tiny cuda:0 "$@" 2>&1 | quiet | tee "$out/$name.txt" \
      | grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* /" | head -40; }
  probe b8_target_only 100 8 128 --outbox --torch-profile 10
  timeout 120 python3 -m specsplit bench profile --device cuda:0 --small --batch 8 --max-tokens 64 2>&1 | quiet \
    | tee "$out/engine_b8.txt" | head -40
  probe b1_random_target_only 90 1 128 --outbox --random-prompt --torch-profile 8
  [ "$(left)" -gt 60 ] && probe b1_random_adaptive "$(left)" 1 128 --outbox --random-prompt --draft cuda:0 \
    --adaptive --torch-profile 8 --profile 25
elif [ "$mode" = k0 ]; then
  probe() { local name="$1" limit="$2"; shift 2
    timeout "$limit" python3 scripts/round_host_probe.py models/tiny cuda:0 "$@" 2>&1 | quiet | tee "$out/$name.txt" \
      | head -8; }
  mkdir -p "$out/rt_adaptive" "$out/rt_k0"
  ROUND_PROBE_DIR="$out/rt_adaptive" PYTHONPATH="$PWD/scripts/round_probe:$PYTHONPATH" \
    probe b1_random_adaptive 100 1 128 --outbox --random-prompt --draft cuda:0 --adaptive
  python3 scripts/round_trace.py "$out/rt_adaptive" 2>&1 | tee "$out/round_trace_adaptive.txt"
  ROUND_PROBE_DIR="$out/rt_k0" PYTHONPATH="$PWD/scripts/round_probe:$PYTHONPATH" \
    probe b1_random_k0_draft 100 1 128 --outbox --random-prompt --draft cuda:0 --k 0
  python3 scripts/round_trace.py "$out/rt_k0" 2>&1 | tee "$out/round_trace_k0.txt"
  [ "$(left)" -gt 100 ] && timeout "$(left)" python3 -m specsplit bench adaptive --backend torch --device cuda:0 \
    --prompts 8 --max-tokens 128 --drafting-probes 2>&1 | quiet | tee "$out/adaptive.txt" | tail -10
elif [ "$mode" = split ]; then
  for round in 1 2; do
    for v in "--k 0" "--adaptive"; do
      echo "== round $round: $v"
      timeout 100 python3 scripts/round_host_probe.py models/tiny cuda:0 1 128 --outbox --random-prompt --draft cuda:0 \
        $v --verify-split 2>&1 | quiet | grep -E "^run|verify" | tee -a "$out/split.txt"
    done
  done
  [ "$(left)" -gt 150 ] && timeout "$(left)" python3 -m specsplit bench adaptive --backend torch --device cuda:0 \
    --prompts 8 --max-tokens 128 --drafting-probes --repeats 2 2>&1 | quiet | tee "$out/adaptive.txt" | tail -10
elif [ "$mode" = same ]; then
  mkdir -p "$out/rt"
  ROUND_PROBE_DIR="$out/rt" PYTHONPATH="$PWD/scripts/round_probe:$PYTHONPATH" timeout 420 python3 -m specsplit \
    bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 --same-stack --repeats 3 2>&1 \
    | quiet | tee "$out/adaptive_same.txt" | tail -10
  python3 scripts/round_trace.py "$out/rt" 2>&1 | tee "$out/round_trace.txt"
else
  echo "unknown mode $mode"; exit 2
fi
