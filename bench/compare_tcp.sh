#!/bin/sh
# The TCP transport against raw TCP between two "hosts" (network namespaces joined by a veth
# pair, addresses 10.98.0.1 and 10.98.0.2 that exist only inside them), in one run:
#   1. tcp-stream: one plain socket, unidirectional and bidirectional (each rank of a 2-rank ring
#      sends and receives at once, so the bidirectional rate is the fair anchor on a CPU-bound
#      link such as veth);
#   2. ddp-bench allreduce over DDP_TRANSPORT=tcp, one rank per host, 32 MiB and up.
# Prints busbw / raw for each size. Needs root. Usage: bench/compare_tcp.sh [BUILD_DIR]
# Environment: MIN_BYTES, MAX_BYTES (ddp-bench sweep, default 32M..256M), RAW_SECONDS (3),
# RAW_BUFFER (see below), NPROC (ranks per host, default 1), TRANSPORT (default tcp; "auto" lets
# the group pick: hierarchical across the two hosts, or flat tcp with DDP_HIERARCHICAL=0).
#   (default build; needs BUILD_DIR/ddprun, ddp-bench and tcp-stream)
set -u
B=$(cd "${1:-build}" && pwd)
for t in ddprun ddp-bench tcp-stream; do
    [ -x "$B/$t" ] || { echo "compare_tcp: $B/$t is missing (build first)"; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "compare_tcp: needs root for network namespaces"; exit 2; }
P="dbn$$"
OUT=$(mktemp -d "${TMPDIR:-/tmp}/ddp-compare-tcp-XXXXXX")
cleanup() {
    for ns in "${P}a" "${P}b"; do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null
        ip netns del "$ns" 2>/dev/null
    done
    rm -rf "$OUT"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
ip netns add "${P}a" && ip netns add "${P}b" || exit 2
ip -n "${P}a" link add eth0 type veth peer name eth0 netns "${P}b" || exit 2
ip -n "${P}a" addr add 10.98.0.1/24 dev eth0
ip -n "${P}b" addr add 10.98.0.2/24 dev eth0
for ns in "${P}a" "${P}b"; do ip -n "$ns" link set eth0 up; ip -n "$ns" link set lo up; done

SECONDS_RAW=${RAW_SECONDS:-3}
# RAW_BUFFER: bytes of memory the raw stream cycles through (default 1 MiB, cache-resident like
# iperf; set it to the collective's size to make the kernel copy from and to memory as well).
RAW_BUFFER=${RAW_BUFFER:-1048576}
raw() { # $1: extra flag (--bidir or nothing)
    ip netns exec "${P}a" "$B/tcp-stream" server --bind 10.98.0.1 --port 29600 \
        --buffer "$RAW_BUFFER" $1 &
    srv=$!
    sleep 1
    ip netns exec "${P}b" "$B/tcp-stream" client --connect 10.98.0.1 --port 29600 \
        --seconds "$SECONDS_RAW" --buffer "$RAW_BUFFER" $1
    wait $srv
}
uni=$(raw "" | tee /dev/stderr | awk '{print $(NF-3)}')
bidir=$(raw --bidir | tee /dev/stderr | awk '{print $(NF-3)}')

TOKEN="bench-$$"
run_node() { # $1 node rank, $2 namespace
    ip netns exec "$2" unshare --uts sh -c "hostname bench-host-$1 && exec env \
        DDP_TRANSPORT=${TRANSPORT:-tcp} DDP_STORE_TOKEN=$TOKEN '$B/ddprun' --nnodes 2 \
        --node-rank $1 --master-addr 10.98.0.1 --master-port 29500 -n ${NPROC:-1} --timeout 600 \
        '$B/ddp-bench' -o allreduce -b ${MIN_BYTES:-32M} -e ${MAX_BYTES:-256M} -f 2 \
        --min-ms 200 --rounds 3"
}
run_node 1 "${P}b" >"$OUT/node1.log" 2>&1 &
n1=$!
run_node 0 "${P}a" >"$OUT/node0.log" 2>&1
wait $n1
grep '^\[0\]' "$OUT/node0.log" | sed 's/^\[0\] //'
echo
echo "raw TCP between the namespaces: unidirectional $uni GB/s, bidirectional $bidir GB/s per direction"
printf "%14s %12s %14s %16s\n" size "busbw(GB/s)" "busbw/uni" "busbw/bidir"
grep '^\[0\] *[0-9]' "$OUT/node0.log" | awk -v u="$uni" -v b="$bidir" \
    '{ printf "%14s %12s %14.2f %16.2f\n", $2, $8, $8 / u, $8 / b }'
