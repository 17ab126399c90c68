#!/bin/sh
# Regenerates the seed corpus of the fuzz targets: build/tests/fuzz_make_seeds writes every
# target's seeds into tests/fuzz/corpus/<target>/, recording the c10d replies from a real torch
# TCPStore (tests/c10d_store_host.py under PYTHON, default Debian's /usr/bin/python3 with
# python3-torch) when one can be started. corpus/store_frame (the first target's frames,
# made by hand) is left alone.
#     sh tests/fuzz/make_seeds.sh [BUILD_DIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
python=${PYTHON:-/usr/bin/python3}
gen=$build/tests/fuzz_make_seeds
[ -x "$gen" ] || { echo "make_seeds.sh: build $gen first (cmake --build $build --target fuzz_make_seeds)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
port=""
if "$python" -c 'import torch.distributed' 2>/dev/null; then
    # The host prints its port, then serves until its stdin (fd 3 here) closes.
    mkfifo "$tmp/in" "$tmp/out"
    "$python" "$here/../c10d_store_host.py" < "$tmp/in" > "$tmp/out" &
    exec 3> "$tmp/in"
    read -r port < "$tmp/out"
fi
[ -n "$port" ] || echo "make_seeds.sh: no torch: corpus/c10d_reply is left as it is" >&2
for t in store_server c10d_reply tcp_hello shm_desc env optim_state powersgd_state fm_checkpoint gpt_checkpoint; do
    if [ "$t" = c10d_reply ] && [ -z "$port" ]; then continue; fi
    rm -rf "$here/corpus/$t"
done
"$gen" "$here/corpus" $port
[ -z "$port" ] || { exec 3>&-; wait; }
