#!/usr/bin/env bash
# The GPU checks, in one go on a CUDA machine (no network needed): the compiled-vs-eager benchmark in
# bf16 (timed alone; the step as CUDA graphs beside it), then CUDA-only failures of the main job (fp32
# and bf16, compile_unit step and blocks, CUDA graphs, a resume onto CUDA, bf16 + per-block compile
# on one nccl rank; these run side by side), the CUDA-graph and no-host-sync tests, the Llama ~1B
# shape compiled and eager, and one table of tokens/s, MFU, peak memory and compiled vs eager.
#
#     bash bench/gpu.sh [part ...]      # parts: step_bf16 smoke graphs llama1b table hf step_fp32 optimizer lora
#                                       (default: step_bf16 smoke graphs llama1b table hf)
#
# Each part runs under its own time limit and appends to $OUT/gpu.log (default runs/gpu); a
# summary of each run (exit code, seconds, its last lines) is printed. A failing compiled run
# leaves its inductor output code (every generated module with a `call`) in $OUT/<run>_code.tgz.
# Without functrain installed it runs from the checkout (PYTHONPATH); the machine's torch is used
# as it is.
set -u
OUT=${OUT:-runs/gpu}
LOGS=${LOGS:-$OUT/runs}  # one log per run (gpu.log gets them all)
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
py=${PYTHON:-python3}
log="$OUT/gpu.log"
parts=${*:-step_bf16 smoke graphs llama1b table hf}

# torch < 2.12 on CUDA: inductor's loop reordering after fusion asserts on a fused node that holds a
# foreach node (pytorch/pytorch#176591, fixed by #176849 in 2.12; the update graph mixes _foreach
# ops with per-tensor norms). functrain asks for torch >= 2.13; this lets a machine with an older
# CUDA build of torch run the checks anyway.
if ! $py -c "import sys, torch; sys.exit(tuple(int(x) for x in torch.__version__.split('.')[:2]) < (2, 12))"; then
  export TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0
  echo "torch < 2.12: TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0 (pytorch/pytorch#176591)" | tee -a "$log"
fi

run() {  # run NAME LIMIT_S CMD...: run with its own inductor cache, log to $OUT/NAME.log
    local name=$1 limit=$2 s rc
    shift 2
    s=$(date +%s)
    TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$name timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "$rc $(( $(date +%s) - s ))" > "/tmp/$name.rc"
    if [ "$rc" != 0 ] && [ -d "/tmp/ic_$name" ]; then
      grep -rl --include="*.py" "def call(" "/tmp/ic_$name" | tar -czf "$OUT/${name}_code.tgz" -T - 2>/dev/null
    fi
}

report() {  # report NAME: the run's exit code, seconds and its telling lines
    local name=$1
    { echo "=== $name rc/seconds: $(cat "/tmp/$name.rc" 2>/dev/null || echo 'not finished')"
      cat "$LOGS/$name.log"; } >> "$log"
    echo "=== $name rc/seconds: $(cat "/tmp/$name.rc" 2>/dev/null || echo 'not finished')"
    grep -E "^(step |\| |  memory|  \[|eval|functrain|first step|peak FLOP|Traceback|[A-Za-z.]*Error|torch)" "$LOGS/$name.log" \
      | tail -n "${TAILN:-14}"
    tail -n 3 "$LOGS/$name.log"
}

main() {  # main NAME LIMIT_S ARGS...: the main job
    local name=$1 limit=$2
    shift 2
    run "$name" "$limit" $py -m functrain.main --config=configs/gpt.py --workdir="/tmp/ft_$name" "$@"
}

