#!/bin/sh
# The collectives built from the five (reduce, gather, scatter, alltoall, allgatherv,
# reduce_scatterv, alltoallv, coalesced) and sendrecv, each against allreduce of the same size run
# just before it in the same repeat (the anchor), so a ratio compares runs seconds apart on this
# shared, speed-shifting machine. Prints one JSON line per run (ddp-bench --json plus "rep"), to
# be summarised by bench/more_collectives.py.
# Usage: bench/more_collectives.sh BUILD_DIR RANKS TRANSPORT REPEATS SIZE...
set -eu
build=$1 ranks=$2 transport=$3 reps=$4
shift 4
ops="reduce gather scatter alltoall allgatherv reduce_scatterv alltoallv allreduce_coalesced broadcast_coalesced sendrecv"
rep=1
while [ "$rep" -le "$reps" ]; do
  for size in "$@"; do
    for op in $ops; do
      for o in allreduce "$op"; do
        DDP_TRANSPORT=$transport "$build/ddprun" -n "$ranks" --no-prefix "$build/ddp-bench" \
          -o "$o" -b "$size" -e "$size" -c 1 -n 10 -w 5 --rounds 5 --min-ms 20 --json |
          sed "s/^{/{\"rep\":$rep,\"pair\":\"$op\",/"
      done
    done
  done
  rep=$((rep + 1))
done
