#!/bin/sh
# `make demo`: install what the trainer needs (Debian/Ubuntu) when it is missing, build, then train
# the Fashion-MNIST MLP data-parallel on 2 ranks, print the final test accuracy, and draw the
# run's loss and throughput curves into $BUILD/demo.png (tools/plot_metrics.sh, gnuplot). On
# several ranks a short run of the same job on one rank follows (DEMO_CALIBRATION_STEPS, 150;
# 0 skips it), so the last line says what the extra ranks bought: their samples/s against one
# rank's, both as the trainer measures them (steps after its warm-up, evaluation excluded).
# Environment: DEMO_RANKS (2), DEMO_EPOCHS (3), DEMO_ARGS (extra trainer options), BUILD (build).
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
RANKS=${DEMO_RANKS:-2}
EPOCHS=${DEMO_EPOCHS:-3}
CALIBRATION_STEPS=${DEMO_CALIBRATION_STEPS:-150}

. tools/demo_common.sh
demo_prepare demo "dataset-fashion-mnist zlib1g-dev libopenblas-dev cmake build-essential pkg-config gnuplot-nox" \
    "zlib and OpenBLAS are needed" fashion-mnist ddprun

# Adam on the full 60k training set, global batch 128 (64 per rank): about 87% after 3 epochs (85% after 1).
echo "demo: training on $RANKS ranks: $BUILD/ddprun -n $RANKS $BUILD/fashion-mnist --epochs $EPOCHS" \
     "--batch 128 --optim adam --lr 1e-3 ${DEMO_ARGS:-}"
out=$(mktemp "${TMPDIR:-/tmp}/ddp-demo.XXXXXX")
trap 'rm -f "$out"' EXIT
start=$(date +%s)
# shellcheck disable=SC2086
"$BUILD/ddprun" -n "$RANKS" "$BUILD/fashion-mnist" --epochs "$EPOCHS" --batch 128 --optim adam \
    --lr 1e-3 --json --metrics "$BUILD/demo-metrics.csv" ${DEMO_ARGS:-} | tee "$out" | grep -v '^\[0\] {'
end=$(date +%s)
acc=$(sed -n 's/^\[0\] {"test_accuracy":\([0-9.]*\).*/\1/p' "$out" | tail -1)
sps=$(sed -n 's/.*"samples_per_sec":\([0-9.]*\).*/\1/p' "$out" | tail -1)
if [ -z "$acc" ]; then
    echo "demo: the trainer did not report an accuracy" >&2
    exit 1
fi
pct=$(awk -v a="$acc" 'BEGIN { printf "%.2f", a * 100 }')
echo "demo: final test accuracy ${pct}% after $EPOCHS epochs on $RANKS ranks" \
     "(${sps} samples/s, $((end - start)) s in all)"
if [ "$RANKS" -gt 1 ] && [ "$CALIBRATION_STEPS" -gt 0 ]; then
    # The same job on one rank for a few steps: the anchor of the speed-up.
    echo "demo: calibrating: the same job on 1 rank for $CALIBRATION_STEPS steps"
    # shellcheck disable=SC2086
    one=$(OPENBLAS_NUM_THREADS=1 "$BUILD/ddprun" -n 1 "$BUILD/fashion-mnist" --epochs 1 --batch 128 \
          --optim adam --lr 1e-3 --no-eval --max-steps $((CALIBRATION_STEPS + 10)) --warmup 10 \
          --json ${DEMO_ARGS:-} 2>/dev/null | sed -n 's/.*"samples_per_sec":\([0-9.]*\).*/\1/p' | tail -1)
    if [ -n "$one" ]; then
        awk -v n="$sps" -v one="$one" -v r="$RANKS" 'BEGIN {
            printf "demo: %d ranks: %.0f samples/s = %.2fx one rank (%.0f samples/s)", r, n, n / one, one
            printf "; ideal %dx (docs/benchmarks.md: what limits it on this machine)\n", r }'
    else
        echo "demo: the 1-rank calibration run reported nothing; no comparison" >&2
    fi
fi
./tools/plot_metrics.sh "$BUILD/demo-metrics.csv" "$BUILD/demo.png" \
    "Fashion-MNIST on $RANKS ranks: MLP 784-1024-1024-10, Adam, global batch 128 (${pct}% test accuracy)"
echo "demo: loss and throughput curves in $BUILD/demo.png (per-step numbers: $BUILD/demo-metrics.csv)"
