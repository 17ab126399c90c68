#!/bin/sh
# The libddp vs Open MPI allreduce comparison repeated over several minutes, because this VM flips
# between states on its own (docs/benchmarks.md: "shared cache", where Open MPI's 8 B allreduce
# takes 0.17-0.25 us and plain copies are fast, and "separate caches", ~0.5 us) and a single run
# sees only one of them. Every run measures memcpy (memcpy-probe), Open MPI (mpi-baseline) and
# libddp (ddp-bench, user buffers) back to back on the same sizes; the report gives each run's
# state (Open MPI's 8 B time is the marker) and, per size, the worst and the median ratio to Open
# MPI (and to memcpy for 32 MiB and up) over all runs, against the targets of issue #18.
# The libddp series ("ddp") runs with the defaults: malloc'd buffers that libddp registers by
# itself when they come back (DDP_SHM_MAP=auto, the "mapped" allreduce). Each run also times
# libddp on the same buffers registered by the caller (ddp-bench --register 1: "reg") and on
# buffers left unregistered (DDP_SHM_MAP=on, the staged and single-copy paths, what runs where
# libddp cannot register by itself: "unreg"), interleaved with the others; their reports follow,
# in the same form, with their ratio to the default series.
#
#   bench/shm_states.sh                 # 2 ranks, f32 sum, runs for 10 minutes
#   DURATION=1800 RANKS="2 4" bench/shm_states.sh
#
# Environment: BUILD (default <repo>/build; built if a program is missing), DURATION (seconds,
# default 600; runs continue until it has passed), RUNS (stop after this many runs instead),
# RANKS ("2"), SIZES (ddp-bench sizes: MIN, MAX, FACTOR; default 8 B .. 128 MiB x4), ITERS (3), WARMUP (16),
# ROUNDS (3), PAUSE (seconds between runs, default 20), OUT (the report file, default
# bench/results/<UTC date-time>-shm-states.txt; the raw JSON goes to OUT's name without .txt),
# REGISTERED (1; 0: no registered runs), UNREGISTERED (1; 0: no unregistered runs).
# Ratios > 1 mean libddp is faster (time of Open MPI / time of libddp).
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
DURATION=${DURATION:-600}
RUNS=${RUNS:-0}
RANKS=${RANKS:-2}
MIN=${MIN:-8}
MAX=${MAX:-128M}
FACTOR=${FACTOR:-4}
ITERS=${ITERS:-3}
# Warm-up calls per size before timing. The shm tuner (docs/shm-transport.md, "Self-tuning")
# probes every candidate variant for its first 3 x (number of candidates) calls of a size class
# (12 at 32/128 MiB): with 2 warm-up calls, the timed calls at those sizes were mostly probes of
# the slower variants (24 Nov 11:38, quiet: 6.9 GB/s at 32 and 128 MiB with -w 2, 10.3-11.3 with
# -w 40, and 8.0-8.7 with the tuner off). A job makes thousands of calls; the steady state is
# what this measures.
WARMUP=${WARMUP:-16}
ROUNDS=${ROUNDS:-3}
PAUSE=${PAUSE:-20}
STAMP=$(date -u '+%Y-%m-%d-%H%M')
OUT=${OUT:-$ROOT/bench/results/$STAMP-shm-states.txt}
REGISTERED=${REGISTERED:-1}
UNREGISTERED=${UNREGISTERED:-1}
RAW=${OUT%.txt}

need=""
for p in ddprun ddp-bench memcpy-probe mpi-baseline cma-probe; do
    [ -x "$BUILD/$p" ] || need="$need $p"
