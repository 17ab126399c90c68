#!/bin/sh
# Side-by-side: libddp collectives (ddp-bench, user and segment buffers) against Open MPI
# (mpi-baseline) and the single-core memcpy bound (memcpy-probe), all measured in this one
# invocation on the same sizes, for 2 ranks and 4 ranks (on this 2-core machine: oversubscribed).
#
#   bench/compare_collectives.sh                     # f32 sum allreduce, 8 B .. 128 MiB, x4
#   OPS="allreduce allgather" RANKS=2 MAX=32M bench/compare_collectives.sh
#
# Environment: BUILD (build directory, default <repo>/build; built if a program is missing),
# RANKS ("2 4"), OPS ("allreduce"; also broadcast, reduce_scatter, allgather), DTYPE (f32),
# REDOP (sum), MIN (8), MAX (128M), FACTOR (4), ITERS (5), WARMUP (2), ROUNDS (5),
# MIN_MS (10), KEEP (a directory to keep the raw JSON in). Ratios > 1 mean libddp is faster.
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
RANKS=${RANKS:-"2 4"}
OPS=${OPS:-allreduce}
DTYPE=${DTYPE:-f32}
REDOP=${REDOP:-sum}
MIN=${MIN:-8}
MAX=${MAX:-128M}
FACTOR=${FACTOR:-4}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-5}
MIN_MS=${MIN_MS:-10}

need=""
for p in ddprun ddp-bench memcpy-probe mpi-baseline; do
    [ -x "$BUILD/$p" ] || need="$need $p"
done
if [ -n "$need" ]; then
    echo "# building$need in $BUILD" >&2
    [ -f "$BUILD/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >&2
    # shellcheck disable=SC2086
    cmake --build "$BUILD" -j2 --target $need >&2
fi
for p in ddprun ddp-bench memcpy-probe; do
    [ -x "$BUILD/$p" ] || { echo "compare_collectives: $BUILD/$p was not built" >&2; exit 1; }
done
HAVE_MPI=1
if [ ! -x "$BUILD/mpi-baseline" ] || ! command -v mpirun >/dev/null 2>&1; then
    HAVE_MPI=0
    echo "# MPI not available: the MPI columns are empty" >&2
fi

if [ -n "${KEEP:-}" ]; then
    OUT=$KEEP
    mkdir -p "$OUT"
else
    OUT=$(mktemp -d "${TMPDIR:-/tmp}/compare-collectives.XXXXXX")
    trap 'rm -rf "$OUT"' EXIT INT TERM
fi

# Open MPI refuses to run as root unless told it is fine.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

COMMON="-d $DTYPE -r $REDOP -b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP --rounds $ROUNDS --min-ms $MIN_MS --json"

# JSON lines only (ddprun may add its own lines on failure; those go to stderr).
json_only() { grep '^{' || true; }

echo "# compare_collectives: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, $(uname -r)"
echo "# $DTYPE $REDOP, sizes $MIN..$MAX x$FACTOR, >= $ITERS iterations x $ROUNDS rounds (median), warmup $WARMUP"
"$BUILD/memcpy-probe" -b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" --rounds "$ROUNDS" \
    --min-ms "$MIN_MS" --json | json_only >"$OUT/memcpy.json"

# Field `name` of a JSON line ("key":value), numbers and strings alike.
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p"; }

for op in $OPS; do
    for n in $RANKS; do
        # shellcheck disable=SC2086
        "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" $COMMON --segment 0 \
            | json_only >"$OUT/ddp-user-$op-$n.json"
        # shellcheck disable=SC2086
        "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" $COMMON --segment 1 \
            | json_only >"$OUT/ddp-segment-$op-$n.json"
        if [ "$HAVE_MPI" = 1 ]; then
            # shellcheck disable=SC2086
            mpirun --oversubscribe -np "$n" "$BUILD/mpi-baseline" -o "$op" $COMMON \
                | json_only >"$OUT/mpi-$op-$n.json" || true
        else
            : >"$OUT/mpi-$op-$n.json"
        fi

        echo
        echo "## $op, $n ranks ($(field transport <"$OUT/ddp-user-$op-$n.json" | head -n 1) transport)"
        # One table row per size: algbw of each run, the ratios, and memcpy's speed at that size.
        awk -v user="$OUT/ddp-user-$op-$n.json" -v seg="$OUT/ddp-segment-$op-$n.json" \
            -v mpi="$OUT/mpi-$op-$n.json" -v mem="$OUT/memcpy.json" '
            function get(line, key,   m) {
                if (match(line, "\"" key "\":\"?[^,\"}]*")) {
                    m = substr(line, RSTART, RLENGTH); sub(/^"[^"]*":"?/, "", m); return m
                }
                return ""
            }
            function slurp(file, bw, t, key,   line, b) {
                while ((getline line < file) > 0) {
                    b = get(line, "bytes"); bw[b] = get(line, key); t[b] = get(line, "time_us")
                    if (file == user) order[++nsizes] = b
                }
                close(file)
            }
            function ratio(a, b) { return (a != "" && b != "" && b + 0 > 0) ? sprintf("%.2f", a / b) : "-" }
            function show(x) { return x == "" ? "-" : sprintf("%.2f", x) }
            BEGIN {
                slurp(user, ubw, ut, "algbw"); slurp(seg, sbw, st, "algbw")
                slurp(mpi, mbw, mt, "algbw"); slurp(mem, cbw, ct, "gbps")
                printf "%12s %9s %9s %9s %8s %8s %9s %8s %8s\n", "bytes", "user", "segment", "MPI",
                       "user/MPI", "seg/MPI", "memcpy", "user/cpy", "seg/cpy"
                printf "%12s %9s %9s %9s %8s %8s %9s %8s %8s\n", "", "GB/s", "GB/s", "GB/s", "", "",
                       "GB/s", "", ""
                for (i = 1; i <= nsizes; i++) {
                    b = order[i]
                    printf "%12s %9s %9s %9s %8s %8s %9s %8s %8s\n", b, show(ubw[b]), show(sbw[b]),
                           show(mbw[b]), ratio(ubw[b], mbw[b]), ratio(sbw[b], mbw[b]), show(cbw[b]),
                           ratio(ubw[b], cbw[b]), ratio(sbw[b], cbw[b])
                }
                b = order[1]
                printf "latency at %s B (us): user %s, segment %s, MPI %s, memcpy %s\n", b,
                       show(ut[b]), show(st[b]), show(mt[b]), show(ct[b])
            }'
        # Any wrong element or failed run shows up here rather than as a silent gap.
        for f in "$OUT/ddp-user-$op-$n.json" "$OUT/ddp-segment-$op-$n.json"; do
            [ -s "$f" ] || echo "!! $(basename "$f"): no results (the run failed)"
        done
    done
done
