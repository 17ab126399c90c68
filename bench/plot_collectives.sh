#!/bin/sh
# plot_collectives.sh RESULTS.txt OUT.png: draws the tables of compare_collectives.sh (saved
# output, e.g. bench/results/*-collectives.txt) as algbw against message size, one panel per
# world size: libddp with user buffers and with buffers in its segment (and with registered and
# unregistered user buffers, when the run has those columns), Open MPI, PyTorch's gloo (when the run has its lines), and the one-core memcpy bound; error bars span the repetitions (the "spread" table). Both axes are
# logarithmic. The tables print GB/s with two decimals, so points below 0.01 GB/s (8-32 B at 4
# ranks) are not drawn; the text's latency line has those sizes. gnuplot: Debian's gnuplot-nox.
#   OP=allreduce (the table to draw, when the results hold several operations)
set -eu
if [ $# -lt 2 ]; then
    echo "usage: $0 RESULTS.txt OUT.png" >&2
    exit 2
fi
in=$1
png=$2
op=${OP:-allreduce}
command -v gnuplot >/dev/null || {
    echo "plot_collectives: gnuplot is not installed (apt-get install gnuplot-nox)" >&2
    exit 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/plot_collectives.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# One data file per world size: bytes, then median, low and high of user, segment, MPI, memcpy,
# registered and unregistered (NaN when the table has no such column).
awk -v op="$op" -v dir="$tmp" '
    /^## / { sect = ($2 == op); if (sect) { n = $0; sub(/ ranks.*/, "", n); sub(/.* /, "", n); ranks[++nr] = n }
             part = 0; next }
    !sect { next }
    /^ *bytes +user +segment +MPI/ && part == 0 { part = 1; next }
    /^spread/ { part = 2; next }
    /^ *bytes/ { next }
    /^latency|^one process/ { part = 3; next }
    part == 1 && NF >= 7 { med[n, $1] = $2 " " $3 " " $4 " " $7 " " (NF >= 13 ? $10 : "-") " " (NF >= 16 ? $14 : "-")
                           order[n, ++cnt[n]] = $1
                           if (NF >= 13 && $10 != "-") has_reg[n] = 1
                           if (NF >= 16 && $14 != "-") has_unreg[n] = 1 }
    part == 2 && NF >= 5 { sp[n, $1] = $2 " " $3 " " $4 " " $5 " " (NF >= 6 ? $6 : "-") " " (NF >= 7 ? $7 : "-") }
    /^gloo +[0-9]/ { print $2, $3, $4, $5 > (dir "/g" n ".dat"); has_gloo[n] = 1 }
    END {
        for (k = 1; k <= nr; k++) {
            r = ranks[k]; f = dir "/r" r ".dat"
            for (i = 1; i <= cnt[r]; i++) {
                b = order[r, i]; split(med[r, b], m, " "); split(sp[r, b], s, " ")
                line = b
                for (j = 1; j <= 6; j++) {
                    lo = hi = m[j]
                    if (s[j] ~ /-/) { split(s[j], q, "-"); lo = q[1]; hi = q[2] }
                    if (lo + 0 <= 0) lo = m[j] # a range down to 0.00 is rounding, not a measurement
                    if (m[j] == "-" || m[j] + 0 <= 0) m[j] = lo = hi = "NaN"
                    line = line " " m[j] " " lo " " hi
                }
                print line > f
            }
            close(f)
            print r > (dir "/ranks")
            if (has_reg[r]) print r > (dir "/reg" r)
            if (has_unreg[r]) print r > (dir "/unreg" r)
            if (has_gloo[r]) close(dir "/g" r ".dat")
        }
    }' "$in"
[ -s "$tmp/ranks" ] || {
    echo "plot_collectives: no '## $op' table in $in (is it compare_collectives.sh output?)" >&2
    exit 1
}
stamp=$(sed -n 's/^# compare_collectives: \([0-9-]* [0-9:]*\) UTC.*/\1 UTC/p' "$in" | head -1)
npanels=$(wc -l <"$tmp/ranks")
{
    echo "set terminal pngcairo size $((650 * npanels)),620 font 'DejaVu Sans,12' linewidth 1.5 noenhanced"
    echo "set output '$png'"
    echo "set multiplot layout 1,$npanels title \"$op f32 sum: bandwidth against message size (compare_collectives.sh, $stamp)\" font ',15'"
    echo "set logscale xy"
    echo "set format y '%g'"
    echo "set grid lc rgb '#dddddd'"
    echo "set key top left box opaque"
    echo "set xlabel 'message size'"
    echo "set ylabel 'algbw, GB/s (size / time)'"
    echo "set xtics ('8 B' 8, '128 B' 128, '2 KiB' 2048, '32 KiB' 32768, '512 KiB' 524288, '8 MiB' 8388608, '128 MiB' 134217728)"
    # gloo reaches down to 1e-6 GB/s at 8 B (0.3-3 ms per allreduce)
    if ls "$tmp"/g*.dat >/dev/null 2>&1; then echo "set yrange [1e-6:20000]"; else echo "set yrange [0.01:20000]"; fi
    while read -r r; do
        f="$tmp/r$r.dat"
        echo "set title '$r ranks (shared memory, one machine)'"
        echo "plot '$f' using 1:2:3:4 with yerrorlines lc rgb '#08519c' lw 2.5 pt 7 ps 0.7 title 'libddp, user buffers', \\"
        echo "     '$f' using 1:5:6:7 with yerrorlines lc rgb '#6baed6' lw 1.5 pt 5 ps 0.6 dt 2 title 'libddp, segment buffers', \\"
        echo "     '$f' using 1:8:9:10 with yerrorlines lc rgb '#e6550d' lw 2.5 pt 9 ps 0.8 title 'Open MPI', \\"
        reg=""
        [ -f "$tmp/reg$r" ] && reg="'$f' using 1:14:15:16 with yerrorlines lc rgb '#756bb1' lw 2 pt 11 ps 0.7 title 'libddp, registered buffers', "
        [ -f "$tmp/unreg$r" ] && reg="$reg'$f' using 1:17:18:19 with yerrorlines lc rgb '#bcbddc' lw 1.5 pt 3 ps 0.6 dt 4 title 'libddp, not registered (MAP=on)', "
        gloo=""
        [ -s "$tmp/g$r.dat" ] && gloo="'$tmp/g$r.dat' using 1:(\$2 > 0 ? \$2 : NaN):3:4 with yerrorlines lc rgb '#31a354' lw 2 pt 13 ps 0.8 title 'PyTorch gloo (loopback TCP)', "
        echo "     $reg$gloo'$f' using 1:11 with lines lc rgb '#636363' lw 1.5 dt 3 title 'memcpy, one core (in cache below 8 MiB)'"
    done <"$tmp/ranks"
    echo "unset multiplot"
} >"$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
with=""
ls "$tmp"/g*.dat >/dev/null 2>&1 && with=", with gloo"
echo "plot_collectives: wrote $png ($(tr '\n' ' ' <"$tmp/ranks")ranks$with)"
