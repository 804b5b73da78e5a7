#!/usr/bin/env bash
# Steady-state step time and losses of the default main job at two git revisions, run alternately.
#
#   bench/ab_revisions.sh REV_A REV_B [STEPS] [ROUNDS] [VARIANT]   e.g. bench/ab_revisions.sh ac77636 HEAD
#
# Each revision is checked out (git worktree) into a temporary directory and run with the same
# python (the current environment's torch) and PYTHONPATH pointing at that checkout, alternating
# A, B, A, B... so slow drift of a shared machine hits both. VARIANT is a configs/gpt.py variant
# ("" for the default run, "tiny"). Prints the logged steps' loss and step_time_s per run, and
# "losses sha1 ..." of every logged loss at full precision (metrics.jsonl): equal digests mean
# bit-identical losses. Measured: docs/results.md.
set -euo pipefail
a=${1:?usage: bench/ab_revisions.sh REV_A REV_B [STEPS] [ROUNDS]}
b=${2:?usage: bench/ab_revisions.sh REV_A REV_B [STEPS] [ROUNDS]}
steps=${3:-300}
rounds=${4:-2}
variant=${5:-}
config="configs/gpt.py${variant:+:$variant}"
python=${PYTHON:-python}
case $python in */*) python=$(realpath -s "$python") ;; esac  # the runs cd into worktrees
repo=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$tmp/a" >/dev/null 2>&1 || true; git -C "$repo" worktree remove --force "$tmp/b" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$repo" worktree add --detach "$tmp/a" "$a" >/dev/null 2>&1
git -C "$repo" worktree add --detach "$tmp/b" "$b" >/dev/null 2>&1
for round in $(seq "$rounds"); do
  for side in a b; do
    rev=$([ "$side" = a ] && echo "$a" || echo "$b")
    if ! out=$(cd "$tmp/$side" && PYTHONPATH="$tmp/$side" OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$python" -m functrain.main \
      --config="$config" --config.steps="$steps" --config.eval_every=100000 \
      --config.checkpoint.enabled=False --config.sample.max_new_tokens=1 --config.log_every="${LOG_EVERY:-100}" \
      --config.tensorboard=False --workdir="$tmp/run_$side" 2>&1); then
      echo "$rev: the run failed; its last lines:" >&2
      echo "$out" | tail -20 >&2
      exit 1
    fi
    digest=$("$python" -c "import json,sys,hashlib; rows=[json.loads(l) for l in open(sys.argv[1])]; \
print(hashlib.sha1(repr([(r['step'], r['loss']) for r in rows if 'loss' in r]).encode()).hexdigest()[:12])" \
      "$tmp/run_$side/metrics.jsonl")
    rm -rf "$tmp/run_$side"
    echo "$rev round $round: $(echo "$out" | grep -E '^step +[0-9]+/[0-9]+ \| loss' \
      | sed -E 's/.*step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+).*step_time_s ([0-9.]+).*/step \1 loss \2 step_time \3/' | tr '\n' ';') losses sha1 $digest"
  done
done
