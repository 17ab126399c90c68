#!/bin/sh
# torch 2.x's torchrun starting libddp's users, as a PyTorch user starts them:
#   standalone: `torchrun --standalone --nproc-per-node 2 train.py` on backend "ddp": both ranks
#               end with identical parameters (train.py checks with an all_gather).
#   restart:    the same with --max-restarts 1 and rank 1 dying at step 12 of the first attempt;
#               the second attempt resumes from the checkpoint and ends at the parameters of a
#               run without the kill (the printed sums are equal).
#   cprogram:   a libddp C program (hello_ddp) under `torchrun --no-python`: it joins through
#               torch 2.x's c10d TCPStore and trains on shm.
#   2hosts:     `torchrun --nnodes 2` on two network-namespace hosts (tests/netns/hosts.sh),
#               c10d rendezvous, --max-restarts 1, one worker killed in the first attempt: both
#               hosts restart and finish with identical parameters, equal to a run without a kill.
# Usage: torchrun.sh PYTHON SOURCE BUILD CASE
set -u
PY=$1 SRC=$2 BUILD=$3 CASE=$4
export PYTHONPATH="$SRC/python" LIBDDP_BUILD_DIR="$BUILD" OMP_NUM_THREADS=1
# A sanitized build (tests/torchrun.cmake): the sanitizer runtime the interpreters must preload
# comes as DDP_TEST_PRELOAD and is given to them alone (TSan's runtime crashes shells).
PRELOAD=${DDP_TEST_PRELOAD:+LD_PRELOAD=$DDP_TEST_PRELOAD}
TRAIN="$SRC/tests/torchrun/train.py"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddp-torchrun-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
die() { echo "FAIL: $*"; [ -f "$WORK/out" ] && tail -n 40 "$WORK/out"; exit 1; }

# The parameter sum printed by every rank: one value, from `want` ranks (run in $(...): it
# prints the problem and returns 1 instead of exiting).
one_sum() {
    lines=$(grep -o "train.py: rank [0-9]* of [0-9]* backend [a-z]* attempt [0-9]* identical True sum -\{0,1\}[0-9]*\.[0-9]\{6\}" "$1")
    n=$(printf '%s\n' "$lines" | grep -c "identical True")
    [ "$n" = "$2" ] || { echo "$n of $2 ranks reported identical parameters"; return 1; }
    sums=$(printf '%s\n' "$lines" | grep -o "sum [-0-9.]*$" | sort -u)
    [ "$(echo "$sums" | wc -l)" = 1 ] || { echo "ranks differ: $sums"; return 1; }
    echo "$sums"
}

run_local() { # torchrun options...
    timeout 300 env ${PRELOAD:+"$PRELOAD"} "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$@" \
        >"$WORK/out" 2>&1
}

case "$CASE" in
standalone)
    run_local "$TRAIN" || die "torchrun exited $?"
    grep -q "backend ddp attempt 0" "$WORK/out" || die "not run on backend ddp"
    sum=$(one_sum "$WORK/out" 2) || die "$sum"
    echo "$sum"
    ;;
restart)
    run_local "$TRAIN" || die "torchrun exited $?"
    want=$(one_sum "$WORK/out" 2) || die "$want"
    DDP_TEST_KILL_STEP=12 DDP_TEST_CKPT="$WORK/ck" run_local --max-restarts 1 "$TRAIN" ||
        die "torchrun --max-restarts 1 exited $?"
    grep -q "rank 1 dies at step 12" "$WORK/out" || die "the worker was not killed"
    grep -q "attempt 1 identical" "$WORK/out" || die "no second attempt"
    got=$(one_sum "$WORK/out" 2) || die "$got"
    [ "$got" = "$want" ] || die "resumed run ends at $got, uninterrupted at $want"
    echo "restarted: $got"
    ;;
cprogram)
    run_local --no-python "$BUILD/hello_ddp" || die "torchrun --no-python hello_ddp exited $?"
    grep -q "hello_ddp: 2 ranks" "$WORK/out" || die "no result line"
    grep "hello_ddp" "$WORK/out"
    ;;
2hosts)
    NHOSTS=2
    . "$SRC/tests/netns/hosts.sh"
    start_hosts() { # extra environment
        # is_host and --local-addr: torchrun tells the store's host, and the address its workers
        # get as MASTER_ADDR, by the hostname's addresses, which are the machine's, not the
        # namespace's 10.99.0.k, so each host is told.
        k=0
        while [ $k -lt 2 ]; do
            ip netns exec "${P}h$k" env "$@" PYTHONPATH="$PYTHONPATH" LIBDDP_BUILD_DIR="$BUILD" \
                timeout 300 env ${PRELOAD:+"$PRELOAD"} "$PY" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
                --rdzv-backend c10d --rdzv-endpoint 10.99.0.1:29400 --rdzv-id "job$$" \
                --rdzv-conf is_host=$((k == 0)) --local-addr 10.99.0.$((k + 1)) \
                --max-restarts 1 "$TRAIN" >"$LOGDIR/host$k.log" 2>&1 &
            RUNNERS="$RUNNERS $!"
            k=$((k + 1))
        done
        status=0
        for pid in $RUNNERS; do wait "$pid" || status=1; done
        RUNNERS=""
        cat "$LOGDIR"/host*.log >"$WORK/out"
        [ $status = 0 ] || fail "a torchrun exited with an error"
    }
    start_hosts DDP_TEST_NONE=1
    want=$(one_sum "$WORK/out" 2) || fail "$want"
    start_hosts DDP_TEST_KILL_STEP=12 DDP_TEST_CKPT="$LOGDIR/ck"
    grep -q "rank 1 dies at step 12" "$WORK/out" || fail "the worker was not killed"
    got=$(one_sum "$WORK/out" 2) || fail "$got"
    [ "$got" = "$want" ] || fail "resumed run ends at $got, uninterrupted at $want"
    echo "2 hosts, restarted: $got"
    ;;
*)
    echo "usage: torchrun.sh PYTHON SOURCE BUILD standalone|restart|cprogram|2hosts" >&2
    exit 2
    ;;
esac
echo "PASS: $CASE"
