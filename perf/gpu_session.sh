#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU (see /work/.library/device): it runs
# from the repository root on the GPU machine and writes everything under $OUT.
#
# Default steps (STEPS="env tests attn gputests engine"; timeouts sum to 460 s, under 8 min):
#   env       nvidia-smi, torch / triton / transformers versions, which libnccl is found; mpi4py
#             from the image, else the carried .whl/ wheels (mpi4py 4.1.2 + mpich 5.0.2);
#   tests     the Triton MoE kernels compiled for real against their torch references
#             (tests/test_kernels_triton.py, TRITON_INTERPRET=0) and the NCCL transport on one
#             GPU (tests/test_comm_nccl.py: round trip, no host synchronisation per message);
#   attn      the Triton paged-attention, MLA and quantised-KV kernels compiled for real against
#             their torch references (tests/test_attention_triton.py, test_mla_triton.py,
#             test_kv_quant_triton.py), and the whole engine with them against HF greedy
#             (tests/test_engine_triton.py);
#   gputests  pytest -m gpu over tests/test_gpu_engine.py (the engine on cuda: greedy parity
#             with HF fp32 / closeness in bf16, CUDA graphs on = off, Triton = torch attention,
#             host syncs per decode step), the sampler's CPU = CUDA bits, the one-copy metadata
#             and a CUDA load against a host load;
#   engine    perf/bench_gpu_engine.py --device cuda: megainfer (CUDA graphs on and off) vs HF
#             generate, Mixtral-8x7B and Qwen3-30B-A3B shapes cut to 8 layers, bf16, batch 1 /
#             64 / 256, 256 tokens in and out; decode step time against its HBM roofline. Its
#             JSON is written into the archive's folder row by row (--budget-s stops it cleanly
#             before the step's timeout).
# Not in the default STEPS (name them to run them, e.g. STEPS="nccl bench"):
#   nccl      perf/bench_nccl_self.py: Channel over NCCL vs raw NCCL vs a device copy, 2 KB - 8 MB;
#   tune1/2   perf/tune_moe_kernels.py --space small: tile configs for the kernel benchmark's
#             shapes, written into the package's table and to $OUT. A tuned table is committed
#             (kernels/tile_configs.json, from the 2026-11-29 session), so they left the default;
#   bench     perf/bench_moe_kernels.py --device cuda: Triton (tuned and default config) vs the
#             torch path, TFLOP/s against the measured dense bf16 matmul rate;
#   m2n       the MPI layer on the machine's 16 cores (below).
# The disaggregated runtime on the GPU (issue 18), a second set that fits one call on its own:
#   STEPS="ipc tokens trace transport calib" bash perf/gpu_session.sh   (timeouts sum to 500 s)
#   ipc       tests/test_runtime_gpu.py -k "round_trips or cudart": cuda_ipc and staged mpi
#             round trips, mpirun -n 2 and -n 3 on the one GPU, both layouts (self-peers);
#   tokens    tests/test_runtime_gpu.py -k tokens: -n 2 and -n 3, cuda_ipc and mpi: fp32 tokens
#             identical to single mode on the GPU, bf16 identical between the transports, host
#             syncs of a decode step on the attention rank within budget;
#   trace     the traced-run test, then megainfer-launch under mpirun -n 3 (deploy=a1e2
#             deploy.device=cuda, Mixtral-8x7B's shapes cut to 2 layers, bf16, cuda_ipc,
#             trace.enabled): its merged trace.json and summary come back;
#   transport perf/bench_transport_gpu.py: 2 KB / 64 KB / 8 MB one-way, cuda_ipc vs mpi staging
#             vs the in-process copy floor, then NCCL with two ranks on the GPU tried and recorded;
#   calib     megainfer-plan calibrate on the GPU (bench=megainfer_cuda: the project's own
#             attention and fused-MoE layers, bf16, smoke sizes; link from the transport bench)
#             -> h200_measured.yaml (commit it as conf/hardware/h200_measured.yaml).
#   These launch MPICH's mpiexec: the carried .whl/ wheels (mpi4py 4.1.2 + mpich 5.0.2; carry
#   [".whl"]) when present, else an mpiexec on PATH.
#
# The GPU image has torch, triton, transformers, pytest and the nvidia-nccl wheel but not this
# package's pins, so the package is put on PYTHONPATH as setup.py lays it out (kernels/ and
# launch/ inside megainfer/) instead of pip-installed. Without transformers the tests that need
# HF skip and the engine benchmark records its HF rows as skipped. Each step has its own timeout
# and the script goes on after a failure; rc.txt records each step's exit status. Every step
# writes its JSON as it goes, so a timeout keeps what finished.
# Usage (device tool, carry [".whl"]): bash perf/gpu_session.sh   (<= 7.5 min; timeout_s 590)
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

