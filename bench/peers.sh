#!/bin/sh
# libddp against its peers on one machine (issue #27): oneCCL, Intel MPI, MPICH, Open MPI and
# PyTorch's gloo, for allreduce, broadcast, allgather, reduce_scatter and alltoall, f32 and bf16,
# 2 and 4 ranks, each peer at its defaults and at its best documented one-host setting
# (docs/benchmarks.md, "The peers comparison", says which and where each comes from). One run
# is every (ranks, op, dtype) for every peer and setting, interleaved (the order rotates each
# repeat, so no peer always meets the same load), plus the copy bounds: one core's memcpy
# (memcpy-probe) and two cores copying at once (cma-probe's "memcpy x2"). Every benchmark program
# checks one call on known data before timing; a wrong result is reported as WRONG, never as time.
#
#   bench/peers.sh                                  # the full run: <= 3 repeats within 30 min
#   REPEATS=1 RANKS=2 OPS=allreduce DTYPES=f32 MAX=64K bench/peers.sh        # a smoke test
#   PEERS="libddp openmpi" SETTINGS=default bench/peers.sh
#
# The peers other than Open MPI and gloo are installed by this script, never by the project's
# setup: pip wheels in venvs under $PEERS_DIR (default <build>/peers): intel/ (impi-devel and
# oneccl-cpu-devel: Intel MPI and oneCCL, which runs on that Intel MPI) and mpich/ (mpich).
# Open MPI is Debian's (openmpi-bin, libopenmpi-dev: the project's MPI transport uses it), gloo is
# the torch of python3. Installing is idempotent (a venv with its programs built is kept) and
# offline-tolerant: a peer that cannot be installed or built is reported missing, with why, and
# the others still run. INSTALL=0 never installs; INSTALL=force reinstalls.
#
# Environment: BUILD (<repo>/build; built if a program is missing), PEERS_DIR, PEERS ("libddp
# openmpi impi mpich oneccl gloo"), SETTINGS ("default best"), OPS ("allreduce broadcast allgather
# reduce_scatter alltoall"), DTYPES ("f32 bf16"), RANKS ("2 4"), MIN (8), MAX (128M), FACTOR (8),
# REPEATS (3 at most), DURATION (1800 s: a repeat starts only if, lasting as long as the one
# before, it ends by then; the first always runs), ITERS (3), WARMUP (5), ROUNDS (3), MIN_MS (5),
# X2_MIN (MIN: smallest size of the two-core copy bound), RUN_TIMEOUT (seconds one program may take, 900),
# MPICH_OVERSUBSCRIBE (1: run MPICH with more ranks than CPUs too; by default it is skipped there,
# where it busy-polls until the time-out), ONECCL_SPEC and
# IMPI_SPEC and MPICH_SPEC (the pip requirements), OUT (the report,
# bench/results/<UTC date-time>-peers.txt; raw JSON in the folder of the same name without .txt,
# the plot next to it as .png).
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PEERS_DIR=${PEERS_DIR:-$BUILD/peers}
PEERS=${PEERS:-libddp openmpi impi mpich oneccl gloo}
SETTINGS=${SETTINGS:-default best}
OPS=${OPS:-allreduce broadcast allgather reduce_scatter alltoall}
DTYPES=${DTYPES:-f32 bf16}
RANKS=${RANKS:-2 4}
MIN=${MIN:-8}
MAX=${MAX:-128M}
FACTOR=${FACTOR:-8}
REPEATS=${REPEATS:-3}
DURATION=${DURATION:-1800}
ITERS=${ITERS:-3}
# 5 warm-up calls + the check + 3 calibration calls come before the timed rounds: libddp's shm
# tuner probes its variants for up to 12 calls of a size class (docs/shm-transport.md), so at
# most the first of the 3 rounds can hold probes and the median round is past them
# (bench/shm_states.sh uses 16 for the same reason with 1 round of its own).
WARMUP=${WARMUP:-5}
ROUNDS=${ROUNDS:-3}
MIN_MS=${MIN_MS:-5}
X2_MIN=${X2_MIN:-$MIN}
# A size with a K, M or G suffix (powers of 1024), as the benchmark programs read it, in bytes.
bytes_of() {
    case $1 in
    *K) echo $((${1%K} << 10)) ;;
    *M) echo $((${1%M} << 20)) ;;
    *G) echo $((${1%G} << 30)) ;;
    *) echo "$1" ;;
    esac
}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
INSTALL=${INSTALL:-1}
# oneCCL's wheels (2021.17.2 and 2022.1.2 alike) ship libccl.so.1 that names libccl.so.2 as a
# dependency, which no wheel contains, and calls Intel compiler run-time functions
# (_intel_fast_memcpy) that only intel-cmplr-lib-rt has: the script adds that wheel and the
# link libccl.so.2 -> libccl.so.1 (see oneccl-bench's build below).
ONECCL_SPEC=${ONECCL_SPEC:-oneccl-cpu-devel intel-cmplr-lib-rt}
IMPI_SPEC=${IMPI_SPEC:-impi-devel}
MPICH_SPEC=${MPICH_SPEC:-mpich}
PYTHON=${PYTHON:-python3}
STAMP=$(date -u '+%Y-%m-%d-%H%M')
OUT=${OUT:-$ROOT/bench/results/$STAMP-peers.txt}
RAW=${OUT%.txt}
mkdir -p "$RAW" "$PEERS_DIR"
MISSING="$RAW/missing.txt"
: >"$MISSING"
missing() { echo "$1: $2" >>"$MISSING"; echo "# peers: $1 is missing: $2" >&2; }
has() { case " $PEERS " in *" $1 "*) return 0 ;; esac; return 1; }

