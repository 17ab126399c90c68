#!/bin/sh
# End-to-end checks of build/gpt, run by ctest: test_gpt.sh CASE GPT DDPRUN
#   worlds      1, 2, 3 and 4 ranks with the same global batch (12 sequences): the same global loss
#               per step (<= 1e-5 relative, 20 steps), bitwise identical parameters on every rank,
#               and the loss falls
#   accumulate  --accumulate 2 with batch 6 equals batch 12 (1e-5); --zero 1 equals the plain
#               optimizer (1e-5) with one parameter checksum over ranks; --param-dtype bf16 agrees
#               on 1 and 3 ranks and differs from f32
#   resume      a run stopped after step 8 (--checkpoint, --stop-at) and continued with
#               --resume auto ends bitwise equal to an uninterrupted one, with the same losses
#               for steps 9-20; the same under --zero 1 (consolidated state) and with bf16
#               parameters; under ddprun --max-restarts 1 a rank killed after step 14
#               restarts the job from the step-12 checkpoint, ending bitwise equal; --resume auto
#               without a file starts fresh; a checkpoint of other hyperparameters is refused,
#               naming the field; a corrupted one is refused
#   blocks      --grad-blocks 4 (each block matrix's row tiles handed to the Reducer as computed,
#               pieces of 64 KiB, and of 1 KiB) gives the same bits as whole tensors on 2 and 3
#               ranks, with --accumulate 2 and --zero 1 too; --grad-blocks 3 is refused
#   errors      missing data names the `fortunes` package; a batch not divisible by the world
#               size and channels not divisible by heads are refused, naming the option
#   bench       --bench-nosync --json --profile on 2 ranks (bench/gpt_vs_pytorch.sh's run): the
#               JSON line parses, counts the synchronised steps, its tokens/s is the global
#               tokens over the median step, a peak RSS per rank, every phase timed; the no_sync
#               steps really skip communication (the ranks end with different parameters, and
#               the first no_sync step's loss is rank 0's own, not the average); the warm-up
#               and first timed steps are synchronised (losses equal a plain run's); refused
#               with --zero 1 and with --checkpoint
#   compare     bench/gpt_vs_pytorch.sh on a tiny model (1 repeat, 2 timed steps): its table has
#               a row per implementation and world size with numbers, and the targets' ratios;
#               without torch only build/gpt's rows (the script says why)
#   fsdp2       bench/zero3_vs_fsdp2.sh on a tiny model (1 repeat, 2 timed steps; python3 on PATH
#               with torch >= 2.4, else skipped): FSDP2's losses equal PyTorch DDP's to 1e-6
#               relative over 4 steps; a tokens/s row for build/gpt --zero 3 and FSDP2 with their
#               ratios; model state rows at 1, 2 and 4 ranks for both, the two sides' parameter,
#               gradient and optimizer bytes equal at 1 rank (the same model), each side's sharded
#               sum x ranks equal at 1, 2 and 4 ranks (it falls as 1/N), no failed run
#   zero3       --zero 3 (FSDP) on 1-4 ranks and --zero 2 on 3 ranks give plain training's
#               losses (1e-5), one checksum over ranks; --zero 3 --accumulate 2; bf16 under
#               --zero 2 equals --zero 1's; memory per rank at 4 ranks is a quarter of 1 rank's
#               (parameters, gradient shards, optimizer state); --mem-budget refuses the plain run on 1 rank
#               and fits --zero 3 on 4; unsupported combinations refused by name
#   zero3resume --zero 3 stopped and resumed (--resume auto) = uninterrupted, bitwise; a rank
#               killed under --max-restarts 1 restarts from the checkpoint, bitwise; the
#               checkpoint continues on 4 ranks and without ZeRO on 1 (losses within 1e-5)
#   progress    under a pseudo-terminal (script(1)) rank 0 draws a \r progress bar (step,
#               loss, tokens/s, ETA), also under ddprun -n 2 and never from rank 1 (not even
#               with --no-prefix, when every rank has the terminal); into a
#               pipe, and with --no-progress, not one \r
# A tiny model (2 layers, 32 channels, context 16) keeps each case a few seconds.
set -u
CASE=$1
GPT=$2
DDPRUN=$3
WORK=$(mktemp -d "${TMPDIR:-/tmp}/test_gpt.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FAILED=0
TINY="--layers 2 --heads 2 --channels 32 --context 16 --steps 20 --warmup 5 --lr 3e-3
      --eval-every 0 --eval-batches 2 --samples 0 --print-losses"

if [ ! -d /usr/share/games/fortunes ]; then
    echo "SKIP: the fortunes package is not installed (apt-get install fortunes)" >&2
    exit 77
fi

fail() {
    echo "FAIL: $*" >&2
    FAILED=1
}

# run N OUT ARGS...: the trainer on N ranks; output without ddprun's prefixes in $WORK/OUT.
run() {
    n=$1
    out=$2
    shift 2
    "$DDPRUN" -n "$n" "$GPT" "$@" >"$WORK/raw" 2>"$WORK/err"
    RC=$?
    sed 's/^\[[0-9]*\] //' "$WORK/raw" >"$WORK/$out"
    if [ "$RC" != 0 ]; then
        echo "--- gpt on $n rank(s) exited $RC: $*" >&2
        cat "$WORK/err" >&2
    fi
}

losses() { grep '^step [0-9]* loss ' "$WORK/$1" | awk '{ print $4 }'; }
checksums() { grep '^rank [0-9]* params fnv ' "$WORK/$1" | awk '{ print $5 }' | sort -u; }

# same_losses A B WHAT [TOL]: both 20 losses, each pair within TOL (1e-5) relative
same_losses() {
    losses "$1" >"$WORK/a"
    losses "$2" >"$WORK/b"
    if ! awk -v tol="${4:-1e-5}" 'NR == FNR { a[FNR] = $1; n = FNR; next }
        { m = FNR; d = (a[FNR] - $1) / $1; if (d < 0) d = -d; if (d > tol) { bad = 1;
          printf "step %d: %s vs %s\n", FNR, a[FNR], $1 } }
        END { if (n != m || n != 20) { printf "%d vs %d steps\n", n, m; exit 1 } exit bad }' \
        "$WORK/a" "$WORK/b" >&2; then
        fail "$3: losses differ"
    fi
}

# one_checksum OUT N: N ranks printed a checksum, all the same
one_checksum() {
    c=$(grep -c '^rank [0-9]* params fnv ' "$WORK/$1")
    [ "$c" = "$2" ] || fail "$1: $c parameter checksums, expected $2"
    [ "$(checksums "$1" | wc -l)" = 1 ] || fail "$1: ranks end with different parameters"
}

case $CASE in
worlds)
    for n in 1 2 3 4; do
        run $n w$n $TINY --batch 12
        [ "$RC" = 0 ] || fail "$n ranks exited $RC"
        one_checksum w$n $n
    done
    for n in 2 3 4; do same_losses w1 w$n "1 vs $n ranks"; done
    first=$(losses w1 | head -1)
    last=$(losses w1 | tail -1)
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' ||
        fail "the loss did not fall: $first -> $last"
    ;;
