#!/bin/sh
# The TCP transport against raw TCP between two "hosts" (network namespaces joined by a veth
# pair, addresses 10.98.0.1 and 10.98.0.2 that exist only inside them), in one run:
#   1. tcp-stream: one plain socket, unidirectional and bidirectional (each rank of a 2-rank ring
#      sends and receives at once, so the bidirectional rate is the fair anchor on a CPU-bound
#      link such as veth);
#   2. ddp-bench allreduce over DDP_TRANSPORT=tcp, one rank per host, 32 MiB and up.
#   3. gloo (PyTorch's torch.distributed over its gloo backend, bench/gloo_allreduce.py), the
#      same sizes, one rank per host (skipped with a note when python3 cannot import torch).
# Prints busbw / raw for each size. Needs root. Usage: bench/compare_tcp.sh [BUILD_DIR]
# RATE (e.g. 1gbit, 10gbit): shape both ends of the veth pair with a token bucket (tc tbf, root
# qdisc of each end's egress) to emulate two machines on a full-duplex link of that rate, where
# the link and not the kernel's copies on this machine's cores is the bottleneck; raw TCP is
# measured on the same shaped link. Unset: the bare veth (CPU-bound).
# Environment: MIN_BYTES, MAX_BYTES (ddp-bench sweep, default 32M..256M), RAW_SECONDS (3),
# RAW_BUFFER (see below), NPROC (ranks per host, default 1), TRANSPORT (default tcp; "auto" lets
# the group pick: hierarchical across the two hosts, or flat tcp with DDP_HIERARCHICAL=0),
# ITERS / WARMUP (ddp-bench -n / -w, default 10 / 3; on a shaped link 1 / 1 keeps a run short:
# --min-ms 200 still holds), GLOO=0 skips gloo.
#   (default build; needs BUILD_DIR/ddprun, ddp-bench and tcp-stream)
set -u
B=$(cd "${1:-build}" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
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

# The link's rate in GB/s (10^9 bytes/s), for the table; empty when unshaped.
link_gbs=""
if [ -n "${RATE:-}" ]; then
    bits=$(echo "$RATE" | awk '
        match(tolower($0), /^[0-9.]+/) {
            v = substr($0, 1, RLENGTH); u = tolower(substr($0, RLENGTH + 1))
            m = u == "gbit" ? 1e9 : u == "mbit" ? 1e6 : u == "kbit" ? 1e3 : u == "bit" ? 1 : 0
            if (m > 0) printf "%.0f", v * m }')
    [ -n "$bits" ] || { echo "compare_tcp: RATE=$RATE: want <number>bit|kbit|mbit|gbit"; exit 2; }
    # burst: what the bucket lets through at once. It must hold a whole GSO packet (64 KiB,
    # else tbf splits each one) and cover the wake-up granularity of the qdisc watchdog (about a
    # millisecond under load, so rate x 1 ms). limit: the queue, 50 ms of the rate and at least
    # 16 MiB, above what TCP small queues let one socket put in a qdisc (tcp_limit_output_bytes,
    # 4 MiB here): so that TCP's window, not drops, paces the sender. (A 4 MiB limit let a busy
    # machine's late qdisc wake-ups overflow the queue; a lost retransmission then costs RTO
    # back-offs of seconds.)
    burst=$(awk -v b="$bits" 'BEGIN { x = b / 8 / 1000; if (x < 262144) x = 262144; printf "%.0f", x }')
    limit=$(awk -v b="$bits" 'BEGIN { x = b / 8 / 20; if (x < 16777216) x = 16777216; printf "%.0f", x }')
    for ns in "${P}a" "${P}b"; do
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$burst" \
            limit "$limit" || { echo "compare_tcp: tc tbf on $ns failed (CONFIG_NET_SCH_TBF?)"; exit 2; }
    done
    link_gbs=$(awk -v b="$bits" 'BEGIN { printf "%.4f", b / 8e9 }')
    echo "link shaped: tbf rate $RATE ($link_gbs GB/s) burst $burst limit $limit on both ends"
fi

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
# (captured, then printed: `tee /dev/stderr` would reopen a redirected log at offset 0)
line=$(raw "") && echo "$line"
uni=$(echo "$line" | awk '{print $(NF-3)}')
line=$(raw --bidir) && echo "$line"
bidir=$(echo "$line" | awk '{print $(NF-3)}')

TOKEN="bench-$$"
run_node() { # $1 node rank, $2 namespace
    ip netns exec "$2" unshare --uts sh -c "hostname bench-host-$1 && exec env \
        DDP_TRANSPORT=${TRANSPORT:-tcp} DDP_STORE_TOKEN=$TOKEN '$B/ddprun' --nnodes 2 \
        --node-rank $1 --master-addr 10.98.0.1 --master-port 29500 -n ${NPROC:-1} --timeout 600 \
        '$B/ddp-bench' -o allreduce -b ${MIN_BYTES:-32M} -e ${MAX_BYTES:-256M} -f 2 \
        --min-ms 200 --rounds 3 -n ${ITERS:-10} -w ${WARMUP:-3}"
}
run_node 1 "${P}b" >"$OUT/node1.log" 2>&1 &
n1=$!
run_node 0 "${P}a" >"$OUT/node0.log" 2>&1
wait $n1
grep '^\[0\]' "$OUT/node0.log" | sed 's/^\[0\] //'

# gloo: the same sizes, one rank per host, f32 sum (sizes in bytes for the script).
to_bytes() { echo "$1" | awk '{ v = $0 + 0; u = toupper(substr($0, length($0)));
    m = u == "K" ? 1024 : u == "M" ? 1048576 : u == "G" ? 1073741824 : 1; printf "%.0f", v * m }'; }
: >"$OUT/gloo.log"
if [ "${GLOO:-1}" = 0 ]; then
    echo "gloo: skipped (GLOO=0)"
elif [ "${NPROC:-1}" != 1 ]; then
    echo "gloo: skipped (it runs one rank per host; NPROC=${NPROC})"
elif ! /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
    echo "gloo: skipped (python3 cannot import torch.distributed)"
else
    gloo() { # $1 rank, $2 namespace
        ip netns exec "$2" env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 /usr/bin/python3 \
            "$SRC/bench/gloo_allreduce.py" --rank "$1" --world 2 --master-addr 10.98.0.1 \
            --master-port 29700 --min-bytes "$(to_bytes "${MIN_BYTES:-32M}")" \
            --max-bytes "$(to_bytes "${MAX_BYTES:-256M}")" --factor 2 --rounds 3
    }
    gloo 1 "${P}b" >/dev/null 2>"$OUT/gloo1.err" &
    g1=$!
    gloo 0 "${P}a" >"$OUT/gloo.log" 2>"$OUT/gloo0.err" || { echo "gloo: failed:"; cat "$OUT/gloo0.err"; }
    wait $g1
    cat "$OUT/gloo.log"
fi
echo
echo "raw TCP between the namespaces: unidirectional $uni GB/s, bidirectional $bidir GB/s per direction"
[ -n "$link_gbs" ] && echo "link rate $RATE = $link_gbs GB/s each way"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
# Losses on the link over the whole run (qdisc drops, TCP retransmissions, timeouts): a stalled
# size in the table with retransmissions here was the link's fault, not the transport's.
for ns in "${P}a" "${P}b"; do
    drops=$(ip netns exec "$ns" tc -s qdisc show dev eth0 | sed -n 's/.*dropped \([0-9]*\).*/\1/p' | head -1)
    tcpstat=$(ip netns exec "$ns" nstat -asz TcpRetransSegs TcpExtTCPTimeouts 2>/dev/null |
        awk '/^Tcp/ { printf "%s %s ", $1, $2 }')
    echo "link ${ns#"$P"}: qdisc drops ${drops:-?}; ${tcpstat:-nstat unavailable}"
done
# busbw recomputed from the time (ddp-bench prints 2 decimals): algbw = S / t, busbw = algbw x
# 2 (n - 1) / n. A 2-rank ring moves S each way per rank, so busbw = algbw <= link. With NPROC=2
# (hierarchical) only the host leaders' ring crosses the link, S each way: algbw / uni is then the
# link's efficiency and busbw (n = 4) may reach 1.5 x the link.
world=$(sed -n 's/^\[0\] # ddp-bench allreduce: \([0-9]*\) ranks.*/\1/p' "$OUT/node0.log")
printf "%11s %8s %8s %9s %9s %11s %8s %8s\n" size "algbw" "busbw" "algbw/uni" "busbw/uni" \
    "busbw/bidir" "gloo" "gloo/uni"
grep '^\[0\] *[0-9]' "$OUT/node0.log" | awk -v u="$uni" -v b="$bidir" -v gf="$OUT/gloo.log" \
    -v n="${world:-2}" '
    BEGIN { while ((getline line < gf) > 0) { split(line, f, " "); g[f[2]] = f[5] } }
    { alg = $2 / $6 * 1e-3; bus = alg * 2 * (n - 1) / n
      gb = "-"; gr = "-"
      if ($2 in g) { gb = g[$2]; gr = sprintf("%.2f", g[$2] / u) }
      printf "%11s %8.4f %8.4f %9.2f %9.2f %11.2f %8s %8s\n", $2, alg, bus, alg / u, bus / u,
             bus / b, gb, gr }'
echo "(GB/s = 10^9 bytes/s; algbw, busbw: libddp ddp-bench over ${TRANSPORT:-tcp}, $world ranks; gloo: busbw,"
echo " 2 ranks; uni / bidir: raw TCP on the same link)"
