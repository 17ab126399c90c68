#!/bin/sh
# libddp's trainer against PyTorch DDP on the same MLP 784-h-h-10, 2 ranks on this machine, with
# PyTorch over torch's "gloo" and over libddp's own torch backend "ddp" (python/, built by make),
# side by side in one invocation. For each hidden size and batch per rank:
#   step       one data-parallel optimizer step on 2 ranks (forward, backward, allreduce, SGD),
#              the median over the timed steps (robust to a busy machine's stalls)
#   exposed    communication the backward pass did not hide, three ways: 2-rank step - 1-rank
#              step (the brief's definition); synchronised - no_sync steps alternating in one
#              2-rank run (same machine load for both), taken on the slowest rank (the other,
#              on a faster core, gets ahead in no_sync steps and waits in the synchronised
#              ones: its difference would count that as communication); libddp's finalize wait
#              (per step the smallest over ranks: an earlier rank's wait also holds the others'
#              backward)
# then the scaling of libddp's trainer: 2 ranks vs 1 rank at the same global batch.
# This machine's speed drifts by 10-20 % from minute to minute (a shared VM), so every libddp
# measurement is REPS runs, 1-rank and 2-rank interleaved, and each cell is the median over the
# runs of the per-run medians; the no_sync column also shows the runs' range. PyTorch runs
# PT_REPS times per configuration and backend, interleaved with libddp's runs (the backends'
# order alternating between repeats), and is summarised the same way (its no_sync exposure moved
# 70-320 ms between single runs of one configuration). PT_BACKENDS picks the backends ("gloo ddp";
# "ddp" needs the build's backend for PY's torch and is skipped with a message without it;
# PY=python3 runs the PyTorch side on torch 2.13, the default /usr/bin/python3 on 1.13);
# each gets its step, exposed and "/ libddp" columns, and with both a last column compares them.
# The defaults (with both PyTorch backends) took 23 min under load 9-16 with 60/5/30; they were
# cut to 40/3/20: on the quiet machine (24 Nov, 11:21 UTC) the full table took 4 minutes.
#   sh bench/trainer_vs_pytorch.sh [BUILD_DIR]      (STEPS=40 WARMUP=5 REPS=3 PT_STEPS=20
#                                                    PT_REPS=3 PT_BACKENDS="gloo ddp" PT_BIND=auto
#                                                    PT_ARGS="--bucket-view"
#                                                    HIDDEN="1024 4096" BATCH="1 64"
#                                                    SCALE_BATCH="128 512")
set -u
# PLOT=FILE.png: the same run, its output also drawn into FILE.png by bench/plot_trainer_vs_pytorch.sh
# (gnuplot-nox); the tables on stdout are unchanged.
if [ -n "${PLOT:-}" ] && [ -z "${DDP_PLOT_INNER:-}" ]; then
    plot_out=$(mktemp "${TMPDIR:-/tmp}/plot_run.XXXXXX")
    { if DDP_PLOT_INNER=1 sh "$0" "$@"; then echo 0 >"$plot_out.rc"; else echo $? >"$plot_out.rc"; fi; } | tee "$plot_out"
    plot_rc=$(cat "$plot_out.rc")
    if [ "$plot_rc" = 0 ] && ! sh "$(dirname "$0")/plot_trainer_vs_pytorch.sh" "$plot_out" "$PLOT" >&2; then plot_rc=1; fi
    rm -f "$plot_out" "$plot_out.rc"
    exit "$plot_rc"
fi
cd "$(dirname "$0")/.."
BUILD=${1:-build}
STEPS=${STEPS:-40}
WARMUP=${WARMUP:-5}
REPS=${REPS:-3}
PT_STEPS=${PT_STEPS:-20}
PT_REPS=${PT_REPS:-3}
PT_BACKENDS=${PT_BACKENDS:-gloo ddp}
# PyTorch's ranks pinned one per CPU as ddprun pins libddp's ("auto"), or left to the scheduler
# ("none"; bench/torch_allreduce.py, where "ddp" beat gloo 7-10x at 2-8 MiB, does not pin)
PT_BIND=${PT_BIND:-auto}
# PT_ARGS: more options for bench/pytorch_ddp.py, e.g. "--bucket-view" (DDP's
# gradient_as_bucket_view=True) or "--bucket-mb 1"
PT_ARGS=${PT_ARGS:-}
HIDDEN=${HIDDEN:-1024 4096}
BATCH=${BATCH:-1 64}
SCALE_BATCH=${SCALE_BATCH:-128 512}
FM=$BUILD/fashion-mnist
DDPRUN=$BUILD/ddprun
PY=${PY:-/usr/bin/python3}  # the PyTorch side's interpreter (python3 on PATH: torch 2.13)
for f in "$FM" "$DDPRUN"; do
    [ -x "$f" ] || { echo "bench: $f missing: build first (make)" >&2; exit 1; }
