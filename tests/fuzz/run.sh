#!/bin/sh
# Runs each libFuzzer target of BUILD_DIR (configured with -DDDP_FUZZ=ON, `make fuzz`) for
# SECONDS, one after the other (one process: the fuzzers are not run in parallel), starting from
# its seed corpus and regression inputs; new inputs go to BUILD_DIR/fuzz-corpus/<target>/,
# findings to BUILD_DIR/fuzz-findings/<target>/. Prints one line per target with libFuzzer's
# final numbers (executions, coverage: cov = edges, ft = features) and exits 1 when any target
# found something (crash, hang, leak, out-of-memory or UB).
#     sh tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]       (default: every target built)
# NICE (default 19) is the nice level; LOG_DIR keeps each target's full log (default
# BUILD_DIR/fuzz-logs).
set -u
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: run.sh BUILD_DIR SECONDS [TARGET...]}
seconds=${2:?usage: run.sh BUILD_DIR SECONDS [TARGET...]}
shift 2
targets="$*"
if [ -z "$targets" ]; then
    for f in "$build"/fuzz/fuzz_*; do [ -x "$f" ] && targets="$targets ${f##*/fuzz_}"; done
fi
[ -n "$targets" ] || { echo "run.sh: no fuzz targets in $build/fuzz (make fuzz builds them)" >&2; exit 2; }
logs=${LOG_DIR:-$build/fuzz-logs}
mkdir -p "$logs"
status=0
printf '%-16s %8s %12s %10s %7s %7s %s\n' target seconds execs exec/s cov ft findings
for t in $targets; do
    bin=$build/fuzz/fuzz_$t
    [ -x "$bin" ] || { echo "run.sh: $bin is not built" >&2; status=1; continue; }
    work=$build/fuzz-corpus/$t
    findings=$build/fuzz-findings/$t
    mkdir -p "$work" "$findings"
    dirs="$work $here/corpus/$t"
    [ -d "$here/regressions/$t" ] && dirs="$dirs $here/regressions/$t"
    log=$logs/$t.log
    # -timeout: an input running this long is a hang; -rss_limit_mb/-malloc_limit_mb: an input
    # making the process allocate this much is an unbounded allocation. -max_len: the largest
    # seed (the checkpoints) plus room to grow.
    maxlen=$(ls -l $here/corpus/$t | awk 'NR>1 && $5>m {m=$5} END {print m < 4096 ? 4096 : m + 1024}')
    start=$(date +%s)
    nice -n "${NICE:-19}" "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -malloc_limit_mb=512 -max_len="$maxlen" -print_final_stats=1 \
        -artifact_prefix="$findings/" $dirs > "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -Eo 'ft: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    found=$(ls "$findings" | wc -l)
    printf '%-16s %8s %12s %10s %7s %7s %s\n' "$t" "$took" "${execs:-?}" "${rate:-?}" \
        "${cov:-?}" "${ft:-?}" "$found"
    if [ $rc -ne 0 ] || [ "$found" -ne 0 ]; then
        echo "  $t: exit $rc, findings in $findings, log $log" >&2
        grep -E '^(==[0-9]+==ERROR|SUMMARY|.*runtime error|.*invariant broken)' "$log" | head -5 >&2
        status=1
    fi
done
exit $status
