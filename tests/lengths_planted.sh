#!/bin/sh
# Plants one violation of the length rules in a copy of the tree and runs tools/check_lengths.py
# on it, so that a test can see the check fire: lengths_planted.sh ROOT KIND, KIND one of
#   long_file      801 more lines in src/core/status.c (a file over 800 lines);
#   long_function  a function of 125 lines appended to src/core/status.c;
#   long_reason    the same function with a "long because" comment above it (must pass).
root=$1 kind=$2
d=$(mktemp -d "${TMPDIR:-/tmp}/lengths.XXXXXX") || exit 2
trap 'rm -rf "$d"' EXIT
cp -r "$root/src" "$d/src" && cp -r "$root/tools" "$d/tools" || exit 2
f="$d/src/core/status.c"
body() { # a function of 125 lines: name line, brace, 122 statements, closing brace
    echo "int ddp__planted_long(int x)"
    echo "{"
    i=0
    while [ $i -lt 122 ]; do echo "    x += $i;"; i=$((i + 1)); done
    echo "}"
}
case "$kind" in
long_file) i=0; while [ $i -lt 801 ]; do echo "/* planted line $i */"; i=$((i + 1)); done >>"$f" ;;
long_function) body >>"$f" ;;
long_reason) { echo "/* Long because it is planted by the test of the length check. */"; body; } >>"$f" ;;
*) echo "lengths_planted.sh: unknown kind $kind"; exit 2 ;;
esac
python3 "$root/tools/check_lengths.py" "$d"
rc=$?
echo "check_lengths.py exit status $rc"
