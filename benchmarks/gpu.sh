#!/usr/bin/env bash
# One command for a GPU: memfit's gpu-marked tests and its GPU benchmarks, results written as files.
#
#   benchmarks/gpu.sh [OUT_DIR]                      OUT_DIR defaults to $OUT, else ./gpu-results
#   benchmarks/gpu.sh --backend cpu-sim [OUT_DIR]    the dry run (CI): the device report alone, on cpu-sim
#
# First it writes the device report, benchmarks/results/gpu-<YYYY-MM-DD>-<device>.json (commit it):
# memfit beside full activation checkpointing, save_on_cpu and no memfit, exactness, offload's
# costs, the profiler's and the simulator's figures (benchmarks/gpu_report.py, which says each key).
# With --backend cpu-sim it writes that report for cpu-sim at CI-sized shapes into OUT_DIR instead,
# so that a device run cannot fail on a typo, and stops there.
#
# Needs a CUDA build of torch that sees a GPU, memfit's packages installed (pip install -e for each
# folder under packages/, or the hatch environment), a C++ compiler and ninja (memfit's native
# extensions are built on first use, about a minute each). Into OUT_DIR it writes at most 10 files (9 without MEMFIT_GPU_CAPACITY=1):
#
#   device.json              the GPU, torch and CUDA versions
#   gpu_report.log           the device report's progress (the report itself goes to benchmarks/results/)
#   gpu-tests.log/.xml       pytest -m gpu over packages/ and tests/ (log and JUnit XML)
#   release.json             benchmarks/release.py --backend cuda (stream-event vs record_stream release)
#   profiler_overhead.json   benchmarks/profiler_overhead.py --backend cuda
#   offload_device.json      benchmarks/offload_device.py --backend cuda (graph-level offload vs eager)
#   offload_device_variants.json  which synchronisation makes offload exact (benchmarks/offload_device_variants.py)
#   swap_capacity.json       benchmarks/swap_capacity.py --backend cuda (only with MEMFIT_GPU_CAPACITY=1: ~10+ min)
#   benchmarks.log           every benchmark's table and progress
#
# MEMFIT_GPU_STEP_TIMEOUT=SECONDS stops any one step (the tests, a benchmark) after that long, so
# that a time-limited machine still returns the steps that finished. Each benchmark prints one JSON
# object as its last line; that line is its .json file. Exit status:
# 0 all passed, 1 a test or benchmark failed (the others still ran), 2 no GPU.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
backend=cuda
if [ "${1:-}" = "--backend" ]; then
    backend=${2:-}
    shift 2 || true
fi
out=${1:-${OUT:-$root/gpu-results}}
python=${PYTHON:-python}
step_timeout=${MEMFIT_GPU_STEP_TIMEOUT:-0}  # 0: no limit
limited() { if [ "$step_timeout" != 0 ]; then timeout "$step_timeout" "$@"; else "$@"; fi; }

if [ "$backend" = "cpu-sim" ]; then
    mkdir -p "$out" || { echo "benchmarks/gpu.sh: cannot create the output folder $out" >&2; exit 1; }
    cd "$root" || exit 1
    limited "$python" benchmarks/gpu_report.py --backend cpu-sim --out "$out"
    exit $?
elif [ "$backend" != "cuda" ]; then
    echo "benchmarks/gpu.sh: --backend takes cuda or cpu-sim, got '$backend'" >&2
    exit 2
fi
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "benchmarks/gpu.sh: no CUDA device is visible to torch ($python: torch.cuda.is_available() is False," >&2
    echo "or torch is not installed). Nothing was run: use a machine with an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
mkdir -p "$out" || { echo "benchmarks/gpu.sh: cannot create the output folder $out" >&2; exit 1; }
cd "$root" || exit 1
status=0

"$python" - >"$out/device.json" <<'EOF'
import json, torch
props = torch.cuda.get_device_properties(0)
print(json.dumps({"device": props.name, "total_memory_bytes": props.total_memory, "devices": torch.cuda.device_count(),
                  "torch": torch.__version__, "cuda": torch.version.cuda}))
EOF
echo "== device: $(cat "$out/device.json")"

echo "== the device report (benchmarks/gpu_report.py), into benchmarks/results/"
PYTORCH_ALLOC_CONF=expandable_segments:True CUBLAS_WORKSPACE_CONFIG=:4096:8 limited "$python" benchmarks/gpu_report.py \
    --backend cuda --out "$root/benchmarks/results" >"$out/gpu_report.log" 2>&1 || status=1
tail -n 3 "$out/gpu_report.log"

echo "== gpu-marked tests"
# expandable segments: the swap tests' budgets are tens of MiB above the floor (tests/conftest.py's tight_device_budget)
# and cuBLAS's fixed workspaces, which the exactness tests' deterministic kernels need (read when a handle is made)
PYTORCH_ALLOC_CONF=expandable_segments:True CUBLAS_WORKSPACE_CONFIG=:4096:8 limited "$python" -m pytest -m gpu -rs -q --junitxml="$out/gpu-tests.xml" packages tests >"$out/gpu-tests.log" 2>&1 || status=1
tail -n 15 "$out/gpu-tests.log"

bench() {  # bench NAME ARGS...: run benchmarks/NAME.py, keep its last line (the JSON object) as NAME.json
    local name=$1
    shift
    echo "== benchmarks/$name.py $*" | tee -a "$out/benchmarks.log"
    if limited "$python" "benchmarks/$name.py" "$@" >>"$out/benchmarks.log" 2>&1; then
        grep '^{' "$out/benchmarks.log" | tail -n 1 >"$out/$name.json"
        echo "   -> $out/$name.json"
    else
        echo "   FAILED: see $out/benchmarks.log" | tee -a "$out/benchmarks.log"
        status=1
    fi
}

# Issue 13 on a real copy engine: offload's exactness, peak and step time against eager.
bench offload_device --backend cuda --deterministic
# ... and, where it is not exact, which synchronisation restores it (about 2 minutes).
bench offload_device_variants --backend cuda
# Fig. 8 analogue on a real copy engine: the medium model, activations of 32-512 MiB.
bench release --backend cuda --model medium --batch 16 --seq 1024 --layers 4,8,16 --fraction 0.5 --steps 18
# Table 1 analogue: the host-bound regime is where a GPU shows the profiler's per-operator cost.
bench profiler_overhead --backend cuda
if [ "${MEMFIT_GPU_CAPACITY:-0}" = "1" ]; then
    bench swap_capacity --backend cuda --capacity 4GiB --layers 8 --batch 8 --seq 512 --model medium
fi

echo "== results in $out (exit status $status)"
exit $status
