#!/bin/sh
# bench/gpt_scaling.sh [REPEATS] [STEPS]: build/gpt's tokens/s and exposed communication on 1 rank
# (the anchor) and 2 ranks at the same global batch, and on 2 ranks with --grad-blocks 4,
# interleaved in one invocation so that the machine's drifting speed hits every variant alike.
# Prints one line per run and the 2-rank/1-rank ratio per repeat. Default model and batch.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPEATS=${1:-3}
STEPS=${2:-40}
args="--steps $STEPS --eval-every 0 --eval-batches 1 --samples 0"
run() { # run N EXTRA...: prints "tokens/s exposed_ms"
    n=$1
    shift
    OPENBLAS_NUM_THREADS=1 "$BUILD/ddprun" -n "$n" "$BUILD/gpt" $args "$@" 2>&1 |
        sed -n 's/.*s: \([0-9]*\) tokens\/s.*communication \([0-9.]*\) ms.*/\1 \2/p'
}
r=1
while [ "$r" -le "$REPEATS" ]; do
    one=$(run 1)
    two=$(run 2)
    rows=$(run 2 --grad-blocks 4)
    echo "repeat $r: 1 rank $one | 2 ranks $two | 2 ranks --grad-blocks 4 $rows  (tokens/s, exposed ms/step)"
    echo "$one $two $rows" | awk '{ printf "repeat ratios: 2 ranks / 1 rank %.2f, grad-blocks 4 / whole %.2f\n", $3 / $1, $5 / $3 }'
    r=$((r + 1))
done