# ---- libddp, Open MPI and the probes: the project's own build ------------------------------
# Always asked of cmake (a no-op when up to date): mpi-baseline must have its alltoall and bf16.
[ -f "$BUILD/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >&2
for p in ddprun ddp-bench memcpy-probe cma-probe mpi-baseline; do
    cmake --build "$BUILD" -j2 --target "$p" >"$RAW/build-$p.log" 2>&1 || echo "# peers: could not build $p ($RAW/build-$p.log)" >&2
done
for p in ddprun ddp-bench memcpy-probe; do
    [ -x "$BUILD/$p" ] || { echo "peers: $BUILD/$p was not built" >&2; exit 1; }
done
if has openmpi && ! { command -v mpirun >/dev/null 2>&1 && mpirun --version 2>/dev/null | grep -q 'Open MPI' &&
    [ -x "$BUILD/mpi-baseline" ]; }; then
    missing openmpi "needs Debian's openmpi-bin and libopenmpi-dev, and $BUILD/mpi-baseline (cmake finds MPI)"
    PEERS=$(echo " $PEERS " | sed 's/ openmpi / /')
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# ---- the pip peers --------------------------------------------------------------------------
# venv_install NAME SPEC...: a venv PEERS_DIR/NAME with SPEC installed; its .ok file says done.
venv_install() {
    name=$1
    shift
    dir=$PEERS_DIR/$name
    [ "$INSTALL" = force ] && rm -rf "$dir" "$dir.ok"
    # installed already when every requirement asked for is one the .ok file lists (so a venv made
    # for more peers serves fewer without going back to the network)
    if [ -f "$dir.ok" ]; then
        have=1
        for want in "$@"; do
            tr ' ' '\n' <"$dir.ok" | grep -qxF -- "$want" || have=0
        done
        [ "$have" = 1 ] && return 0
    fi
    [ "$INSTALL" = 0 ] && { echo "INSTALL=0 and $dir is not installed"; return 1; }
    echo "# peers: installing $* into $dir" >&2
    [ -f "$dir.ok" ] && set -- $(cat "$dir.ok") "$@" # keep what was there in the record
    rm -f "$dir.ok"
    [ -x "$dir/bin/pip" ] || "$PYTHON" -m venv "$dir" >"$PEERS_DIR/$name.log" 2>&1 || {
        echo "python3 -m venv failed ($PEERS_DIR/$name.log)"; return 1; }
    # shellcheck disable=SC2068
    "$dir/bin/pip" install --disable-pip-version-check --timeout 30 --retries 1 $@ \
        >>"$PEERS_DIR/$name.log" 2>&1 || { echo "pip install $* failed (offline?): $PEERS_DIR/$name.log"; return 1; }
    echo "$*" >"$dir.ok"
}

# build_mpi_baseline DIR: bench/mpi_baseline.c against the MPI in DIR (its mpi.h and libmpi;
# the wheels' mpicc scripts carry placeholders for their prefix, so the compiler is called here).
build_mpi_baseline() {
    [ -x "$1/mpi-baseline" ] && [ "$1/mpi-baseline" -nt "$ROOT/bench/mpi_baseline.c" ] && return 0
    cc -O2 -std=c11 -I"$1/include" -o "$1/mpi-baseline" "$ROOT/bench/mpi_baseline.c" \
        -L"$1/lib" -lmpi -lm -Wl,-rpath,"$1/lib" >"$1/build.log" 2>&1 ||
        { echo "building mpi-baseline failed: $1/build.log"; return 1; }
}

INTEL=$PEERS_DIR/intel
MPICH=$PEERS_DIR/mpich
if has impi || has oneccl; then
    spec="$IMPI_SPEC"
    has oneccl && spec="$spec $ONECCL_SPEC"
    # shellcheck disable=SC2086
    if why=$(venv_install intel $spec); then
        if has impi && ! why=$(build_mpi_baseline "$INTEL"); then
            missing impi "$why"; PEERS=$(echo " $PEERS " | sed 's/ impi / /')
        fi
        if has oneccl && ! { [ -x "$INTEL/oneccl-bench" ] && [ "$INTEL/oneccl-bench" -nt "$ROOT/bench/oneccl_bench.cpp" ]; }; then
            [ -e "$INTEL/lib/libccl.so.2" ] || ln -s libccl.so.1 "$INTEL/lib/libccl.so.2"
            # --disable-new-dtags: an RPATH (not RUNPATH) also serves libccl.so.1's own dependencies
            c++ -O2 -std=c++17 -I"$INTEL/include" -o "$INTEL/oneccl-bench" "$ROOT/bench/oneccl_bench.cpp" \
                -L"$INTEL/lib" -lccl -lmpi -lintlc -Wl,--disable-new-dtags -Wl,-rpath,"$INTEL/lib" \
                >"$INTEL/oneccl-build.log" 2>&1 || {
                missing oneccl "building oneccl-bench failed: $INTEL/oneccl-build.log"
                PEERS=$(echo " $PEERS " | sed 's/ oneccl / /'); }
        fi
    else
        for p in impi oneccl; do
            has $p && { missing $p "$why"; PEERS=$(echo " $PEERS " | sed "s/ $p / /"); }
        done
    fi
fi
if has mpich; then
    if ! why=$(venv_install mpich "$MPICH_SPEC") || ! why=$(build_mpi_baseline "$MPICH"); then
        missing mpich "$why"; PEERS=$(echo " $PEERS " | sed 's/ mpich / /')
    fi
fi
if has gloo && ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
    missing gloo "$PYTHON has no torch with gloo"; PEERS=$(echo " $PEERS " | sed 's/ gloo / /')
fi

# ---- one program run --------------------------------------------------------------------------
# run LABEL N OP DTYPE: JSON lines of LABEL (PEER-SETTING) on N ranks. The settings are
# documented in docs/benchmarks.md ("The peers comparison"); keep the two in step.
COMMON="-b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP --rounds $ROUNDS --min-ms $MIN_MS -c 1 --json"
T="timeout -k 10 $RUN_TIMEOUT"
in_venv() { dir=$1; shift; $T env PATH="$dir/bin:$PATH" I_MPI_ROOT="$dir" "$@"; }
run() {
    label=$1 n=$2 op=$3 dt=$4
    # shellcheck disable=SC2086
    case $label in
    libddp-default) $T "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" -d "$dt" $COMMON ;;
    libddp-best) $T "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" -d "$dt" $COMMON --register 1 ;;
    openmpi-default) $T mpirun --oversubscribe -np "$n" "$BUILD/mpi-baseline" -o "$op" -d "$dt" $COMMON ;;
    openmpi-best)
        bind=none
        [ "$n" -le "$(nproc)" ] && bind=core
        $T mpirun --oversubscribe -np "$n" --bind-to $bind --mca pml ob1 --mca btl self,vader \
            --mca btl_vader_single_copy_mechanism cma "$BUILD/mpi-baseline" -o "$op" -d "$dt" $COMMON ;;
    impi-default) in_venv "$INTEL" mpirun -np "$n" "$INTEL/mpi-baseline" -o "$op" -d "$dt" $COMMON ;;
    impi-best) in_venv "$INTEL" env I_MPI_FABRICS=shm mpirun -np "$n" "$INTEL/mpi-baseline" -o "$op" -d "$dt" $COMMON ;;
    mpich-default) in_venv "$MPICH" mpirun -np "$n" "$MPICH/mpi-baseline" -o "$op" -d "$dt" $COMMON ;;
    oneccl-default) in_venv "$INTEL" mpirun -np "$n" "$INTEL/oneccl-bench" -o "$op" -d "$dt" $COMMON ;;
    oneccl-best) in_venv "$INTEL" env CCL_ATL_TRANSPORT=mpi I_MPI_FABRICS=shm \
        mpirun -np "$n" "$INTEL/oneccl-bench" -o "$op" -d "$dt" $COMMON ;;
    gloo-default | gloo-best)
        [ "$label" = gloo-best ] && export GLOO_SOCKET_IFNAME=lo
        $T "$PYTHON" "$ROOT/bench/peers_gloo.py" --world "$n" --op "$op" --dtype "$dt" --min-bytes "$MIN" \
            --max-bytes "$MAX" --factor "$FACTOR" --iters "$ITERS" --warmup "$WARMUP" --rounds "$ROUNDS" \
            --min-ms "$MIN_MS" --timeout "$RUN_TIMEOUT"
        unset GLOO_SOCKET_IFNAME ;;
    esac
}

