#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU (see /work/.library/device): it runs
# from the repository root on the GPU machine and writes everything under $OUT.
#
#   1. environment: nvidia-smi, torch / triton versions, which libnccl is found;
#   2. the Triton kernels compiled for real against their torch references
#      (tests/test_kernels_triton.py with TRITON_INTERPRET=0) and the NCCL transport round trip
#      on one GPU (tests/test_comm_nccl.py);
#   3. perf/bench_moe_kernels.py --device cuda: Triton vs the torch path, TFLOP/s against the
#      measured dense bf16 matmul rate, decode-like and prefill-like shapes;
#   4. perf/tune_moe_kernels.py: fills the tile-config table for the benchmark's shapes.
#
# The GPU image has torch, triton, mpi4py, pytest and the nvidia-nccl wheel but not this
# package's pins, so the package is put on PYTHONPATH as setup.py lays it out (kernels/ and
# launch/ inside megainfer/) instead of pip-installed. Each step has its own timeout and the
# script goes on after a failure; rc.txt records each step's exit status.
# Usage (device tool): bash perf/gpu_session.sh      (about 6 minutes; give it timeout_s 540)
set -u
OUT=${OUT:-/tmp/megainfer_gpu_out}
PY=${PY:-python3}
mkdir -p "$OUT"
SRC=$(mktemp -d)/src
mkdir -p "$SRC"
cp -r megainfer "$SRC/" && cp -r kernels "$SRC/megainfer/kernels" \
  && cp -r launch "$SRC/megainfer/launch" && cp -r conf "$SRC/megainfer/conf"
export PYTHONPATH="$SRC:$PWD/tests" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1

step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, record the exit status
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name $rc" >>"$OUT/rc.txt"
  tail -n 25 "$OUT/$name.log"
}

step env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; $PY -c 'from megainfer.comm import nccl; lib = nccl.load_nccl(); print(\"nccl\", nccl.nccl_version(lib))'"
step tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py tests/test_comm_nccl.py
step bench 180 "$PY" perf/bench_moe_kernels.py --device cuda --repeats 5
step tune 150 "$PY" perf/tune_moe_kernels.py --shape 8,14336,4096 --shape 64,1408,2048 --m 1,8,64,512,2048 --table "$OUT/tile_configs.json"
cp perf/results/bench_moe_kernels_cuda.json perf/results/tune_moe_kernels.json "$OUT/" 2>/dev/null
cat "$OUT/rc.txt"
