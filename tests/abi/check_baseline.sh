#!/usr/bin/env bash
# The test abi_baseline: the built libfp8.so against the ABI baseline of the last release
# (libfp8.abi, written by update_baseline.sh with libabigail's abidw, and fp8_constants.txt).
#
#   check_baseline.sh LIB HEADER BASELINE.abi BASELINE_CONSTANTS.txt
#
# Fails (1) when a program built against the last release could break:
# - a function of the baseline is gone or has another symbol version (abidiff's status bit 8,
#   ABIDIFF_ABI_INCOMPATIBLE_CHANGE, is set only for removed symbols);
# - a function's type changed, directly or through the types it uses: a parameter, a return type,
#   a typedef (fp8_dtype_t becoming int64_t), a struct's layout (abidiff's bit 4, ABIDIFF_ABI_CHANGE,
#   is set for any change it reports; libfp8.abignore keeps new functions out of the report, so
#   after it bit 4 means a change to what the baseline has);
# - a versioned struct (one that begins with uint32_t struct_size) changed other than by fields
#   appended past its old size (see below), or any other struct changed at all;
# - an FP8_* constant of fp8.h was removed or changed value (status codes, dtypes, attribute ids:
#   they are macros, which no ABI tool sees, so they are compared here); *_COUNT ones may grow.
# Passes when only additions were made: new functions (in a new version node), new constants,
# fields appended to versioned structs. They are listed for information.
# When the SONAME differs from the baseline's (a new major version) it fails saying the baseline
# must be regenerated. Skipped (77) without abidw/abidiff (Debian's abigail-tools), when the
# library has no DWARF, or on another architecture than the baseline's (x86-64).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=abi_common.sh
source "$here/abi_common.sh"
lib=$1 header=$2 baseline=$3 base_constants=$4

for tool in abidw abidiff; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found (apt-get install abigail-tools)"; exit 77; }
done
[ -f "$baseline" ] || { echo "no baseline $baseline: tests/abi/update_baseline.sh writes it"; exit 1; }
[ -f "$base_constants" ] || { echo "no baseline $base_constants: tests/abi/update_baseline.sh writes it"; exit 1; }
readelf -S "$lib" | grep '\.debug_info' >/dev/null ||
  { echo "SKIP: $lib has no DWARF to read its ABI from (configure with -DFP8_ABI_DEBUG_INFO=ON)"; exit 77; }

corpus_attr() { sed -n "s/^<abi-corpus .* $2='\([^']*\)'.*/\1/p" "$1" | head -n1; }
base_soname=$(corpus_attr "$baseline" soname)
soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
if [ "$soname" != "$base_soname" ]; then
  echo "The baseline $baseline describes $base_soname, this build is $soname: the major version"
  echo "changed, and with it everything may change. Regenerate the baseline for the new major version"
  echo "(tests/abi/update_baseline.sh, in the change that bumps the version) and this test compares"
  echo "against it from then on."
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fp8_abidw "$lib" "$header" "$work/current.abi"
base_arch=$(corpus_attr "$baseline" architecture) arch=$(corpus_attr "$work/current.abi" architecture)
if [ "$arch" != "$base_arch" ]; then
  echo "SKIP: the baseline describes $base_arch, this library is $arch"; exit 77
fi

# Every struct that fp8.h or the baseline defines must be defined in what was read here: a struct
# that the header filter did not recognise as fp8.h's (its DWARF names another path for the
# header) would be read as a mere declaration, which abidiff takes for the same type, and every
# change to its layout would go unseen.
fp8_check_definitions "$work/current.abi" "$header"
defined() { sed -n "s/.*<class-decl name='\\([^']*\\)' size-in-bits=.*/\\1/p" "$1" | LC_ALL=C sort -u; }
undefined=$(comm -23 <(defined "$baseline") <(defined "$work/current.abi"))
[ -z "$undefined" ] || { echo "The ABI read from $lib lacks the definitions of: $(echo "$undefined" | tr "\n" " ")"; exit 1; }

