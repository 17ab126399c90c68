#!/bin/sh
# plot_metrics.sh METRICS.csv OUT.png [TITLE]: draws the trainer's --metrics CSV (step, epoch,
# loss, lr, samples_per_sec, step_ms, exposed_comm_ms) as a PNG with gnuplot: the loss per step
# and its moving average against epochs on top; below, throughput (samples/s) and the exposed
# communication per step, both smoothed, since single steps on a shared machine jump by 2x.
# `make demo` ends with it; gnuplot comes from Debian's gnuplot-nox.
set -eu
if [ $# -lt 2 ]; then
    echo "usage: $0 METRICS.csv OUT.png [TITLE]" >&2
    exit 2
fi
csv=$1
png=$2
title=${3:-Fashion-MNIST training}
command -v gnuplot >/dev/null || {
    echo "plot_metrics: gnuplot is not installed (apt-get install gnuplot-nox)" >&2
    exit 1
}
head -1 "$csv" | grep -q '^step,epoch,loss,lr,samples_per_sec,step_ms,exposed_comm_ms$' || {
    echo "plot_metrics: $csv is not the trainer's --metrics CSV (header: $(head -1 "$csv"))" >&2
    exit 1
}
rows=$(($(wc -l <"$csv") - 1))
[ "$rows" -ge 1 ] || {
    echo "plot_metrics: $csv has no rows" >&2
    exit 1
}
data=$(mktemp "${TMPDIR:-/tmp}/plot_metrics.XXXXXX")
trap 'rm -f "$data"' EXIT
# Moving averages over a window of about 2% of the run (at least 5 steps): long enough to show
# the trend through per-step noise, short enough to keep the first epoch's fast drop.
win=$((rows / 50))
[ "$win" -ge 5 ] || win=5
awk -F, -v win="$win" -v skip=5 'NR > 1 {
        n = NR - 2; l[n % win] = $3; k = n + 1 < win ? n + 1 : win; sl = 0
        for (i = 0; i < k; i++) sl += l[i]
        ss = sc = "NaN"
        if (n >= skip) { # throughput and comm averaged over the steps after the first ones
            m = n - skip; s[m % win] = $5; c[m % win] = $7; j = m + 1 < win ? m + 1 : win
            ss = sc = 0
            for (i = 0; i < j; i++) { ss += s[i]; sc += c[i] }
            ss /= j; sc /= j
        }
        printf "%s %s %s %.6f %s %s\n", $1, $2, $3, sl / k, ss, sc
    }' "$csv" >"$data"
# Axis tops: the largest moving average, with room above it for the curve to read.
top_sps=$(awk '$5 != "NaN" && $5 > m { m = $5 } END { print (m > 0 ? m * 1.3 : 1) }' "$data")
top_comm=$(awk '$6 != "NaN" && $6 > m { m = $6 } END { print (m > 0 ? m * 1.3 : 1) }' "$data")
# Summary for the titles: the last smoothed loss, the median throughput and exposed time (of
# the per-step values after the first 5 steps: first touches of memory, the Reducer's bucket
# rebuild; they would also squash the scale of everything after them, so they are not drawn).
last_loss=$(tail -1 "$data" | awk '{ printf "%.3f", $4 }')
med_sps=$(tail -n +2 "$csv" | awk -F, 'NR > 5 { print $5 }' | sort -g | awk '{ v[NR] = $1 } END { printf "%.0f", v[int((NR + 1) / 2)] }')
med_comm=$(tail -n +2 "$csv" | awk -F, 'NR > 5 { print $7 }' | sort -g | awk '{ v[NR] = $1 } END { printf "%.3f", v[int((NR + 1) / 2)] }')

gnuplot <<GP
set terminal pngcairo size 1200,800 font "DejaVu Sans,12" linewidth 1.5
set output "$png"
set multiplot layout 2,1 title "$title" font ",16"
set grid lc rgb "#dddddd"
set border lc rgb "#555555"
set key top right box opaque
set lmargin 12
set rmargin 12

set title "Training loss (last moving average $last_loss)"
set ylabel "cross-entropy loss"
set xlabel "epoch"
set xrange [0:*]
set yrange [0:*]
plot "$data" using 2:3 with lines lc rgb "#9ecae1" lw 0.8 title "per step", \
     "" using 2:4 with lines lc rgb "#08519c" lw 2.5 title "moving average ($win steps)"

set title "Throughput (median $med_sps samples/s) and exposed communication (median $med_comm ms/step)"
set ylabel "samples / s" tc rgb "#a63603"
set y2label "exposed communication, ms / step" tc rgb "#54278f"
set ytics nomirror tc rgb "#a63603"
set y2tics tc rgb "#54278f"
set yrange [0:$top_sps]
set y2range [0:$top_comm]
set key top center horizontal box opaque
plot "$data" using 2:5 axes x1y1 with lines lc rgb "#e6550d" lw 2.5 title "samples/s (moving average)", \
     "" using 2:6 axes x1y2 with lines lc rgb "#756bb1" lw 2.5 title "exposed comm ms (moving average)"
unset multiplot
GP
echo "plot_metrics: wrote $png ($rows steps)"
