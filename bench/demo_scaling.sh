#!/bin/sh
# bench/demo_scaling.sh [REPEATS] [STEPS]: what the second rank buys `make demo`'s job (the
# Fashion-MNIST MLP 784-1024-1024-10, Adam, lr 1e-3, the trainer's defaults otherwise) at global
# batch 128 (the demo's) and 512: samples/s on 1 rank (the anchor) and on 2 ranks, interleaved
# 1, 2, 1, 2, ... in one invocation so a drifting machine hits both alike, with the trainer's own
# per-phase medians (--json's phase_ms, rank 0) and the 2-rank/1-rank ratio of every repeat, by
# samples/s and by CPU time per step (cpu_ms_per_step_max: on a shared machine other programs'
# time is in the wall clock, not in a process's CPU time).
# Then build/optim-bandwidth: the optimizer step alone on one process and on two at once.
#   BUILD (build), VARIANTS (extra 2-rank configurations, ';'-separated trainer options, run
#   after the default 2-rank run of each repeat, e.g. VARIANTS='--zero 0;--zero-overlap'),
#   BASELINE (another build directory, e.g. of an older commit: its 1- and 2-rank runs join each
#   repeat, tagged @base, and its ratio is against its own 1-rank run),
#   BATCHES (128 512), DATA (a --data directory; default the trainer's, or --synthetic when
#   the files are missing).
# Defaults: 5 repeats of 120 timed steps after 10 untimed ones.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPEATS=${1:-5}
STEPS=${2:-120}
WARM=10
BATCHES=${BATCHES:-128 512}
VARIANTS=${VARIANTS:-}
for f in fashion-mnist ddprun optim-bandwidth; do
    [ -x "$BUILD/$f" ] || { echo "demo_scaling: $BUILD/$f is missing (build first: make)" >&2; exit 1; }
done
export OPENBLAS_NUM_THREADS=1
data_dir=${DATA:-/usr/share/datasets/fashion-mnist}
if [ -r "$data_dir/train-images-idx3-ubyte.gz" ]; then
    data="--data $data_dir"
else
    data="--synthetic 60000"
fi
out=$(mktemp "${TMPDIR:-/tmp}/demo-scaling.XXXXXX")
trap 'rm -f "$out"' EXIT

# run TAG N BATCH EXTRA...: one run, one line: TAG, samples/s, step ms median and the phases
# (RUN_BUILD: the build to run, default $BUILD)
run() {
    tag=$1 n=$2 batch=$3
    shift 3
    bdir=${RUN_BUILD:-$BUILD}
    # shellcheck disable=SC2086
    "$bdir/ddprun" -n "$n" "$bdir/fashion-mnist" $data --no-eval --optim adam --lr 1e-3 \
        --batch "$batch" --epochs 1000 --max-steps $((WARM + STEPS)) --warmup "$WARM" --json "$@" \
        2>&1 | sed -n 's/^\(\[0\] \)\{0,1\}{/{/p' | python3 -c '
import json, sys
tag = sys.argv[1]
d = json.loads(sys.stdin.read())
p = d["phase_ms"]
print(tag, "%.1f" % d["samples_per_sec"], "%.3f" % d["step_ms_median"],
      " ".join("%s=%.3f" % kv for kv in p.items()),
      "cpu=%.3f" % d.get("cpu_ms_per_step_max", float("nan")),
      "zero=%d" % d.get("zero", 0))
' "$tag" | tee -a "$out"
}

echo "# demo_scaling: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, load average" \
     "$(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?');" \
     "$REPEATS repeats of $STEPS timed steps (after $WARM), batches $BATCHES; data: $data"
echo "# columns: run, samples/s, step ms (median), phase medians in ms on rank 0, ZeRO stage"
r=1
while [ "$r" -le "$REPEATS" ]; do
    for b in $BATCHES; do
        if [ -n "${BASELINE:-}" ]; then
            RUN_BUILD=$BASELINE run "b$b.1rank@base.r$r" 1 "$b"
            RUN_BUILD=$BASELINE run "b$b.2ranks@base.r$r" 2 "$b"
        fi
        run "b$b.1rank.r$r" 1 "$b"
        run "b$b.2ranks.r$r" 2 "$b"
        i=1
        echo "$VARIANTS" | tr ';' '\n' | while IFS= read -r v; do
            [ -n "$v" ] || continue
            # shellcheck disable=SC2086
            run "b$b.2ranks[$(echo $v | tr ' ' '_')].r$r" 2 "$b" $v
            i=$((i + 1))
        done
    done
    r=$((r + 1))
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "# summary: medians over the repeats (ms; cpu: CPU time per step of the busiest rank, every"
echo "# thread); the 2-rank/1-rank samples/s ratio of each repeat, median [min-max], and the same"
echo "# ratio from CPU time per step (1-rank CPU ms / 2-rank busiest rank's CPU ms: what the wall"
echo "# ratio would be if nothing else ran and no rank waited without spinning)"
python3 - "$out" <<'PY'
import sys, re, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    m = re.match(r"b(\d+)\.(.*)\.r(\d+)$", r[0])
    b, cfg, rep = m.group(1), m.group(2), m.group(3)
    vals = {"samples/s": float(r[1]), "step": float(r[2])}
    vals.update((k, float(v)) for k, v in (x.split("=") for x in r[3:]) if k != "zero")
    vals["zero"] = float(dict(x.split("=") for x in r[3:]).get("zero", 0))
    by.setdefault((b, cfg), {})[rep] = vals
for (b, cfg), reps in sorted(by.items(), key=lambda kv: (int(kv[0][0]), not kv[0][1].endswith("@base"),
                                                         not kv[0][1].startswith("1rank"), kv[0][1])):
    names = list(next(iter(reps.values())).keys())
    med = {n: st.median(v[n] for v in reps.values()) for n in names}
    line = "batch %-4s %-26s %8.1f samples/s  " % (b, cfg, med["samples/s"])
    line += " ".join("%s %.2f" % (n, med[n]) for n in names[1:])
    one = by.get((b, "1rank@base" if cfg.endswith("@base") else "1rank"), {})
    if not cfg.startswith("1rank") and one:
        ratios = sorted(reps[k]["samples/s"] / one[k]["samples/s"] for k in reps if k in one)
        line += "  | vs 1 rank: %.2fx [%.2f-%.2f]" % (st.median(ratios), ratios[0], ratios[-1])
        cpu = sorted(one[k]["cpu"] / reps[k]["cpu"] for k in reps if k in one)
        if cpu and cpu[0] == cpu[0]:  # not NaN (a build without cpu_ms_per_step)
            line += ", by CPU time %.2fx [%.2f-%.2f]" % (st.median(cpu), cpu[0], cpu[-1])
    print(line)
PY
echo
"$BUILD/optim-bandwidth" --procs 2 --reps 5 --steps 10