# The labels to run: every peer at every setting it has (MPICH has no documented one-host
# setting besides its defaults: only "default").
LABELS=""
for p in $PEERS; do
    for s in $SETTINGS; do
        [ "$p-$s" = mpich-best ] && continue
        LABELS="$LABELS $p-$s"
    done
done
nlabels=$(echo $LABELS | wc -w)

{
    echo "# peers: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, $(uname -r), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "# ops: $OPS; dtypes: $DTYPES; ranks: $RANKS; sizes $MIN..$MAX x$FACTOR; up to $REPEATS repeats (within ${DURATION}s), interleaved"
    echo "# per size: >= $ITERS iterations and >= $MIN_MS ms per round, median of $ROUNDS rounds, $WARMUP warm-up calls"
    echo "# runs: $LABELS"
    echo "# $(($(echo $RANKS | wc -w) * $(echo $OPS | wc -w) * $(echo $DTYPES | wc -w) * nlabels)) program runs per repeat; each one's seconds go to $RAW/seconds.txt"
    [ -s "$MISSING" ] && sed 's/^/# missing: /' "$MISSING"
    echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT"

start=$(date +%s)
rep=1
json_only() { grep '^{' || true; }
while [ "$rep" -le "$REPEATS" ]; do
    now=$(date +%s)
    if [ "$rep" -gt 1 ] && [ $((now - start + now - rep_start)) -gt "$DURATION" ]; then
        echo "# stopping after $((rep - 1)) repeats: another would end after DURATION (${DURATION}s)" | tee -a "$OUT"
        break
    fi
    rep_start=$now
    # What else runs: a CPU-bound process on a rank's CPU costs a pinned pair of ranks a
    # scheduler slice per collective (docs/benchmarks.md, "The millisecond state reproduced").
    top -b -n 1 -o %CPU 2>/dev/null | head -n 15 >"$RAW/top.$rep.txt" || true
    "$BUILD/memcpy-probe" -b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" --rounds "$ROUNDS" --json \
        | json_only >"$RAW/memcpy.$rep.json"
    if [ -x "$BUILD/cma-probe" ]; then
        # On the comparison's sizes (MIN times powers of FACTOR), from X2_MIN.
        "$BUILD/cma-probe" -b "$MIN" -e "$MAX" -f "$FACTOR" --rounds "$ROUNDS" 2>/dev/null \
            | awk -v lo="$(bytes_of "$X2_MIN")" '$1 == "memcpy" && $2 == "x2" && $3 >= lo' \
                >"$RAW/x2.$rep.txt" || true
    fi
    k=0
    for n in $RANKS; do
        for op in $OPS; do
            for dt in $DTYPES; do
                # rotate the order by one label per repeat and per case
                k=$((k + 1))
                shift_by=$(((rep + k) % nlabels))
                order=$(echo $LABELS | tr ' ' '\n' | awk -v s="$shift_by" '{ a[NR] = $0 } END {
                    for (i = 1; i <= NR; i++) print a[(i + s - 1) % NR + 1] }')
                for label in $order; do
                    # MPICH's ranks busy-poll: with more ranks than CPUs its first programs ran
                    # into the time-out (900 s by default) on both machines tried (AMD EPYC,
                    # Intel Xeon; docs/benchmarks.md). MPICH_OVERSUBSCRIBE=1 runs it anyway.
                    if [ "$label" = mpich-default ] && [ "$n" -gt "$(nproc)" ] &&
                        [ "${MPICH_OVERSUBSCRIBE:-0}" != 1 ]; then
                        grep -q "^mpich at $n ranks" "$MISSING" 2>/dev/null ||
                            echo "mpich at $n ranks: more ranks than the $(nproc) CPUs, where it busy-polls until the time-out (MPICH_OVERSUBSCRIBE=1 runs it)" |
                            tee -a "$MISSING" | sed 's/^/# missing: /' | tee -a "$OUT"
                        continue
                    fi
                    f="$RAW/$label-$n-$op-$dt.$rep.json"
                    rc=0
                    t0=$(date +%s)
                    run "$label" "$n" "$op" "$dt" 2>"$f.err" | json_only >"$f" || rc=$?
                    echo "$label $n $op $dt $rep $(($(date +%s) - t0))" >>"$RAW/seconds.txt"
                    # timeout: a program that hangs loses its case, not the run
                    [ -s "$f" ] || echo "!! $label $n ranks $op $dt repeat $rep: no results (rc $rc, $f.err)" | tee -a "$OUT"
                    [ -s "$f.err" ] || rm -f "$f.err"
                done
            done
        done
    done
    echo "# repeat $rep of $REPEATS done after $(($(date +%s) - start)) s, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
    rep=$((rep + 1))
done
"$PYTHON" "$ROOT/bench/peers_summary.py" "$RAW" --plot "$RAW.png" | tee -a "$OUT"
echo "# peers: report $OUT, raw JSON $RAW/, plot $RAW.png" >&2
