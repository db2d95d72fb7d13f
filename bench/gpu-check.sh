#!/usr/bin/env bash
# make gpu-check: gpipe's CUDA and NCCL paths on one GPU host, in at most about 6 minutes, one line a check:
#   PASS|FAIL|SKIP <check>: <detail>
#
#   bash bench/gpu-check.sh --prepare    where a package index answers: download into .gpucheck/whl the wheels a
#                                        CUDA image lacks (pydantic, grpcio, protobuf 7, ...; about 29 MB)
#   bash bench/gpu-check.sh              on the GPU host, from the repository root
#
# It runs on the host's own CUDA torch (printed first; gpipe supports 2.11 to 2.13), installing the other
# packages from .gpucheck/whl (or GPU_CHECK_WHEELS) with --no-index: a GPU host needs no package index.
# The checks: the environment; the worker's device probe; every test marked `gpu` (tests/engine/test_gpu.py, tests/service/test_gpu.py and the
# gpu tests of the other files), a line each; the throughput of a GPT-2-small-sized model (bench/gpu_throughput.py):
# a 2-stage gpipe.Pipeline against plain one-GPU training, and `run` on one stage against the same.
# Results: stdout, and $OUT (or GPU_CHECK_OUT, default /tmp/gpu-check) summary.txt and full.log.
# Knobs: GPU_CHECK_PYTHON (default python3), GPU_CHECK_ONLY="env worker-device pytest tput-pipeline tput-run
# tput-deterministic" (the checks to run),
# GPU_CHECK_QUICK=1 (tiny sizes: a dry run on a CPU, where the gpu tests are skipped).
set -u
cd "$(dirname "$0")/.." || exit 2
PINS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing-extensions==4.16.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2 prometheus-client==0.26.0
tensorboard==2.21.0 transformers==5.23.0 pytest==9.1.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0"
WHEELS=${GPU_CHECK_WHEELS:-.gpucheck/whl}

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS"
    # The CUDA images' python3 is CPython 3.12 on x86-64: one version of each, no dependencies.
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $PINS || exit 1
    du -sh "$WHEELS"
    exit 0
fi

OUTDIR=${OUT:-${GPU_CHECK_OUT:-/tmp/gpu-check}}
mkdir -p "$OUTDIR"
SUMMARY=$OUTDIR/summary.txt
FULL=$OUTDIR/full.log
: > "$SUMMARY"
: > "$FULL"
PY=${GPU_CHECK_PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"
unset GPIPE_OVERSUBSCRIBE OMP_NUM_THREADS
line() { echo "$*" | tee -a "$SUMMARY" >> "$FULL"; echo "$*"; }
wanted() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " $GPU_CHECK_ONLY " == *" $1 "* ]]; }
START=$SECONDS

line "gpu-check at $(date -u +%FT%TZ) on $(hostname)"
if command -v nvidia-smi > /dev/null; then
    line "INFO gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 4 | tr '\n' ';')"
fi
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$WHEELS"/*.whl \
            >> "$FULL" 2>&1; then
        line "INFO setup: $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS, installed with --no-index"
    else
        line "FAIL setup: the wheels in $WHEELS did not install (full.log says why)"
    fi
else
    line "INFO setup: no wheels in $WHEELS (bash bench/gpu-check.sh --prepare makes them): $PY as it is"
fi

# gpipe itself, editable: its three packages, gpipe, worker and coordinator.
if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e . \
        >> "$FULL" 2>&1; then
    line "INFO setup: gpipe installed (editable) into $("$PY" -c 'import sys; print(sys.prefix)')"
else
    line "FAIL setup: pip install -e . failed (full.log says why)"
fi

# check NAME LIMIT_S CMD...: CMD's RESULT lines become check lines; a CMD that ends without one is a FAIL.
check() {
    local name=$1 limit=$2 log rc
    shift 2
    wanted "$name" || return 0
    log=$(mktemp)
    echo "===== $name: $*" >> "$FULL"
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    cat "$log" >> "$FULL"
    grep '^RESULT ' "$log" | while read -r _ st nm rest; do line "$st $nm: $rest"; done
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        line "FAIL $name: timed out after ${limit}s: $(tail -n 3 "$log" | tr '\n' ' ' | cut -c1-300)"
    elif [ "$rc" -ne 0 ] && ! grep -q '^RESULT ' "$log"; then
        line "FAIL $name: exit $rc: $(grep -E 'Error|error' "$log" | tail -n 1 | cut -c1-300)"
    fi
    rm -f "$log"
    echo "      ($name: $((SECONDS - START))s so far)"
}

check env 60 "$PY" -c '
import torch, gpipe, gpipe.coordinator.cli.main, gpipe.stage, gpipe.worker.stage_server, gpipe.service.v1.jobs_pb2
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name() if cuda else "no GPU"
nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
status = "PASS" if cuda else "SKIP"
print(f"RESULT {status} env torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}) on {name}; gpipe imports")
'

# The worker owns its device: the probe child names the GPU; a GPU index the host lacks is refused at start.
check worker-device 150 "$PY" -c '
import subprocess, sys
from worker import device
gpus = device.probe()
found = "PASS" if gpus.gpus else "SKIP"
print(f"RESULT {found} worker-device-probe {gpus.describe()}")
missing = f"cuda:{len(gpus.gpus)}"
r = subprocess.run([sys.executable, "-c", "import sys; from gpipe.worker.daemon import main; sys.exit(main())",
                    "--rank", "0", "--device", missing, "--coordinator", "127.0.0.1:9"],
                   capture_output=True, text=True, timeout=120)
line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
ok = r.returncode == 2 and "--device" in line and "Traceback" not in r.stderr
verdict = "PASS" if ok else "FAIL"
print(f"RESULT {verdict} worker-refuses-{missing} exit {r.returncode}: {line}")
'

# Every test marked gpu, a line each (pytest's own short summary, -rA).
pytest_gpu() {
    local spread=()
    "$PY" -c 'import xdist' 2> /dev/null && spread=(-n 4)  # the GPU's tests side by side, where pytest-xdist is
    # The files that hold gpu tests (the others may need packages a GPU host lacks, as test_deploy.py does).
    mapfile -t files < <(grep -l 'mark\.gpu' tests/*/test_*.py)
    "$PY" -m pytest -q -m gpu -rA -p no:cacheprovider -o addopts= --timeout 180 "${spread[@]}" "${files[@]}" 2>&1 \
        | tee -a "$FULL" \
        | sed -nE 's/^(PASSED|FAILED|ERROR|SKIPPED) (\[[0-9]+\] )?([^ ]+)( - | )?(.*)$/RESULT \1 \3 \5/p' \
        | sed -E 's/^RESULT PASSED/RESULT PASS/; s/^RESULT (FAILED|ERROR)/RESULT FAIL/; s/^RESULT SKIPPED/RESULT SKIP/'
    return "${PIPESTATUS[0]}"
}
if wanted pytest; then
    export -f pytest_gpu
    export PY FULL
    check pytest 240 bash -c pytest_gpu
fi
check tput-pipeline 100 "$PY" bench/gpu_throughput.py pipeline --rounds 2
check tput-run 100 "$PY" bench/gpu_throughput.py run --steps 30
check tput-deterministic 80 "$PY" bench/gpu_throughput.py pipeline --rounds 2 --deterministic

count() { grep -c "^$1 " "$SUMMARY"; }
line "GPU-CHECK DONE in $((SECONDS - START))s: $(count PASS) pass, $(count FAIL) fail, $(count SKIP) skip"
[ "$(count FAIL)" -eq 0 ]