done
export OPENBLAS_NUM_THREADS=1

# PyTorch: install Debian's python3-torch when missing (root only); otherwise skip its
# column.
. bench/common.sh
have_torch=$(bench_have_torch "$PY")
[ "$have_torch" = 1 ] || echo "bench: PyTorch unavailable (apt-get install python3-torch): its columns are skipped" >&2
backends=""
if [ "$have_torch" = 1 ]; then
    for be in $PT_BACKENDS; do
        case $be in
            gloo) ;;
            ddp)
                if ! bench_ddp_extension "$PY" "$BUILD"; then
                    echo "bench: $BUILD/python/libddp has no backend for $PY's torch (make builds it): PyTorch+ddp is skipped" >&2
                    continue
                fi ;;
            *) echo "bench: PT_BACKENDS: unknown backend '$be' (gloo, ddp)" >&2; exit 2 ;;
        esac
        backends="$backends $be"
    done
fi
backends=${backends# }
[ -n "$backends" ] || have_torch=0

field() { sed -n "s/.*\"$1\": *\([0-9.eE+-]*\).*/\1/p" | tail -1; }
# median and range of the numbers on stdin, one per line
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR) printf "%.2f", (a[int((NR + 1) / 2)] + a[int(NR / 2) + 1]) / 2 }'; }
range() { sort -g | awk '{ a[NR] = $1 } END { if (NR) printf "%.2f-%.2f", a[1], a[NR] }'; }

# trainer RANKS GLOBAL_BATCH HIDDEN [OPTIONS]: the JSON line of a timed run on synthetic data
# (with --bench-nosync twice the steps: half of them without communication)
trainer() {
    n=$1 b=$2 h=$3
    shift 3
    steps=$((WARMUP + STEPS * (1 + (${1:+1}+0))))
    samples=$((b * steps))
    args="--synthetic $samples --hidden $h --batch $b --optim sgd --lr 0.01 --epochs 1000000"
    args="$args --max-steps $steps --warmup $WARMUP --json $*"
    if [ "$n" = 1 ]; then
        "$FM" $args | grep '^{'
    else
        "$DDPRUN" -n "$n" "$FM" $args | sed -n 's/^\[0\] {/{/p'
    fi
}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-trainer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "# trainer_vs_pytorch: 2 ranks, MLP 784-h-h-10, SGD momentum; libddp: $REPS runs of $STEPS timed steps after $WARMUP (1-rank and 2-rank runs interleaved), PyTorch ($backends): $PT_REPS runs of $PT_STEPS per backend, interleaved with them"
echo "# machine: $(nproc) cores, $(uname -r); $(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# all times in ms; libddp cells: median over the runs of each run's median step; exposed ="
echo "# communication not hidden:"
echo "#   vs 1 rank: 2-rank step - 1-rank step at the same batch per rank"
echo "#   no_sync:   synchronised step - no_sync step, alternating in the same 2-rank run, on"
echo "#              the rank with the slower no_sync step (median [range] over the runs)"
echo "#   wait:      per step the smallest time ddp_reducer_finalize waited over the ranks (the"
echo "#              last rank to finish backward waits only for unhidden communication)"
echo
# PyTorch's columns, one group per backend; with gloo and ddp both, their ratio last.
head="| config | libddp step | libddp exposed: vs 1 rank / no_sync [range] / wait |"
rule="|---|---|---|"
for be in $backends; do
    # gloo keeps the column names of earlier results (bench/plot_trainer_vs_pytorch.sh reads both)
    name="PyTorch"
    [ "$be" = gloo ] || name="PyTorch+$be"
    head="$head $name step | $name exposed: vs 1 rank / no_sync [range] | $name / libddp exposed |"
    rule="$rule---|---|---|"
done
both=0
case " $backends " in *" gloo "*) case " $backends " in *" ddp "*) both=1 ;; esac ;; esac
if [ "$both" = 1 ]; then
    head="$head PyTorch gloo / ddp exposed [range] |"
    rule="$rule---|"
