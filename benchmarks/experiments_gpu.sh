#!/usr/bin/env bash
# The experiments' GPU sweep (docs/system.md §9): the CPU run's commands with the long curriculum (64 pairs with
# filler lines between them: 4K-token windows in training, documents to about 8.7K tokens in evaluation) and six KV
# splits, run as parallel processes on one GPU within one time limit:
#   - one `experiments run budget --splits NAME` process per split (trains its task model, evaluates it);
#   - `experiments train-task` (the studies' task model), then `experiments run approximations|replay|needle` on it;
#   - at the end one `experiments run budget` over every split that finished training (evaluation only: a split
#     trained with the same settings is not trained again) writes the budget report.
# Usage (repo root, a CUDA machine):
#   SCALE=1 LIMIT=560 bash benchmarks/experiments_gpu.sh            # -> runs/experiments-gpu/
# SCALE multiplies every curriculum stage's steps (TASK_SCALE those of the studies' task model: on one H100 with
# seven processes SCALE 0.3 took about 410 s a model and left train-task's studies no time; a smaller TASK_SCALE
# leaves them some, not yet measured), LIMIT (s) bounds the whole run (training processes still
# running 70 s before it are stopped, their splits left out of the report), TRAIN_SEED the budget models' seed,
# BUDGET_SPLITS the splits (comma-separated). Seven processes held 65 GB of the H100's memory at the longest stage.
set -u
SCALE=${SCALE:-1}
TASK_SCALE=${TASK_SCALE:-$SCALE}           # train-task's: its accuracy and three studies follow it in the same time
LIMIT=${LIMIT:-560}
OUT=${EXP_OUT:-runs/experiments-gpu}
SIZES=${SIZES:-16,64}                      # pairs per evaluation document (8 tokens a pair with its query)
FILLER=${FILLER:-0,4,8,16,24}                # filler lines (about 6 tokens each) after each pair
DOCS=${DOCS:-8}
STUDY_FILLER=${STUDY_FILLER:-16}           # approximations (and replay's stream): 64 pairs + 16 lines: ~6K tokens
NEEDLE_FILLER=${NEEDLE_FILLER:-0,8}        # the needle study (its decode steps per approximation take the time)
NEEDLE_DOCS=${NEEDLE_DOCS:-2}
TRAIN_SEED=${TRAIN_SEED:-0}
DEVICE=${DEVICE:-cuda}
IFS=, read -r -a SPLITS <<< "${BUDGET_SPLITS:-preset,swapped,three m=2,six m=4,m=1 4 4,m=4 4 1}"
PY=${PYTHON:-python3}
mkdir -p "$OUT/logs"
t0=$(date +%s)
BUDGET=(-m dsv41 experiments run budget --curriculum long --device "$DEVICE" --lr 0.01 --scale "$SCALE"
        --train-seed "$TRAIN_SEED" --sizes "$SIZES" --filler "$FILLER" --docs "$DOCS" --out "$OUT")
for s in "${SPLITS[@]}"; do
    timeout $((LIMIT - 70)) $PY "${BUDGET[@]}" --splits "$s" > "$OUT/logs/budget-${s// /_}.log" 2>&1 &
done
(
    timeout $((LIMIT - 150)) $PY -m dsv41 experiments train-task --curriculum long --device "$DEVICE" --scale "$TASK_SCALE" --lr 0.01 \
        --out "$OUT/task-kv-compact" --sizes "$SIZES" --filler "$FILLER" --docs 4 > "$OUT/logs/train-task.log" 2>&1 \
        || exit 1
    for study in approximations replay needle; do
        left=$((LIMIT - 20 - $(date +%s) + t0))
        [ "$left" -gt 10 ] || break
        docs=4; filler=$STUDY_FILLER
        [ "$study" = needle ] && docs=$NEEDLE_DOCS && filler=$NEEDLE_FILLER
        timeout "$left" $PY -m dsv41 experiments run "$study" --checkpoint "$OUT/task-kv-compact" --task kv-compact \
            --size "${SIZES##*,}" --filler "$filler" --docs "$docs" --sizes "${SIZES##*,}" --device "$DEVICE" \
            --out "$OUT" > "$OUT/logs/$study.log" 2>&1
    done
) &
wait
done_splits=()
for s in "${SPLITS[@]}"; do
    d="$OUT/budget/$(echo "$s" | tr ' ' '-' | tr -d '=')$([ "$TRAIN_SEED" = 0 ] || echo "-seed$TRAIN_SEED")"
    [ -f "$d/trained.json" ] && done_splits+=("$s")
done
if [ ${#done_splits[@]} -gt 0 ]; then
    list=$(IFS=,; echo "${done_splits[*]}")
    $PY "${BUDGET[@]}" --splits "$list" > "$OUT/logs/budget-report.log" 2>&1
fi
echo "experiments GPU sweep: $(( $(date +%s) - t0 )) s; budget splits trained: ${done_splits[*]:-none}"
for f in "$OUT"/logs/*.log; do echo "== $f"; tail -n 4 "$f"; done