# Versioned structs may grow at the end: in a copy of the current ABI, each struct that begins
# with struct_size in the baseline is cut back to its baseline size (the fields that lie wholly
# past it are dropped). Whatever else changed in it (a field removed, retyped or moved, the size
# shrunk) still differs from the baseline. (libabigail's own has_data_member_inserted_at = end
# suppression would not do: it also hides a field retyped in the middle when the struct grows.)
awk '
  FNR == NR {
    if (match($0, /<class-decl name=.[^'\'' ]*. size-in-bits=.[0-9]+./)) {
      split(substr($0, RSTART, RLENGTH), a, "'\''"); name = a[2]; size = a[4]; first = 1
    } else if (first && $0 ~ /<var-decl name=/) {
      if ($0 ~ /<var-decl name=.struct_size./) versioned[name] = size
      first = 0
    } else if ($0 ~ /<\/class-decl>/) first = 0
    next
  }
  /<class-decl name=/ && !/\/>$/ {
    split($0, a, "'\''"); cur = (a[2] in versioned) ? a[2] : ""
    if (cur != "" && match($0, /size-in-bits=.[0-9]+./)) {
      size = substr($0, RSTART + 14, RLENGTH - 15) + 0
      if (size > versioned[cur]) sub(/size-in-bits=.[0-9]+./, "size-in-bits='\''" versioned[cur] "'\''")
    }
  }
  /<\/class-decl>/ { cur = "" }
  cur != "" && /<data-member .*layout-offset-in-bits=/ {
    match($0, /layout-offset-in-bits=.[0-9]+./)
    if (substr($0, RSTART + 23, RLENGTH - 24) + 0 >= versioned[cur]) { skipping = 1; next }
  }
  skipping { if ($0 ~ /<\/data-member>/) skipping = 0; next }
  { print }' "$baseline" "$work/current.abi" > "$work/current_cut.abi"

# The verdict: baseline against the cut copy, new functions suppressed (libfp8.abignore).
# --no-default-suppression: no system or ~/.abignore file may hide anything.
set +e
abidiff --no-default-suppression --suppressions "$here/libfp8.abignore" "$baseline" "$work/current_cut.abi" \
  > "$work/verdict.txt" 2>&1
status=$?
set -e
if (( status & 1 )); then  # ABIDIFF_ERROR (ABIDIFF_USAGE_ERROR, 2, comes with it)
  cat "$work/verdict.txt"; echo "abidiff failed (status $status)"; exit 1
fi
fail=0
if (( status & 8 )); then  # ABIDIFF_ABI_INCOMPATIBLE_CHANGE: symbols removed
  cat "$work/verdict.txt"
  echo "INCOMPATIBLE: functions of the last release are gone or have another symbol version (abidiff status $status)"
  fail=1
elif (( status & 4 )); then  # ABIDIFF_ABI_CHANGE, additions suppressed: the existing ABI changed
  cat "$work/verdict.txt"
  echo "INCOMPATIBLE: the functions or types of the last release changed (abidiff status $status)"
  echo "(Versioned structs were cut back to their size in the baseline before the comparison, so a"
  echo "field pushed past that size shows as deleted.)"
  fail=1
fi

# The constants of fp8.h.
fp8_constants "$header" > "$work/constants.txt"
constants_report=$(awk '
  FNR == NR { base[$1] = substr($0, length($1) + 2); order[++n] = $1; next }
  { cur[$1] = substr($0, length($1) + 2) }
  END {
    for (i = 1; i <= n; i++) {
      k = order[i]
      if (!(k in cur)) { print "removed constant " k " (was " base[k] ")"; bad = 1 }
      else if (cur[k] != base[k]) {
        if (k ~ /_COUNT$/ && cur[k] ~ /^[0-9]+$/ && base[k] ~ /^[0-9]+$/ && cur[k] + 0 > base[k] + 0) continue
        print "changed constant " k ": " base[k] " -> " cur[k]; bad = 1
      }
    }
    exit bad
  }' "$base_constants" "$work/constants.txt") || { echo "$constants_report"; echo "INCOMPATIBLE: fp8.h's pinned constants changed"; fail=1; }
[ "$fail" = 0 ] || exit 1

# Passed: say what was added since the baseline (for information; additions are allowed).
set +e
abidiff --no-default-suppression "$baseline" "$work/current.abi" > "$work/full.txt" 2>&1
full_status=$?
set -e
if [ "$full_status" != 0 ]; then
  echo "Additions since the baseline (allowed):"
  cat "$work/full.txt"
fi
added_constants=$(comm -13 <(awk '{print $1}' "$base_constants" | LC_ALL=C sort) <(awk '{print $1}' "$work/constants.txt" | LC_ALL=C sort))
[ -z "$added_constants" ] || { echo "New constants (allowed):"; echo "$added_constants"; }
echo "ABI baseline ok: $soname against $(basename "$baseline") ($(grep -c '<elf-symbol ' "$baseline") functions," \
  "$(wc -l < "$base_constants") constants): nothing removed or changed"