fi
echo "$head"
echo "$rule"
for h in $HIDDEN; do
    for b in $BATCH; do
        : >"$tmp/runs"
        for be in $backends; do : >"$tmp/pt_runs_$be"; done
        # libddp's and PyTorch's runs interleaved, so that both see the same machine states
        r=1
        while [ "$r" -le "$REPS" ] || { [ "$have_torch" = 1 ] && [ "$r" -le "$PT_REPS" ]; }; do
            if [ "$r" -le "$REPS" ]; then
                local1=$(trainer 1 "$b" "$h" | field step_ms_median)
                line=$(trainer 2 $((2 * b)) "$h" --bench-nosync)
                step2=$(echo "$line" | field step_ms_median)
                nosync_exp=$(echo "$line" | field nosync_exposed_ms)
                wait_ms=$(echo "$line" | field exposed_comm_ms_median)
                echo "$local1 $step2 $nosync_exp $wait_ms" >>"$tmp/runs"
            fi
            if [ "$have_torch" = 1 ] && [ "$r" -le "$PT_REPS" ]; then
                # the backends' order alternates between repeats: neither always runs second
                order=$backends
                [ $((r % 2)) = 0 ] && order=$(echo "$backends" | awk '{ for (i = NF; i > 0; i--) printf "%s%s", $i, (i > 1 ? " " : "") }')
                for be in $order; do
                    if $PY bench/pytorch_ddp.py --hidden "$h" --batch "$b" --steps "$PT_STEPS" \
                        --warmup "$WARMUP" --backend "$be" --build "$BUILD" --bind "$PT_BIND" $PT_ARGS \
                        >"$tmp/pt" 2>"$tmp/pt.err"; then
                        p1=$(field ddp_step_ms <"$tmp/pt")
                        pe1=$(field exposed_ms <"$tmp/pt")
                        pe2=$(field slowest_rank_exposed_ms <"$tmp/pt")
                        [ -n "$p1" ] && echo "$p1 $pe1 $pe2 $r" >>"$tmp/pt_runs_$be"
                    else
                        cat "$tmp/pt.err" >&2
                    fi
                done
            fi
            r=$((r + 1))
        done
        step2=$(awk '{ print $2 }' "$tmp/runs" | median)
        exp1=$(awk '{ print $2 - $1 }' "$tmp/runs" | median)
        exp2=$(awk '{ print $3 }' "$tmp/runs" | median)
        exp2r=$(awk '{ print $3 }' "$tmp/runs" | range)
        wait_ms=$(awk '{ print $4 }' "$tmp/runs" | median)
        row=$(printf '| hidden %s, batch %s/rank | %s | %s / %s [%s] / %s |' "$h" "$b" \
            "$step2" "$exp1" "$exp2" "$exp2r" "$wait_ms")
        for be in $backends; do
            pstep="-" pexp="-" ratio="-"
            if [ -s "$tmp/pt_runs_$be" ]; then
                pstep=$(awk '{ print $1 }' "$tmp/pt_runs_$be" | median)
                pe1=$(awk '{ print $2 }' "$tmp/pt_runs_$be" | median)
                pe2=$(awk '{ print $3 }' "$tmp/pt_runs_$be" | median)
                pe2r=$(awk '{ print $3 }' "$tmp/pt_runs_$be" | range)
                pexp="$pe1 / $pe2 [$pe2r]"
                # libddp's larger no_sync/wait measure against PyTorch's no_sync measure, medians
                ratio=$(awk -v p="$pe2" -v e="$exp2" -v w="$wait_ms" 'BEGIN {
                    m = e > w ? e : w; if (m < 0.01) m = 0.01; printf "%.1fx", p / m }')
            fi
            row="$row $pstep | $pexp | $ratio |"
        done
        if [ "$both" = 1 ]; then
            # gloo's no_sync exposure over ddp's, per repeat (the two ran back to back), then
            # the median and range of those ratios
            gd="-"
            if [ -s "$tmp/pt_runs_gloo" ] && [ -s "$tmp/pt_runs_ddp" ]; then
                gd=$(awk 'NR == FNR { g[$4] = $3; next } ($4 in g) {
                        d = $3 < 0.01 ? 0.01 : $3; print g[$4] / d }' \
                    "$tmp/pt_runs_gloo" "$tmp/pt_runs_ddp" >"$tmp/gd"
                    m=$(median <"$tmp/gd"); rr=$(awk '{ printf "%.1f\n", $1 }' "$tmp/gd" | range)
                    [ -n "$m" ] && printf '%.1fx [%s]' "$m" "$rr" || printf -- '-')
            fi
            row="$row $gd |"
        fi
        echo "$row"
    done
done
echo
echo "# scaling: 2 ranks vs 1 rank at the same global batch, hidden 1024 (samples/s from the median"
echo "# step; $REPS runs each, interleaved, medians and the range of the per-run ratios)"
for sb in $SCALE_BATCH; do
    : >"$tmp/scale"
    for r in $(seq "$REPS"); do
        s1=$(trainer 1 "$sb" 1024 | field step_ms_median)
        s2=$(trainer 2 "$sb" 1024 | field step_ms_median)
        echo "$s1 $s2" >>"$tmp/scale"
    done
    s1=$(awk '{ print $1 }' "$tmp/scale" | median)
    s2=$(awk '{ print $2 }' "$tmp/scale" | median)
    rr=$(awk '{ print $1 / $2 }' "$tmp/scale" | range)
    awk -v a="$s1" -v b="$s2" -v n="$sb" -v r="$rr" 'BEGIN { printf "global batch %d: 1 rank %.0f samples/s, 2 ranks %.0f samples/s: %.2fx (runs %s)\n", n, n * 1000 / a, n * 1000 / b, a / b, r }'
done
