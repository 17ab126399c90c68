#!/bin/sh
# bench/plot_collectives.sh and bench/plot_trainer_vs_pytorch.sh on the committed results the
# docs quote: each writes a PNG (signature and the size it sets), and a file that is not the
# script's kind of output is refused with a message. test_bench_plots.sh SOURCE_DIR
set -u
SRC=$1
if ! command -v gnuplot >/dev/null; then
    echo "SKIP: gnuplot is not installed (apt-get install gnuplot-nox; .ci/run installs it)" >&2
    exit 77
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/test_bench_plots.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FAILED=0
fail() {
    echo "FAIL: $*" >&2
    FAILED=1
}
# png_size FILE: "W H" from the IHDR chunk, or nothing when FILE is not a PNG
png_size() {
    [ "$(od -An -tx1 -N8 "$1" 2>/dev/null | tr -d ' \n')" = 89504e470d0a1a0a ] || return 0
    od -An -tu1 -j16 -N8 "$1" | awk '{ print $3 * 256 + $4, $7 * 256 + $8 }'
}
R=$SRC/bench/results
sh "$SRC/bench/plot_collectives.sh" "$R/2026-11-23-0800-collectives.txt" "$WORK/c.png" >"$WORK/out" 2>&1 ||
    { fail "plot_collectives"; cat "$WORK/out" >&2; }
grep -q '(2 4 ranks)' "$WORK/out" || fail "plot_collectives did not find the 2- and 4-rank tables: $(cat "$WORK/out")"
[ "$(png_size "$WORK/c.png")" = "1300 620" ] || fail "c.png: '$(png_size "$WORK/c.png")', expected a 1300x620 PNG"
# a run with gloo's lines: gloo is drawn too
sh "$SRC/bench/plot_collectives.sh" "$R/2026-11-24-0700-collectives-gloo-loaded.txt" "$WORK/g.png" >"$WORK/out" 2>&1 ||
    { fail "plot_collectives with gloo"; cat "$WORK/out" >&2; }
grep -q '(2 4 ranks, with gloo)' "$WORK/out" || fail "plot_collectives did not draw gloo: $(cat "$WORK/out")"
[ "$(png_size "$WORK/g.png")" = "1300 620" ] || fail "g.png: '$(png_size "$WORK/g.png")'"
sh "$SRC/bench/plot_trainer_vs_pytorch.sh" "$R/2026-11-23-0823-trainer-vs-pytorch.txt" "$WORK/t.png" >"$WORK/out" 2>&1 ||
    { fail "plot_trainer_vs_pytorch"; cat "$WORK/out" >&2; }
grep -q '(4 configurations)' "$WORK/out" || fail "plot_trainer_vs_pytorch: $(cat "$WORK/out")"
[ "$(png_size "$WORK/t.png")" = "1300 620" ] || fail "t.png: '$(png_size "$WORK/t.png")', expected a 1300x620 PNG"
# a run with PyTorch over both backends: the "ddp" bars are drawn too
sh "$SRC/bench/plot_trainer_vs_pytorch.sh" "$R/2026-11-24-1030-trainer-vs-pytorch-ddp-loaded.txt" "$WORK/d.png" >"$WORK/out" 2>&1 ||
    { fail "plot_trainer_vs_pytorch with ddp"; cat "$WORK/out" >&2; }
grep -q '(4 configurations, with PyTorch+ddp)' "$WORK/out" || fail "plot_trainer_vs_pytorch did not draw ddp: $(cat "$WORK/out")"
[ "$(png_size "$WORK/d.png")" = "1300 620" ] || fail "d.png: '$(png_size "$WORK/d.png")'"
# each refuses the other's output
sh "$SRC/bench/plot_collectives.sh" "$R/2026-11-23-0823-trainer-vs-pytorch.txt" "$WORK/x.png" 2>"$WORK/err"
[ $? = 1 ] && grep -q "no '## allreduce' table" "$WORK/err" || fail "plot_collectives accepted a trainer table"
sh "$SRC/bench/plot_trainer_vs_pytorch.sh" "$R/2026-11-23-0800-collectives.txt" "$WORK/y.png" 2>"$WORK/err"
[ $? = 1 ] && grep -q "no '| hidden H, batch B/rank |' rows" "$WORK/err" || fail "plot_trainer_vs_pytorch accepted a collectives table"
[ "$FAILED" = 0 ] || exit 1
echo "test_bench_plots: ok"
