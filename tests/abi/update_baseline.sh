#!/usr/bin/env bash
# Writes the ABI baseline of a release, which the test abi_baseline (check_baseline.sh) compares
# every later build with:
#   tests/abi/libfp8.abi         libabigail's description (abidw) of libfp8.so's public ABI: the
#                                exported functions with their symbol versions and the types of
#                                fp8.h they use;
#   tests/abi/fp8_constants.txt  the values of fp8.h's FP8_* constants (macros, which no ABI tool sees).
#
# Run it ONLY when a release is cut, in the change that sets the release's version (project() in
# CMakeLists.txt, FP8_VERSION_* in fp8.h, its node in src/libfp8.map), and commit both files with
# it. Between releases the baseline stays as it is: that is what makes abi_baseline catch a break.
# A new major version (a new SONAME) is such a release too; abi_baseline asks for it.
#
#   tests/abi/update_baseline.sh [BUILD_DIR]     (default: build/release)
#
# BUILD_DIR must be a Release build of the current tree, already built (cmake --build BUILD_DIR),
# configured with FP8_ABI_DEBUG_INFO=ON (the default). Needs abidw (Debian's abigail-tools).
# The files do not depend on the machine: the same ABI gives the same bytes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
# shellcheck source=abi_common.sh
source "$here/abi_common.sh"
build=${1:-$src/build/release}
command -v abidw >/dev/null || { echo "abidw not found: apt-get install abigail-tools"; exit 1; }
grep '^CMAKE_BUILD_TYPE:STRING=Release$' "$build/CMakeCache.txt" >/dev/null ||
  { echo "$build is not a Release build (cmake --preset release)"; exit 1; }
lib=$(readlink -f "$build/libfp8.so")
header=$src/include/fp8.h
[ "$lib" -nt "$header" ] || { echo "$lib is older than $header: build it first"; exit 1; }
readelf -S "$lib" | grep '\.debug_info' >/dev/null ||
  { echo "$lib has no DWARF: configure $build with -DFP8_ABI_DEBUG_INFO=ON and rebuild"; exit 1; }

major=$(sed -n 's/^#define FP8_VERSION_MAJOR \([0-9]*\).*/\1/p' "$header")
minor=$(sed -n 's/^#define FP8_VERSION_MINOR \([0-9]*\).*/\1/p' "$header")
# The symbols must already be what the release ships: SONAME, exactly fp8.h's functions, versioned.
bash "$here/check_abi.sh" "$lib" "$header" "$major" "$src/src/libfp8.map" "$minor"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fp8_abidw "$lib" "$header" "$work/libfp8.abi"
fp8_check_definitions "$work/libfp8.abi" "$header"
functions=$(grep -c '<elf-symbol name=' "$work/libfp8.abi")
declared=$(tr '\n' ' ' < "$header" | grep -o 'FP8_API [^;{]*(' | grep -c 'fp8_[a-z0-9_]*($')
[ "$functions" = "$declared" ] || { echo "abidw saw $functions functions, fp8.h declares $declared"; exit 1; }
fp8_constants "$header" > "$work/fp8_constants.txt"
mv "$work/libfp8.abi" "$here/libfp8.abi"
mv "$work/fp8_constants.txt" "$here/fp8_constants.txt"
echo "wrote $here/libfp8.abi ($functions functions of $(basename "$(readelf -d "$lib" | sed -n 's/.*soname: \[\(.*\)\]/\1/p')")," \
  "version $major.$minor) and $here/fp8_constants.txt ($(wc -l < "$here/fp8_constants.txt") constants)"
