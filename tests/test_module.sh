#!/bin/sh
# The MPI transport is a module, not part of libddp (docs/mpi-transport.md, "The module").
#   usage: test_module.sh SOURCE BUILD CC INSTALL_LIBDIR [FLAGS]
# 1. libddp.so needs no MPI (readelf -d), and libddp.a holds no MPI object or reference.
# 2. A program on a libddp.so whose directory has no libddp_mpi.so, asking for transport "mpi",
#    gets DDP_ERR_UNSUPPORTED naming the Debian package and the paths searched.
set -u
src=$1 build=$2 cc=$3 install_libdir=$4 flags=${5:-}
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

needed=$(readelf -d "$build/libddp.so" | grep NEEDED) || { echo "readelf failed"; exit 1; }
echo "$needed"
if echo "$needed" | grep -qi 'mpi'; then echo "libddp.so links MPI"; exit 1; fi
# Only the C runtime (and the sanitizers' runtimes in a sanitized build).
echo "$needed" | grep -v -E '\[(libc|libm|libpthread|librt|libdl|ld-linux[^]]*|libasan|libubsan|libtsan|libstdc\+\+|libgcc_s)\.so' \
  | grep -q . && { echo "libddp.so needs more than the C runtime"; exit 1; }
if nm "$build/libddp.a" 2>/dev/null | grep -q ' [UT] P\{0,1\}MPI_'; then
  echo "libddp.a refers to MPI"; exit 1
fi
if ar t "$build/libddp.a" | grep -q 'mpi_transport'; then echo "libddp.a holds the MPI transport"; exit 1; fi

mkdir "$tmp/lib"
cp -P "$build"/libddp.so* "$tmp/lib/" || exit 1
cat > "$tmp/main.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <ddp/ddp.h>
int main(void)
{
    ddp_group_options_t options = DDP_GROUP_OPTIONS_INIT;
    options.transport = "mpi";
    ddp_group_t *group = NULL;
    ddp_status_t s = ddp_group_create_from_env(&options, &group);
    printf("%s: %s\n", ddp_status_string(s), ddp_last_error());
    if (group) ddp_group_destroy(group);
    return 0;
}
C
# shellcheck disable=SC2086 # the flags are words
"$cc" $flags -I"$src/include" "$tmp/main.c" -o "$tmp/main" -L"$tmp/lib" -lddp \
  -Wl,-rpath,"$tmp/lib" || { echo "cannot build the probe"; exit 1; }
ldd "$tmp/main" | grep libddp
# libddp's second place to look is the install libdir: a module installed there would be found.
if [ -e "$install_libdir/libddp_mpi.so" ]; then
  echo "SKIP: $install_libdir/libddp_mpi.so is installed, so the module is not absent"; exit 77
fi
out=$(env -u MASTER_ADDR -u MASTER_PORT RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 \
      "$tmp/main" 2>&1)
echo "$out"
echo "$out" | grep -q '^DDP_ERR_UNSUPPORTED: ' || { echo "expected DDP_ERR_UNSUPPORTED"; exit 1; }
echo "$out" | grep -q 'libopenmpi3' || { echo "the text does not name libopenmpi3"; exit 1; }
echo "$out" | grep -q "$tmp/lib/libddp_mpi.so" || { echo "the text does not name $tmp/lib"; exit 1; }
echo "ok"
