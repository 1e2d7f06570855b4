#!/bin/bash
# closing rerun 2026-12-05b: the documented commands, SFT step budget set to what fits in its minutes
cd /work/main && . .venv/bin/activate
export OMP_NUM_THREADS=1
R=runs/pt; L=$R/logs
t() { local n=$1; shift; local s=$(date +%s); "$@" > $L/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s) - s ))s" >> $L/times.txt; }
t sft    python -m dsv41 posttrain sft --runs $R --out $R/post-sft --minutes 4 --steps 330 --quiet
t rl     python -m dsv41 posttrain rl  --runs $R --minutes 8 --steps 1000 --quiet
t opd    python -m dsv41 posttrain opd --runs $R --minutes 4 --steps 1000
t dspark python -m dsv41 posttrain dspark --runs $R --steps 400 --minutes 3 --quiet
( for g in sample prompt batch; do
    t occ-$g python -m dsv41 posttrain rl --runs $R --dispatch $g --steps 12 --minutes 4 --out $R/post-rl-$g-12 --quiet
  done ) &
t eval-rl  python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-rl  --baseline $R/post-sft --problems 500
t eval-opd python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-opd --baseline $R/post-rl  --problems 500
wait
t eval-opd-sft python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-opd --baseline $R/post-sft --problems 500
cp $R/post-opd/eval.json $R/post-opd/eval-opd-vs-sft.json
t eval-opd-rl python -m dsv41 posttrain eval --runs $R --checkpoint $R/post-opd --baseline $R/post-rl --problems 500
cp $R/post-opd/eval.json $R/post-opd/eval-opd-vs-rl.json
t report python -m dsv41 posttrain report --runs $R --out benchmarks/results/posttrain-cpu-2026-12-05b
echo done >> $L/times.txt
