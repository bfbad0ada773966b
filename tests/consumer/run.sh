#!/usr/bin/env bash
# Installs the built tree into a scratch prefix, then builds and runs examples/quantize.c twice:
# with `pkg-config --cflags --libs fp8` and as a CMake project using find_package(fp8).
set -euo pipefail
build_dir=$1 src_dir=$2 cc=$3 example=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null

export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
"$cc" -std=c99 -Wall -Werror "$example" -o "$work/consumer_pc" $(pkg-config --cflags --libs fp8)
"$work/consumer_pc"
echo "pkg-config consumer: ok"

cmake -S "$src_dir" -B "$work/cmake_build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_C_COMPILER="$cc" -DFP8_EXAMPLE="$example" >/dev/null
cmake --build "$work/cmake_build" >/dev/null
"$work/cmake_build/consumer"
"$work/cmake_build/consumer_static"
echo "find_package consumers (fp8::fp8 and fp8::fp8_static): ok"
