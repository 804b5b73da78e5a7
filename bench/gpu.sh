#!/usr/bin/env bash
# The GPU checks, in one go on a CUDA machine (no network needed): CUDA-only failures of the main
# job (compiled step, compile_unit=blocks, bf16, nccl on one rank, async checkpoints), then the
# compiled-vs-eager benchmarks in bf16 and fp32 and the optimizer update alone.
#
#     bash bench/gpu.sh [part ...]      # parts: smoke step_bf16 step_fp32 optimizer (default: all)
#
# Each part runs under its own time limit and appends to $OUT/gpu.log (default runs/gpu); a
# summary of each part (exit code, seconds, its last lines) is printed. Without functrain
# installed it runs from the checkout (PYTHONPATH); the machine's torch is used as it is.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
py=${PYTHON:-python3}
log="$OUT/gpu.log"
parts=${*:-smoke step_bf16 step_fp32 optimizer}

# torch < 2.12 on CUDA: inductor's loop reordering after fusion asserts on a fused node that holds a
# foreach node (pytorch/pytorch#176591, fixed by #176849 in 2.12; the update graph mixes _foreach
# ops with per-tensor norms). functrain asks for torch >= 2.13; this lets a machine with an older
# CUDA build of torch run the checks anyway.
if ! $py -c "import sys, torch; sys.exit(tuple(int(x) for x in torch.__version__.split('.')[:2]) < (2, 12))"; then
  export TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0
  echo "torch < 2.12: TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0 (pytorch/pytorch#176591)" | tee -a "$log"
fi

part() {  # part NAME LIMIT_S CMD...: run, log, print the tail
    local name=$1 limit=$2 s rc
    shift 2
    echo "=== $name: $*" | tee -a "$log"
    s=$(date +%s)
    timeout "$limit" "$@" > "$OUT/part.log" 2>&1
    rc=$?
    cat "$OUT/part.log" >> "$log"
    echo "--- $name rc=$rc $(( $(date +%s) - s )) s" | tee -a "$log"
    grep -E "^(step |\| |eval|sample|functrain|Traceback|[A-Za-z]*Error)" "$OUT/part.log" | tail -n "${TAILN:-14}"
    tail -n 3 "$OUT/part.log"
}

for p in $parts; do
  case $p in
    smoke)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$log"
      $py -c "import torch, functrain; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"
      # The default run (300 steps): compiled step, eval, async checkpoint, sample, on cuda:0.
      part main_default 200 $py -m functrain.main --config=configs/gpt.py --workdir=/tmp/ft_default \
        --config.steps=300 --config.eval_every=150 --config.checkpoint.every=150
      # Resume from its checkpoint: restore onto CUDA, 100 more steps.
      part main_resume 90 $py -m functrain.main --config=configs/gpt.py --workdir=/tmp/ft_default \
        --config.steps=400 --config.eval_every=150 --config.checkpoint.every=150
      # bf16, per-block compile, remat full, on one nccl rank (a 1-process mesh).
      part main_blocks_bf16_nccl 170 $py -m torch.distributed.run --standalone --nproc_per_node=1 -m functrain.main \
        --config=configs/gpt.py:tiny --workdir=/tmp/ft_blocks --config.precision=bf16 \
        --config.compile_unit=blocks --config.remat=full
      ;;
    step_bf16)
      part step_bf16 420 $py bench/step.py --sizes default,gpt2 --precision bf16 --steps 20 --rounds 4 --json
      ;;
    step_fp32)
      part step_fp32 300 $py bench/step.py --sizes 100m --precision fp32 --steps 20 --rounds 4 --json
      ;;
    optimizer)
      part optimizer 150 $py bench/optimizer.py --size 100m --device cuda --rounds 30 --profile 5 --json
      ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