done
if [ -n "$need" ]; then
    echo "# building$need in $BUILD" >&2
    [ -f "$BUILD/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >&2
    # shellcheck disable=SC2086
    cmake --build "$BUILD" -j2 --target $need >&2
fi
command -v mpirun >/dev/null 2>&1 && [ -x "$BUILD/mpi-baseline" ] || {
    echo "shm_states: needs Open MPI (mpirun) and $BUILD/mpi-baseline" >&2
    exit 1
}
mkdir -p "$RAW"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
COMMON="-d f32 -r sum -b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP --rounds $ROUNDS --min-ms 10 --json"
json_only() { grep '^{' || true; }

start=$(date +%s)
run=0
{
    echo "# shm_states: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, $(uname -r), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "# f32 sum allreduce, user buffers, sizes $MIN..$MAX x$FACTOR, ranks: $RANKS; for ${DURATION}s$([ "$RUNS" -gt 0 ] && echo " or $RUNS runs")"
    echo "# libddp: DDP_SHM_MAP=auto (default: reused buffers registered by libddp)"
    [ "$REGISTERED" = 0 ] || echo "# and the same user buffers registered by the caller (ddp-bench --register 1), in every run"
    [ "$UNREGISTERED" = 0 ] || echo "# and the same user buffers unregistered (DDP_SHM_MAP=on), in every run"
} | tee "$OUT"
while :; do
    run=$((run + 1))
    load=$(cut -d' ' -f1 /proc/loadavg)
    when=$(date -u '+%H:%M:%S')
    "$BUILD/memcpy-probe" -b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" --rounds "$ROUNDS" --json \
        | json_only >"$RAW/memcpy.$run.json"
    # What two cores get together: both copying at once (cma-probe's "memcpy x2"). An allreduce
    # of 2 ranks must move one memcpy's bytes on each rank at the same time, so this, not one
    # core's memcpy, bounds it where the two cores share the memory bandwidth.
    "$BUILD/cma-probe" -b 32M -e "$MAX" -f 4 --rounds "$ROUNDS" 2>/dev/null \
        | grep -E '^memcpy x2 +[0-9]' >"$RAW/x2.$run.txt" || true
    for n in $RANKS; do
        # Open MPI and libddp alternate which goes first, so neither always meets the same load
        # (registered libddp at either end).
        if [ $((run % 2)) -eq 1 ]; then order="mpi ddp"; else order="ddp mpi"; fi
        if [ "$REGISTERED" != 0 ]; then
            if [ $((run % 2)) -eq 1 ]; then order="$order reg"; else order="reg $order"; fi
        fi
        if [ "$UNREGISTERED" != 0 ]; then
            if [ $((run % 2)) -eq 1 ]; then order="unreg $order"; else order="$order unreg"; fi
        fi
        for who in $order; do
            if [ "$who" = mpi ]; then
                # shellcheck disable=SC2086
                mpirun --oversubscribe -np "$n" "$BUILD/mpi-baseline" $COMMON \
                    | json_only >"$RAW/mpi-$n.$run.json" || true
            elif [ "$who" = reg ]; then
                # shellcheck disable=SC2086
                "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" $COMMON --register 1 \
                    | json_only >"$RAW/reg-$n.$run.json" || true
            elif [ "$who" = unreg ]; then
                # shellcheck disable=SC2086
                DDP_SHM_MAP=on "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" $COMMON \
                    | json_only >"$RAW/unreg-$n.$run.json" || true
            else
                # shellcheck disable=SC2086
                "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" $COMMON \
                    | json_only >"$RAW/ddp-$n.$run.json" || true
            fi
        done
    done
    echo "$run $when $load" >>"$RAW/runs.txt"
    echo "# run $run at $when UTC, load $load" >&2
    elapsed=$(($(date +%s) - start))
    if [ "$RUNS" -gt 0 ]; then [ "$run" -ge "$RUNS" ] && break
    elif [ "$elapsed" -ge "$DURATION" ]; then break; fi
    sleep "$PAUSE"
done

# The report: one line per run (state, ratios per size), then per size the worst and median;
# for libddp on unregistered buffers (series ddp), then on registered ones (series reg, which
# also gives its median ratio to the unregistered run).
series=ddp
[ "$REGISTERED" = 0 ] || series="$series reg"
[ "$UNREGISTERED" = 0 ] || series="$series unreg"
passes=""
for who in $series; do for n in $RANKS; do passes="$passes $who:$n"; done; done
for pass in $passes; do
    who=${pass%%:*}
    n=${pass#*:}
    awk -v raw="$RAW" -v ranks="$n" -v runs="$run" -v who="$who" '
        function get(line, key,   m) {
            if (match(line, "\"" key "\":\"?[^,\"}]*")) {
                m = substr(line, RSTART, RLENGTH); sub(/^"[^"]*":"?/, "", m); return m
            }
            return ""
        }
        function slurp(kind, file, r,   line, b) {
            while ((getline line < file) > 0) {
                b = get(line, "bytes") + 0
                t[kind, r, b] = get(line, "time_us") + 0
                if (kind == "ddp") {
                    # The variants that ran: "staged:nt", or "staged:nt:3,single-copy:2" (rounds).
                    alg[r, b] = match(line, /"algorithm":"[^"]*"/) ? substr(line, RSTART + 13, RLENGTH - 14) : ""
                    if (!(b in seen)) { seen[b] = 1; order[++ns] = b }
                }
            }
            close(file)
        }
        function sort(a, m,   i, j, x) { for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { x = a[j]; a[j] = a[j - 1]; a[j - 1] = x } }
        function label(b) { return b >= 1048576 ? b / 1048576 "M" : (b >= 1024 ? b / 1024 "K" : b "B") }
        BEGIN {
            while ((getline line < (raw "/runs.txt")) > 0) { split(line, f, " "); at[f[1]] = f[2]; ld[f[1]] = f[3] }
            for (r = 1; r <= runs; r++) {
                slurp("ddp", raw "/" who "-" ranks "." r ".json", r)
                if (who != "ddp") slurp("usr", raw "/ddp-" ranks "." r ".json", r)
                slurp("mpi", raw "/mpi-" ranks "." r ".json", r)
                slurp("mem", raw "/memcpy." r ".json", r)
                xf = raw "/x2." r ".txt"
                while ((getline line < xf) > 0) { split(line, w, " "); x2[r, w[3] + 0] = w[4] + 0 }
                close(xf)
            }
            if (who == "reg")
                printf "\n## %d ranks, libddp on registered buffers (ddp-bench --register 1): per run, time(Open MPI) / time(libddp registered) per size (>1: libddp faster); 32M+: also libddp registered / memcpy and / memcpy x2 (both cores copying at once) (GB/s ratios)\n", ranks
            else if (who == "unreg")
                printf "\n## %d ranks, libddp on unregistered buffers (DDP_SHM_MAP=on: staged / single copy): per run, time(Open MPI) / time(libddp unregistered) per size (>1: libddp faster); 32M+: also libddp unregistered / memcpy and / memcpy x2 (GB/s ratios)\n", ranks
            else
                printf "\n## %d ranks: per run, time(Open MPI) / time(libddp) per size (>1: libddp faster); 32M+: also libddp / memcpy and / memcpy x2 (both cores copying at once) (GB/s ratios)\n", ranks
            printf "%4s %9s %5s %8s %-9s", "run", "UTC", "load", "MPI 8B", "state"
            for (i = 1; i <= ns; i++) printf " %7s", label(order[i])
            printf "\n"
            for (r = 1; r <= runs; r++) {
                m8 = t["mpi", r, order[1]]
                state = m8 <= 0 ? "?" : (m8 < 0.35 ? "shared" : "separate")
                st[r] = state
                printf "%4d %9s %5s %8.3f %-9s", r, at[r], ld[r], m8, state
                for (i = 1; i <= ns; i++) {
                    b = order[i]; d = t["ddp", r, b]; m = t["mpi", r, b]
                    x = (d > 0 && m > 0) ? m / d : -1
                    ratio[b, r] = x
                    printf " %7s", x < 0 ? "-" : sprintf("%.2f", x)
                    cm = t["mem", r, b]
                    cpy[b, r] = (d > 0 && cm > 0) ? cm / d : -1
                    cx[b, r] = (d > 0 && x2[r, b] > 0) ? b / d / 1000 / x2[r, b] : -1
                    u = t["usr", r, b]
                    vsu[b, r] = (d > 0 && u > 0) ? u / d : -1
                }
                printf "   mem:"
                for (i = 1; i <= ns; i++) if (order[i] >= 33554432) printf " %s %.2f", label(order[i]), cpy[order[i], r]
                printf "   x2:"
                for (i = 1; i <= ns; i++) if (order[i] >= 33554432) printf " %s %.2f", label(order[i]), cx[order[i], r]
                printf "\n"
            }
            if (who != "ddp")
                printf "\nper size over %d runs (%d ranks, %s): ratio to Open MPI worst / median [to memcpy worst / median]; to the default series (time(default) / time(this)) median; libddp variants seen; target\n", runs, ranks, who == "reg" ? "registered" : "unregistered"
            else
                printf "\nper size over %d runs (%d ranks): ratio to Open MPI worst / median [to memcpy worst / median]; libddp variants seen; target\n", runs, ranks
            for (i = 1; i <= ns; i++) {
                b = order[i]; k = 0; kc = 0; ku = 0; kx = 0; delete a; delete c; delete uu; delete xx; delete algs; vs = ""
                for (r = 1; r <= runs; r++) {
                    if (ratio[b, r] >= 0) a[++k] = ratio[b, r]
                    if (cpy[b, r] >= 0) c[++kc] = cpy[b, r]
                    if (vsu[b, r] >= 0) uu[++ku] = vsu[b, r]
                    if (cx[b, r] >= 0) xx[++kx] = cx[b, r]
                    if (alg[r, b] != "" && !(alg[r, b] in algs)) { algs[alg[r, b]] = 1; vs = vs (vs == "" ? "" : " ") alg[r, b] }
                }
                sort(a, k); sort(c, kc); sort(uu, ku); sort(xx, kx)
                med = k ? (k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2) : -1
                cmed = kc ? (kc % 2 ? c[(kc + 1) / 2] : (c[kc / 2] + c[kc / 2 + 1]) / 2) : -1
                target = ""; met = ""
                if (ranks == 2 && b <= 8) { target = "MPI/ddp >= 1"; met = (k && a[1] >= 1) ? "met in every run" : "NOT met in every run" }
                if (ranks == 2 && b >= 131072 && b <= 8388608) { target = "MPI/ddp >= 2"; met = (k && a[1] >= 2) ? "met in every run" : "NOT met in every run" }
                if (ranks == 2 && b >= 33554432) { target = "ddp/memcpy >= 0.6"; met = (kc && c[1] >= 0.6) ? "met in every run" : "NOT met in every run" }
                printf "%8s  %6.2f / %6.2f", label(b), k ? a[1] : -1, med
                if (b >= 33554432) printf "  [%5.2f / %5.2f; x2 %5.2f / %5.2f]", kc ? c[1] : -1, cmed, kx ? xx[1] : -1, kx ? (kx % 2 ? xx[(kx + 1) / 2] : (xx[kx / 2] + xx[kx / 2 + 1]) / 2) : -1
                if (who != "ddp") printf "  vs default %5.2f", ku ? (ku % 2 ? uu[(ku + 1) / 2] : (uu[ku / 2] + uu[ku / 2 + 1]) / 2) : -1
                printf "  %s%s\n", vs, target == "" ? "" : "  (" target ": " met ")"
            }
            ns_s = 0; ns_p = 0
            for (r = 1; r <= runs; r++) { if (st[r] == "shared") ns_s++; else if (st[r] == "separate") ns_p++ }
            printf "states seen: %d shared-cache runs (Open MPI 8 B < 0.35 us), %d separate-cache runs\n", ns_s, ns_p
        }' | tee -a "$OUT"
done
echo "# raw JSON in $RAW" | tee -a "$OUT"
