#!/bin/sh
# The example trainer of two builds, interleaved A B A B ..., 2 ranks on synthetic data: the
# "no regression" check of a refactor (this machine's speed moves 2x within minutes, so only
# interleaved pairs compare). Each run prints rank 0's JSON line (step_ms_median,
# exposed_comm_ms_median = finalize's wait, nosync_exposed_ms = synchronised - no_sync step,
# final_loss, which must be equal when the change keeps the bits).
#   sh bench/trainer_ab.sh BUILD_A BUILD_B [PAIRS HIDDEN GLOBAL_BATCH STEPS]
#   (defaults 8 1024 128 60; DDP_TRANSPORT=tcp to force the tcp transport)
#   e.g. git worktree add /tmp/before <commit>, build it there, then
#   sh bench/trainer_ab.sh /tmp/before/build build
set -u
A=$1 B=$2 PAIRS=${3:-8} H=${4:-1024} GB=${5:-128} STEPS=${6:-60} WARM=5
for d in "$A" "$B"; do
    [ -x "$d/fashion-mnist" ] && [ -x "$d/ddprun" ] ||
        { echo "trainer_ab: $d lacks fashion-mnist or ddprun (build first)" >&2; exit 1; }
done
export OPENBLAS_NUM_THREADS=1
run() {
    steps=$((WARM + 2 * STEPS))
    "$1/ddprun" -n 2 "$1/fashion-mnist" --synthetic $((GB * steps)) --hidden "$H" --batch "$GB" \
        --optim sgd --lr 0.01 --epochs 1000000 --max-steps "$steps" --warmup "$WARM" --json \
        --bench-nosync | sed -n 's/^\[0\] {/{/p'
}
echo "# trainer A/B: A=$A B=$B; hidden $H, global batch $GB, 2 ranks, $STEPS timed steps" \
    "twice (sync, no_sync) after $WARM, $PAIRS pairs, DDP_TRANSPORT=${DDP_TRANSPORT:-auto};" \
    "$(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)"
i=1
while [ "$i" -le "$PAIRS" ]; do
    printf 'A %d ' "$i"; run "$A"
    printf 'B %d ' "$i"; run "$B"
    i=$((i + 1))
done
