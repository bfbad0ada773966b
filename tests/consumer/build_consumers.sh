#!/usr/bin/env bash
# Builds and runs examples/quantize.c against an installed libfp8 under PREFIX, twice: with
# `pkg-config --cflags --libs fp8` and as a CMake project using find_package(fp8) (fp8::fp8 and
# fp8::fp8_static). Shared by run.sh (cmake --install) and deb_packages.sh (the Debian packages).
#   build_consumers.sh PREFIX LIBDIR SRC_DIR CC EXAMPLE WORK
# LIBDIR: PREFIX's library directory (lib, lib/x86_64-linux-gnu); WORK: a scratch directory.
set -euo pipefail
prefix=$1 libdir=$2 src_dir=$3 cc=$4 example=$5 work=$6

# fp8.pc finds its prefix from where it lies (${pcfiledir}), so no --define-prefix or sysroot is needed.
export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig"
[ "$(pkg-config --variable=includedir fp8)" -ef "$prefix/include" ] ||
  { echo "fp8.pc under $prefix names includedir $(pkg-config --variable=includedir fp8)"; exit 1; }
# shellcheck disable=SC2046  # the flags are words
"$cc" -std=c99 -Wall -Werror "$example" -o "$work/consumer_pc" $(pkg-config --cflags --libs fp8)
"$work/consumer_pc"
echo "pkg-config consumer: ok"

cmake -S "$src_dir" -B "$work/cmake_build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DFP8_EXAMPLE="$example" >/dev/null
cmake --build "$work/cmake_build" >/dev/null
"$work/cmake_build/consumer"
"$work/cmake_build/consumer_static"
echo "find_package consumers (fp8::fp8 and fp8::fp8_static): ok"
