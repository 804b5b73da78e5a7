#!/usr/bin/env bash
# torchrun's elastic restart, N times in a row: 2 gloo ranks (tiny GPT, FSDP, eager), a checkpoint every
# 10 steps, one worker killed with kill -9 once step 30 is committed; torchrun --max-restarts=1 brings
# the run back, and its logged losses must equal an uninterrupted run's, bit for bit.
#
#   bash bench/elastic.sh [N]        # prints one line per drill and "elastic: K/N restarted bit-exactly"
set -uo pipefail
n=${1:-10}
python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(--config=configs/gpt.py:tiny --config.mesh.dp_shard=2 --config.compile=False --config.checkpoint.every=10
       --config.steps=120 --config.log_every=10 --config.eval_every=1000 --config.tensorboard=False)
# each step's logged loss (a step logged by the killed attempt and again after the restart: the last)
losses() { "$python" -c "import json,sys; print(sorted({r['step']: r['loss'] for r in map(json.loads, open(sys.argv[1])) if 'loss' in r}.items()))" "$1/metrics.jsonl"; }
OMP_NUM_THREADS=1 "$python" -m torch.distributed.run --standalone --nproc_per_node=2 -m functrain.main "${flags[@]}" \
  --workdir="$tmp/whole" > "$tmp/whole.log" 2>&1 || { echo "the uninterrupted run failed"; tail -5 "$tmp/whole.log"; exit 1; }
want=$(losses "$tmp/whole")
ok=0
for i in $(seq "$n"); do
  wd="$tmp/run$i"
  OMP_NUM_THREADS=1 timeout 600 "$python" -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=1 \
    -m functrain.main "${flags[@]}" --workdir="$wd" > "$tmp/log$i" 2>&1 &
  launcher=$!
  until [ -f "$wd/checkpoints/30/commit_success.txt" ] || ! kill -0 $launcher 2>/dev/null; do sleep 0.2; done
  victim=$(ps -eo pid,args | grep -v grep | grep -- "-m functrain.main .*--workdir=$wd" | grep -v torch.distributed.run \
           | awk '{print $1}' | tail -1)
  kill -9 "$victim" 2>/dev/null
  wait $launcher
  code=$?
  got=$(losses "$wd" 2>/dev/null)
  if [ $code -eq 0 ] && [ "$got" = "$want" ]; then
    ok=$((ok + 1)); echo "drill $i: restarted, losses bit-identical"
  else
    echo "drill $i: torchrun exit $code, losses $([ "$got" = "$want" ] && echo equal || echo differ); last lines:"
    grep -E "Error|refused|restored" "$tmp/log$i" | tail -3
  fi
done
echo "elastic: $ok/$n restarted bit-exactly"
