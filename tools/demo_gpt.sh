#!/bin/sh
# `make demo-gpt`: install what the GPT trainer needs (Debian/Ubuntu) when it is missing, build,
# train the byte-level GPT on the fortunes quotations on 2 ranks (about 2 minutes on 2 cores),
# print the validation loss against the unigram baseline, generated samples and the throughput,
# and draw the train/validation loss into $BUILD/demo-gpt.png (gnuplot).
# Environment: DEMO_RANKS (2), DEMO_ARGS (extra trainer options), BUILD (build).
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
RANKS=${DEMO_RANKS:-2}

. tools/demo_common.sh
demo_prepare demo-gpt "fortunes libopenblas-dev cmake build-essential pkg-config gnuplot-nox" \
    "OpenBLAS is needed" gpt ddprun

csv="$BUILD/demo-gpt-metrics.csv"
echo "demo-gpt: training on $RANKS ranks: $BUILD/ddprun -n $RANKS $BUILD/gpt --metrics $csv ${DEMO_ARGS:-}"
# One OpenBLAS thread per rank: the ranks are the parallelism (the trainer sets it too).
# shellcheck disable=SC2086
OPENBLAS_NUM_THREADS=1 "$BUILD/ddprun" -n "$RANKS" "$BUILD/gpt" --metrics "$csv" ${DEMO_ARGS:-}

if command -v gnuplot >/dev/null; then
    gnuplot <<GP
set terminal pngcairo size 900,500 noenhanced
set output "$BUILD/demo-gpt.png"
set datafile separator ","
set datafile missing ""
set title "GPT on fortunes (bytes), $RANKS ranks: train and validation loss (nats/byte)"
set xlabel "optimizer step"
set ylabel "loss"
set key top right
plot "$csv" using 1:2 every ::1 with lines lc rgb "#8080c0" title "train (global batch)", \
     "$csv" using 1:(\$3 > 0 ? \$3 : 1/0) every ::1 with linespoints pt 7 lc rgb "#c03030" title "validation"
GP
    echo "demo-gpt: loss curves in $BUILD/demo-gpt.png (per-step numbers: $csv)"
else
    echo "demo-gpt: gnuplot is not installed, no plot (per-step numbers: $csv)"
fi
