#!/usr/bin/env bash
# The test abi_baseline_selftest: check_baseline.sh must fail on each way of breaking the ABI and
# pass on each allowed addition. A stand-in library (selftest/stub.c: five of fp8.h's functions
# over its structs and typedefs, symbol-versioned like libfp8) is built from the real fp8.h as the
# "release", its baseline written the way update_baseline.sh writes libfp8's, and then rebuilt
# from altered copies of the header, each checked against that baseline. About 2 s in all.
#
#   selftest.sh CC HEADER
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=abi_common.sh
source "$here/abi_common.sh"
export CC=$1
header=$2
for tool in abidw abidiff; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found (apt-get install abigail-tools)"; exit 77; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
v1="fp8_comm_get_id fp8_device_info_init fp8_device_query fp8_dtype_size fp8_status_string"

# build NAME SED_SCRIPT CFLAGS SONAME_MAJOR NODE_0.1_SYMBOLS [NODE_0.2_SYMBOLS]
#   the stand-in built from fp8.h altered by SED_SCRIPT, into $work/NAME/libfp8.so
build() {
  local name=$1 edit=$2 cflags=$3 major=$4 node1=$5 node2=${6:-} s
  mkdir -p "$work/$name/include"
  sed -e "$edit" "$header" > "$work/$name/include/fp8.h"
  {
    echo "FP8_0.1 { global:"; for s in $node1; do echo "  $s;"; done; echo "local: *; };"
    if [ -n "$node2" ]; then echo "FP8_0.2 { global:"; for s in $node2; do echo "  $s;"; done; echo "} FP8_0.1;"; fi
  } > "$work/$name/libfp8.map"
  # shellcheck disable=SC2086
  "$CC" -std=c99 -g -O2 -fPIC -shared -fvisibility=hidden -I"$work/$name/include" $cflags \
    -Wl,-soname,libfp8.so."$major" -Wl,--version-script="$work/$name/libfp8.map" \
    "$here/selftest/stub.c" -o "$work/$name/libfp8.so"
}

# The release: the real header; its baseline.
build release '' '' 0 "$v1"
fp8_abidw "$work/release/libfp8.so" "$work/release/include/fp8.h" "$work/baseline.abi"
fp8_check_definitions "$work/baseline.abi" "$work/release/include/fp8.h"
fp8_constants "$work/release/include/fp8.h" > "$work/constants.txt"

failures=0
# expect NAME pass|fail [TEXT]: check_baseline.sh's verdict on $work/NAME, and TEXT in its output
expect() {
  local name=$1 want=$2 text=${3:-} rc=0
  bash "$here/check_baseline.sh" "$work/$name/libfp8.so" "$work/$name/include/fp8.h" "$work/baseline.abi" \
    "$work/constants.txt" > "$work/$name/out.txt" 2>&1 || rc=$?
  local got=other
  [ "$rc" = 0 ] && got=pass
  [ "$rc" = 1 ] && got=fail
  if [ "$got" != "$want" ] || { [ -n "$text" ] && ! grep -F -- "$text" "$work/$name/out.txt" >/dev/null; }; then
    echo "WRONG: $name: expected $want${text:+ saying '$text'}, got exit status $rc:"
    sed 's/^/    /' "$work/$name/out.txt"
    failures=$((failures + 1))
  else
    printf '%-28s %s%s\n' "$name" "$want" "${text:+ ($text)}"
  fi
}
info='/^typedef struct fp8_device_info {/,/^} fp8_device_info_t;/'

# Allowed: nothing changed; additions.
build same '' '' 0 "$v1"
expect same pass
build added_function 's/^FP8_API fp8_status_t fp8_device_query(.*/&\nFP8_API int32_t fp8_selftest_added(int32_t x);\n#define FP8_SELFTEST_CONSTANT 7/;
  s/^#define FP8_RECIPE_ATTR_COUNT \([0-9]*\)/#define FP8_RECIPE_ATTR_COUNT 99/' \
  -DSELFTEST_ADD_FUNCTION 0 "$v1" fp8_selftest_added
expect added_function pass fp8_selftest_added
build appended_field "${info}"'s/^\(  int64_t cublaslt_version;.*\)/\1\n  int64_t selftest_appended;/' '' 0 "$v1"
expect appended_field pass selftest_appended

# Breaks: each must fail.
build removed_function '' -DSELFTEST_REMOVE_DTYPE_SIZE 0 "${v1/fp8_dtype_size/}"
expect removed_function fail "functions of the last release are gone"
build moved_to_new_version '' '' 0 "${v1/fp8_dtype_size/}" fp8_dtype_size
expect moved_to_new_version fail "functions of the last release are gone"
build removed_field "${info}"'{/^  int32_t multiprocessor_count;/d}' '' 0 "$v1"
expect removed_field fail "multiprocessor_count"
build retyped_field_and_appended "${info}"'{s/^  int32_t fp8_gemm;/  int64_t fp8_gemm;/; s/^\(  int64_t cublaslt_version;.*\)/\1\n  int64_t selftest_appended;/}' '' 0 "$v1"
expect retyped_field_and_appended fail "fp8_gemm"
build changed_typedef 's/^typedef int32_t fp8_dtype_t;/typedef int64_t fp8_dtype_t;/' '' 0 "$v1"
expect changed_typedef fail "fp8_dtype_t"
build grown_plain_struct 's/^\(  unsigned char bytes\[FP8_COMM_ID_BYTES\];\)/\1\n  int32_t selftest_appended;/' '' 0 "$v1"
expect grown_plain_struct fail "fp8_comm_id"
build changed_constant 's/^#define FP8_DTYPE_E4M3 3 /#define FP8_DTYPE_E4M3 5 /' '' 0 "$v1"
expect changed_constant fail "changed constant FP8_DTYPE_E4M3: 3 -> 5"
build removed_constant '/^#define FP8_ERR_INTERNAL /d' '' 0 "$v1"
expect removed_constant fail "removed constant FP8_ERR_INTERNAL"
build new_major '' '' 1 "$v1"
expect new_major fail "Regenerate the baseline"

[ "$failures" = 0 ] || { echo "$failures case(s) judged wrongly"; exit 1; }
echo "check_baseline.sh judged every case right"
