#!/bin/sh
# Plants one violation in a copy of the tree and runs tools/check_layers.sh on it, so that a
# test can see the check fire: layers_planted.sh ROOT FILE LINE appends LINE to src/FILE.
root=$1 file=$2 line=$3
d=$(mktemp -d "${TMPDIR:-/tmp}/layers.XXXXXX") || exit 2
trap 'rm -rf "$d"' EXIT
cp -r "$root/src" "$d/src" || exit 2
printf '%s\n' "$line" >>"$d/src/$file" || exit 2
sh "$root/tools/check_layers.sh" "$d"
rc=$?
echo "check_layers.sh exit status $rc"
[ "$rc" -ne 0 ]
