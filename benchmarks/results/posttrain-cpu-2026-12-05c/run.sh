#!/bin/bash
# The post-training run of 2026-12-05c, as run (2-core Intel Xeon): each stage at its defaults, in the order
# `dsv41 posttrain all` runs them, then the acceptance evaluation (500 held-out problems x 9 levels) and three
# short RL runs that measure generation-slot occupancy per dispatch granularity.
set -u
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
R=${R:-runs/pt}; L=$R/logs; mkdir -p $L; : > $L/times.txt
t() { local n=$1; shift; local s=$(date +%s); "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s) - s ))s" >> $L/times.txt; }
start=$(date +%s)
if [ -n "${SFT_FROM:-}" ]; then   # an SFT checkpoint trained at the same defaults (see COMMANDS.md)
  mkdir -p $R/post-sft && cp $SFT_FROM/* $R/post-sft/ && rm -f $R/post-sft/eval*; echo "sft copied from $SFT_FROM" >> $L/times.txt
else
  t sft  python -m dsv41 posttrain sft    --runs $R --quiet
fi
t rl     python -m dsv41 posttrain rl     --runs $R --quiet
t opd    python -m dsv41 posttrain opd    --runs $R
t dspark python -m dsv41 posttrain dspark --runs $R --quiet
echo "stages $(( $(date +%s) - start ))s" >> $L/times.txt
export OMP_NUM_THREADS=1            # two evaluations at a time, one core each
t eval-sft python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-sft --baseline none --problems 500 &
t eval-rl  python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-rl  --baseline none --problems 500 &
wait
t eval-rl-vs-sft python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-rl --baseline $R/post-sft --problems 500
t eval-opd-vs-rl python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-opd --baseline $R/post-rl --problems 500 &
( for g in sample prompt batch; do
    t occ-$g python -m dsv41 posttrain rl --runs $R --dispatch $g --steps 12 --minutes 4 --out $R/post-rl-$g-12 --quiet
  done ) &
wait
t report python -m dsv41 posttrain report --runs $R --out benchmarks/results/posttrain-cpu-2026-12-05c
cp -r $L benchmarks/results/posttrain-cpu-2026-12-05c/
echo "done $(( $(date +%s) - start ))s" >> $L/times.txt
cp $L/times.txt benchmarks/results/posttrain-cpu-2026-12-05c/logs/