STEPS=${STEPS:-env tests attn gputests engine}  # a rerun can name others (and TESTS=files)
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
    # engine: bench_gpu_engine.py writes its JSON straight into $W, row by row
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

step env 30 bash -c "cd $ROOT; nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; $PY -c 'import transformers; print(\"transformers\", transformers.__version__)'; $PY -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'; $PY -c 'from megainfer.comm import nccl; lib = nccl.load_nccl(); print(\"nccl\", nccl.nccl_version(lib), lib._name)'"
step tests 90 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=80 ${TESTS:-tests/test_kernels_triton.py tests/test_comm_nccl.py}"
step attn 100 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=90 tests/test_attention_triton.py tests/test_engine_triton.py tests/test_mla_triton.py tests/test_kv_quant_triton.py"
GPUTESTS=$(cd "$ROOT" && ls tests/test_gpu_engine.py tests/test_sampler.py tests/test_device_config.py tests/test_loader_memory.py 2>/dev/null)
step gputests 100 bash -c "cd $ROOT && TRITON_INTERPRET=0 $PY -m pytest -q -rs -m gpu -p no:cacheprovider -o timeout=100 $(echo $GPUTESTS)"
step engine 140 "$PY" perf/bench_gpu_engine.py --device cuda --budget-s 125 --out "$W/bench_gpu_engine_cuda.json"
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
# ---- issue 18: the disaggregated runtime on the GPU (STEPS="ipc tokens trace transport calib")
if [[ " $STEPS " =~ " "(ipc|tokens|trace|transport|calib)" " ]]; then
  if [ -d .whl ]; then
    carried_mpi
    export PYTHONPATH="$MPI_SITE:$PYTHONPATH" MPI4PY_LIBMPI="$LIBMPI" MPIEXEC="$MPICH_BIN/mpiexec"
  else
    export MPIEXEC=$(command -v mpiexec || echo "$(dirname "$(command -v "$PY")")/mpiexec")
  fi
  PYT="$PY -m pytest -q -rs -m gpu -p no:cacheprovider"
  step ipc 80 bash -c "cd $ROOT && $PYT -o timeout=75 tests/test_runtime_gpu.py -k 'round_trips or cudart'"
  step tokens 150 bash -c "cd $ROOT && $PYT -o timeout=145 tests/test_runtime_gpu.py -k tokens"
  step trace 110 bash -c "cd $ROOT && $PYT -o timeout=60 tests/test_runtime_gpu.py -k traced; \
    $MPIEXEC -n 3 $PY -m megainfer.launch.main model=mixtral_8x7b model.arch.num_layers=2 \
      deploy=a1e2 deploy.device=cuda model.dtype=bfloat16 comm.transport=cuda_ipc \
      trace.enabled=true sampling.max_tokens=8 hydra.run.dir=$W/trace_run \
    && cp $W/trace_run/trace.json $W/trace_mixtral_n3.json"
  step transport 60 "$PY" perf/bench_transport_gpu.py --mpiexec "$MPIEXEC" --iters 200 \
    --out "$W/bench_transport_gpu.json"
  step calib 100 env MEGAINFER_CALIBRATE_LINK="$W/bench_transport_gpu.json" bash -c "cd $ROOT && \
    $PY -m megainfer.launch.plan calibrate model=mixtral_8x7b model.num_layers=2 \
      calibrate.bench=megainfer_cuda calibrate.mpi=false calibrate.node=false calibrate.smoke=true \
      calibrate.merge=false calibrate.out=$W/h200_measured.yaml"
fi
cat "$W/rc.txt"
