#!/bin/sh
# Examples and packaging, the way a user meets them.
#   hello DDPRUN HELLO: the README's example trains to the same weights on 1, 2, 3 and 4 ranks.
#   install SOURCE BUILD [FLAGS]: `cmake --install` into a temporary prefix, then a program
#   outside the tree builds against it with find_package(ddp) and with pkg-config, and runs.
#   Then examples/hello_ddp.c links statically with `pkg-config --static` (libddp.a needs no MPI),
#   and, when MPI was built, a static program registers the MPI module from libddp_mpi.a.
#   FLAGS (compile and link) are the sanitizer flags of a sanitized BUILD: its libddp needs a
#   consumer built with the same sanitizer.
set -u
case "$1" in
hello)
  ddprun=$2 hello=$3
  ref=""
  for n in 1 2 3 4; do
    out=$("$ddprun" -n "$n" "$hello") || { echo "hello_ddp failed on $n ranks: $out"; exit 1; }
    line=$(printf '%s\n' "$out" | grep "hello_ddp: $n ranks") || { echo "no result line on $n ranks: $out"; exit 1; }
    weights=${line#*ranks, }
    echo "$n ranks: $weights"
    # The fitted weights must be close to the true line 1..8 and b = 0.5.
    printf '%s\n' "$weights" | awk '{ for (f = 1; f <= 8; f++) if ($(f+2) < f - 0.2 || $(f+2) > f + 0.2) exit 1 }' \
      || { echo "weights far from the true line: $weights"; exit 1; }
    if [ -z "$ref" ]; then ref=$weights; elif [ "$weights" != "$ref" ]; then
      echo "different result on $n ranks: '$weights' vs '$ref'"; exit 1
    fi
  done
  ;;
install)
  src=$2 build=$3 flags=${4:-}
  tmp=$(mktemp -d) || exit 1
  trap 'rm -rf "$tmp"' EXIT
  cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; exit 1; }
  for f in include/ddp/ddp.h lib/pkgconfig/ddp.pc lib/cmake/ddp/ddpConfig.cmake; do
    [ -f "$tmp/prefix/$f" ] || { echo "missing $f after install"; ls -R "$tmp/prefix"; exit 1; }
  done
  mkdir -p "$tmp/app"
  cat > "$tmp/app/main.c" <<'C'
#include <stdio.h>
#include <string.h>
#include <ddp/ddp.h>
int main(void)
{
    ddp_store_t *store;
    if (ddp_store_hash_create(&store) != DDP_OK) return 1;
    ddp_group_t *group;
    if (ddp_group_create(store, 0, 1, NULL, &group) != DDP_OK) return 2;
    float x[3] = {1, 2, 3};
    if (ddp_group_allreduce(group, x, x, 3, DDP_F32, DDP_SUM) != DDP_OK) return 3;
    ddp_group_destroy(group);
    ddp_store_destroy(store);
    printf("consumer ok %g\n", x[2]);
    return strcmp(ddp_status_string(DDP_OK), "DDP_OK") != 0;
}
C
  cat > "$tmp/app/CMakeLists.txt" <<'C'
cmake_minimum_required(VERSION 3.20)
project(consumer C)
find_package(ddp REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE ddp::ddp)
C
  cmake -S "$tmp/app" -B "$tmp/app/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" > "$tmp/app.log" 2>&1 \
    && cmake --build "$tmp/app/build" >> "$tmp/app.log" 2>&1 || { cat "$tmp/app.log"; exit 1; }
  LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/app/build/consumer" || { echo "find_package consumer failed"; exit 1; }
  if command -v pkg-config > /dev/null; then
    pc_flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs ddp) || exit 1
    # shellcheck disable=SC2086 # the flags are words
    cc $flags "$tmp/app/main.c" -o "$tmp/app/pc" $pc_flags \
      || { echo "pkg-config build failed ($flags $pc_flags)"; exit 1; }
    LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/app/pc" || { echo "pkg-config consumer failed"; exit 1; }
    # A fully static hello_ddp (a sanitizer runtime cannot be linked statically: skipped then).
    if [ -z "$flags" ]; then
      st_flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --static --cflags --libs ddp) || exit 1
      # shellcheck disable=SC2086 # the flags are words
      cc -static "$src/examples/hello_ddp.c" -o "$tmp/app/hello_static" $st_flags 2> "$tmp/static.log" \
        || { cat "$tmp/static.log"; echo "static link of hello_ddp failed ($st_flags)"; exit 1; }
      if readelf -d "$tmp/app/hello_static" | grep -q NEEDED; then echo "hello_static is not static"; exit 1; fi
      out=$(RANK=0 WORLD_SIZE=1 "$tmp/app/hello_static") || { echo "static hello_ddp failed: $out"; exit 1; }
      echo "$out" | grep -q 'hello_ddp: 1 ranks' || { echo "static hello_ddp: $out"; exit 1; }
      echo "static (pkg-config --static --libs ddp: $st_flags): $out"
    fi
    if [ -f "$tmp/prefix/lib/pkgconfig/ddp-mpi.pc" ]; then
      [ -f "$tmp/prefix/lib/libddp_mpi.so" ] || { echo "libddp_mpi.so not installed beside libddp.so"; exit 1; }
      cat > "$tmp/app/mpi.c" <<'C'
#include <stdio.h>
#include <ddp/ddp.h>
#include <ddp/mpi.h>
int main(void)
{
    if (ddp_mpi_register() != DDP_OK) return 1;
    printf("registered\n");
    return 0;
}
C
      # libddp.a and libddp_mpi.a (MPI itself stays shared: Debian ships no libmpi.a).
      mpi_flags=$(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --static --cflags --libs ddp-mpi) || exit 1
      mpi_flags=$(printf '%s' "$mpi_flags" | sed 's/-lddp\( \|$\)/-l:libddp.a /')
      # shellcheck disable=SC2086 # the flags are words
      cc $flags "$tmp/app/mpi.c" -o "$tmp/app/mpi_static" $mpi_flags \
        || { echo "static link with ddp-mpi failed ($mpi_flags)"; exit 1; }
      if readelf -d "$tmp/app/mpi_static" | grep -q 'libddp'; then echo "mpi_static is not static in libddp"; exit 1; fi
      "$tmp/app/mpi_static" || { echo "ddp_mpi_register failed"; exit 1; }
    fi
  fi
  ;;
*)
  echo "usage: $0 hello DDPRUN HELLO | install SOURCE BUILD"; exit 2 ;;
esac
