#!/bin/sh
# Side-by-side: libddp collectives (ddp-bench, user and segment buffers, user buffers registered
# with ddp_group_register_memory, and user buffers libddp may not register) against Open MPI
# (mpi-baseline) and the single-core memcpy bound (memcpy-probe), all measured in this one
# invocation on the same sizes, for 2 ranks and 4 ranks (on this 2-core machine: oversubscribed).
# "user" runs with the defaults, so on shm DDP_SHM_MAP=auto registers its reused buffers by
# itself (the allreduce goes "mapped" from a buffer's second call).
#
#   bench/compare_collectives.sh                     # f32 sum allreduce, 8 B .. 128 MiB, x4
#   OPS="allreduce allgather" RANKS=2 MAX=32M bench/compare_collectives.sh
#
# Environment: BUILD (build directory, default <repo>/build; built if a program is missing),
# RANKS ("2 4"), OPS ("allreduce"; also broadcast, reduce_scatter, allgather), DTYPE (f32),
# REDOP (sum), MIN (8), MAX (128M), FACTOR (4), ITERS (5), WARMUP (16), ROUNDS (5),
# MIN_MS (10), REPEAT (3: every run is repeated, interleaved, and the table shows the median
# with the spread below it), KEEP (a directory to keep the raw JSON in), FROM (a directory KEEP
# filled earlier: print its tables again without running anything; give the same RANKS, OPS and
# REPEAT).
# REGISTERED (1): also ddp-bench --register 1 (malloc'd buffers registered by the caller, the
# "mapped" allreduce on shm), and UNREGISTERED (1): also DDP_SHM_MAP=on ddp-bench (user buffers
# libddp leaves alone: the staged and single-copy paths), interleaved with the others; their
# columns (registered, reg/MPI, reg/cpy, reg/user, unreg, unr/MPI, unr/cpy) follow the others in
# each table ("-" for a series not run). With both 0, or a FROM directory without their runs,
# the tables are printed without them.
# GLOO (1): for allreduce also PyTorch's gloo backend (bench/gloo_allreduce.py, Debian's
# python3-torch, ranks meeting over 127.0.0.1), interleaved with the others; its lines follow
# each allreduce table. gloo times one allreduce per round (not a loop), so small sizes carry
# the clock's and the barrier's jitter. GLOO=0, or no torch, leaves it out.
# Ratios > 1 mean libddp is faster.
set -eu
# PLOT=FILE.png: the same run, its output also drawn into FILE.png by bench/plot_collectives.sh
# (gnuplot-nox); the tables on stdout are unchanged.
if [ -n "${PLOT:-}" ] && [ -z "${DDP_PLOT_INNER:-}" ]; then
    plot_out=$(mktemp "${TMPDIR:-/tmp}/plot_run.XXXXXX")
    { if DDP_PLOT_INNER=1 sh "$0" "$@"; then echo 0 >"$plot_out.rc"; else echo $? >"$plot_out.rc"; fi; } | tee "$plot_out"
    plot_rc=$(cat "$plot_out.rc")
    if [ "$plot_rc" = 0 ] && ! sh "$(dirname "$0")/plot_collectives.sh" "$plot_out" "$PLOT" >&2; then plot_rc=1; fi
    rm -f "$plot_out" "$plot_out.rc"
    exit "$plot_rc"
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
RANKS=${RANKS:-"2 4"}
OPS=${OPS:-allreduce}
DTYPE=${DTYPE:-f32}
REDOP=${REDOP:-sum}
MIN=${MIN:-8}
MAX=${MAX:-128M}
FACTOR=${FACTOR:-4}
ITERS=${ITERS:-5}
# 16: past the shm tuner's probe at every size (bench/shm_states.sh says why; with 2 the
# 32/128 MiB timings were mostly probes of the slower variants)
WARMUP=${WARMUP:-16}
ROUNDS=${ROUNDS:-5}
MIN_MS=${MIN_MS:-10}
REPEAT=${REPEAT:-3}

need=""
[ -n "${FROM:-}" ] || for p in ddprun ddp-bench memcpy-probe switch-probe mpi-baseline; do
    [ -x "$BUILD/$p" ] || need="$need $p"
done
if [ -n "$need" ]; then
    echo "# building$need in $BUILD" >&2
    [ -f "$BUILD/CMakeCache.txt" ] || cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >&2
    # shellcheck disable=SC2086
    cmake --build "$BUILD" -j2 --target $need >&2
fi
[ -n "${FROM:-}" ] || for p in ddprun ddp-bench memcpy-probe switch-probe; do
    [ -x "$BUILD/$p" ] || { echo "compare_collectives: $BUILD/$p was not built" >&2; exit 1; }
