#!/bin/sh
# Lists the #include edges between the folders of src/ and fails on any that goes up a layer, and
# on two files of src/ in a circle (headers that include each other, .c files that call each other).
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
# A transport names no other transport (NCCL's transports are reached only through their
# table): no ddp__transport_<other> in a transport's folder. hier, which builds on shm and tcp,
# is the one exception, as for includes.
named=$(for dir in src/transport/*/; do
    f=$(basename "$dir")
    [ "$f" = hier ] && continue
    grep -rnoE 'ddp__transport_(shm|tcp|mpi|hierarchical|self)\b' "$dir" | grep -v ":ddp__transport_$f\$"
done)
if [ -n "$named" ]; then
    echo "FAIL: a transport names another transport:"; echo "$named"; bad=1
else
    echo "no transport names another transport's table but hier (shm, tcp)"
fi
# No configuration is read below the group: no getenv or ddp__env* in src/transport (the group
# resolves settings and hands them to create). Still to move, by their owners: the shm folder's
# tuning variables and tcp_socket.c's DDP_SOCKET_IFNAME and DDP_STORE_TOKEN; core's own
# configuration table (env.c, config.c) and log level (log.c) are where the variables are read.
env=$(grep -rnE '(^|[^a-z_])(getenv|ddp__env(_[a-z]+)?) *\(' src/transport |
    grep -vE '^src/transport/shm/|^src/transport/tcp/tcp_socket\.c:' || true)
envcore=$(grep -rnE '(^|[^a-z_])getenv *\(' src/core | grep -vE '^src/core/(env|config|log)\.c:' || true)
if [ -n "$env$envcore" ]; then
    echo "FAIL: configuration read below the group:"; echo "$env$envcore"; bad=1
else
    echo "no getenv or ddp__env below the group outside core's configuration (and the files still to move)"
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
# No two files in src/ in a circle: no header that includes a header which includes it back, and
# no two .c files that each call a function the other defines (a circle between files is a seam
# in the wrong place: move the shared piece down, docs/architecture.md). Functions are found as
# the project writes them: a ddp_/ddp__ name on a line at column 0 that is not static, followed
# by a body opening with `{` at column 0; calls through function pointers are not seen.
incs=$(for h in $(find src -name '*.h' | sort); do
    grep -o '^#include "[a-z_/]*\.h"' "$h" | sed "s|^#include \"\(.*\)\"|${h#src/} \1|"
done)
inc_circles=$(echo "$incs" | awk 'NF == 2 { e[$1 " " $2] = 1 } END {
    for (k in e) { split(k, p, " "); if (p[1] < p[2] && ((p[2] " " p[1]) in e)) print "  " p[1] " <-> " p[2] } }' | sort)
defs=$(find src -name '*.c' | sort | xargs awk '
    FNR == 1 { cand = "" }
    /^[A-Za-z_]/ && !/^static/ && !/^typedef/ && !/^#/ {
        if (match($0, /ddp_[a-z0-9_]+ *\(/)) { cand = substr($0, RSTART, RLENGTH); sub(/ *\($/, "", cand) }
        if ($0 ~ /;[ \t]*$/) cand = ""
    }
    /^\{/ && cand != "" { print cand, FILENAME; cand = "" }')
# Calls: each ddp_ name followed by "(" outside comments and string literals.
calls=$(find src -name '*.c' | sort | xargs awk '
    FNR == 1 { incomment = 0 }
    {
        line = $0; out = ""
        while (line != "") {
            if (incomment) {
                i = index(line, "*/"); if (!i) { line = ""; break }
                line = substr(line, i + 2); incomment = 0; continue
            }
            if (match(line, /\/\*|\/\/|"([^"\\]|\\.)*"|\047([^\047\\]|\\.)*\047/)) {
                tok = substr(line, RSTART, RLENGTH); out = out substr(line, 1, RSTART - 1) " "
                line = substr(line, RSTART + RLENGTH)
                if (tok == "//") line = ""
                else if (tok == "/*") incomment = 1
            } else { out = out line; line = "" }
        }
        while (match(out, /(^|[^A-Za-z0-9_])ddp_[a-z0-9_]+ *\(/)) {
            name = substr(out, RSTART, RLENGTH); sub(/^[^d]/, "", name); sub(/ *\($/, "", name)
            print FILENAME ":" name
            out = substr(out, RSTART + RLENGTH)
        }
    }')
call_circles=$(echo "$calls" | awk -v defs="$defs" '
    BEGIN { n = split(defs, d, "\n"); for (i = 1; i <= n; i++) { split(d[i], f, " "); where[f[1]] = f[2] } }
    { i = index($0, ":"); file = substr($0, 1, i - 1); name = substr($0, i + 1)
      if ((name in where) && where[name] != file) { e[file " " where[name]] = name } }
    END { for (k in e) { split(k, p, " "); r = p[2] " " p[1]
          if (p[1] < p[2] && (r in e)) print "  " p[1] " -> " p[2] " (" e[k] ") and back (" e[r] ")" } }' | sort)
if [ -n "$inc_circles$call_circles" ]; then
    [ -n "$inc_circles" ] && { echo "FAIL: two headers in src/ include each other:"; echo "$inc_circles"; }
    [ -n "$call_circles" ] && { echo "FAIL: two files in src/ call each other:"; echo "$call_circles"; }
    bad=1
else
    echo "no two files in src/ include or call each other in a circle"
fi
[ $bad -eq 0 ] && echo "OK: every include and call goes down"
exit $bad
