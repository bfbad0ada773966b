#!/usr/bin/env bash
# Installs the built tree into a scratch prefix, then builds and runs examples/quantize.c twice:
# with `pkg-config --cflags --libs fp8` and as a CMake project using find_package(fp8).
set -euo pipefail
build_dir=$1 src_dir=$2 cc=$3 example=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
libdir=$(sed -n 's/^CMAKE_INSTALL_LIBDIR:PATH=//p' "$build_dir/CMakeCache.txt")
bash "$(dirname "$0")/build_consumers.sh" "$work/prefix" "${libdir:-lib}" "$src_dir" "$cc" "$example" "$work"
