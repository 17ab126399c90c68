#!/bin/sh
# Two libddp builds side by side over a range of sizes, alternating in one invocation (the VM
# changes speed within minutes, so only runs side by side compare):
#
#   bench/builds_ab.sh BASE_BUILD NEW_BUILD OUT
#
# Environment: RANKS (2), REPS (3), OPS (allgather alltoall allreduce broadcast reduce_scatter),
# DTYPES (f32), MIN (2K), MAX (64K), FACTOR (2), EXTRA (more ddp-bench options). Each repetition
# runs every op and dtype with BASE then NEW; OUT gets one line per run and size ("base|new
# op-dtype bytes time_us"), and the summary per op and size: the median [min-max] time of each
# build, new/base of the medians, and new/base per repetition.
set -eu
BASE=${1:?usage: builds_ab.sh BASE_BUILD NEW_BUILD OUT}
NEW=${2:?usage: builds_ab.sh BASE_BUILD NEW_BUILD OUT}
OUT=${3:?usage: builds_ab.sh BASE_BUILD NEW_BUILD OUT}
: >"$OUT"
rep=1
while [ "$rep" -le "${REPS:-3}" ]; do
    for op in ${OPS:-allgather alltoall allreduce broadcast reduce_scatter}; do
        for d in ${DTYPES:-f32}; do
            for v in base new; do
                b=$BASE
                [ "$v" = new ] && b=$NEW
                # shellcheck disable=SC2086
                "$b/ddprun" -n "${RANKS:-2}" --no-prefix "$b/ddp-bench" -o "$op" -d "$d" \
                    -b "${MIN:-2K}" -e "${MAX:-64K}" -f "${FACTOR:-2}" --rounds 5 ${EXTRA:-} |
                    awk -v op="$op" -v v="$v" -v d="$d" \
                        '$1 ~ /^[0-9]+$/ {printf "%s %s-%s %s %s\n", v, op, d, $1, $5}' >>"$OUT"
            done
        done
    done
    rep=$((rep + 1))
done
python3 - "$OUT" <<'PY'
import collections, statistics as st, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    v, op, size, t = line.split()
    runs[(op, int(size), v)].append(float(t))
for op, size in sorted({(k[0], k[1]) for k in runs}):
    b, n = runs[(op, size, "base")], runs[(op, size, "new")]
    print(f"{op:20s}{size:10d}  base {st.median(b):8.2f} [{min(b):.2f}-{max(b):.2f}]"
          f"  new {st.median(n):8.2f} [{min(n):.2f}-{max(n):.2f}]"
          f"  x{st.median(n) / st.median(b):.3f}  per-rep "
          + " ".join(f"{y / x:.2f}" for x, y in zip(b, n)))
PY
