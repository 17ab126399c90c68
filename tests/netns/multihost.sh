#!/bin/sh
# Multi-host test on one machine: NHOSTS network namespaces ("hosts"), each with its own hostname
# (a UTS namespace) and one veth leg on a bridge that lives in a further namespace, addresses in
# 10.99.0.0/24 that exist only inside those namespaces. One `ddprun --nnodes NHOSTS` per host
# starts 2 workers there.
#   check: every collective is correct and bitwise identical on every rank (HASH lines agree),
#          and the group runs on the hierarchical transport (the worker asserts it).
#   flat:  the same with DDP_HIERARCHICAL=0: the group must run on flat tcp.
#   slurm: no ddprun: 2 workers per host started with srun's variables set by hand (SLURM_PROCID,
#          SLURM_NODEID, a compressed node list of the hosts' addresses, job and step ids, a
#          shared HOME for the secret); the group must find the store the first host's first
#          task hosts and run hierarchical.
#   kill:  once the job runs, every process of the last host is killed with SIGKILL; the ranks
#          of host 0 must report the failure (DETECTED lines), not hang.
# Skips (exit 77) when not root or when network namespaces are not permitted. The namespaces
# are removed on every exit path.
# Usage: multihost.sh DDPRUN WORKER NHOSTS check|flat|slurm|kill
set -u
DDPRUN=$1
WORKER=$2
NHOSTS=$3
MODE=$4

. "$(dirname "$0")/hosts.sh"

# The bridge runs without STP, so its ports forward at once; ddprun's store connection retries
# with backoff anyway while node 0 comes up.
TOKEN="netns-$$-$(date +%s)"
# With 3 hosts the transport binds to the interface named by DDP_SOCKET_IFNAME; with 2 it finds
# the address that routes to MASTER_ADDR by itself.
IFNAME_ENV=""
[ "$NHOSTS" -ge 3 ] && IFNAME_ENV="DDP_SOCKET_IFNAME=eth0"
WORKER_MODE=$MODE
# When a host is killed, node 0's ddprun notices the silence after the heartbeat timeout: keep it
# short so the test ends soon after the workers have reported the failure.
LAUNCH_OPTS=""
[ "$MODE" = kill ] && LAUNCH_OPTS="--heartbeat-timeout 5"
if [ "$MODE" = flat ]; then
    IFNAME_ENV="$IFNAME_ENV DDP_HIERARCHICAL=0"
    WORKER_MODE=check-flat
fi
if [ "$MODE" = slurm ]; then
    k=0
    while [ $k -lt "$NHOSTS" ]; do
        for i in 0 1; do
            ip netns exec "${P}h$k" unshare --uts sh -c "hostname ddp-host-$k && exec env \
                -u DDP_STORE_TOKEN -u MASTER_ADDR -u MASTER_PORT HOME=$LOGDIR DDP_TIMEOUT=60 \
                $IFNAME_ENV SLURM_PROCID=$((k * 2 + i)) SLURM_NTASKS=$((NHOSTS * 2)) \
                SLURM_LOCALID=$i SLURM_NODEID=$k SLURM_STEP_TASKS_PER_NODE='2(x$NHOSTS)' \
                SLURM_STEP_NODELIST='10.99.0.[1-$NHOSTS]' SLURM_JOB_ID=$$ SLURM_STEP_ID=0 \
                '$WORKER' check-slurm" >"$LOGDIR/host$k.$i.log" 2>&1 &
            RUNNERS="$RUNNERS $!"
        done
        k=$((k + 1))
    done
    status=0
    for pid in $RUNNERS; do
        wait "$pid" || status=1
    done
    for f in "$LOGDIR"/host*.log; do cat "$f" >>"$LOGDIR/all"; done
    [ $status -eq 0 ] || { for f in "$LOGDIR"/host*.log; do echo "---- $f"; tail -n 20 "$f"; done; exit 1; }
    grep -E "TRANSPORT" "$LOGDIR/all" | sort | uniq -c
    n=$(grep -c "TRANSPORT [0-9]* hierarchical" "$LOGDIR/all")
    [ "$n" -eq $((NHOSTS * 2)) ] || fail "$n ranks ran hierarchical"
    distinct=$(grep "HASH group " "$LOGDIR/all" | awk '{print $NF}' | sort -u | wc -l)
    [ "$distinct" -eq 1 ] || fail "group outputs differ between ranks"
    mode=$(stat -c %a "$LOGDIR/.ddp/store-secret")
    [ "$mode" = 600 ] || fail "the store's secret has mode $mode"
    echo "PASS: $((NHOSTS * 2)) ranks on $NHOSTS hosts under srun's variables, hierarchical, identical"
    exit 0
fi

k=0
while [ $k -lt "$NHOSTS" ]; do
    ip netns exec "${P}h$k" unshare --uts sh -c "hostname ddp-host-$k && exec env \
        DDP_STORE_TOKEN=$TOKEN DDP_TIMEOUT=60 $IFNAME_ENV '$DDPRUN' --nnodes $NHOSTS --node-rank $k \
        --master-addr 10.99.0.1 --master-port 29500 -n 2 --timeout 240 $LAUNCH_OPTS '$WORKER' $WORKER_MODE" \
        >"$LOGDIR/host$k.log" 2>&1 &
    RUNNERS="$RUNNERS $!"
    k=$((k + 1))
done

if [ "$MODE" = kill ]; then
    last=$((NHOSTS - 1))
    tries=0
    until grep -q LOOPING "$LOGDIR/host$last.log" 2>/dev/null; do
        tries=$((tries + 1))
        [ $tries -gt 600 ] && fail "the job never started looping"
        sleep 0.1
    done
    pids=$(ip netns pids "${P}h$last")
    echo "killing host $last (pids $pids)"
    kill -9 $pids
    set -- $RUNNERS
    wait "$1" # host 0's ddprun
    n=$(grep -c "DETECTED rank" "$LOGDIR/host0.log")
    grep "DETECTED rank" "$LOGDIR/host0.log"
    [ "$n" -eq 2 ] || fail "host 0 should have 2 DETECTED lines, has $n"
    grep -q UNDETECTED "$LOGDIR/host0.log" && fail "a rank missed the failure"
    grep "DETECTED rank" "$LOGDIR/host0.log" | grep -q "DDP_ERR_REMOTE\|DDP_ERR_ABORTED" ||
        fail "the failure is not reported as a remote failure"
    echo "PASS: killing host $last was detected by host 0's ranks"
    exit 0
fi

status=0
for pid in $RUNNERS; do
    wait "$pid" || status=1
done
[ $status -eq 0 ] || fail "a ddprun exited with an error"
cat "$LOGDIR"/host*.log | grep -E "TRANSPORT|NOTE" | sort | uniq -c
world=$((NHOSTS * 2))
for what in direct group; do
    n=$(cat "$LOGDIR"/host*.log | grep "HASH $what " | wc -l)
    [ "$n" -eq "$world" ] || fail "$n of $world ranks printed their $what hash"
    distinct=$(cat "$LOGDIR"/host*.log | grep "HASH $what " | awk '{print $NF}' | sort -u | wc -l)
    [ "$distinct" -eq 1 ] || fail "$what outputs differ between ranks"
done
echo "PASS: $world ranks on $NHOSTS hosts, every output bitwise identical"
exit 0
