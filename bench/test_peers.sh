#!/bin/sh
# The parts of bench/peers.sh that decide what it reports (ctest test_peers):
# 1. mpi-baseline (Open MPI) gives right results for every collective the comparison runs, f32 and
#    bf16 (the user-defined MPI_Op), on 2 and 3 ranks, sizes not a multiple of the rank count;
#    and --test-corrupt 1 makes it report the spoiled element and exit 1 (the check can fail).
# 2. peers_summary.py never picks a result with wrong elements as the best peer, shows it as
#    WRONG, lists it and an unsupported case, and divides the right times.
#   test_peers.sh SOURCE_DIR MPI_BASELINE MPIRUN
set -u
SRC=$1
MB=$2
MPIRUN=$3
WORK=$(mktemp -d "${TMPDIR:-/tmp}/test_peers.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FAILED=0
fail() {
    echo "FAIL: $*" >&2
    FAILED=1
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

for n in 2 3; do
    for op in allreduce broadcast allgather reduce_scatter alltoall; do
        for dt in f32 bf16; do
            "$MPIRUN" -np $n "$MB" -o $op -d $dt -b 6 -e 300K -f 37 -n 1 -w 1 --rounds 1 --min-ms 0 -c 1 --json \
                >"$WORK/out" 2>&1
            rc=$?
            rows=$(grep -c '"wrong":0,' "$WORK/out")
            [ "$rc" = 0 ] && [ "$rows" = 4 ] ||
                fail "mpi-baseline $op $dt on $n ranks: rc $rc, $rows right rows of 4: $(head -c 600 "$WORK/out")"
        done
    done
done
"$MPIRUN" -np 2 "$MB" -o alltoall -d bf16 -b 64 -e 64 -n 1 -w 0 --rounds 1 --min-ms 0 -c 1 --json \
    --test-corrupt 1 >"$WORK/out" 2>&1
rc=$?
[ "$rc" != 0 ] && grep -q '"wrong":1,' "$WORK/out" ||
    fail "mpi-baseline --test-corrupt 1: rc $rc, expected wrong 1 and a failure: $(head -c 600 "$WORK/out")"
"$MPIRUN" -np 2 "$MB" -o alltoall --inplace 1 >"$WORK/out" 2>&1 && fail "mpi-baseline alltoall --inplace 1 was accepted"

# The summariser on made-up results: Open MPI's faster time is wrong, so Intel MPI is the best peer.
R=$WORK/raw
mkdir "$R"
for rep in 1 2; do
    echo '{"op":"allreduce","dtype":"f32","bytes":8,"time_us":1.0,"wrong":0}' >"$R/libddp-default-2-allreduce-f32.$rep.json"
    echo '{"op":"allreduce","dtype":"f32","bytes":8,"time_us":0.5,"wrong":3}' >"$R/openmpi-default-2-allreduce-f32.$rep.json"
    echo "{\"op\":\"allreduce\",\"dtype\":\"f32\",\"bytes\":8,\"time_us\":$((rep + 1)).0,\"wrong\":0}" >"$R/impi-default-2-allreduce-f32.$rep.json"
    echo '{"op":"allreduce","dtype":"f32","transport":"gloo","unsupported":"no such op"}' >"$R/gloo-default-2-allreduce-f32.$rep.json"
    echo '{"op":"memcpy","bytes":8,"time_us":0.01,"gbps":0.8}' >"$R/memcpy.$rep.json"
done
echo "oneccl: pip install failed (offline?)" >"$R/missing.txt"
python3 "$SRC/bench/peers_summary.py" "$R" >"$WORK/sum" 2>&1 || fail "peers_summary: $(cat "$WORK/sum")"
row=$(grep '^ *8 ' "$WORK/sum")
echo "$row" | grep -q 'WRONG' || fail "the wrong Open MPI result is not shown as WRONG: $row"
echo "$row" | grep -q 'impi-default' || fail "the best peer is not Intel MPI (Open MPI's result was wrong): $row"
# Intel MPI took 2 and 3 us against libddp's 1: ratio median 2.50, min-max 2.00-3.00
echo "$row" | grep -q '2.50 \[2.00-3.00\]' || fail "libddp's ratio to the best peer: $row"
grep -q '^# missing: oneccl: pip install failed' "$WORK/sum" || fail "the missing peer is not listed"
grep -q 'unsupported (no such op)' "$WORK/sum" || fail "the unsupported case is not listed"
grep -q 'openmpi-default 2 ranks allreduce f32 8 B repeat 1: 3 wrong elements' "$WORK/sum" ||
    fail "the wrong result is not listed"

[ "$FAILED" = 0 ] && echo "test_peers: ok"
exit "$FAILED"
