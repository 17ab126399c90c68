#!/bin/sh
# plot_trainer_vs_pytorch.sh RESULTS.txt OUT.png: draws the table of trainer_vs_pytorch.sh (saved
# output, e.g. bench/results/*-trainer-vs-pytorch.txt) as grouped bars per configuration: the
# step time, and the exposed communication, libddp against PyTorch DDP (gloo), and PyTorch DDP
# over libddp's torch backend "ddp" when the run has its columns. Exposed is what
# the table's ratio compares: PyTorch's no_sync measure against the larger of libddp's no_sync
# and finalize-wait measures; the error bars span the no_sync measure's runs. The y axes are
# logarithmic (the two differ by 20-40x); each group is labelled with the ratio.
# gnuplot: Debian's gnuplot-nox.
set -eu
if [ $# -lt 2 ]; then
    echo "usage: $0 RESULTS.txt OUT.png" >&2
    exit 2
fi
in=$1
png=$2
command -v gnuplot >/dev/null || {
    echo "plot_trainer_vs_pytorch: gnuplot is not installed (apt-get install gnuplot-nox)" >&2
    exit 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/plot_trainer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Rows: "| hidden H, batch B/rank | step | v1 / ns [lo-hi] / wait | pt step | v1 / ns [lo-hi] | Rx |"
# [ "pt+ddp step | v1 / ns [lo-hi] | Rx |" ... ]
# -> label, libddp step, PyTorch step, libddp exposed lo hi, PyTorch exposed lo hi, ratio
#    [, PyTorch+ddp step, exposed lo hi]
awk -F'|' '
    # "[lo-hi]" in cell -> out[1], out[2]; lo may be negative (an exposure measure is a
    # difference: noise can make it so), and the log axis needs it above 0, so it is clamped
    function range_of(cell, out,    r, neg) {
        match(cell, /\[-?[0-9.]+-[0-9.]+\]/); r = substr(cell, RSTART + 1, RLENGTH - 2)
        neg = substr(r, 1, 1) == "-"; if (neg) r = substr(r, 2)
        split(r, out, "-"); if (neg) out[1] = -out[1]
        if (out[1] < 0.05) out[1] = 0.05
    }
    /^\| hidden [0-9]+, batch [0-9]+\/rank/ {
        label = $2; gsub(/^ +| +$/, "", label); sub(/, batch /, "\\n", label); sub(/\/rank/, "/rank", label); label = label; sub(/\\n/, "\\nbatch ", label)
        lstep = $3 + 0; pstep = $5 + 0
        # libddp exposed: "v1 / ns [lo-hi] / wait"
        split($4, a, "/"); ns = a[2] + 0; wait = a[3] + 0
        range_of(a[2], lr)
        lexp = ns > wait ? ns : wait; llo = lr[1] < lexp ? lr[1] : lexp; lhi = lr[2] > lexp ? lr[2] : lexp
        split($6, b, "/"); pns = b[2] + 0
        range_of(b[2], pr)
        ratio = $7; gsub(/ /, "", ratio)
        extra = ""
        if (NF >= 11 && $8 ~ /[0-9]/) {
            split($9, c, "/"); dns = c[2] + 0
            range_of(c[2], dr)
            extra = sprintf(" %s %s %s %s", $8 + 0, dns, dr[1], dr[2])
        }
        printf "\"%s\" %s %s %s %s %s %s %s %s %s%s\n", label, lstep, pstep, lexp, llo, lhi, pns, pr[1], pr[2], ratio, extra
    }' "$in" >"$tmp/data"
[ -s "$tmp/data" ] || {
    echo "plot_trainer_vs_pytorch: no '| hidden H, batch B/rank |' rows in $in" >&2
    exit 1
}
# the PyTorch+ddp bars when every row has them
with_ddp=0
awk 'NF < 14 { bad = 1 } END { exit bad }' "$tmp/data" && with_ddp=1
step_ddp="" exp_ddp="" gloo_name="PyTorch DDP"
title="Fashion-MNIST MLP on 2 ranks: libddp against PyTorch DDP (gloo)"
if [ "$with_ddp" = 1 ]; then
    step_ddp=', "" using 11 lc rgb "#31a354" title "PyTorch DDP (ddp)"'
    exp_ddp=', "" using 12:13:14 lc rgb "#31a354" title "PyTorch DDP (ddp)"'
    gloo_name="PyTorch DDP (gloo)"
    title="MLP on 2 ranks: libddp, PyTorch DDP over gloo and over ddp"
fi
stamp=$(sed -n 's/.*machine: .*; \([0-9-]* [0-9:]* UTC\);.*/\1/p' "$in" | head -1)
gnuplot <<GP
set terminal pngcairo size 1300,620 font "DejaVu Sans,12" linewidth 1.5 noenhanced
set output "$png"
set multiplot layout 1,2 title "$title, trainer_vs_pytorch.sh, $stamp" font ",15"
set style data histogram
set style fill solid 0.85 border -1
set boxwidth 0.9
set grid ytics lc rgb "#dddddd"
set logscale y
set key top left box opaque
set xtics scale 0 font ",10"
set bmargin 5

set title "One optimizer step\n(median over the runs)"
set ylabel "ms per step"
set yrange [0.5:3000]
set style histogram clustered gap 1
plot "$tmp/data" using 2:xtic(1) lc rgb "#08519c" title "libddp", \
     "" using 3 lc rgb "#e6550d" title "$gloo_name" $step_ddp

set title "Exposed communication per step\n(error bars: the runs' range; above: PyTorch (gloo) / libddp)"
set ylabel "ms per step, not hidden by backward"
set yrange [0.05:3000]
set style histogram errorbars gap 1 lw 1.5
plot "$tmp/data" using 4:5:6:xtic(1) lc rgb "#08519c" title "libddp", \
     "" using 7:8:9 lc rgb "#e6550d" title "$gloo_name" $exp_ddp, \
     "" using (\$0):(\$9 * 1.6):(stringcolumn(10)) with labels font ",10" notitle
unset multiplot
GP
with=""
[ "$with_ddp" = 1 ] && with=", with PyTorch+ddp"
echo "plot_trainer_vs_pytorch: wrote $png ($(wc -l <"$tmp/data") configurations$with)"
