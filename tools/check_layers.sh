#!/bin/sh
# Lists the #include edges between the folders of src/ and fails on any that goes up a layer.
# The layers, lowest first: core < store < transport < group < reducer, hooks, shard (the top
# three do not include one another). Within a layer, a transport may use a sibling transport
# (hierarchical builds on shm and tcp), and no other transport includes a sibling's header.
# Run from anywhere: tools/check_layers.sh [ROOT] (ROOT: a tree with src/, default this one; the
# tests point it at a copy with a planted violation to see that each check fires).
cd "${1:-$(dirname "$0")/..}" || exit 2
level() {
    case "$1" in
    core) echo 0 ;; store) echo 1 ;; transport) echo 2 ;; group) echo 3 ;;
    reducer | hooks | shard) echo 4 ;; *) echo 9 ;;
    esac
}
bad=0
edges=$(grep -rHo '^#include "[a-z_]*/[^"]*"' src | sed 's|^src/\([a-z_]*\)/[^:]*:#include "\([a-z_]*\)/.*|\1 \2|' |
    grep -v ' ddp$' | sort | uniq -c | sort -k2,2 -k3,3)
echo "include edges between src/ folders (count, from, to):"
echo "$edges" | while read -r n from to; do
    [ -z "$from" ] && continue
    lf=$(level "$from"); lt=$(level "$to")
    mark=ok
    if [ "$lt" -gt "$lf" ] || { [ "$lt" -eq 4 ] && [ "$from" != "$to" ]; }; then mark=UPWARD; fi
    printf '  %4s  %-10s -> %-10s %s\n' "$n" "$from" "$to" "$mark"
done
if echo "$edges" | while read -r n from to; do
    lf=$(level "$from"); lt=$(level "$to")
    if [ "$lt" -gt "$lf" ] || { [ "$lt" -eq 4 ] && [ "$from" != "$to" ]; }; then echo x; fi
done | grep -q x; then
    echo "FAIL: an include goes up a layer"; bad=1
fi
# A transport uses only core, the contract and its own folder; the hierarchical transport alone
# builds on others (shm inside a host, tcp among hosts).
sib=$(grep -rHo '^#include "transport/[a-z_]*/' src/transport | sed 's|^src/transport/\([a-z_]*\)/[^:]*:#include "transport/\([a-z_]*\)/|\1 \2|' |
    awk '$1 != $2 && $1 != "hier"' | sort -u)
if [ -n "$sib" ]; then
    echo "FAIL: a transport includes another transport's header (only hier may):"; echo "$sib"; bad=1
else
    echo "no transport includes a sibling's header but hier (shm, tcp)"
fi
# No transport calls the group: no ddp_group_* / ddp__group_* name in src/transport.
calls=$(grep -rnE '\bddp_{1,2}group_[a-z_]+ *\(|ddp__on_progress_thread' src/transport || true)
if [ -n "$calls" ]; then
    echo "FAIL: transports call the group layer:"; echo "$calls"; bad=1
else
    echo "no transport calls a group function (ddp_group_*, ddp__group_*, ddp__on_progress_thread)"
fi
# Nothing in core names a function of a layer above.
up=$(grep -rnE '\bddp_{1,2}(group|store|reducer|transport|mpi|tcp|shm|hier)_[a-z_]+ *\(' src/core/*.h || true)
if [ -n "$up" ]; then echo "FAIL: core declares functions of layers above:"; echo "$up"; bad=1; fi
[ $bad -eq 0 ] && echo "OK: every include and call goes down"
exit $bad
