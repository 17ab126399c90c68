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

need="fortunes libopenblas-dev cmake build-essential pkg-config gnuplot-nox"
missing=""
if command -v dpkg-query >/dev/null 2>&1; then
    for p in $need; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
            missing="$missing $p"
        fi
    done
else
    echo "demo-gpt: not a Debian-like system (no dpkg-query); make sure these are installed: $need" >&2
fi
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "demo-gpt: installing$missing"
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y $missing
    else
        echo "demo-gpt: missing packages:$missing" >&2
        echo "demo-gpt: install them with:" >&2
        echo "    sudo apt-get update && sudo apt-get install -y$missing" >&2
        exit 1
    fi
fi

echo "demo-gpt: building into $BUILD/"
make BUILD="$BUILD" >/dev/null || make BUILD="$BUILD"
for f in "$BUILD/gpt" "$BUILD/ddprun"; do
    if [ ! -x "$f" ]; then
        echo "demo-gpt: $f was not built; see the cmake messages above (OpenBLAS is needed)" >&2
        exit 1
    fi
done

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