for p in $parts; do
  case $p in
    step_bf16)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$log"
      $py -c "import torch, functrain; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"
      run step_bf16 "${STEP_LIMIT:-300}" $py bench/step.py --sizes default,gpt2 --precision bf16 --steps 12 --rounds 3 \
        --mem-steps 2 --no-breakdown --json
      TAILN=30 report step_bf16
      ;;
    smoke)
      # Side by side (they are small; 16 cores): the default run (fp32, compile_unit=step; failed on
      # torch 2.11 at the first step, a Triton launch given a pointer it could not read), the same
      # with donate=False (failed the same way until functrain.compiler.sdpa_seeds), the same with
      # compile_unit=blocks, the default in bf16 with a checkpoint and then a resume onto CUDA,
      # and bf16 + per-block compile + remat on one nccl rank.
      L=${SMOKE_LIMIT:-200}
      TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 main fp32_step "$L" --config.steps=100 --config.eval_every=50 &
      main fp32_nodonate "$L" --config.steps=100 --config.eval_every=50 --config.donate=False &
      main fp32_blocks "$L" --config.steps=100 --config.eval_every=50 --config.compile_unit=blocks &
      main fp32_graphs "$L" --config.steps=100 --config.eval_every=50 --config.checkpoint.every=50 --config.cuda_graphs=True &
      { main bf16_step "$L" --config.steps=100 --config.eval_every=50 --config.checkpoint.every=50 --config.precision=bf16 &&
        run bf16_resume 90 $py -m functrain.main --config=configs/gpt.py --workdir=/tmp/ft_bf16_step \
          --config.steps=150 --config.eval_every=50 --config.checkpoint.every=50 --config.precision=bf16; } &
      run blocks_bf16_nccl "$L" $py -m torch.distributed.run --standalone --nproc_per_node=1 -m functrain.main \
        --config=configs/gpt.py:tiny --workdir=/tmp/ft_blocks --config.precision=bf16 \
        --config.compile_unit=blocks --config.remat=full --config.steps=100 &
      wait
      for n in fp32_step fp32_nodonate fp32_blocks fp32_graphs bf16_step bf16_resume blocks_bf16_nccl; do TAILN=6 report $n; done
      ;;
    graphs)
      # CUDA graphs (losses equal the plain compiled step's, a resume under graphs) and the
      # no-host-sync counts, as pytest runs them.
      run graphs_tests 400 $py -m pytest -q tests/test_cuda_graphs.py tests/test_host_sync.py
      report graphs_tests
      ;;
    llama1b)
      # The Llama ~1B shape (configs/llama.py:1b, bf16, 8 x 2048 tokens a step): compiled, then eager.
      L=${LLAMA_LIMIT:-420}
      run llama1b "$L" $py -m functrain.main --config=configs/llama.py:1b --workdir=/tmp/ft_llama1b \
        --config.steps=40 --config.eval_every=40 --config.eval_batches=1 --config.checkpoint.enabled=False --config.export_hf=False
      report llama1b
      run llama1b_eager "$L" $py -m functrain.main --config=configs/llama.py:1b --workdir=/tmp/ft_llama1b_eager \
        --config.steps=30 --config.eval_every=30 --config.eval_batches=1 --config.checkpoint.enabled=False --config.export_hf=False \
        --config.compile=False
      report llama1b_eager
      ;;
    table)
      # One table of what the parts above measured (the GPT shapes from step_bf16, the Llama 1b runs).
      $py bench/gpu_table.py "$LOGS/step_bf16.log" /tmp/ft_llama1b /tmp/ft_llama1b_eager | tee -a "$log"
      ;;
    hf)
      # transformers' Llama, Qwen2, GPT-2 and functrain's GPT: functrain's step vs torch.compile and the
      # eager loop, fused AdamW (cold compile, warm first step, steady step: one JSON line per type).
      if $py -c "import transformers" 2>/dev/null; then
        for t in llama qwen2 gpt2 gpt; do
          run "hf_$t" 300 $py bench/hf.py --type "$t" --size small --batch 16 --seq 512 --json
          report "hf_$t"
        done
      else
        echo "hf: transformers is not installed here: skipped" | tee -a "$log"
      fi
      ;;
    step_fp32)
      run step_fp32 300 $py bench/step.py --sizes 100m --precision fp32 --steps 20 --rounds 4 --json
      report step_fp32
      ;;
    optimizer)
      run optimizer 150 $py bench/optimizer.py --size 100m --device cuda --rounds 30 --profile 5 --json
      report optimizer
      ;;
    lora)  # LoRA vs a full fine-tune of a 12 x 1024 GPT (~150M), a population of 4 adapter sets vs 4 solo runs
      run lora 300 $py bench/lora.py --device cuda --layers 12 --width 1024 --steps 20 --json
      report lora
      ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
