#!/usr/bin/env bash
# The one prepared script for a session that is lent a GPU (see /work/.library/device): it runs
# from the repository root on the GPU machine and writes everything under $OUT.
#
# Default steps (STEPS="env attn gputests ipc tokens tp eplb trace online pyapi engine transport", about 7.5 min).
# The correctness steps (PAR_STEPS) run at the same time, sharing the GPU and the 16 cores;
# then the figures run one by one, alone on the GPU.
#   env       nvidia-smi, torch / triton / transformers versions, mpi4py's MPI, libnccl;
#   tests     the Triton MoE kernels compiled for real against their torch references and the
#             NCCL transport on one GPU (tests/unit/kernels/test_kernels_triton.py, tests/unit/comm/test_comm_nccl.py);
#   attn      the Triton paged-attention, MLA and quantised-KV kernels against their torch
#             references, and the whole engine with them against HF greedy (ATTN_TESTS=files);
#   gputests  pytest -m gpu: the engine on cuda (fp32 greedy = HF, bf16 within HF's top-5,
#             past position 2000, CUDA graphs = eager, Triton = torch attention, host syncs of
#             a decode step), the sampler on cuda, a CUDA load against a host load, an expert
#             rank's load count with no host sync;
#   ipc       tests/gpu/test_runtime_gpu.py: cuda_ipc and staged mpi round trips, mpiexec -n 2 / 3
#             on the one GPU, both layouts (self-peers), and the CUDA runtime wrapper;
#   tokens    the runtime on the GPU, -n 2 / 3, cuda_ipc and mpi: fp32 tokens = single mode,
#             bf16 equal across transports, host syncs of the attention rank's decode step;
#   tp        attention TP 2 + 1 expert rank on the one GPU: TP collectives point to point over
#             cuda_ipc (runtime/tp/channel.py) and through host memory (mpi): fp32 tokens =
#             single mode, bf16 equal across the two;
#   eplb      tests/gpu/test_eplb_device_moves.py -m gpu: expert weight moves over cuda_ipc
#             (comm.eplb_moves), buffers exact, live EPLB tokens = single mode, -n 3 / 4;
#   trace     the traced-run test, then megainfer-launch under mpiexec -n 3 (deploy=a1e2,
#             Mixtral-8x7B's shapes cut to 2 layers, bf16, cuda_ipc, traced);
#   online    the engine core and AsyncLLM tests on cuda (tests/unit/engine/test_engine_online.py, tests/unit/engine/test_async_llm.py);
#   pyapi     LLM(deploy="a1e2") and AsyncLLM(deploy="a1e2") under mpiexec -n 3 on the one GPU
#             (cuda_ipc, fp32) against single mode on it (tests/gpu/test_llm_deploy_gpu.py);
#   engine    perf/bench/bench_gpu_engine.py: megainfer (graphs on, ENGINE_SYSTEMS also
#             megainfer-eager) vs HF generate, Mixtral-8x7B / Qwen3-30B-A3B shapes cut to 8
#             layers (ENGINE_MODELS), bf16, batch 1 / 64 / 256, 256 in and out, against the HBM
#             roofline; --budget-s (ENGINE_S - 15) stops it between rows;
#   transport perf/bench/bench_transport_gpu.py: 2 KB / 64 KB / 8 MB one-way, cuda_ipc (host-fenced,
#             as on a shared GPU) and cuda_ipc_device vs mpi staging vs the copy floor; NCCL
#             with two ranks on one GPU tried and recorded; the TP all-reduce of bf16
#             [1 / 64 / 256, 4096] over cuda_ipc vs through host memory.
# Named on demand (STEPS="calib nccl ..."):
#   calib     megainfer-plan calibrate on the GPU (bench=megainfer_cuda, full sizes unless
#             CALIB_SMOKE=true: the 2026-11-30 smoke run was too small to use; link from
#             the transport bench) -> h200_measured.yaml;
#   nccl      perf/bench/bench_nccl_self.py: Channel over NCCL vs raw NCCL vs a device copy;
#   tune1/2   perf/bench/tune_moe_kernels.py --space small (kernels/tile_configs.json is committed);
#   bench     perf/bench/bench_moe_kernels.py --device cuda: Triton vs the torch path, TFLOP/s;
#   m2n       the MPI layer on the machine's 16 cores (bench_m2n).
#   fp8       the block-scaled FP8 dense GEMM compiled for real (fp8 tensor cores) against its
#             torch reference (tests/unit/kernels/test_fp8_gemm_triton.py, with the cuda qlinear path);
#   fp8bench  perf/bench/bench_fp8_gemm_gpu.py: the FP8 grouped GEMM vs bf16 at Mixtral-8x7B /
#             Qwen3-30B-A3B / DeepSeek-V3 expert shapes (decode B = 1..256, prefill 4096) and
#             the FP8 dense GEMM vs bf16 F.linear, against the HBM and tensor-core roofs;
#             --budget-s (FP8_S - 30) stops it between rows. Issue 50's GPU check on its own:
#             STEPS="env fp8 fp8bench" bash perf/gpu_session.sh (about 5 min, timeout_s 480).
#   serve     perf/bench/bench_serve.py --device cuda: megainfer-serve (bench50m, bf16, on the GPU, a
#             subprocess; SERVE_MODES, default single,a1e2: also mpiexec -n 3 deploy=a1e2, its 3
#             ranks sharing the GPU, beside the simulator's prediction) driven by
#             megainfer-bench-serve's client at three Poisson rates
#             (SERVE_RATES, default 8,32,inf) beside the offline job on the same requests and
#             one request at a time against the engine's prefill; needs fastapi, uvicorn,
#             prometheus-client, httpx (+ starlette, pydantic, anyio, h11, ...) as pure-Python
#             wheels in .whl/py: pip download -d .whl/py fastapi==0.165.0 uvicorn==0.54.0
#             prometheus-client==0.26.0 httpx==0.28.1 with the cp312 manylinux flags above
#             (pydantic-core is binary; the other dependencies are pure Python).
#
# Carried wheels (the image has torch, triton, transformers, pytest, nccl, Open MPI's mpi4py):
#   .whl/     mpi4py 4.1.2 (cp312) + mpich 5.0.2: the MPI steps (ipc tokens trace transport
#             calib m2n) run under MPICH, as on the dev box;
#   .whl/py/  hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3 (pure Python):
#             the launcher and the hydra-composing tests. Fetch both once:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl mpi4py==4.1.2 mpich==5.0.2
#     pip download --no-deps -d .whl/py hydra-core==1.3.8 omegaconf==2.3.1
#     pip wheel --no-deps -w .whl/py antlr4-python3-runtime==4.9.3
# The package is put on PYTHONPATH as setup.py lays it out (kernels/ and launch/ inside
# megainfer/). Each step has a timeout and the script goes on after a failure; rc.txt records
# each step's exit status; every step writes its JSON as it goes.
# Usage (device tool, carry [".whl"]; when others edit the tree meanwhile, run from a snapshot:
#   git archive HEAD | tar -x -C .snap, carry [".snap", ".whl"], cd .snap && ln -s ../.whl .whl):
#   bash perf/gpu_session.sh          (timeout_s 480)
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
if ls .whl/py/*.whl >/dev/null 2>&1; then  # pure-Python packages the image lacks (hydra-core,
  # omegaconf, antlr4: the launcher and tests/unit/launch/test_device_config.py need them)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ROOT/pyext" \
    .whl/py/*.whl && PY_EXTRA="$ROOT/pyext${PY_EXTRA:+:$PY_EXTRA}"
fi
export PYTHONPATH="$SRC:$ROOT/tests${PY_EXTRA:+:$PY_EXTRA}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1

STEPS=${STEPS:-env attn gputests ipc tokens tp eplb trace online pyapi engine transport}  # or name others
# Correctness steps in PAR_STEPS run at the same time (the GPU and 16 cores are shared; their
# timings are not figures); the rest run alone, one after the other, in the order below.
PAR_STEPS=${PAR_STEPS:-tests attn gputests ipc tokens tp eplb trace online pyapi}
PIDS=()
wanted() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
concurrent() { case " $PAR_STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
run_step() {  # NAME TIMEOUT CMD...: run, log to $W/NAME.log, record the exit status
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$W/$name.log" 2>&1
  echo "$name $?" >>"$W/rc.txt"
}
report() {  # NAME: the log's end, what it wrote outside $W, re-pack the archive
  tail -n "${TAIL:-12}" "$W/$1.log"
  case $1 in
    tune*) cp "$TUNED" "$W/tile_configs.json" ;;
    bench) cp perf/results/bench_moe_kernels_cuda.json "$W/" 2>/dev/null ;;
    # engine: bench_gpu_engine.py writes its JSON straight into $W, row by row
  esac
  tar czf "$OUT/gpu_session.tgz" -C "$W" .  # the device tool returns at most 8 files
}
step() {  # step NAME TIMEOUT CMD...: a concurrent step starts in the background
  wanted "$1" || return 0
  echo "== $1 ($(date +%T), limit $2 s): ${*:3}" | cut -c1-200
  if concurrent "$1"; then
    run_step "$@" &
    PIDS+=("$!:$1")
    return 0
  fi
  join
  run_step "$@"
  report "$1"
}
join() {  # wait for the concurrent steps started so far, then report each
  local p
  for p in "${PIDS[@]}"; do
    wait "${p%%:*}"
    echo "== ${p#*:} done ($(date +%T))"
    report "${p#*:}"
  done
  PIDS=()
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

# The issue-18 steps launch MPICH's mpiexec: the carried .whl/ wheels (mpi4py 4.1.2 + mpich
# 5.0.2; carry [".whl"]) when present, else an mpiexec on PATH. Their environment is set per step
# (R18 below), so the other steps keep the image's own mpi4py.
R18=(env)
if [[ " $STEPS " =~ " "(ipc|tokens|tp|eplb|trace|transport|calib)" " ]]; then
  if [ -d .whl ]; then
    carried_mpi
    R18=(env PYTHONPATH="$MPI_SITE:$PYTHONPATH" MPI4PY_LIBMPI="$LIBMPI" MPIEXEC="$MPICH_BIN/mpiexec")
    MPIEXEC="$MPICH_BIN/mpiexec"
  else
    MPIEXEC=$(command -v mpiexec || echo "$(dirname "$(command -v "$PY")")/mpiexec")
    R18=(env MPIEXEC="$MPIEXEC")
  fi
fi
PYT="$PY -m pytest -q -rs -m gpu -p no:cacheprovider --continue-on-collection-errors"

step env 30 bash -c "cd $ROOT; nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; $PY -c 'import transformers; print(\"transformers\", transformers.__version__)'; $PY -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'; $PY -c 'from megainfer.comm import nccl; lib = nccl.load_nccl(); print(\"nccl\", nccl.nccl_version(lib), lib._name)'"
# ---- correctness (concurrent, PAR_STEPS)
step tests 150 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=120 ${TESTS:-tests/unit/kernels/test_kernels_triton.py tests/unit/comm/test_comm_nccl.py}"
step attn 170 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=120 ${ATTN_TESTS:-tests/unit/kernels/test_attention_triton.py tests/parity/test_engine_triton.py tests/unit/kernels/test_mla_triton.py tests/unit/kernels/test_kv_quant_triton.py}"
GPUTESTS=$(cd "$ROOT" && ls tests/gpu/test_gpu_engine.py tests/unit/engine/test_sampler.py tests/unit/launch/test_device_config.py tests/unit/models/test_loader_memory.py tests/unit/runtime/test_expert_load_count.py 2>/dev/null)
step gputests 170 bash -c "cd $ROOT && $PYT -o timeout=120 $(echo $GPUTESTS)"
# issue 18: the disaggregated runtime on the GPU, every rank on the one GPU
step ipc 120 "${R18[@]}" bash -c "cd $ROOT && $PYT -o timeout=100 tests/gpu/test_runtime_gpu.py -k 'round_trips or cudart'"
step tokens 170 "${R18[@]}" bash -c "cd $ROOT && $PYT -o timeout=160 tests/gpu/test_runtime_gpu.py -k 'tokens and not tp2'"
step tp 170 "${R18[@]}" bash -c "cd $ROOT && $PYT -o timeout=160 tests/gpu/test_runtime_gpu.py -k tp2"
step eplb 170 "${R18[@]}" bash -c "cd $ROOT && $PYT -o timeout=160 tests/gpu/test_eplb_device_moves.py"
step trace 170 "${R18[@]}" bash -c "cd $ROOT && $PYT -o timeout=80 tests/gpu/test_runtime_gpu.py -k traced; \
    \$MPIEXEC -n 3 $PY -m megainfer.launch.main model=mixtral_8x7b model.arch.num_layers=2 \
      deploy=a1e2 deploy.device=cuda model.dtype=bfloat16 comm.transport=cuda_ipc \
      trace.enabled=true sampling.max_tokens=8 hydra.run.dir=$W/trace_run \
    && cp $W/trace_run/trace.json $W/trace_mixtral_n3.json"
# online: the engine core and AsyncLLM on cuda (LLM's default device when one is visible)
step online 150 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=120 tests/unit/engine/test_engine_online.py tests/unit/engine/test_async_llm.py"
# pyapi: every deploy mode from Python, on the GPU (rank 0 of an mpiexec launch serving the core)
step pyapi 150 "${R18[@]}" bash -c "cd $ROOT && $PYT -o timeout=140 tests/gpu/test_llm_deploy_gpu.py"
# ---- figures (each alone on the GPU)
step engine ${ENGINE_S:-200} "$PY" perf/bench/bench_gpu_engine.py --device cuda --budget-s $(( ${ENGINE_S:-200} - 15 )) \
  --models "${ENGINE_MODELS:-mixtral_8x7b,qwen3_30b_a3b}" \
  --systems "${ENGINE_SYSTEMS:-megainfer,megainfer-eager,hf}" --out "$W/bench_gpu_engine_cuda.json"
step transport 75 "${R18[@]}" "$PY" perf/bench/bench_transport_gpu.py --mpiexec "$MPIEXEC" --iters 200 \
  --out "$W/bench_transport_gpu.json"
step calib 200 "${R18[@]}" MEGAINFER_CALIBRATE_LINK="$W/bench_transport_gpu.json" bash -c "cd $ROOT && \
  $PY -m megainfer.launch.plan calibrate model=mixtral_8x7b model.num_layers=2 \
    calibrate.bench=megainfer_cuda calibrate.mpi=false calibrate.node=false calibrate.smoke=${CALIB_SMOKE:-false} \
    calibrate.merge=false calibrate.out=$W/h200_measured.yaml"
step nccl 60 "$PY" perf/bench/bench_nccl_self.py --out "$W/bench_nccl_self.json"
step fp8 150 bash -c "cd $ROOT && $PY -m pytest -q -rs -p no:cacheprovider -o timeout=140 tests/unit/kernels/test_fp8_gemm_triton.py"
step fp8bench ${FP8_S:-240} "$PY" perf/bench/bench_fp8_gemm_gpu.py --device cuda \
  --budget-s $(( ${FP8_S:-240} - 30 )) --out "$W/bench_fp8_gemm_cuda.json"
step tune1 90 "$PY" perf/bench/tune_moe_kernels.py --space small --shape 8,14336,4096 --top-k 2 --m 4,32,256,2048,8192 --table "$TUNED" --log "$W/tune_mixtral.json"
step tune2 80 "$PY" perf/bench/tune_moe_kernels.py --space small --shape 64,1408,2048 --top-k 6 --m 10,85,682,5461 --table "$TUNED" --log "$W/tune_dsv2lite.json"
step bench 150 "$PY" perf/bench/bench_moe_kernels.py --device cuda
step serve ${SERVE_S:-420} "${R18[@]}" bash -c "cd $ROOT && $PY $PWD/perf/bench/bench_serve.py --device cuda --threads 4 \
  --num-prompts ${SERVE_PROMPTS:-256} --input-len 128 --output-len 64 --max-num-seqs 64 \
  --modes ${SERVE_MODES:-single,a1e2} --mpiexec \${MPIEXEC:-mpiexec} \
  --rates ${SERVE_RATES:-8,32,inf} --out $W/bench_serve_cuda.json"
# Not in the default STEPS (STEPS=m2n to run it): bench_m2n's collectives and ping-pong on this
# machine's 16 cores (4 ranks, no oversubscription), under MPICH 5.0.2 from the carried wheel with
# the carried mpi4py 4.1.2 bound to it, as on the 2-core dev box.
if [[ " $STEPS " == *" m2n "* ]]; then
  carried_mpi
  step m2n 280 env PYTHONPATH="$MPI_SITE:$PYTHONPATH" MPI4PY_LIBMPI="$LIBMPI" \
    "$PY" perf/bench/bench_m2n.py --mpiexec "$MPICH_BIN/mpiexec" --parts collectives,pingpong \
    --scale "${M2N_SCALE:-0.5}" --out "$W/bench_m2n.json"
fi
join
echo "== summary"
grep -h -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|error" "$W"/{tests,attn,gputests,ipc,tokens,tp,eplb,trace,online,fp8}.log 2>/dev/null | cut -c1-220 | tail -n 40
cat "$W/rc.txt"