accumulate)
    run 2 big $TINY --batch 12
    run 2 acc $TINY --batch 6 --accumulate 2
    [ "$RC" = 0 ] || fail "--accumulate 2 exited $RC"
    same_losses big acc "--accumulate 2 x 6 vs batch 12"
    run 3 zero $TINY --batch 12 --zero 1
    [ "$RC" = 0 ] || fail "--zero 1 exited $RC"
    one_checksum zero 3
    same_losses big zero "--zero 1 on 3 ranks vs plain on 2"
    run 1 bf1 $TINY --batch 12 --param-dtype bf16
    run 3 bf3 $TINY --batch 12 --param-dtype bf16
    [ "$RC" = 0 ] || fail "--param-dtype bf16 exited $RC"
    one_checksum bf3 3
    same_losses bf1 bf3 "bf16 parameters on 1 vs 3 ranks"
    losses big >"$WORK/a"
    losses bf3 >"$WORK/b"
    cmp -s "$WORK/a" "$WORK/b" && fail "--param-dtype bf16 changed nothing"
    ;;
resume)
    for z in 0 1 2; do
        # 2: ZeRO-1 with bf16 parameters (f32 masters in the saved optimizer state)
        v="--zero $z"
        [ $z = 2 ] && v="--zero 1 --param-dtype bf16"
        run 2 full$z $TINY --batch 12 $v
        rm -f "$WORK/ck"
        run 2 part$z $TINY --batch 12 $v --checkpoint "$WORK/ck" --resume auto --stop-at 8
        [ "$RC" = 0 ] && [ -f "$WORK/ck" ] || fail "zero $z: the stopped run wrote no checkpoint"
        [ "$(losses part$z | wc -l)" = 8 ] || fail "zero $z: the stopped run did not stop at 8"
        run 2 rest$z $TINY --batch 12 $v --checkpoint "$WORK/ck" --resume auto
        [ "$RC" = 0 ] || fail "zero $z: the resumed run exited $RC"
        grep -q "resumed from $WORK/ck after step 8" "$WORK/rest$z" || fail "zero $z: not resumed"
        one_checksum rest$z 2
        [ "$(checksums rest$z)" = "$(checksums full$z)" ] ||
            fail "zero $z: resumed parameters differ from the uninterrupted run's"
        losses full$z | tail -12 >"$WORK/a"
        losses rest$z >"$WORK/b"
        cmp -s "$WORK/a" "$WORK/b" || fail "zero $z: losses after the resume differ"
    done
    # ddprun --max-restarts 1: rank 1 dies after step 14; the restarted job continues from the
    # --save-every 4 checkpoint of step 12 and ends bitwise equal to the uninterrupted run
    rm -f "$WORK/ck2"
    GPT_TEST_KILL_AT_STEP=14 "$DDPRUN" -n 2 --max-restarts 1 "$GPT" $TINY --batch 12 \
        --checkpoint "$WORK/ck2" --save-every 4 --resume auto >"$WORK/raw" 2>"$WORK/err"
    RC=$?
    sed 's/^\[[0-9]*\] //' "$WORK/raw" >"$WORK/job"
    [ "$RC" = 0 ] || { fail "--max-restarts 1: exit $RC"; cat "$WORK/err" >&2; }
    grep -q 'killed by signal 9' "$WORK/err" || fail "rank 1 was not killed"
    grep -q 'starting fresh (restart 0)' "$WORK/job" || fail "the first attempt did not start fresh"
    grep -q "resumed from $WORK/ck2 after step 12 (restart 1)" "$WORK/job" ||
        fail "the restart did not continue from step 12"
    [ "$(checksums job)" = "$(checksums full0)" ] ||
        fail "restarted job: parameters differ from the uninterrupted run's"
    # the last checkpoint is the bf16 run's
    run 2 dtype $TINY --batch 12 --zero 1 --resume "$WORK/ck"
    [ "$RC" != 0 ] && grep -q "written with param-dtype bf16 1, this run has 0" "$WORK/err" ||
        fail "a bf16 checkpoint resumed into f32 was not refused by name"
    run 2 lr $TINY --batch 12 $v --lr 1e-3 --resume "$WORK/ck"
    [ "$RC" != 0 ] && grep -q "written with lr 0.003, this run has 0.001" "$WORK/err" ||
        fail "a checkpoint of another lr was not refused by name"
    printf 'X' | dd of="$WORK/ck" bs=1 seek=200 conv=notrunc 2>/dev/null
    run 2 bad $TINY --batch 12 $v --resume "$WORK/ck"
    [ "$RC" != 0 ] && grep -q "is corrupt" "$WORK/err" || fail "a corrupted checkpoint was accepted"
    ;;
