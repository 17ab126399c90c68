#!/bin/sh
# The 2-rank 8 B f32 sum allreduce of two libddp builds and Open MPI, interleaved in one
# invocation (the VM changes speed within minutes, so only runs side by side compare):
#
#   bench/latency_ab.sh BASE_BUILD NEW_BUILD [REPS]
#
# Each repetition runs BASE, NEW and Open MPI (mpi-baseline from NEW_BUILD) once and prints their
# JSON lines; the summary gives every repetition's time_us and the median per column. Leave out
# the first repetition when comparing: its libddp runs start cold.
set -eu
BASE=${1:?usage: latency_ab.sh BASE_BUILD NEW_BUILD [REPS]}
NEW=${2:?usage: latency_ab.sh BASE_BUILD NEW_BUILD [REPS]}
REPS=${3:-6}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
C="-d f32 -r sum -b 8 -e 8 -f 4 -n 5 -w 2 --rounds 5 --min-ms 10 --json"
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT INT TERM
rep=1
while [ "$rep" -le "$REPS" ]; do
    # shellcheck disable=SC2086
    b=$("$BASE/ddprun" -n 2 --no-prefix "$BASE/ddp-bench" -o allreduce $C | grep '^{' | head -1)
    # shellcheck disable=SC2086
    n=$("$NEW/ddprun" -n 2 --no-prefix "$NEW/ddp-bench" -o allreduce $C | grep '^{' | head -1)
    m=""
    if [ -x "$NEW/mpi-baseline" ] && command -v mpirun >/dev/null 2>&1; then
        # shellcheck disable=SC2086
        m=$(mpirun --oversubscribe -np 2 "$NEW/mpi-baseline" -o allreduce $C | grep '^{' | head -1)
    fi
    printf 'rep %s\nbase %s\nnew  %s\nmpi  %s\n' "$rep" "$b" "$n" "$m" | tee -a "$OUT"
    rep=$((rep + 1))
done
echo "# time_us per repetition, then the median"
for col in base new mpi; do
    vals=$(sed -n "s/^$col *{.*\"time_us\":\([0-9.]*\).*/\1/p" "$OUT")
    [ -n "$vals" ] || continue
    med=$(printf '%s\n' $vals | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
    printf '%-5s %s  median %s\n' "$col" "$(echo $vals)" "$med"
done
