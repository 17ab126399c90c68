#!/bin/sh
# bench/zero3_vs_fsdp2.sh [REPEATS] [STEPS]: build/gpt --zero 3 against PyTorch FSDP2 on the same
# GPT (issue #28), in one command:
#   0. losses: bench/gpt_pytorch.py --fsdp2 (over gloo and over libddp's "ddp") against the same
#      script's DDP (gloo), CHECK_STEPS steps on WORLD ranks, every step's global loss and the
#      largest difference, so the comparison below is of one training computation. (build/gpt
#      draws its initial weights from its own generator, so its losses are not the PyTorch
#      ones step for step; test_gpt.zero3 holds --zero 3 to plain data parallelism instead.)
#   A. tokens/s on WORLD ranks (2), interleaved per repeat: build/gpt --zero 3, FSDP2 over gloo,
#      FSDP2 over "ddp", back to back, so the machine's drifting speed hits them alike; per-repeat
#      ratios and their min / median / max. Both sides time it the same way: WARM steps, then
#      STEPS timed steps, every one synchronised; tokens/s = global tokens per step over the
#      slowest rank's median step (build/gpt --json's tokens_per_sec without --bench-nosync;
#      gpt_pytorch.py --fsdp2's).
#   B. model state per rank at 1, 2 and 4 ranks on MEM_MODEL: build/gpt --zero 3's ledger
#      (parameter, gradient and optimizer shards, gathered peak, unit gradients peak) and FSDP2's
#      state counted from the tensors (the storages of each rank's DTensor shards, padding
#      included, as the ledger counts its padding; AdamW's exp_avg, exp_avg_sq and step), both
#      exact byte counts; and the peak RSS of each side.
# Model and batch: MODEL and MEM_MODEL take build/gpt's own flags (--layers --heads --channels
# --context --batch --lr --warmup --min-lr-ratio --weight-decay --clip --seed --data); the same
# values go to gpt_pytorch.py (--warmup as its --lr-warmup). Other flags are refused: the PyTorch
# side has no counterpart.
# Environment: BUILD (build), PY (python3: a torch >= 2.4 interpreter), WORLD (2), WARM (5),
# MODEL (none: build/gpt's defaults), MEM_MODEL ("--layers 8 --heads 8 --channels 256"),
# CHECK_STEPS (8; 0 skips part 0), MEM_RANKS (the rank counts of part B, "1 2 4"; empty skips
# it: its figures are exact byte counts that a loaded machine does not change, part A's are
# not, so the two can run apart; REPEATS 0 skips part A), BIND (auto: ddprun pins each rank to a CPU and gpt_pytorch.py
# does the same when the ranks fit the CPUs; none: both leave placement to the kernel).
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPEATS=${1:-5}
STEPS=${2:-30}
WARM=${WARM:-5}
WORLD=${WORLD:-2}
MODEL=${MODEL:-}
MEM_MODEL=${MEM_MODEL:---layers 8 --heads 8 --channels 256}
CHECK_STEPS=${CHECK_STEPS:-8}
MEM_RANKS=${MEM_RANKS-1 2 4}
PY=${PY:-python3}
BIND=${BIND:-auto}
case $BIND in auto | none) ;; *) echo "bench: BIND=$BIND is not auto or none" >&2; exit 2 ;; esac
case $BUILD in /*) BUILD_ABS=$BUILD ;; *) BUILD_ABS=$PWD/$BUILD ;; esac
for f in "$BUILD/gpt" "$BUILD/ddprun"; do
    [ -x "$f" ] || { echo "bench: $f missing: build first (make)" >&2; exit 1; }
done
if ! "$PY" -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit((int(v[0]), int(v[1])) < (2, 4))' 2>/dev/null; then
    echo "bench: $PY has no torch >= 2.4 (FSDP2): set PY to a torch 2 interpreter" >&2
    exit 1
fi
. bench/common.sh
backends=gloo
if bench_ddp_extension "$PY" "$BUILD"; then
    backends="gloo ddp"
else
    echo "bench: $BUILD/python/libddp has no backend for $PY's torch (make builds it): FSDP2 over \"ddp\" is skipped" >&2
fi

# pyflags FLAGS...: build/gpt's model, batch and optimizer flags as gpt_pytorch.py's
pyflags() {
    out=""
    while [ $# -gt 0 ]; do
        [ $# -ge 2 ] || { echo "bench: $1 needs a value" >&2; exit 2; }
        case $1 in
        --layers | --heads | --channels | --context | --batch | --lr | --min-lr-ratio | \
            --weight-decay | --clip | --seed | --data) out="$out $1 $2" ;;
        --warmup) out="$out --lr-warmup $2" ;;
        *)
            echo "bench: $1 (in MODEL or MEM_MODEL): not a flag gpt_pytorch.py matches (model, batch, optimizer and data only)" >&2
            exit 2 ;;
        esac
        shift 2
    done
    echo "$out"
}
# shellcheck disable=SC2086
PY_MODEL=$(pyflags $MODEL)
# shellcheck disable=SC2086
PY_MEM_MODEL=$(pyflags $MEM_MODEL)

OUT=$(mktemp -d "${TMPDIR:-/tmp}/zero3_vs_fsdp2.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
trap 'exit 130' INT TERM HUP  # through the EXIT trap: no temporary directory left behind
export OPENBLAS_NUM_THREADS=1
common="--eval-every 0 --eval-batches 1 --samples 0 --no-progress --json"

# gpt TAG N ARGS...: build/gpt on N ranks; appends {"tag": TAG, ...its JSON line} to $OUT/runs
gpt() {
    tag=$1 n=$2
    shift 2
    # shellcheck disable=SC2086
    if "$BUILD/ddprun" -n "$n" --bind "$BIND" "$BUILD/gpt" $common "$@" >"$OUT/out" 2>"$OUT/err"; then
        line=$(sed -n 's/^\(\[0\] \)\{0,1\}\({.*}\)$/\2/p' "$OUT/out" | tail -1)
    else
        line=""
    fi
    record "$tag" "build/gpt --zero 3 on $n rank(s)"
}

# fsdp2 TAG ARGS...: bench/gpt_pytorch.py --fsdp2; appends each JSON line, tagged, to $OUT/runs
fsdp2() {
    tag=$1
    shift
    rc=0
    PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} LIBDDP_BUILD_DIR=$BUILD_ABS \
        "$PY" bench/gpt_pytorch.py --bind "$BIND" "$@" >"$OUT/out" 2>"$OUT/err" || rc=$?
    # one line per backend and world size: those before a failure still count
    line=$(grep '^{' "$OUT/out" || true)
    grep '^gpt_pytorch: the gloo run' "$OUT/err" >&2 || true  # a retried crash, said
    if [ "$rc" -ne 0 ] && [ -n "$line" ]; then
        echo "bench: gpt_pytorch.py $* failed after $(echo "$line" | wc -l) run(s):" >&2
        why
    fi
    record "$tag" "gpt_pytorch.py $*"
}

# why: what a failed run printed: its last lines, and before them any line of a crash (a C++
# exception's what(), a fatal Python error) that a traceback would push out of them
why() {
    grep -E 'terminate called|what\(\)|Fatal|Aborted|Segmentation' "$OUT/err" | head -5 >&2
    tail -5 "$OUT/err" >&2
}

# record TAG WHAT: $line's JSON lines into $OUT/runs, tagged; on failure, the error to stderr
record() {
    if [ -z "$line" ]; then
        echo "bench: $2 failed:" >&2
        why
        return
    fi
    echo "$line" | while IFS= read -r l; do
        echo "{\"tag\": \"$1\", ${l#\{}" >>"$OUT/runs"
    done
}
: >"$OUT/runs"

echo "# bench/zero3_vs_fsdp2.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs, $("$PY" -c 'import torch; print("torch", torch.__version__)'), FSDP2 over: $backends, BIND=$BIND"
start=$(date +%s)

if [ "$CHECK_STEPS" -gt 0 ]; then
    echo
    echo "## 0. losses: FSDP2 against DDP (PyTorch, the same script), $WORLD ranks, model: defaults$PY_MODEL, $CHECK_STEPS steps"
    echo
    # shellcheck disable=SC2086
    PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} LIBDDP_BUILD_DIR=$BUILD_ABS \
        "$PY" bench/gpt_pytorch.py --backend gloo --world "$WORLD" $PY_MODEL --warmup 0 \
        --steps "$CHECK_STEPS" --print-losses >"$OUT/loss.ddp" 2>"$OUT/err" ||
        { echo "bench: DDP's losses failed:" >&2; why; exit 1; }
    # shellcheck disable=SC2086
    PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} LIBDDP_BUILD_DIR=$BUILD_ABS \
        "$PY" bench/gpt_pytorch.py --fsdp2 --backend $backends --world "$WORLD" $PY_MODEL \
        --warmup 0 --steps "$CHECK_STEPS" --print-losses >"$OUT/loss.fsdp2" 2>"$OUT/err" ||
        { echo "bench: FSDP2's losses failed:" >&2; why; exit 1; }
    "$PY" - "$OUT/loss.ddp" "$OUT/loss.fsdp2" "$backends" <<'PY'
import sys
def runs(path):
    """The --print-losses lines of each run in the file (one run per JSON line that ends it)."""
    out, cur = [], []
    for line in open(path):
        if line.startswith("step "):
            cur.append(float(line.split()[3]))
        elif line.startswith("{"):
            out.append(cur)
            cur = []
    return out
ddp = runs(sys.argv[1])[0]
fsdp = runs(sys.argv[2])
names = ["FSDP2 " + b for b in sys.argv[3].split()]
print("| step | DDP gloo | " + " | ".join(names) + " |")
print("|---|---|" + "---|" * len(names))
for s, v in enumerate(ddp):
    print("| %d | %.9g | %s |" % (s, v, " | ".join("%.9g" % f[s] for f in fsdp)))
for name, f in zip(names, fsdp):
    d = [abs(a - b) for a, b in zip(f, ddp)]
    k = max(range(len(d)), key=d.__getitem__)
    print("- %s - DDP gloo: largest |difference| %.3g (relative %.3g) at step %d; %d of %d steps equal" % (
        name, d[k], d[k] / abs(ddp[k]), k, sum(x == 0 for x in d), len(d)))
PY
fi

echo
echo "## A. tokens/s on $WORLD ranks, model: defaults$MODEL, $WARM + $STEPS steps (the median of the last $STEPS), $REPEATS repeats interleaved"
echo
r=1
while [ "$r" -le "$REPEATS" ]; do
    t0=$(date +%s)
    # shellcheck disable=SC2086
    gpt "a$r" "$WORLD" $MODEL --zero 3 --steps $((WARM + STEPS)) --bench-warmup "$WARM"
    for b in $backends; do
        # shellcheck disable=SC2086
        fsdp2 "a$r" --fsdp2 --backend "$b" --world "$WORLD" $PY_MODEL --warmup "$WARM" --steps "$STEPS"
    done
    echo "# repeat $r/$REPEATS took $(($(date +%s) - t0)) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    r=$((r + 1))
done

if [ -n "$MEM_RANKS" ]; then
    echo
    echo "## B. model state per rank, $MEM_MODEL (other flags: defaults), after 2 steps"
    # shellcheck disable=SC2086
    for n in $MEM_RANKS; do gpt "b" "$n" $MEM_MODEL --zero 3 --steps 2 --bench-warmup 0; done
    # shellcheck disable=SC2086
    fsdp2 "b" --fsdp2 --backend $backends --world $MEM_RANKS $PY_MEM_MODEL --warmup 0 --steps 2
fi

echo
"$PY" - "$OUT/runs" "$REPEATS" "$backends" "$MEM_RANKS" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
repeats, backends = int(sys.argv[2]), sys.argv[3].split()
mem_ranks = [int(n) for n in sys.argv[4].split()]
def find(tag, impl, world, backend=None):
    for r in runs:
        if r["tag"] == tag and r["impl"] == impl and r["world_size"] == world and \
                (backend is None or r.get("backend") == backend):
            return r
    return None

world = next((r["world_size"] for r in runs if r["tag"].startswith("a")), None)
print("### A. tokens/s\n")
cols = ["build/gpt --zero 3"] + ["FSDP2 " + b for b in backends]
ratio_names = ["gpt / FSDP2 " + b for b in backends] + (["FSDP2 ddp / FSDP2 gloo"] if len(backends) > 1 else [])
print("| repeat | " + " | ".join(cols + ratio_names) + " |")
print("|---|" + "---|" * (len(cols) + len(ratio_names)))
ratios = {k: [] for k in ratio_names}
for rep in range(1, repeats + 1):
    tag = "a%d" % rep
    g = find(tag, "libddp-gpt", world)
    fs = [find(tag, "pytorch-fsdp2", world, b) for b in backends]
    tps = [x["tokens_per_sec"] if x else float("nan") for x in [g] + fs]
    row = [tps[0] / t for t in tps[1:]] + ([tps[2] / tps[1]] if len(backends) > 1 else [])
    for k, v in zip(ratio_names, row):
        if v == v:
            ratios[k].append(v)
    print("| %d | %s | %s |" % (rep, " | ".join("%.0f" % t for t in tps), " | ".join("%.3f" % v for v in row)))
print()
for k, v in ratios.items():
    if v:
        v = sorted(v)
        print("- %s tokens/s: min %.3f, median %.3f, max %.3f (%d repeats)" % (k, v[0], statistics.median(v), v[-1], len(v)))

print("\n### B. model state per rank (MiB; the rank with the most)\n")
if not mem_ranks:
    print("(skipped: MEM_RANKS is empty)")
    sys.exit(0)
print("| ranks | implementation | parameters | gradients | optimizer | sharded: params + grads + optimizer | the same x ranks | local shards without padding | gathered peak | unit gradients peak | model state (ledger) | peak RSS |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in mem_ranks:
    g = find("b", "libddp-gpt", n)
    if g:
        m = max(g["memory_mib"], key=lambda x: x["total"])
        s = m["params"] + m["grads"] + m["optimizer"]
        print("| %d | build/gpt --zero 3 | %.3f | %.3f | %.3f | %.3f | %.1f | - | %.3f | %.3f | %.3f | %.1f |" % (
            n, m["params"], m["grads"], m["optimizer"], s, s * n, m["gathered_peak"],
            m["unit_grads_peak"], m["total"], max(g["peak_rss_mib"])))
    else:
        print("| %d | build/gpt --zero 3 | failed |" % n)
    for b in backends:
        f = find("b", "pytorch-fsdp2", n, b)
        if not f:
            print("| %d | FSDP2 %s | failed |" % (n, b))
            continue
        k = max(range(n), key=lambda q: f["state_held_mib"][q]["total"])
        h, o = f["state_held_mib"][k], f["state_mib"][k]
        print("| %d | FSDP2 %s | %.3f | %.3f | %.3f | %.3f | %.1f | %.3f | - | - | - | %.1f |" % (
            n, b, h["params"], h["grads"], h["optimizer"], h["total"], h["total"] * n,
            o["total"], max(f["peak_rss_mib"])))
PY
echo
echo "# took $(($(date +%s) - start)) s; load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