done
HAVE_MPI=1
if [ -z "${FROM:-}" ] && { [ ! -x "$BUILD/mpi-baseline" ] || ! command -v mpirun >/dev/null 2>&1; }; then
    HAVE_MPI=0
    echo "# MPI not available: the MPI columns are empty" >&2
fi

if [ -n "${FROM:-}" ]; then
    OUT=$FROM
elif [ -n "${KEEP:-}" ]; then
    OUT=$KEEP
    mkdir -p "$OUT"
else
    OUT=$(mktemp -d "${TMPDIR:-/tmp}/compare-collectives.XXXXXX")
    trap 'rm -rf "$OUT"' EXIT INT TERM
fi

# Open MPI refuses to run as root unless told it is fine.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

COMMON="-d $DTYPE -r $REDOP -b $MIN -e $MAX -f $FACTOR -n $ITERS -w $WARMUP --rounds $ROUNDS --min-ms $MIN_MS --json"

HAVE_GLOO=0
if [ "${GLOO:-1}" != 0 ] && [ -z "${FROM:-}" ] && /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
    HAVE_GLOO=1
fi
# gloo_run N: one gloo allreduce sweep on N local ranks; rank 0's "gloo BYTES US ALGBW BUSBW" lines.
gloo_run() {
    port=$((20000 + ($$ * 7 + $1 * 131 + rep * 17) % 40000))
    rounds=$ROUNDS
    [ "$rounds" -ge 5 ] || rounds=5
    r=$(($1 - 1))
    while [ "$r" -ge 1 ]; do
        timeout 900 /usr/bin/python3 "$ROOT/bench/gloo_allreduce.py" --rank "$r" --world "$1" \
            --master-port "$port" --min-bytes "$MIN" --max-bytes "$MAX" --factor "$FACTOR" \
            --warmup "$WARMUP" --rounds "$rounds" >/dev/null 2>&1 &
        r=$((r - 1))
    done
    timeout 900 /usr/bin/python3 "$ROOT/bench/gloo_allreduce.py" --rank 0 --world "$1" \
        --master-port "$port" --min-bytes "$MIN" --max-bytes "$MAX" --factor "$FACTOR" \
        --warmup "$WARMUP" --rounds "$rounds" 2>/dev/null | grep '^gloo ' || true
    wait
}

# JSON lines only (ddprun may add its own lines on failure; those go to stderr).
json_only() { grep '^{' || true; }

if [ -n "${FROM:-}" ]; then
    echo "# compare_collectives: tables from the runs kept in $FROM"
else
    echo "# compare_collectives: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, $(uname -r)"
    echo "# $DTYPE $REDOP, sizes $MIN..$MAX x$FACTOR, >= $ITERS iterations x $ROUNDS rounds (median), warmup $WARMUP"
    echo "# $REPEAT repetitions of every run, interleaved; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
fi
# Field `name` of a JSON line ("key":value), numbers and strings alike.
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p"; }

# All runs of one repetition back to back, so that every configuration sees the same load.
rep=1
[ -z "${FROM:-}" ] || rep=$((REPEAT + 1))
while [ "$rep" -le "$REPEAT" ]; do
    "$BUILD/memcpy-probe" -b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" --rounds "$ROUNDS" \
        --min-ms "$MIN_MS" --json | json_only >"$OUT/memcpy.$rep.json"
    "$BUILD/switch-probe" --json | json_only >"$OUT/switch.$rep.json"
    for op in $OPS; do
        for n in $RANKS; do
            for seg in 0 1; do
                # shellcheck disable=SC2086
                "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" $COMMON \
                    --segment "$seg" | json_only >"$OUT/ddp-$seg-$op-$n.$rep.json" || true
            done
            if [ "${REGISTERED:-1}" != 0 ]; then
                # shellcheck disable=SC2086
                "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" $COMMON \
                    --segment 0 --register 1 | json_only >"$OUT/ddp-reg-$op-$n.$rep.json" || true
            fi
            if [ "${UNREGISTERED:-1}" != 0 ]; then
                # shellcheck disable=SC2086
                DDP_SHM_MAP=on "$BUILD/ddprun" -n "$n" --no-prefix "$BUILD/ddp-bench" -o "$op" \
                    $COMMON --segment 0 | json_only >"$OUT/ddp-unreg-$op-$n.$rep.json" || true
            fi
            if [ "$HAVE_MPI" = 1 ]; then
                # shellcheck disable=SC2086
                mpirun --oversubscribe -np "$n" "$BUILD/mpi-baseline" -o "$op" $COMMON \
                    | json_only >"$OUT/mpi-$op-$n.$rep.json" || true
            else
                : >"$OUT/mpi-$op-$n.$rep.json"
            fi
            if [ "$HAVE_GLOO" = 1 ] && [ "$op" = allreduce ]; then
                gloo_run "$n" >"$OUT/gloo-$op-$n.$rep.txt"
            fi
        done
    done
    rep=$((rep + 1))