blocks)
    for n in 2 3; do
        for extra in "" "--accumulate 2 --batch 6" "--zero 1"; do
            # shellcheck disable=SC2086
            run $n whole $TINY --batch 12 $extra
            for piece in "" "--piece-kb 1"; do
                # shellcheck disable=SC2086
                run $n rows $TINY --batch 12 $extra --grad-blocks 4 $piece
                [ "$RC" = 0 ] || fail "$n ranks, --grad-blocks 4 $extra $piece: exit $RC"
                one_checksum rows $n
                [ "$(checksums rows)" = "$(checksums whole)" ] ||
                    fail "$n ranks $extra $piece: row tiles changed the parameters"
                losses whole >"$WORK/a"
                losses rows >"$WORK/b"
                cmp -s "$WORK/a" "$WORK/b" || fail "$n ranks $extra $piece: losses differ"
            done
        done
    done
    "$GPT" $TINY --grad-blocks 3 >"$WORK/out" 2>"$WORK/err"
    [ $? != 0 ] && grep -q -- "--grad-blocks: 3 is not 1 or 4" "$WORK/err" ||
        fail "--grad-blocks 3 was not refused by name"
    ;;
errors)
    "$GPT" $TINY --data "$WORK/none" >"$WORK/out" 2>"$WORK/err"
    [ $? != 0 ] || fail "missing data: exit 0"
    grep -q "fortunes" "$WORK/err" && grep -q "$WORK/none" "$WORK/err" ||
        fail "missing data: the message does not name the package and directory: $(cat "$WORK/err")"
    run 2 e1 $TINY --batch 5
    [ "$RC" != 0 ] && grep -q -- "--batch 5 is not divisible by the world size 2" "$WORK/err" ||
        fail "an indivisible batch was not refused by name"
    "$GPT" $TINY --channels 30 --heads 4 >"$WORK/out" 2>"$WORK/err"
    [ $? != 0 ] && grep -q -- "--channels 30 is not a multiple of --heads 4" "$WORK/err" ||
        fail "channels % heads was not refused by name"
    ;;
