#!/usr/bin/env bash
# The one prepared GPU run (for a lent GPU machine, a few minutes on one H100/H200):
#   1. single-device correctness: tests/gpu (cuDNN and flash kernels, the fused merge, bf16/fp16 against the
#      fp32/fp64 reference with TransformerEngine's tolerances: bf16 2.5e-2, fp16 1e-2 relative; the dQ of a
#      524k-row flash backward past FlashAttention-2's int32 offsets, ~60 GiB and ~30 s; offload's registered
#      host buffers);
#   2. every local kernel timed on one rank's share (is kernel=auto the fastest?), then the benchmark of
#      BENCHMARKS.md: every backend simulated at N = 8 and 16 on one GPU, bf16, 32 heads × 128,
#      causal, S = 128k, forward and forward+backward, with the best kernel (kernel=auto), and each row's slowest
#      rank profiled once (--profile: kernel, merge, copies, other, gaps); medians of 3 repetitions;
#   3. the same at N = 8 with packed documents of 4k tokens on torch's flash kernel (its varlen calls; cuDNN, auto's
#      pick, has none here), with the plan ms column.
# Needs a GPU with a CUDA build of torch (it stops after the device line without one) and pytest; installs
# nothing, fetches nothing. Results go to $OUT (default ./gpu-results), each written as it runs:
# device.txt, pytest.txt, bench.txt, bench.json, bench.png, docs.txt, docs.json, and summary.txt (one line per
# step: "gpu_check: <step> PASS|FAIL (exit N)|TIMEOUT (limit N s) after N s", also on stdout).
# Each step has its own time limit (seconds; estimated on an H200: ~2, ~3.5 and ~1 minutes, the benchmark's data
# made on the host included; the pytest step's allows for an H100, slower on the 524k-row test), so that one that
# hangs or runs long still leaves the others their time:
# GPU_CHECK_LIMITS="pytest bench docs" (default "200 250 80"). At its limit a step gets SIGINT (pytest then prints
# its summary so far: failures, slowest tests; the benchmark its table, JSON and plot of the rows measured), 10 s
# later SIGKILL; with the device line the whole run takes at most
# ~9 minutes, inside one device call's 10. Output is unbuffered; failures are printed as they happen
# (tests/gpu/conftest.py) and the benchmark prints each row on stderr as it finishes (the targets'
# forward+backward rows first), so a step cut off at its limit still shows what it measured; a GPU test running
# over 90 s prints every thread's stack (faulthandler) before its step's limit.
# Usage: bash launch/gpu_check.sh [python]   (default: python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${1:-python3}"
out="${OUT:-gpu-results}"
read -r t_pytest t_bench t_docs <<<"${GPU_CHECK_LIMITS:-200 250 80}"
for t in "$t_pytest" "$t_bench" "$t_docs"; do
    [[ "$t" =~ ^[1-9][0-9]*$ ]] || { echo "GPU_CHECK_LIMITS must be three whole seconds, e.g. \"200 250 80\"" \
                                     "(got \"${GPU_CHECK_LIMITS:-}\")" >&2; exit 2; }
done
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY' | tee "$out/device.txt"   # no GPU: stop here (the benchmark would run its 128k rows on the CPU)
import datetime, sys, torch
gpu = "none"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    gpu = f"{p.name} (sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
try:
    import triton
    tri = triton.__version__
except Exception as e:  # noqa: BLE001 - the fused merge falls back to torch's
    tri = f"none ({type(e).__name__})"
print(f"{datetime.date.today()}: torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, triton {tri}, Python {sys.version.split()[0]}, device {gpu}")
if not torch.cuda.is_available():
    sys.exit("launch/gpu_check.sh needs a GPU and a CUDA build of torch; this torch sees no GPU "
             "(on a CPU machine run the tests with bash launch/test.sh, the benchmark with ctx-plugin bench --smoke)")
PY
export PYTHONUNBUFFERED=1
status=0   # each step runs even when one before it failed; the script exits with the last failure (124: a limit)
started=$SECONDS
step() {   # step NAME LIMIT FILE COMMAND...: COMMAND under its limit, its output to $out/FILE, a summary line
    local name="$1" secs="$2" file="$3" t0=$SECONDS rc=0 verdict=PASS
    shift 3
    timeout -s INT -k 10 "$secs" "$@" 2>&1 | tee "$out/$file" || rc=$?
    if ((rc == 124 || rc == 137)); then verdict="TIMEOUT (limit $secs s)"; elif ((rc != 0)); then verdict="FAIL (exit $rc)"; fi
    echo "gpu_check: $name $verdict after $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
    if ((rc != 0)); then status=$rc; fi
}
step pytest "$t_pytest" pytest.txt "$py" -m pytest -q -rfEs --tb=short --durations=15 -p no:cacheprovider \
    -o faulthandler_timeout=90 tests/gpu
step bench "$t_bench" bench.txt "$py" -m ctx_plugin.cli bench --compare-kernels --ranks 8 16 --seq-len 128k --heads 32 \
    --head-dim 128 --dtype bf16 --reps 3 --passes fwd+bwd fwd --profile --json "$out/bench.json" --plot "$out/bench.png"
step docs "$t_docs" docs.txt "$py" -m ctx_plugin.cli bench --backends zigzag striped allgather ulysses --ranks 8 \
    --seq-len 128k --heads 32 --head-dim 128 --dtype bf16 --doc-len 4k --kernel sdpa_flash --reps 3 \
    --json "$out/docs.json"
echo "gpu_check: all steps done in $((SECONDS - started)) s (exit $status); results in $out" | tee -a "$out/summary.txt"
exit "$status"