done
[ -n "${FROM:-}" ] || echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Lists the files of every repetition of one configuration.
reps() { r=1; l=""; while [ "$r" -le "$REPEAT" ]; do l="$l $OUT/$1.$r.json"; r=$((r + 1)); done; echo "$l"; }

for op in $OPS; do
    for n in $RANKS; do
        echo
        echo "## $op $DTYPE $REDOP, $n ranks ($(field transport <"$OUT/ddp-0-$op-$n.1.json" | head -n 1) transport)," \
            "algbw in GB/s from the median time of $REPEAT runs"
        # The registered and unregistered columns only when this configuration has those runs.
        hasreg=0
        [ -f "$OUT/ddp-reg-$op-$n.1.json" ] && hasreg=1
        hasunreg=0
        [ -f "$OUT/ddp-unreg-$op-$n.1.json" ] && hasunreg=1
        awk -v user="$(reps "ddp-0-$op-$n")" -v seg="$(reps "ddp-1-$op-$n")" \
            -v reg="$(reps "ddp-reg-$op-$n")" -v hasreg="$hasreg" \
            -v unreg="$(reps "ddp-unreg-$op-$n")" -v hasunreg="$hasunreg" \
            -v mpi="$(reps "mpi-$op-$n")" -v mem="$(reps memcpy)" -v sw="$(reps switch)" \
            -v ranks="$n" -v cores="$(nproc)" '
            function get(line, key,   m) {
                if (match(line, "\"" key "\":\"?[^,\"}]*")) {
                    m = substr(line, RSTART, RLENGTH); sub(/^"[^"]*":"?/, "", m); return m
                }
                return ""
            }
            # Reads every repetition of one configuration: v[kind, bytes, k] = value of run k.
            function slurp(kind, files, key,   list, nf, i, line, b) {
                nf = split(files, list, " ")
                for (i = 1; i <= nf; i++) {
                    while ((getline line < list[i]) > 0) {
                        b = get(line, "bytes")
                        n[kind, b]++
                        bw[kind, b, n[kind, b]] = get(line, key)
                        us[kind, b, n[kind, b]] = get(line, "time_us")
                        if (kind == "user" && !(b in seen)) { seen[b] = 1; order[++nsizes] = b }
                    }
                    close(list[i])
                }
            }
            # Median (and min, max) of the runs of one configuration at one size.
            function stats(arr, kind, b,   k, m, tmp, i, j, t) {
                m = n[kind, b] + 0
                if (m == 0) { lo = hi = ""; return "" }
                for (k = 1; k <= m; k++) tmp[k] = arr[kind, b, k] + 0
                for (i = 2; i <= m; i++) for (j = i; j > 1 && tmp[j - 1] > tmp[j]; j--) {
                    t = tmp[j]; tmp[j] = tmp[j - 1]; tmp[j - 1] = t
                }
                lo = tmp[1]; hi = tmp[m]
                return m % 2 ? tmp[(m + 1) / 2] : (tmp[m / 2] + tmp[m / 2 + 1]) / 2
            }
            function ratio(a, b) { return (a != "" && b != "" && b + 0 > 0) ? sprintf("%.2f", a / b) : "-" }
            function gbps(b, t) { return (t == "" || t + 0 <= 0) ? "" : b / t / 1e3 }
            function show(x) { return x == "" ? "-" : sprintf("%.2f", x) }
            function range(x) { return x == "" ? "-" : sprintf("%.2f-%.2f", lo, hi) }
            BEGIN {
                slurp("user", user, "algbw"); slurp("seg", seg, "algbw")
                slurp("mpi", mpi, "algbw"); slurp("mem", mem, "gbps")
                if (hasreg) slurp("reg", reg, "algbw")
                if (hasunreg) slurp("unr", unreg, "algbw")
                # The registered and unregistered columns come last, always all of them when one
                # is there, so the others keep their places (and plot_collectives.sh its fields).
                extra = hasreg || hasunreg
                fmt = "%10s %8s %8s %8s %8s %8s %8s %8s %8s"
                xfmt = " %10s %8s %8s %8s %8s %8s %8s"
                printf fmt, "bytes", "user", "segment", "MPI", "user/MPI", "seg/MPI", "memcpy",
                       "user/cpy", "seg/cpy"
                if (extra) printf xfmt, "registered", "reg/MPI", "reg/cpy", "reg/user", "unreg",
                                  "unr/MPI", "unr/cpy"
                printf "\n"
                # GB/s from the median time, and ratios of median times (same bytes, so the same
                # as ratios of algbw), so that every column of a row agrees even with an even
                # number of repetitions.
                for (i = 1; i <= nsizes; i++) {
                    b = order[i]
                    ut = stats(us, "user", b); st = stats(us, "seg", b)
                    mt = stats(us, "mpi", b); ct = stats(us, "mem", b)
                    printf fmt, b, show(gbps(b, ut)), show(gbps(b, st)), show(gbps(b, mt)),
                           ratio(mt, ut), ratio(mt, st), show(gbps(b, ct)), ratio(ct, ut), ratio(ct, st)
                    rt = hasreg ? stats(us, "reg", b) : ""
                    nt = hasunreg ? stats(us, "unr", b) : ""
                    if (extra) printf xfmt, show(gbps(b, rt)), ratio(mt, rt), ratio(ct, rt),
                                      ratio(ut, rt), show(gbps(b, nt)), ratio(mt, nt), ratio(ct, nt)
                    printf "\n"
                }
                print "spread (min-max GB/s over the runs):"
                fmt = "%10s %14s %14s %14s %14s"
                printf fmt, "bytes", "user", "segment", "MPI", "memcpy"
                if (extra) printf " %14s %14s", "registered", "unreg"
                printf "\n"
                for (i = 1; i <= nsizes; i++) {
                    b = order[i]
                    u = stats(bw, "user", b); ur = range(u); s = stats(bw, "seg", b); sr = range(s)
                    m = stats(bw, "mpi", b); mr = range(m); c = stats(bw, "mem", b); cr = range(c)
                    printf fmt, b, ur, sr, mr, cr
                    rr = "-"; nr = "-"
                    if (hasreg) { r = stats(bw, "reg", b); rr = range(r) }
                    if (hasunreg) { x = stats(bw, "unr", b); nr = range(x) }
                    if (extra) printf " %14s %14s", rr, nr
                    printf "\n"
                }
                b = order[1]
                if (hasreg) { r = stats(us, "reg", b); rr = range(r) }
                if (hasunreg) { x = stats(us, "unr", b); nr = range(x) }
                u = stats(us, "user", b); ur = range(u); s = stats(us, "seg", b); sr = range(s)
                m = stats(us, "mpi", b); mr = range(m)
                printf "latency at %s B, us (median, min-max): user %s (%s), segment %s (%s), MPI %s (%s)",
                       b, show(u), ur, show(s), sr, show(m), mr
                if (hasreg) printf ", registered %s (%s)", show(r), rr
                if (hasunreg) printf ", unregistered %s (%s)", show(x), nr
                printf "\n"
                # More ranks than cores: every core runs each of its ranks once per collective,
                # so a process switch is the floor of a small collective.
                if (ranks + 0 > cores + 0) {
                    nsw = split(sw, list, " ")
                    for (i = 1; i <= nsw; i++) {
                        while ((getline line < list[i]) > 0) { n["sw", 0]++; swt["sw", 0, n["sw", 0]] = get(line, "switch_us") }
                        close(list[i])
                    }
                    w = stats(swt, "sw", 0); wr = range(w)
                    printf "one process switch on a core (the floor with %d ranks on %d cores): %s us (%s); user latency / switch: %s\n",
                           ranks, cores, show(w), wr, ratio(u, w)
                }
            }'
        # gloo: algbw from the median time over the repetitions, and the range of algbw.
        gloo_files=""
        r=1
        while [ "$r" -le "$REPEAT" ]; do
            [ -s "$OUT/gloo-$op-$n.$r.txt" ] && gloo_files="$gloo_files $OUT/gloo-$op-$n.$r.txt"
            r=$((r + 1))
        done
        if [ -n "$gloo_files" ]; then
            echo "PyTorch gloo (torch.distributed over 127.0.0.1), algbw in GB/s: gloo BYTES MEDIAN MIN MAX"
            # shellcheck disable=SC2086 # a list of files
            cat $gloo_files | sort -n -k2 -s | awk '
                function flush(   i, j, t, m, lo, hi) {
                    if (!cnt) return
                    for (i = 1; i <= cnt; i++) for (j = i + 1; j <= cnt; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
                    m = cnt % 2 ? v[(cnt + 1) / 2] : (v[cnt / 2] + v[cnt / 2 + 1]) / 2
                    lo = bytes / v[cnt] / 1000; hi = bytes / v[1] / 1000
                    printf "gloo %10s %9.3g %9.3g %9.3g\n", bytes, bytes / m / 1000, lo, hi
                    cnt = 0
                }
                $2 != bytes { flush(); bytes = $2 }
                { v[++cnt] = $3 }
                END { flush() }'
        fi
        regfiles=""
        [ "$hasreg" = 0 ] || regfiles=$(reps "ddp-reg-$op-$n")
        [ "$hasunreg" = 0 ] || regfiles="$regfiles $(reps "ddp-unreg-$op-$n")"
        for f in $(reps "ddp-0-$op-$n") $(reps "ddp-1-$op-$n") $regfiles; do
            [ -s "$f" ] || echo "!! $(basename "$f"): no results (the run failed)"
        done
    done
done