zero3)
    # ZeRO-2 and ZeRO-3 (FSDP) against plain data parallelism: the same losses (1e-5 relative)
    # at 1-4 ranks, one parameter checksum over the ranks of each run
    run 1 plain1 $TINY --batch 12
    for n in 1 2 3 4; do
        run $n z3_$n $TINY --batch 12 --zero 3
        [ "$RC" = 0 ] || fail "--zero 3 on $n ranks exited $RC"
        one_checksum z3_$n $n
        same_losses plain1 z3_$n "--zero 3 on $n ranks vs plain on 1"
    done
    run 3 z2 $TINY --batch 12 --zero 2
    [ "$RC" = 0 ] || fail "--zero 2 exited $RC"
    one_checksum z2 3
    same_losses plain1 z2 "--zero 2 on 3 ranks vs plain on 1"
    run 2 z2bf $TINY --batch 12 --zero 2 --param-dtype bf16
    run 2 z1bf $TINY --batch 12 --zero 1 --param-dtype bf16
    [ "$RC" = 0 ] || fail "--zero 2 --param-dtype bf16 exited $RC"
    one_checksum z2bf 2
    # ZeRO-1 averages f32 gradients and rounds them to bf16 once; ZeRO-2 reduce-scatters bf16
    # gradients (rounded before and after the sum): equal to bf16 precision, not 1e-5
    same_losses z1bf z2bf "--zero 2 vs --zero 1 with bf16 parameters" 1e-3
    losses z2 >"$WORK/a"
    losses z2bf >"$WORK/b"
    cmp -s "$WORK/a" "$WORK/b" && fail "--zero 2 --param-dtype bf16 changed nothing"
    run 2 z3acc $TINY --batch 6 --accumulate 2 --zero 3
    [ "$RC" = 0 ] || fail "--zero 3 --accumulate 2 exited $RC"
    one_checksum z3acc 2
    same_losses plain1 z3acc "--zero 3 --accumulate 2 x 6 vs batch 12"
    # memory per rank: the sharded part (parameters, optimizer state) at 4 ranks is a quarter of
    # 1 rank's (to the padding of a few elements per unit); the gathered peak is reported
    python3 - "$WORK/z3_1" "$WORK/z3_4" <<'PY' || fail "--zero 3: memory per rank does not fall as 1/N"
import re, sys
def mem(path):
    rows = [l for l in open(path) if l.startswith("gpt: memory rank")]
    return [dict((k, float(v)) for k, v in re.findall(r"(parameters|gradients|optimizer state|gathered peak) ([0-9.]+)", l)) for l in rows]
one, four = mem(sys.argv[1]), mem(sys.argv[2])
assert len(one) == 1 and len(four) == 4, (one, four)
for r in four:
    for k in ("parameters", "gradients", "optimizer state"):
        assert abs(4 * r[k] - one[0][k]) <= 0.02 * one[0][k] + 0.004, (k, r[k], one[0][k])
    assert 0 < r["gathered peak"] <= one[0]["gathered peak"], r
