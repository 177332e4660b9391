#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU (see /work/.library/device): it runs
# from the repository root on the GPU machine and writes everything under $OUT.
#
#   1. environment: nvidia-smi, torch / triton versions, which libnccl is found; mpi4py from the
#      image, else the carried .whl/ wheels (mpi4py 4.1.2 + the mpich 5.0.2 library);
#   2. the Triton kernels compiled for real against their torch references
#      (tests/test_kernels_triton.py with TRITON_INTERPRET=0) and the NCCL transport on one GPU
#      (tests/test_comm_nccl.py: round trip, no host synchronisation per message);
#   3. perf/bench_nccl_self.py: Channel over NCCL vs raw NCCL vs a device copy, 2 KB - 8 MB;
#   4. perf/tune_moe_kernels.py --space small: tile configs for the benchmark's shapes and token
#      counts, written into the package's table (so step 5 uses them) and to $OUT;
#   5. perf/bench_moe_kernels.py --device cuda: Triton (tuned and default config) vs the torch
#      path, TFLOP/s against the measured dense bf16 matmul rate, decode- to prefill-like M.
#
# The GPU image has torch, triton, pytest and the nvidia-nccl wheel but not this package's
# pins, so the package is put on PYTHONPATH as setup.py lays it out (kernels/ and launch/
# inside megainfer/) instead of pip-installed. Each step has its own timeout and the script
# goes on after a failure; rc.txt records each step's exit status. Every step writes its
# JSON as it goes, so a timeout keeps what finished.
# Usage (device tool, carry [".whl"]): bash perf/gpu_session.sh   (~6 min; timeout_s 590)
# Everything comes back in $OUT/gpu_session.tgz: a log per step, rc.txt, the JSON results.
set -u
OUT=${OUT:-/tmp/megainfer_gpu_out}
PY=${PY:-python3}
W=$(mktemp -d)/gpu_session  # logs and JSON; $OUT/gpu_session.tgz is re-packed after each step
mkdir -p "$OUT" "$W"
ROOT=$(mktemp -d)  # python -c and python -m put the cwd first on sys.path: run those from here,
SRC=$ROOT/src      # where no unassembled megainfer/ shadows the assembled one
mkdir -p "$SRC"
cp -r megainfer "$SRC/" && cp -r kernels "$SRC/megainfer/kernels" \
  && cp -r launch "$SRC/megainfer/launch" && cp -r conf "$SRC/megainfer/conf" && cp -r tests "$ROOT/"
export PYTHONPATH="$SRC:$ROOT/tests" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1

STEPS=${STEPS:-env tests nccl tune1 tune2 bench}  # a rerun can name fewer (and TESTS=files)
step() {  # step NAME TIMEOUT CMD...: run, log to $W/NAME.log, record the exit status
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  echo "== $name: $*"
  timeout "$limit" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  echo "$name $rc" >>"$W/rc.txt"
  tail -n 25 "$W/$name.log"
  case $name in  # what this step wrote outside $W
    tune*) cp "$TUNED" "$W/tile_configs.json" ;;
    bench) cp perf/results/bench_moe_kernels_cuda.json "$W/" 2>/dev/null ;;
  esac
  tar czf "$OUT/gpu_session.tgz" -C "$W" .  # the device tool returns at most 8 files
}

carried_mpi() {  # unpack the carried mpi4py 4.1.2 + MPICH 5.0.2 wheels into $ROOT/mpi
  if [ ! -d "$ROOT/mpi" ]; then
    "$PY" -m zipfile -e .whl/mpi4py-*cp312*.whl "$ROOT/mpi/site" \
      && "$PY" -m zipfile -e .whl/mpich-*.whl "$ROOT/mpi/mpich"
    chmod +x "$ROOT"/mpi/mpich/mpich-*.data/data/bin/*
  fi
  MPI_SITE=$ROOT/mpi/site
  LIBMPI=$(ls "$ROOT"/mpi/mpich/mpich-*.data/data/lib/libmpi.so.12)
  MPICH_BIN=$(ls -d "$ROOT"/mpi/mpich/mpich-*.data/data/bin)
}
if ! timeout 60 "$PY" -c "from mpi4py import MPI; MPI.COMM_SELF.Get_size()" >"$W/mpi.log" 2>&1; then
  echo "image mpi4py unusable (see mpi.log); using the carried wheels" | tee -a "$W/mpi.log"
  carried_mpi
  export PYTHONPATH="$MPI_SITE:$PYTHONPATH" MPI4PY_LIBMPI=$LIBMPI
fi
TUNED="$SRC/megainfer/kernels/tile_configs.json"

step env 60 bash -c "cd $ROOT; nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; $PY -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'; $PY -c 'from megainfer.comm import nccl; lib = nccl.load_nccl(); print(\"nccl\", nccl.nccl_version(lib), lib._name)'"
step tests 200 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=150 ${TESTS:-tests/test_kernels_triton.py tests/test_comm_nccl.py}"
step nccl 60 "$PY" perf/bench_nccl_self.py --out "$W/bench_nccl_self.json"
step tune1 90 "$PY" perf/tune_moe_kernels.py --space small --shape 8,14336,4096 --top-k 2 --m 4,32,256,2048,8192 --table "$TUNED" --log "$W/tune_mixtral.json"
step tune2 80 "$PY" perf/tune_moe_kernels.py --space small --shape 64,1408,2048 --top-k 6 --m 10,85,682,5461 --table "$TUNED" --log "$W/tune_dsv2lite.json"
step bench 150 "$PY" perf/bench_moe_kernels.py --device cuda
# Not in the default STEPS (STEPS=m2n to run it): bench_m2n's collectives and ping-pong, and the
# ladder (perf/bench_m2n_ladder.py), on this machine's 16 cores (4 ranks, no oversubscription),
# under MPICH 5.0.2 from the carried wheel with the carried mpi4py 4.1.2 bound to it, as on the
# 2-core dev box.
if [[ " $STEPS " == *" m2n "* ]]; then
  carried_mpi
  step m2n 280 env PYTHONPATH="$MPI_SITE:$PYTHONPATH" MPI4PY_LIBMPI="$LIBMPI" \
    "$PY" perf/bench_m2n.py --mpiexec "$MPICH_BIN/mpiexec" --parts collectives,pingpong \
    --scale "${M2N_SCALE:-0.5}" --out "$W/bench_m2n.json"
  # where the channel's time goes with a core per rank (on 2 cores: docs/comm.md)
  STEPS="$STEPS m2nladder" step m2nladder 120 env PYTHONPATH="$MPI_SITE:$PYTHONPATH" MPI4PY_LIBMPI="$LIBMPI" \
    "$PY" perf/bench_m2n_ladder.py --mpiexec "$MPICH_BIN/mpiexec" --out "$W/bench_m2n_ladder.json"
fi
cat "$W/rc.txt"
