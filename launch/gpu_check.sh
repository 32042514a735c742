#!/usr/bin/env bash
# The one prepared GPU run (for a lent GPU machine, a few minutes on one H100/H200):
#   1. single-device correctness: tests/gpu (cuDNN and flash kernels, the fused merge, bf16/fp16 against the
#      fp32/fp64 reference with TransformerEngine's tolerances: bf16 2.5e-2, fp16 1e-2 relative);
#   2. every local kernel timed on one rank's share (is kernel=auto the fastest?), then the benchmark of
#      BENCHMARKS.md: every backend simulated at N = 8 and 16 on one GPU, bf16, 32 heads × 128,
#      causal, S = 128k, forward and forward+backward, with the best kernel (kernel=auto), and each row's slowest
#      rank profiled once (--profile: kernel, merge, copies, other, gaps);
#   3. the same at N = 8 with packed documents of 4k tokens (the varlen kernels, the plan ms column).
# Needs a GPU with a CUDA build of torch (it stops after the device line without one) and pytest; installs
# nothing. Results go to $OUT (default ./gpu-results):
# pytest.txt, bench.txt, bench.json, bench.png, docs.txt, docs.json.
# Each step has its own time limit (seconds; estimated on an H200: ~1, ~3 and ~1 minutes), so that one that hangs
# or runs long still leaves the others their time, and the whole run fits one device call of 10 minutes with
# room for the machine's start: GPU_CHECK_LIMITS="pytest bench docs" (default "120 300 120"). Output is
# unbuffered and the benchmark prints each row on stderr as it finishes (the targets' forward+backward rows
# first), so a step cut off at its limit still shows what it measured; a GPU test running over 90 s prints every
# thread's stack (faulthandler) before its step's limit.
# Usage: bash launch/gpu_check.sh [python]   (default: python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${1:-python3}"
out="${OUT:-gpu-results}"
read -r t_pytest t_bench t_docs <<<"${GPU_CHECK_LIMITS:-120 300 120}"
for t in "$t_pytest" "$t_bench" "$t_docs"; do
    [[ "$t" =~ ^[1-9][0-9]*$ ]] || { echo "GPU_CHECK_LIMITS must be three whole seconds, e.g. \"120 300 120\"" \
                                     "(got \"${GPU_CHECK_LIMITS:-}\")" >&2; exit 2; }
done
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY' | tee "$out/device.txt"   # no GPU: stop here (the benchmark would run its 128k rows on the CPU)
import datetime, sys, torch
print(f"{datetime.date.today()}: torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
if not torch.cuda.is_available():
    sys.exit("launch/gpu_check.sh needs a GPU and a CUDA build of torch; this torch sees no GPU "
             "(on a CPU machine run the tests with bash launch/test.sh, the benchmark with ctx-plugin bench --smoke)")
PY
export PYTHONUNBUFFERED=1
status=0   # each step runs even when one before it failed; the script exits with the last failure (124: a limit)
limit() { local secs="$1"; shift; timeout -k 15 "$secs" "$@"; }
limit "$t_pytest" "$py" -m pytest -q -rs -o faulthandler_timeout=90 tests/gpu 2>&1 | tee "$out/pytest.txt" || status=$?
limit "$t_bench" "$py" -m ctx_plugin.cli bench --compare-kernels --ranks 8 16 --seq-len 128k --heads 32 --head-dim 128 \
    --dtype bf16 --reps 5 --passes fwd+bwd fwd --profile --json "$out/bench.json" --plot "$out/bench.png" 2>&1 | tee "$out/bench.txt" || status=$?
limit "$t_docs" "$py" -m ctx_plugin.cli bench --backends zigzag striped allgather ulysses --ranks 8 --seq-len 128k \
    --heads 32 --head-dim 128 --dtype bf16 --doc-len 4k --reps 3 --json "$out/docs.json" 2>&1 | tee "$out/docs.txt" \
    || status=$?
exit "$status"