PY
    # --mem-budget: the plain trainer on 1 rank is refused before training; --zero 3 on 4 ranks
    # fits the same budget and trains
    run 1 budget1 $TINY --batch 12 --mem-budget 0.45
    [ "$RC" != 0 ] && grep -q -- "--mem-budget 0.45 MiB: before training: this rank holds" "$WORK/err" ||
        fail "a model over --mem-budget was not refused by name"
    run 4 budget4 $TINY --batch 12 --mem-budget 0.45 --zero 3
    [ "$RC" = 0 ] || fail "--zero 3 on 4 ranks did not fit --mem-budget 0.45"
    # refused combinations, by name
    run 2 e $TINY --batch 12 --zero 4
    [ "$RC" != 0 ] && grep -q -- "--zero: 4 is not 0, 1, 2 or 3" "$WORK/err" || fail "--zero 4 accepted"
    run 2 e $TINY --batch 12 --zero 3 --param-dtype bf16
    [ "$RC" != 0 ] && grep -q -- "not with --zero 3" "$WORK/err" || fail "--zero 3 bf16 accepted"
    run 2 e $TINY --batch 12 --zero 2 --grad-blocks 4
    [ "$RC" != 0 ] && grep -q -- "--zero 2 has no Reducer" "$WORK/err" || fail "--zero 2 --grad-blocks 4 accepted"
    run 2 e $TINY --batch 12 --zero 3 --bench-nosync
    [ "$RC" != 0 ] && grep -q -- "not with --zero 3" "$WORK/err" || fail "--zero 3 --bench-nosync accepted"
    ;;
zero3resume)
    # --zero 3 stopped after step 8 and resumed = uninterrupted, bitwise; a kill under
    # --max-restarts restarts from the last checkpoint and ends bitwise equal; the checkpoint
    # (consolidated) resumes at another world size and under --zero 0
    run 2 full $TINY --batch 12 --zero 3
    rm -f "$WORK/ck"
    run 2 part $TINY --batch 12 --zero 3 --checkpoint "$WORK/ck" --resume auto --stop-at 8
    [ "$RC" = 0 ] && [ -f "$WORK/ck" ] || fail "the stopped --zero 3 run wrote no checkpoint"
    cp "$WORK/ck" "$WORK/ck8"
    run 2 rest $TINY --batch 12 --zero 3 --checkpoint "$WORK/ck" --resume auto
    [ "$RC" = 0 ] || fail "the resumed --zero 3 run exited $RC"
    grep -q "resumed from $WORK/ck after step 8" "$WORK/rest" || fail "--zero 3: not resumed"
    one_checksum rest 2
    [ "$(checksums rest)" = "$(checksums full)" ] ||
        fail "--zero 3: resumed parameters differ from the uninterrupted run's"
    losses full | tail -12 >"$WORK/a"
    losses rest >"$WORK/b"
    cmp -s "$WORK/a" "$WORK/b" || fail "--zero 3: losses after the resume differ"
    rm -f "$WORK/ck2"
    GPT_TEST_KILL_AT_STEP=14 "$DDPRUN" -n 2 --max-restarts 1 "$GPT" $TINY --batch 12 --zero 3 \
        --checkpoint "$WORK/ck2" --save-every 4 --resume auto >"$WORK/raw" 2>"$WORK/err"
    RC=$?
    sed 's/^\[[0-9]*\] //' "$WORK/raw" >"$WORK/job"
    [ "$RC" = 0 ] || { fail "--zero 3 --max-restarts 1: exit $RC"; cat "$WORK/err" >&2; }
    grep -q 'killed by signal 9' "$WORK/err" || fail "rank 1 was not killed"
    grep -q "resumed from $WORK/ck2 after step 12 (restart 1)" "$WORK/job" ||
        fail "--zero 3: the restart did not continue from step 12"
    [ "$(checksums job)" = "$(checksums full)" ] ||
        fail "--zero 3 restarted job: parameters differ from the uninterrupted run's"
    # resharded: the step-8 checkpoint of 2 ranks continued on 4 ranks, and without ZeRO on 1
    for spec in 4:3 1:0; do
        cp "$WORK/ck8" "$WORK/ckr"
        run "${spec%:*}" other $TINY --batch 12 --zero "${spec#*:}" --checkpoint "$WORK/ckr" \
            --resume auto
        [ "$RC" = 0 ] || fail "the --zero 3 checkpoint resumed on $spec: exit $RC"
        losses full | tail -12 >"$WORK/a"
        losses other >"$WORK/b"
        awk 'NR == FNR { a[FNR] = $1; n = FNR; next }
            { d = (a[FNR] - $1) / $1; if (d < 0) d = -d; if (d > 1e-5) bad = 1 }
            END { exit bad || n != 12 }' "$WORK/a" "$WORK/b" ||
            fail "the --zero 3 checkpoint resumed on $spec: losses differ"
    done
    ;;
