#!/bin/sh
# bench/zero3_gpt.sh [REPEATS] [STEPS]: ZeRO-3 (FSDP) in the GPT trainer (issue #28).
#   A. tokens/s of --zero 3 against plain data parallelism and --zero 1 (and --zero 2) on
#      WORLD ranks (2), the default model, interleaved per repeat (plain, zero 1, zero 2, zero 3
#      back to back, so the machine's drifting speed hits them alike); per-repeat ratios and
#      their min-median-max. tokens/s is the trainer's --json figure: global tokens over the
#      slowest rank's median step after --bench-warmup steps.
#   B. model state per rank (parameters, gradients, optimizer state, gathered peak; exact byte
#      counts from the trainer's ledger, not timings) at 1, 2 and 4 ranks for --zero 0-3, on a
#      larger model (MEM_MODEL).
#   C. --mem-budget BUDGET_MIB with that model: plain on 1 rank, then --zero 1, 2 and 3 on 4
#      ranks: which fit, which are refused.
# Environment: BUILD (build), WORLD (2), MODEL (default model flags: none), MEM_MODEL
# ("--layers 8 --heads 8 --channels 256"), BUDGET_MIB (48).
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPEATS=${1:-5}
STEPS=${2:-30}
WARM=${WARM:-5}
WORLD=${WORLD:-2}
MODEL=${MODEL:-}
MEM_MODEL=${MEM_MODEL:---layers 8 --heads 8 --channels 256}
BUDGET_MIB=${BUDGET_MIB:-48}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/zero3_gpt.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
common="--eval-every 0 --eval-batches 1 --samples 0 --no-progress --json"

# json N FILE ARGS...: runs the trainer on N ranks, its JSON line into FILE (empty on failure;
# the error into FILE.err)
json() {
    n=$1
    f=$2
    shift 2
    # shellcheck disable=SC2086
    if OPENBLAS_NUM_THREADS=1 "$BUILD/ddprun" -n "$n" "$BUILD/gpt" $common "$@" >"$f.out" 2>"$f.err"; then
        sed -n 's/^\(\[0\] \)\{0,1\}\({.*}\)$/\2/p' "$f.out" | tail -1 >"$f"
    else
        : >"$f"
    fi
}

echo "# bench/zero3_gpt.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
echo
echo "## A. tokens/s on $WORLD ranks, model: defaults$MODEL, $STEPS steps (median after $WARM), $REPEATS repeats interleaved"
echo
echo "| repeat | plain | --zero 1 | --zero 2 | --zero 3 | zero3/plain | zero3/zero1 |"
echo "|---|---|---|---|---|---|---|"
r=1
while [ "$r" -le "$REPEATS" ]; do
    for z in 0 1 2 3; do
        # shellcheck disable=SC2086
        json "$WORLD" "$OUT/a$r.$z" $MODEL --steps "$STEPS" --bench-warmup "$WARM" --zero "$z"
    done
    python3 - "$OUT" "$r" <<'PY'
import json, sys
out, r = sys.argv[1], sys.argv[2]
tps = []
for z in range(4):
    try:
        tps.append(json.loads(open(f"{out}/a{r}.{z}").read())["tokens_per_sec"])
    except Exception:
        tps.append(float("nan"))
print("| %s | %.0f | %.0f | %.0f | %.0f | %.3f | %.3f |" % (r, *tps, tps[3] / tps[0], tps[3] / tps[1]))
with open(f"{out}/ratios", "a") as f:
    f.write("%r %r %r\n" % (tps[3] / tps[0], tps[3] / tps[1], tps[2] / tps[0]))
PY
    r=$((r + 1))
done
python3 - "$OUT/ratios" <<'PY'
import sys, statistics
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
for k, name in enumerate(["--zero 3 / plain", "--zero 3 / --zero 1", "--zero 2 / plain"]):
    v = sorted(x[k] for x in rows)
    print("- %s tokens/s: min %.3f, median %.3f, max %.3f (%d repeats)" % (name, v[0], statistics.median(v), v[-1], len(v)))
PY

echo
echo "## B. model state per rank (MiB; the rank with the most), $MEM_MODEL (other flags: defaults)"
echo
echo "| ranks | --zero | parameters | gradients | optimizer | gathered peak | unit gradients peak | model state | (params + grads + optimizer) x ranks |"
echo "|---|---|---|---|---|---|---|---|---|"
for n in 1 2 4; do
    for z in 0 1 2 3; do
        # shellcheck disable=SC2086
        json "$n" "$OUT/b$n.$z" $MEM_MODEL --steps 2 --bench-warmup 0 --zero "$z"
        python3 - "$OUT/b$n.$z" "$n" "$z" <<'PY'
import json, sys
path, n, z = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    m = json.loads(open(path).read())["memory_mib"]
except Exception:
    print("| %d | %s | failed: %s |" % (n, z, open(path + ".err").read().strip()[-200:]))
    sys.exit(0)
worst = max(m, key=lambda r: r["total"])
sharded = (worst["params"] + worst["grads"] + worst["optimizer"]) * n
print("| %d | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f |" % (n, z, worst["params"], worst["grads"], worst["optimizer"], worst["gathered_peak"], worst["unit_grads_peak"], worst["total"], sharded))
PY
    done
done

echo
echo "## C. --mem-budget $BUDGET_MIB MiB, $MEM_MODEL"
echo
for spec in 1:0 4:1 4:2 4:3; do
    n=${spec%:*}
    z=${spec#*:}
    # shellcheck disable=SC2086
    json "$n" "$OUT/c$n.$z" $MEM_MODEL --steps 4 --bench-warmup 0 --zero "$z" --mem-budget "$BUDGET_MIB"
    if [ -s "$OUT/c$n.$z" ]; then
        python3 - "$OUT/c$n.$z" "$n" "$z" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read())
print("- %s rank(s), --zero %s: trained %d steps, final loss %.4f, model state per rank %s MiB, %.0f tokens/s" % (
    sys.argv[2], sys.argv[3], r["steps"], r["final_loss"],
    "/".join("%.1f" % m["total"] for m in r["memory_mib"]), r["wall_tokens_per_sec"]))
PY
    else
        echo "- $n rank(s), --zero $z: refused: $(grep -o 'error: .*' "$OUT/c$n.$z.err" | head -1 | cut -c8-)"
    fi
done
