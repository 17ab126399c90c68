#!/bin/sh
# The llm.c layout's overlap, before and after pieces were cut along row ranges and launched in
# one schedule across buckets: build/stacked-overlap from two builds of the same tree, the
# second with the old launch order compiled in, run alternately (A B, then B A) so that both
# see the same minutes of this VM:
#
#   cmake -S . -B build-old -DCMAKE_BUILD_TYPE=Release -DDDP_TORCH=OFF \
#         -DCMAKE_C_FLAGS=-DDDP__READINESS_SCHEDULE=0
#   cmake --build build-old -j2 --target stacked-overlap ddprun
#   bench/stacked_ab.sh build build-old [REPS] [-- stacked-overlap options...]
#
# Prints every run's summary line, labelled "new" or "old".
set -eu
NEW=${1:?usage: stacked_ab.sh NEW_BUILD OLD_BUILD [REPS] [-- options]}
OLD=${2:?usage: stacked_ab.sh NEW_BUILD OLD_BUILD [REPS] [-- options]}
shift 2
REPS=5
if [ $# -gt 0 ] && [ "$1" != "--" ]; then REPS=$1; shift; fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
run() { # label build options...
    label=$1 dir=$2
    shift 2
    "$dir/ddprun" -n 2 "$dir/stacked-overlap" "$@" 2>&1 | grep -E '^(\[0\] )?(#|buckets)' |
        sed "s/^\(\[0\] \)\{0,1\}/$label /" || true
}
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -r) load: $(cut -d' ' -f1-3 /proc/loadavg) options: $*"
rep=1
while [ "$rep" -le "$REPS" ]; do
    if [ $((rep % 2)) -eq 1 ]; then
        run new "$NEW" "$@"; run old "$OLD" "$@"
    else
        run old "$OLD" "$@"; run new "$NEW" "$@"
    fi
    rep=$((rep + 1))
done
echo "# end $(date -u +%H:%M:%SZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
