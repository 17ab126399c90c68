#!/bin/sh
# bench/demo_scaling.sh [REPEATS] [STEPS]: what the second rank buys `make demo`'s job (the
# Fashion-MNIST MLP 784-1024-1024-10, Adam, lr 1e-3, the trainer's defaults otherwise) at global
# batch 128 (the demo's) and 512, and what bounds it (issue #31). Each repeat runs, interleaved so
# a drifting machine hits them alike:
#   1rank   the anchor: 1 rank at the global batch
#   2ranks  2 ranks (ddprun pins rank i to the i-th CPU), the trainer's default (ZeRO-1 in chunks)
#   pair    the bound: 2 x 1 rank at half batch, at once, no communication - two independent
#           1-rank processes started together, pinned to the 2-rank run's two CPUs, each at
#           batch B/2 stepping only its ZeRO-1 chunk of the parameters (--bench-optim-share i/2):
#           the same model, the same arithmetic per core and both cores' shared memory bus and
#           cache, without any exchange. Its samples/s is the sum of the two processes'; its step,
#           phases and CPU time the mean of the two (CPU time: the larger). (One that ends first
#           leaves the other its last steps alone, which can only raise the bound.)
# then prints per repeat the ratios 2ranks/1rank, bound = pair/1rank and 2ranks/bound, and at the
# end the medians over the repeats of every run and phase (the trainer's --json phase_ms, rank 0
# for 2ranks), the per-repeat ratios (median [min-max]), by samples/s and by CPU time per step
# (cpu_ms_per_step_max: on a shared machine other programs' time is in the wall clock, not in a
# process's CPU time), and per phase the 2-rank run against the pair (what is above the bound).
# Then build/optim-bandwidth: the optimizer step alone, whole on one process and each process's
# half at once on two: the optimizer phase's bound.
#   BUILD (build), VARIANTS (extra 2-rank configurations, ';'-separated trainer options, run
#   after the default 2-rank run of each repeat, e.g. VARIANTS='--zero 0;--zero-overlap'),
#   BASELINE (another build directory, e.g. of an older commit: its 1- and 2-rank runs join each
#   repeat, tagged @base, and its ratio is against its own 1-rank run; a build whose JSON has no
#   phase_ms - before 4402622 - is reported by whole-step times only, with a note),
#   BATCHES (128 512), DATA (a --data directory; default the trainer's, or --synthetic when
#   the files are missing), PAIR=0 (skip the pair).
# Defaults: 5 repeats of 120 timed steps after 10 untimed ones.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPEATS=${1:-5}
STEPS=${2:-120}
WARM=10
BATCHES=${BATCHES:-128 512}
VARIANTS=${VARIANTS:-}
PAIR=${PAIR:-1}
for f in fashion-mnist ddprun optim-bandwidth; do
    [ -x "$BUILD/$f" ] || { echo "demo_scaling: $BUILD/$f is missing (build first: make)" >&2; exit 1; }
done
if [ -n "${BASELINE:-}" ]; then
    for f in fashion-mnist ddprun; do
        [ -x "$BASELINE/$f" ] || { echo "demo_scaling: BASELINE $BASELINE/$f is missing" >&2; exit 1; }
    done
fi
export OPENBLAS_NUM_THREADS=1
data_dir=${DATA:-/usr/share/datasets/fashion-mnist}
if [ -r "$data_dir/train-images-idx3-ubyte.gz" ]; then
    data="--data $data_dir"
else
    data="--synthetic 60000"
