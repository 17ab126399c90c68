#!/bin/sh
# What libddp's optimizer features cost in the Fashion-MNIST trainer: the median step time of the
# trainer's own Adam (the anchor) against libddp's AdamW, + clipping and a cosine schedule, + bf16
# master weights, and ZeRO-1/ZeRO-2 with AdamW + clipping, run interleaved in one invocation (the
# VM changes speed within minutes, so only runs side by side compare):
#
#   bench/optim_ab.sh BUILD [REPS] [RANKS] [HIDDEN]
#
# Synthetic data (12800 samples, batch 128: 100 steps, the first 3 untimed), one OpenBLAS thread
# per rank. Prints every run's step_ms_median and, per configuration, the ratio to the anchor of
# the same repetition (min / median / max over repetitions).
set -eu
BUILD=${1:?usage: optim_ab.sh BUILD [REPS] [RANKS] [HIDDEN]}
REPS=${2:-5}
RANKS=${3:-2}
HIDDEN=${4:-1024}
export OPENBLAS_NUM_THREADS=1
BASE="--synthetic 12800 --batch 128 --epochs 1 --hidden $HIDDEN --json --no-eval"
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT INT TERM
set -- "adam:--optim adam" \
       "adamw:--optim adamw --wd 0.1" \
       "adamw+clip+cosine:--optim adamw --wd 0.1 --clip-grad 1 --lr-schedule cosine --warmup-steps 10" \
       "adamw+bf16:--optim adamw --wd 0.1 --param-dtype bf16" \
       "zero1+adamw+clip:--optim adamw --wd 0.1 --clip-grad 1 --zero 1" \
       "zero2+adamw+clip:--optim adamw --wd 0.1 --clip-grad 1 --zero 2"
rep=1
while [ "$rep" -le "$REPS" ]; do
    for spec in "$@"; do
        name=${spec%%:*}
        args=${spec#*:}
        # shellcheck disable=SC2086
        ms=$("$BUILD/ddprun" -n "$RANKS" --no-prefix "$BUILD/fashion-mnist" $BASE $args |
             grep '^{' | head -1 | sed 's/.*"step_ms_median":\([0-9.]*\).*/\1/')
        echo "$rep $name $ms" | tee -a "$OUT"
    done
    rep=$((rep + 1))
done
echo "ratio to adam (same repetition): min median max"
awk '{ ms[$1 " " $2] = $3; names[$2] = 1; reps[$1] = 1 }
     END {
         for (n in names) {
             k = 0
             for (r in reps) if (ms[r " adam"] > 0) v[++k] = ms[r " " n] / ms[r " adam"]
             for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++)
                 if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
             printf "%-20s %.3f %.3f %.3f\n", n, v[1], v[int((k + 1) / 2)], v[k]
         }
     }' "$OUT" | sort
