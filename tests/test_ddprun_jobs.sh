#!/bin/sh
# ddprun's job options, end to end: test_ddprun_jobs.sh DDPRUN
#   --max-restarts N: a failed attempt is stopped and started again with DDP_RESTART_COUNT and
#     TORCHELASTIC_RESTART_COUNT counting attempts, each with a fresh store; after N restarts the
#     failure ends the job with its status; --timeout and a signal to ddprun are never restarted;
#     multi-node is refused
#   --nproc-per-node auto (one worker per CPU of ddprun's affinity mask, taskset narrows it),
#   --standalone (and its refusals), --log-dir (per-rank files, restarts appended), --version
set -u
DDPRUN=$1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/test_ddprun_jobs.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FAILED=0
fail() {
    echo "FAIL: $*" >&2
    FAILED=1
}

# A worker that prints its attempt and store, and as rank 1 dies by SIGKILL on attempts below $1
# once rank 0 has printed its line (a file rank 0 writes after its echo: without it, a loaded
# machine can start rank 0's shell after rank 1's death and ddprun stops it before it prints).
worker() {
    cat <<SH
echo "attempt \$DDP_RESTART_COUNT \$TORCHELASTIC_RESTART_COUNT rank \$RANK store \$DDP_STORE_PORT"
[ "\$RANK" = 0 ] && : >"$WORK/printed.\$DDP_RESTART_COUNT"
if [ "\$RANK" = 1 ] && [ "\$DDP_RESTART_COUNT" -lt $1 ]; then
    n=0
    while [ ! -e "$WORK/printed.\$DDP_RESTART_COUNT" ] && [ \$n -lt 200 ]; do sleep 0.05; n=\$((n + 1)); done
    kill -9 \$\$
fi
sleep 0.2
SH
}

# Two failed attempts, then one that succeeds: exit 0 after exactly two restarts.
"$DDPRUN" -n 2 --max-restarts 2 --log-dir "$WORK/logs" sh -c "$(worker 2)" >"$WORK/out" 2>"$WORK/err"
rc=$?
[ "$rc" = 0 ] || { fail "--max-restarts 2 with two failures: exit $rc"; cat "$WORK/err" >&2; }
for a in 0 1 2; do
    for r in 0 1; do
        grep -q "^\[$r\] attempt $a $a rank $r " "$WORK/out" || fail "rank $r did not run attempt $a"
    done
done
[ "$(grep -c 'restarting the job' "$WORK/err")" = 2 ] || fail "expected two restarts"
[ "$(grep -c 'killed by signal 9' "$WORK/err")" = 2 ] || fail "expected two kills named"
# each attempt has a store of its own (the ranks of one attempt share it)
[ "$(sed -n 's/.*store \([0-9]*\)$/\1/p' "$WORK/out" | sort -u | wc -l)" = 3 ] ||
    fail "the attempts did not get three stores: $(cat "$WORK/out")"
for r in 0 1; do
    f="$WORK/logs/rank$r.log"
    [ -f "$f" ] || { fail "no $f"; continue; }
    [ "$(grep -c "^attempt [012] [012] rank $r " "$f")" = 3 ] || fail "$f lacks an attempt: $(cat "$f")"
    [ "$(grep -c '^=== ddprun: restart [12] of 2 ===$' "$f")" = 2 ] || fail "$f lacks restart lines"
    grep -q '^\[' "$f" && fail "$f has prefixed lines"
done

# Out of restarts: the last failure ends the job with the kill's status, after one restart.
"$DDPRUN" -n 2 --max-restarts 1 sh -c "$(worker 5)" >"$WORK/out" 2>"$WORK/err"
rc=$?
[ "$rc" = 137 ] || fail "--max-restarts 1 with endless failures: exit $rc, expected 137"
[ "$(grep -c 'restarting the job' "$WORK/err")" = 1 ] || fail "expected exactly one restart"
grep -q 'attempt 2' "$WORK/out" && fail "a third attempt ran"

# --timeout is final: no restart.
"$DDPRUN" -n 2 --max-restarts 3 --timeout 0.5 --grace 0.2 sh -c 'sleep 30' >"$WORK/out" 2>"$WORK/err"
rc=$?
[ "$rc" = 1 ] || fail "--timeout with --max-restarts: exit $rc"
grep -q 'restarting' "$WORK/err" && fail "a job stopped by --timeout was restarted"

