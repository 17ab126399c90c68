# Sourced by the multi-host tests (multihost.sh, torchrun.sh): makes NHOSTS network namespaces
# ("hosts") ${P}h0.., each with one veth leg on a bridge that lives in a further namespace
# ${P}sw, addresses 10.99.0.1.. in 10.99.0.0/24 that exist only inside those namespaces. Defines
# P, LOGDIR (a scratch directory; host*.log there are shown by fail), NAMESPACES, RUNNERS and
# fail(); removes the namespaces on every exit path. Skips (exit 77) when not root or when
# network namespaces are not permitted.
if [ "$(id -u)" != 0 ]; then
    echo "SKIP: network namespaces need root"
    exit 77
fi
if ! command -v ip >/dev/null 2>&1 || ! command -v unshare >/dev/null 2>&1; then
    echo "SKIP: needs ip (iproute2) and unshare (util-linux)"
    exit 77
fi

P="ddp$$"             # namespace and interface prefix, unique per run
LOGDIR=$(mktemp -d "${TMPDIR:-/tmp}/ddp-netns-XXXXXX")
NAMESPACES=""
RUNNERS=""

cleanup() {
    for ns in $NAMESPACES; do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    done
    for ns in $NAMESPACES; do ip netns del "$ns" 2>/dev/null; done
    rm -rf "$LOGDIR"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

fail() {
    echo "FAIL: $*"
    for f in "$LOGDIR"/host*.log; do
        echo "---- $f"
        tail -n 60 "$f"
    done
    exit 1
}

if ! ip netns add "${P}sw" 2>/dev/null; then
    echo "SKIP: 'ip netns add' is not permitted here"
    exit 77
fi
NAMESPACES="${P}sw"
ip -n "${P}sw" link set lo up || fail "switch namespace"
ip -n "${P}sw" link add br0 type bridge || fail "bridge"
ip -n "${P}sw" link set br0 up || fail "bridge up"

k=0
while [ $k -lt "$NHOSTS" ]; do
    ns="${P}h$k"
    ip netns add "$ns" || fail "netns $ns"
    NAMESPACES="$NAMESPACES $ns"
    # Both ends are created inside the namespaces: nothing appears in the caller's network.
    ip -n "$ns" link add eth0 type veth peer name "${P}p$k" netns "${P}sw" || fail "veth $k"
    ip -n "${P}sw" link set "${P}p$k" master br0 up || fail "bridge port $k"
    ip -n "$ns" addr add "10.99.0.$((k + 1))/24" dev eth0 || fail "address $k"
    ip -n "$ns" link set eth0 up || fail "eth0 up $k"
    ip -n "$ns" link set lo up || fail "lo up $k"
    k=$((k + 1))
done