bench)
    # 4 warm-up steps, then 8 synchronised and 8 no_sync steps alternating
    B="--bench-warmup 4 --bench-nosync --json"
    # shellcheck disable=SC2086
    run 2 b $TINY --batch 12 $B --profile
    [ "$RC" = 0 ] || fail "--bench-nosync --json --profile on 2 ranks: exit $RC"
    grep '^{' "$WORK/b" | tail -1 >"$WORK/json"
    python3 - "$WORK/json" <<'PY' || fail "the JSON line of --bench-nosync --json --profile is wrong"
import json, sys
r = json.loads(open(sys.argv[1]).read())
bad = []
def check(ok, what):
    if not ok:
        bad.append(what)
check(r["world_size"] == 2 and r["timed_steps"] == 8, "world %s, timed_steps %s (8)" % (r["world_size"], r["timed_steps"]))
check(r["step_ms_median"] > 0 and abs(r["tokens_per_sec"] - 12 * 16 * 1000.0 / r["step_ms_median"]) <= 0.01 * r["tokens_per_sec"],
      "tokens_per_sec %s is not 12 x 16 tokens / %s ms" % (r["tokens_per_sec"], r["step_ms_median"]))
check(r["nosync_step_ms_median"] > 0 and "nosync_exposed_ms" in r, "no no_sync median")
check(len(r["peak_rss_mib"]) == 2 and all(1 < x < 100000 for x in r["peak_rss_mib"]), "peak RSS %s" % r["peak_rss_mib"])
prof = r.get("profile_ms_per_step", {})
check(len(prof) == 9 and all(v > 0 for v in prof.values()), "profile %s" % prof)
for b in bad:
    print("json:", b, file=sys.stderr)
sys.exit(1 if bad else 0)
PY
    # no_sync steps apply each rank's own gradients: the ranks' parameters part
    [ "$(checksums b | wc -l)" = 2 ] || fail "--bench-nosync: the ranks end with the same parameters (no_sync steps communicated)"
    # shellcheck disable=SC2086
    run 2 plain $TINY --batch 12
    losses plain | head -5 >"$WORK/a"
    losses b | head -5 >"$WORK/b5"
    cmp -s "$WORK/a" "$WORK/b5" || fail "--bench-nosync: the warm-up and first timed steps are not the plain run's"
    [ "$(losses plain | sed -n 6p)" != "$(losses b | sed -n 6p)" ] ||
        fail "--bench-nosync: the first no_sync step's loss is the global one (the loss was averaged)"
    # shellcheck disable=SC2086
    "$GPT" $TINY $B >"$WORK/one" 2>"$WORK/err" || fail "--bench-nosync on 1 rank: exit $?"
    grep -q '"nosync_exposed_ms"' "$WORK/one" || fail "--bench-nosync on 1 rank: no no_sync figure"
    # shellcheck disable=SC2086
    run 2 z $TINY --batch 12 $B --zero 1
    [ "$RC" != 0 ] && grep -q -- "--bench-nosync: not with --zero 1" "$WORK/err" ||
        fail "--bench-nosync with --zero 1 was not refused by name"
    # shellcheck disable=SC2086
    "$GPT" $TINY $B --checkpoint "$WORK/ck" >"$WORK/out" 2>"$WORK/err"
    [ $? != 0 ] && grep -q -- "--bench-nosync: .*not with --checkpoint" "$WORK/err" ||
        fail "--bench-nosync with --checkpoint was not refused by name"
    ;;
