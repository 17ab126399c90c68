#!/bin/sh
# The long fuzzing run: every libFuzzer target for TOTAL_SECONDS in all (default 3600, an hour),
# split evenly over the targets, one target at a time under nice -n 19 (the machine is shared).
# Builds build-fuzz/ first (as `make fuzz` does); writes the per-target table (seconds,
# executions, exec/s, cov, ft, findings) to bench/results/<date>-fuzz.txt, whose numbers go into
# docs/fuzzing.md. The corpus each target grew stays in build-fuzz/fuzz-corpus/ for the next run.
#     sh bench/fuzz_long.sh                       TOTAL_SECONDS=600 TARGETS="env shm_desc"
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${FUZZ_BUILD:-build-fuzz}
total=${TOTAL_SECONDS:-3600}
make -s fuzz FUZZ_BUILD="$build" FUZZ_SECONDS=1 FUZZ_TARGETS=store_frame > /dev/null
targets=${TARGETS:-$(for f in "$build"/fuzz/fuzz_*; do printf '%s ' "${f##*/fuzz_}"; done)}
n=$(echo $targets | wc -w)
each=$(( total / n ))
out=bench/results/$(date -u +%Y-%m-%d-%H%M)-fuzz.txt
{
    echo "# bench/fuzz_long.sh: $n targets x $each s (TOTAL_SECONDS=$total), $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD)"
    echo "# $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start; clang $(clang -dumpversion)"
    set +e
    sh tests/fuzz/run.sh "$build" "$each" $targets
    rc=$?
    set -e
    echo "# end $(date -u '+%H:%M UTC'), exit $rc"
} 2>&1 | tee "$out"
echo "written: $out"