fi
# The CPUs ddprun pins a 2-rank job's ranks to (the first two it may run on): the pair's.
cpus=$(python3 -c 'import os; c = sorted(os.sched_getaffinity(0)); print(*(c * 2)[:2])')
cpu0=${cpus% *} cpu1=${cpus#* }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/demo-scaling.XXXXXX")
out=$tmp/rows
: >"$out"
trap 'rm -rf "$tmp"' EXIT

# parse TAG FILE...: one line from the trainer's JSON in each FILE (ddprun's "[0] " prefix
# allowed): TAG, samples/s, step ms median, the phase medians, cpu=, zero=. Several files (the
# pair): samples/s summed, step and phases averaged, CPU time the largest. A JSON without
# phase_ms (an older build) gives the whole step only, tagged phases=none.
parse() {
    python3 - "$@" <<'PY'
import json, re, sys
tag, files = sys.argv[1], sys.argv[2:]
ds = []
for f in files:
    lines = [re.sub(r"^\[0\] ", "", l) for l in open(f) if re.match(r"^(\[0\] )?\{", l)]
    if not lines:
        sys.exit("demo_scaling: %s: no JSON line from the trainer:\n%s" % (tag, open(f).read()[-2000:]))
    ds.append(json.loads(lines[-1]))
mean = lambda xs: sum(xs) / len(xs)
sps = sum(d["samples_per_sec"] for d in ds)
step = mean([d.get("step_ms_median", d.get("step_ms")) for d in ds])
fields = []
if all("phase_ms" in d for d in ds):
    fields += ["%s=%.3f" % (k, mean([d["phase_ms"][k] for d in ds])) for k in ds[0]["phase_ms"]]
else:
    fields.append("phases=none")
fields.append("cpu=%.3f" % max(d.get("cpu_ms_per_step_max", float("nan")) for d in ds))
fields.append("zero=%d" % max(d.get("zero", 0) for d in ds))
print(tag, "%.1f" % sps, "%.3f" % step, " ".join(fields))
PY
}

# trainer BUILD_DIR N BATCH EXTRA...: the trainer's command line for one run
trainer() {
    bdir=$1 n=$2 batch=$3
    shift 3
    # shellcheck disable=SC2086
    "$bdir/ddprun" -n "$n" "$bdir/fashion-mnist" $data --no-eval --optim adam --lr 1e-3 \
        --batch "$batch" --epochs 1000 --max-steps $((WARM + STEPS)) --warmup "$WARM" --json "$@"
}

# run TAG N BATCH EXTRA...: one run, one line (RUN_BUILD: the build to run, default $BUILD)
run() {
    tag=$1
    shift
    trainer "${RUN_BUILD:-$BUILD}" "$@" >"$tmp/json" 2>&1 || true
    parse "$tag" "$tmp/json" | tee -a "$out"
}

# pair TAG BATCH: the bound - two 1-rank processes at BATCH/2 at once, pinned to the 2-rank run's
# CPUs, each stepping its half of the optimizer; one line
pair() {
    tag=$1 half=$(($2 / 2))
    (trainer_pinned "$cpu0" "$half" 0 >"$tmp/pair0" 2>&1) &
    p0=$!
    (trainer_pinned "$cpu1" "$half" 1 >"$tmp/pair1" 2>&1) &
    p1=$!
    wait "$p0" || true
    wait "$p1" || true
    parse "$tag" "$tmp/pair0" "$tmp/pair1" | tee -a "$out"
}
trainer_pinned() { # CPU BATCH SHARE: one of the pair under taskset
    cpu=$1
    shift
    # shellcheck disable=SC2086
    taskset -c "$cpu" "$BUILD/ddprun" -n 1 "$BUILD/fashion-mnist" $data --no-eval --optim adam \
        --lr 1e-3 --batch "$1" --epochs 1000 --max-steps $((WARM + STEPS)) --warmup "$WARM" \
        --json --bench-optim-share "$2/2"
}

# ratios B R: the ratios of repeat R at batch B from the lines so far
ratios() {
    python3 - "$out" "$1" "$2" <<'PY'
import sys
rows = {l.split()[0]: float(l.split()[1]) for l in open(sys.argv[1]) if l.strip()}
b, r = sys.argv[2], sys.argv[3]
one, two, pair = (rows.get("b%s.%s.r%s" % (b, k, r)) for k in ("1rank", "2ranks", "pair"))
s = "# repeat %s, batch %s:" % (r, b)
if one and two: s += " 2 ranks / 1 rank %.2fx" % (two / one)
if one and pair: s += "; bound (pair / 1 rank) %.2fx" % (pair / one)
if two and pair: s += "; 2 ranks / bound %.2f" % (two / pair)
print(s)
PY
}

echo "# demo_scaling: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, load average" \
     "$(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?');" \
     "$REPEATS repeats of $STEPS timed steps (after $WARM), batches $BATCHES; data: $data"
echo "# columns: run, samples/s, step ms (median), phase medians in ms on rank 0 (pair: mean of" \
     "its two processes), CPU ms per step, ZeRO stage"
[ "$cpu0" != "$cpu1" ] || echo "# note: only CPU $cpu0 is available: the pair shares it, which bounds nothing"
r=1
while [ "$r" -le "$REPEATS" ]; do
    for b in $BATCHES; do
        if [ -n "${BASELINE:-}" ]; then
            RUN_BUILD=$BASELINE run "b$b.1rank@base.r$r" 1 "$b"
            RUN_BUILD=$BASELINE run "b$b.2ranks@base.r$r" 2 "$b"
        fi
        run "b$b.1rank.r$r" 1 "$b"
        run "b$b.2ranks.r$r" 2 "$b"
        [ "$PAIR" = 0 ] || pair "b$b.pair.r$r" "$b"
        echo "$VARIANTS" | tr ';' '\n' | while IFS= read -r v; do
            [ -n "$v" ] || continue
            # shellcheck disable=SC2086
            run "b$b.2ranks[$(echo $v | tr ' ' '_')].r$r" 2 "$b" $v
        done
        ratios "$b" "$r"
    done
    r=$((r + 1))
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "# summary: medians over the repeats (ms; cpu: CPU time per step of the busiest rank, every"
echo "# thread); the samples/s ratio of each repeat, median [min-max]: 2-rank runs against 1 rank"
echo "# and against the bound (the pair), the pair against 1 rank (the bound itself); and the same"
echo "# from CPU time per step (what the wall ratio would be if nothing else ran and no rank waited"
echo "# without spinning)"
python3 - "$out" <<'PY'
import sys, re, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    m = re.match(r"b(\d+)\.(.*)\.r(\d+)$", r[0])
    b, cfg, rep = m.group(1), m.group(2), m.group(3)
    vals = {"samples/s": float(r[1]), "step": float(r[2])}
    kv = dict(x.split("=") for x in r[3:])
    vals.update((k, float(v)) for k, v in kv.items() if k not in ("zero", "phases"))
    vals["zero"] = float(kv.get("zero", 0))
    by.setdefault((b, cfg), {})[rep] = vals

def order(key):
    b, cfg = key
    base = cfg.endswith("@base")
    kind = 0 if cfg.startswith("1rank") else 2 if cfg == "pair" else 1
    return (int(b), not base, kind, cfg)

def ratio(reps, anchor, what):
    pairs = [(reps[k], anchor[k]) for k in reps if k in anchor]
    if not pairs: return ""
    w = sorted(a["samples/s"] / z["samples/s"] for a, z in pairs)
    s = " | %s %.2fx [%.2f-%.2f]" % (what, st.median(w), w[0], w[-1])
    c = sorted(z["cpu"] / a["cpu"] for a, z in pairs if "cpu" in a and "cpu" in z)
    if c and c[0] == c[0]:  # not NaN (a build without cpu_ms_per_step)
        s += ", by CPU time %.2fx [%.2f-%.2f]" % (st.median(c), c[0], c[-1])
    return s

meds = {}
for (b, cfg), reps in sorted(by.items(), key=lambda kv: order(kv[0])):
    names = [n for n in next(iter(reps.values())).keys() if all(n in v for v in reps.values())]
    med = meds[(b, cfg)] = {n: st.median(v[n] for v in reps.values()) for n in names}
    line = "batch %-4s %-26s %8.1f samples/s  " % (b, cfg, med["samples/s"])
    line += " ".join("%s %.2f" % (n, med[n]) for n in names[1:])
    if not any(n in med for n in ("forward", "backward")):
        line += "  (no phase_ms in this build's JSON: whole-step times only)"
    one = by.get((b, "1rank@base" if cfg.endswith("@base") else "1rank"), {})
    pair = by.get((b, "pair"), {})
    if cfg == "pair":
        line += ratio(reps, one, "bound = pair / 1 rank:")
    elif not cfg.startswith("1rank"):
        line += ratio(reps, one, "vs 1 rank:")
        if pair and not cfg.endswith("@base"):
            line += ratio(reps, pair, "vs bound:")
    print(line)

# Per phase: the 2-rank run (rank 0) against the pair (mean of its processes) and half of 1 rank.
phases = ["data", "forward", "backward", "finalize", "optimizer", "other", "step"]
for b in sorted({b for b, _ in by}, key=int):
    one, two, pair = (meds.get((b, k)) for k in ("1rank", "2ranks", "pair"))
    if not (one and two and pair) or "forward" not in two or "forward" not in pair:
        continue
    print("\nbatch %s per phase (ms, medians): %-9s %8s %8s %8s %8s %12s" %
          (b, "phase", "1 rank/2", "pair", "2 ranks", "above", "2 ranks/pair"))
    for n in phases:
        if n in one and n in two and n in pair:
            print("%32s %-9s %8.2f %8.2f %8.2f %+8.2f %11.2fx" % ("", n, one[n] / 2, pair[n], two[n],
                  two[n] - pair[n], two[n] / pair[n] if pair[n] > 0 else float("nan")))
PY
echo
"$BUILD/optim-bandwidth" --procs 2 --reps 5 --steps 10