compare)
    SRC=$(cd "$(dirname "$0")/.." && pwd)
    BUILD=$(cd "$(dirname "$GPT")" && pwd)
    REPS=1 STEPS=2 WARMUP=1 LAYERS=1 HEADS=2 CHANNELS=32 CONTEXT=16 BATCH=4 \
        sh "$SRC/bench/gpt_vs_pytorch.sh" "$BUILD" >"$WORK/cmp" 2>"$WORK/cmp.err" ||
        fail "gpt_vs_pytorch.sh: exit $?: $(cat "$WORK/cmp.err")"
    impls="gpt"
    if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
        impls="gpt pytorch+gloo"
        . "$SRC/bench/common.sh"
        bench_ddp_extension /usr/bin/python3 "$BUILD" && impls="$impls pytorch+ddp"
    fi
    for impl in $impls; do
        for n in 1 2; do
            # | impl | n | tokens/s [range] | step ms [range] | exposed [range] | wait | RSS per rank |
            grep -q "^| $impl | $n | [0-9][0-9]* \[[0-9-]*\] | [0-9.]* \[[0-9.-]*\] | -*[0-9.]* \[" "$WORK/cmp" ||
                fail "gpt_vs_pytorch.sh: no row for $impl on $n rank(s): $(cat "$WORK/cmp" "$WORK/cmp.err")"
        done
    done
    grep -q '^- gpt 2 ranks / 1 rank tokens/s: [0-9.]*x' "$WORK/cmp" || fail "gpt_vs_pytorch.sh: no scaling ratio"
    case $impls in
    *gloo*)
        grep -q '^- gpt / pytorch+gloo tokens/s, 1 rank: [0-9.]*x' "$WORK/cmp" &&
            grep -q '^- pytorch+gloo exposed comm / gpt exposed comm, 2 ranks: [0-9.]*x' "$WORK/cmp" ||
            fail "gpt_vs_pytorch.sh: no ratios against PyTorch" ;;
    esac
    ! grep -q "failed" "$WORK/cmp.err" || fail "gpt_vs_pytorch.sh: a run failed: $(cat "$WORK/cmp.err")"
    ;;
fsdp2)
    SRC=$(cd "$(dirname "$0")/.." && pwd)
    BUILD=$(cd "$(dirname "$GPT")" && pwd)
    PY=${PY:-python3}
    if ! "$PY" -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit((int(v[0]), int(v[1])) < (2, 4))' 2>/dev/null; then
        echo "SKIP: $PY has no torch >= 2.4 (FSDP2)" >&2
        exit 77
    fi
    tiny="--heads 2 --channels 32 --context 16 --batch 4"
    PY=$PY BUILD=$BUILD WARM=1 CHECK_STEPS=4 MODEL="--layers 1 $tiny" MEM_MODEL="--layers 2 $tiny" \
        sh "$SRC/bench/zero3_vs_fsdp2.sh" 1 2 >"$WORK/cmp" 2>"$WORK/cmp.err" ||
        fail "zero3_vs_fsdp2.sh: exit $?: $(cat "$WORK/cmp.err")"
    backends="gloo"
    . "$SRC/bench/common.sh"
    bench_ddp_extension "$PY" "$BUILD" && backends="gloo ddp"
    for b in $backends; do
        rel=$(sed -n "s/^- FSDP2 $b - DDP gloo: largest |difference| [^ ]* (relative \([^)]*\)).*/\1/p" "$WORK/cmp")
        [ -n "$rel" ] && awk -v r="$rel" 'BEGIN { exit !(r <= 1e-6) }' ||
            fail "zero3_vs_fsdp2.sh: FSDP2 over $b's losses are not DDP's (relative '$rel'): $(cat "$WORK/cmp")"
        grep -q "^- gpt / FSDP2 $b tokens/s: min [0-9.]*, median [0-9.]*, max [0-9.]* (1 repeats)" "$WORK/cmp" ||
            fail "zero3_vs_fsdp2.sh: no gpt / FSDP2 $b ratio: $(cat "$WORK/cmp")"
    done
    grep -q '^| 1 | [0-9][0-9]* | [0-9][0-9]* |' "$WORK/cmp" || fail "zero3_vs_fsdp2.sh: no tokens/s row"
    # B's rows: | ranks | impl | params | grads | optimizer | sum | ...
    awk -F' [|] ' -v backends="$backends" '
        /^[|] [124] [|] (build\/gpt --zero 3|FSDP2 [a-z]*) [|] [0-9]/ {
            n = substr($1, 3) + 0; impl = $2
            seen[impl, n] = 1
            if (n == 1) { p[impl] = $3; g[impl] = $4; o[impl] = $5 }
            total[impl, n] = $6 * n
        }
        function near(a, b, tol) { return a - b <= tol && b - a <= tol }
        END {
            nb = split(backends, bs, " ")
            impls[1] = "build/gpt --zero 3"
            for (i = 1; i <= nb; i++) impls[i + 1] = "FSDP2 " bs[i]
            for (i = 1; i <= nb + 1; i++) {
                for (n = 1; n <= 4; n *= 2) {
                    if (!seen[impls[i], n]) { print "no row for " impls[i] " on " n " rank(s)"; bad = 1 }
                    # the tiny model'"'"'s tensors divide by 4: no padding on either side;
                    # 0.01 MiB covers the printed rounding (0.0005 x 4)
                    else if (!near(total[impls[i], n], total[impls[i], 1], 0.01)) {
                        print impls[i] ": sharded sum x " n " ranks " total[impls[i], n] " is not 1 rank'"'"'s " total[impls[i], 1]; bad = 1
                    }
                }
                if (i > 1 && !(near(p[impls[i]], p[impls[1]], 0.002) && near(g[impls[i]], g[impls[1]], 0.002) && near(o[impls[i]], o[impls[1]], 0.002))) {
                    print impls[i] " at 1 rank holds " p[impls[i]] "/" g[impls[i]] "/" o[impls[i]] " MiB, build/gpt " p[impls[1]] "/" g[impls[1]] "/" o[impls[1]]; bad = 1
                }
            }
            exit bad
        }' "$WORK/cmp" >"$WORK/why" || fail "zero3_vs_fsdp2.sh's model state: $(cat "$WORK/why" "$WORK/cmp")"
    ! grep -q "failed" "$WORK/cmp.err" || fail "zero3_vs_fsdp2.sh: a run failed: $(cat "$WORK/cmp.err")"
    ;;