# --timeout counts the whole job: endless quick failures with restarts left still end there.
start=$(date +%s)
"$DDPRUN" -n 2 --max-restarts 1000 --timeout 2 --grace 0.2 sh -c 'sleep 0.3; exit 3' >"$WORK/out" 2>"$WORK/err"
rc=$?
took=$(($(date +%s) - start))
[ "$rc" = 1 ] && grep -q 'ran past --timeout 2 s' "$WORK/err" || fail "restarts past --timeout: exit $rc: $(tail -3 "$WORK/err")"
grep -q 'restarting the job (restart 1 of 1000)' "$WORK/err" || fail "no restart before the timeout"
[ "$took" -le 10 ] || fail "--timeout 2 with restarts took $took s"

# A signal to ddprun is final too.
"$DDPRUN" -n 2 --max-restarts 3 --grace 0.5 sh -c 'echo up; sleep 30' >"$WORK/out" 2>"$WORK/err" &
pid=$!
for _ in $(seq 100); do [ "$(grep -c up "$WORK/out")" = 2 ] && break; sleep 0.05; done
kill -TERM "$pid"
wait "$pid"
rc=$?
[ "$rc" = 143 ] || fail "SIGTERM to ddprun with --max-restarts: exit $rc"
grep -q 'restarting' "$WORK/err" && fail "a job stopped by SIGTERM was restarted"

"$DDPRUN" -n 1 --max-restarts 1 --nnodes 2 --master-port 1 --token x true 2>"$WORK/err"
[ $? = 2 ] && grep -q 'one node only' "$WORK/err" || fail "--max-restarts with --nnodes 2"

# --nproc-per-node auto: one worker per CPU ddprun may use.
cpus=$(taskset -pc $$ 2>/dev/null | sed 's/.*: //')
want=$(nproc)
n=$("$DDPRUN" --nproc-per-node auto sh -c 'echo $WORLD_SIZE' | sed 's/^\[[0-9]*\] //' | sort -u)
[ "$n" = "$want" ] || fail "--nproc-per-node auto: WORLD_SIZE $n, nproc says $want"
if command -v taskset >/dev/null && [ -n "$cpus" ]; then
    first=$(printf '%s' "$cpus" | sed 's/[-,].*//')
    n=$(taskset -c "$first" "$DDPRUN" --nproc-per-node=auto sh -c 'echo $WORLD_SIZE' | sed 's/^\[[0-9]*\] //' | sort -u)
    [ "$n" = 1 ] || fail "--nproc-per-node auto under taskset -c $first: WORLD_SIZE $n"
fi
"$DDPRUN" --nproc-per-node autox true 2>"$WORK/err"
[ $? = 2 ] && grep -q "autox" "$WORK/err" || fail "--nproc-per-node autox accepted"

# --standalone: a local job; the multi-node options contradict it.
out=$("$DDPRUN" --standalone -n 2 sh -c 'echo $MASTER_ADDR $WORLD_SIZE') || fail "--standalone"
[ "$(printf '%s\n' "$out" | grep -c '127.0.0.1 2$')" = 2 ] || fail "--standalone: $out"
for opt in "--nnodes 2" "--master-port 29500" "--node-rank 0" "--master-addr 10.0.0.1"; do
    # shellcheck disable=SC2086 # the option and its value are two words
    "$DDPRUN" --standalone -n 1 $opt true 2>"$WORK/err"
    [ $? = 2 ] && grep -q -- "cannot be combined with ${opt%% *}" "$WORK/err" ||
        fail "--standalone $opt: $(cat "$WORK/err")"
done

# --log-dir that cannot be made
"$DDPRUN" -n 1 --log-dir /proc/no/such/dir true 2>"$WORK/err"
[ $? = 1 ] && grep -q -- "--log-dir: cannot create '/proc/no/such/dir'" "$WORK/err" ||
    fail "--log-dir in a missing parent: $(cat "$WORK/err")"

# --version names the library's version (ddp_version()).
v=$("$DDPRUN" --version)
printf '%s\n' "$v" | grep -Eq '^ddprun \(libddp\) [0-9]+\.[0-9]+\.[0-9]+$' || fail "--version: $v"

if [ "$FAILED" != 0 ]; then
    echo "test_ddprun_jobs.sh: FAILED" >&2
    exit 1
fi
echo "test_ddprun_jobs.sh: ok"
