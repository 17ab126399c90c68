#!/bin/sh
# libddp's MPI transport against plain MPI: ddp-bench run by mpirun with DDP_TRANSPORT=mpi (the
# whole group path: work queue, progress thread, fingerprint exchange, MPI_Iallreduce) next to
# mpi-baseline (MPI_Allreduce in a loop), same sizes, interleaved repetitions, median per size.
# Then the transport alone against a bare MPI_Iallreduce (tests/test_mpi_fingerprint_cost), which
# separates the fingerprint exchange from the group layer's own cost.
#
#   bench/compare_mpi.sh                      # f32 sum allreduce, 8 B .. 64 MiB x8, 2 ranks
#   BUILD=build-mpi OPS="allreduce allgather" MAX=16M bench/compare_mpi.sh
#
# Environment: BUILD (default <repo>/build; programs missing there are built), NP (2), OPS
# (allreduce; also broadcast, reduce_scatter, allgather), DTYPE (f32), REDOP (sum), MIN (8),
# MAX (64M), FACTOR (8), ITERS (10), ROUNDS (5), MIN_MS (10), REPEAT (3), COST (1: also run the
# transport-only measurement). The overhead column is ddp time / MPI time - 1 (lower is better).
#
# The group comes from ddp_group_create_from_env, which needs a store: ddprun -n 1 hosts one and
# runs mpirun under it, with its own RANK/WORLD_SIZE removed so the ranks read Open MPI's.
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
NP=${NP:-2}
OPS=${OPS:-allreduce}
DTYPE=${DTYPE:-f32}
REDOP=${REDOP:-sum}
MIN=${MIN:-8}
MAX=${MAX:-64M}
FACTOR=${FACTOR:-8}
ITERS=${ITERS:-10}
ROUNDS=${ROUNDS:-5}
MIN_MS=${MIN_MS:-10}
REPEAT=${REPEAT:-3}
COST=${COST:-1}

command -v mpirun >/dev/null 2>&1 || { echo "compare_mpi: mpirun not found" >&2; exit 1; }
need=""
for p in ddprun ddp-bench mpi-baseline tests/test_mpi_fingerprint_cost; do
    [ -x "$BUILD/$p" ] || need="$need $(basename "$p")"
done
if [ -n "$need" ]; then
    echo "# building$need in $BUILD" >&2
    [ -f "$BUILD/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >&2
    # shellcheck disable=SC2086
    cmake --build "$BUILD" -j2 --target $need >&2
fi
for p in ddprun ddp-bench mpi-baseline; do
    [ -x "$BUILD/$p" ] || { echo "compare_mpi: $BUILD/$p was not built" >&2; exit 1; }
done

OUT=$(mktemp -d "${TMPDIR:-/tmp}/compare-mpi.XXXXXX")
trap 'rm -rf "$OUT"' EXIT INT TERM

# Open MPI as root, shared memory only, more ranks than cores allowed.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader} OMPI_MCA_rmaps_base_oversubscribe=1

COMMON="-d $DTYPE -r $REDOP -b $MIN -e $MAX -f $FACTOR -n $ITERS --rounds $ROUNDS --min-ms $MIN_MS --json"
json_only() { grep '^{' || true; }

echo "# compare_mpi: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, $NP ranks, $(mpirun --version | head -n 1)"
echo "# $DTYPE $REDOP, sizes $MIN..$MAX x$FACTOR, >= $ITERS iterations x $ROUNDS rounds (median), $REPEAT interleaved repetitions"
echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

rep=1
while [ "$rep" -le "$REPEAT" ]; do
    for op in $OPS; do
        # shellcheck disable=SC2086
        "$BUILD/ddprun" -n 1 --no-prefix sh -c \
            'unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK; exec "$@"' sh \
            env DDP_TRANSPORT=mpi mpirun -np "$NP" "$BUILD/ddp-bench" -o "$op" $COMMON \
            | json_only >"$OUT/ddp-$op.$rep.json" || true
        # shellcheck disable=SC2086
        mpirun -np "$NP" "$BUILD/mpi-baseline" -o "$op" $COMMON \
            | json_only >"$OUT/mpi-$op.$rep.json" || true
    done
    rep=$((rep + 1))
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

for op in $OPS; do
    ddp_files="" mpi_files=""
    r=1
    while [ "$r" -le "$REPEAT" ]; do
        ddp_files="$ddp_files $OUT/ddp-$op.$r.json"
        mpi_files="$mpi_files $OUT/mpi-$op.$r.json"
        [ -s "$OUT/ddp-$op.$r.json" ] || echo "!! ddp-bench $op repetition $r gave no results"
        r=$((r + 1))
    done
    transport=$(sed -n 's/.*"transport":"\([^"]*\)".*/\1/p' "$OUT/ddp-$op.1.json" | head -n 1)
    echo
    echo "## $op $DTYPE $REDOP, $NP ranks: libddp (transport ${transport:-?}) vs MPI, median of $REPEAT runs"
    awk -v ddp="$ddp_files" -v mpi="$mpi_files" '
        function get(line, key,   m) {
            if (match(line, "\"" key "\":\"?[^,\"}]*")) {
                m = substr(line, RSTART, RLENGTH); sub(/^"[^"]*":"?/, "", m); return m
            }
            return ""
        }
        function slurp(kind, files,   list, nf, i, line, b) {
            nf = split(files, list, " ")
            for (i = 1; i <= nf; i++) {
                while ((getline line < list[i]) > 0) {
                    b = get(line, "bytes")
                    n[kind, b]++
                    t[kind, b, n[kind, b]] = get(line, "time_us") + 0
                    if (!(b in seen)) { seen[b] = 1; order[++nsizes] = b }
                }
                close(list[i])
            }
        }
        function median(kind, b,   m, k, i, j, x, tmp) {
            m = n[kind, b] + 0
            if (m == 0) return ""
            for (k = 1; k <= m; k++) tmp[k] = t[kind, b, k]
            for (i = 2; i <= m; i++) for (j = i; j > 1 && tmp[j - 1] > tmp[j]; j--) {
                x = tmp[j]; tmp[j] = tmp[j - 1]; tmp[j - 1] = x
            }
            return m % 2 ? tmp[(m + 1) / 2] : (tmp[m / 2] + tmp[m / 2 + 1]) / 2
        }
        BEGIN {
            slurp("ddp", ddp); slurp("mpi", mpi)
            fmt = "%10s %12s %12s %10s %10s %10s\n"
            printf fmt, "bytes", "ddp(us)", "MPI(us)", "ddp GB/s", "MPI GB/s", "overhead"
            for (i = 1; i <= nsizes; i++) {
                b = order[i]; d = median("ddp", b); m = median("mpi", b)
                ds = "-"; ms = "-"; dbw = "-"; mbw = "-"; over = "-"
                if (d != "") { ds = sprintf("%.2f", d); if (d > 0) dbw = sprintf("%.2f", b / d / 1000) }
                if (m != "") { ms = sprintf("%.2f", m); if (m > 0) mbw = sprintf("%.2f", b / m / 1000) }
                if (d != "" && m != "" && m > 0) over = sprintf("%+.1f%%", (d / m - 1) * 100)
                printf fmt, b, ds, ms, dbw, mbw, over
            }
        }'
done

if [ "$COST" = 1 ] && [ -x "$BUILD/tests/test_mpi_fingerprint_cost" ]; then
    echo
    echo "## the transport alone (no group layer) against a bare MPI_Iallreduce + MPI_Test loop"
    mpirun -np "$NP" "$BUILD/tests/test_mpi_fingerprint_cost" 2000 || true
fi