progress)
    if ! command -v script >/dev/null; then
        echo "SKIP: script(1) (util-linux/bsdutils) is needed for a pseudo-terminal" >&2
        exit 77
    fi
    P="--layers 2 --heads 2 --channels 32 --context 16 --steps 20 --warmup 5 --eval-every 0 --eval-batches 2 --samples 0"
    # in a pseudo-terminal: the bar, on one line redrawn with \r
    script -qec "$GPT $P" /dev/null >"$WORK/tty" 2>&1 || fail "gpt under script(1): exit $?"
    tr '\r' '\n' <"$WORK/tty" >"$WORK/tty.lines"
    grep -q '^\[#*\.*\] step 20/20  loss [0-9.]*  [0-9]* tokens/s  ETA [0-9:]*' "$WORK/tty.lines" ||
        fail "no progress bar on a terminal: $(head -c 600 "$WORK/tty")"
    grep -q '^gpt: 20 steps in' "$WORK/tty.lines" || fail "the summary line is not at the start of a line after the bar"
    script -qec "$GPT $P --no-progress" /dev/null >"$WORK/tty2" 2>&1
    ! grep -q 'ETA' "$WORK/tty2" && ! tr -d '\n' <"$WORK/tty2" | grep -q "$(printf '\r')\[" ||
        fail "--no-progress still draws the bar"
    # into a pipe: not one \r, so logs stay line-oriented
    "$GPT" $P | cat >"$WORK/pipe"
    grep -q '^gpt: 20 steps in' "$WORK/pipe" || fail "no summary into a pipe"
    ! grep -q "$(printf '\r')" "$WORK/pipe" || fail "a carriage return in the output to a pipe"
    # under ddprun: rank 0 has the terminal and draws; rank 1 never does
    script -qec "$DDPRUN -n 2 $GPT $P --batch 12" /dev/null >"$WORK/tty3" 2>&1 || fail "ddprun under script(1): exit $?"
    tr '\r' '\n' <"$WORK/tty3" >"$WORK/tty3.lines"
    grep -q '^\[#*\.*\] step 20/20 ' "$WORK/tty3.lines" || fail "no bar from rank 0 under ddprun"
    ! grep -q '^\[1\] \[[#.]' "$WORK/tty3.lines" || fail "rank 1 drew a bar"
    # --no-prefix: every rank writes to the terminal itself; still one bar (rank 0's)
    script -qec "$DDPRUN --no-prefix -n 2 $GPT $P --batch 12" /dev/null >"$WORK/tty4" 2>&1 ||
        fail "ddprun --no-prefix under script(1): exit $?"
    c=$(tr '\r' '\n' <"$WORK/tty4" | grep -c '^\[#*\.*\] step 20/20 ')
    [ "$c" = 1 ] || fail "ddprun --no-prefix: $c final bars (rank 0's alone expected)"
    ;;
*)
    echo "unknown case $CASE" >&2
    exit 2
    ;;
esac
exit $FAILED
