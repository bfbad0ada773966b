# shellcheck shell=bash
# How libfp8's ABI is written down, shared by update_baseline.sh (which writes the baseline of a
# release), check_baseline.sh (the test abi_baseline) and selftest.sh. Sourced, not run.
#
# fp8_abidw LIB HEADER OUT
#   libabigail's description of LIB's public ABI: its exported functions with their symbol
#   versions, and the types of HEADER they use (struct layouts, typedefs), from the DWARF of the
#   entry points (CMakeLists.txt compiles src/api with -g for this). Types defined elsewhere (the
#   C++ objects behind the opaque handles) are left out, so are source locations (a comment added
#   to fp8.h changes nothing), DT_NEEDED (the CUDA runtime's SONAME is not libfp8's ABI) and
#   machine-specific paths: the file is the same on every machine that builds the same ABI.
#   About 0.1 s for libfp8.so (2 s without the header filter).
fp8_abidw() {
  local lib=$1 header=$2 out=$3 root
  root=$(cd "$(dirname "$header")/.." && pwd)
  header=$(cd "$(dirname "$header")" && pwd)/$(basename "$header")  # as the compiler saw it: absolute
  abidw --header-file "$header" --drop-private-types --exported-interfaces-only \
    --no-corpus-path --no-comp-dir-path --no-show-locs --no-elf-needed --type-id-style hash \
    --out-file "$out.tmp" "$lib"
  # What remains of paths: the translation units' names, made relative to the source tree.
  sed "s|path='$root/|path='|" "$out.tmp" > "$out"
  rm -f "$out.tmp"
}

# fp8_constants HEADER
#   "NAME VALUE" for every object-like FP8_* macro of HEADER (status codes, dtypes, attribute ids,
#   limits: the numbers fp8.h pins), sorted. The version macros change with every release and are
#   left out, so are FP8_API and the include guard.
fp8_constants() {
  "${CC:-cc}" -E -dM -x c "$1" | awk '
    $1 == "#define" && $2 ~ /^FP8_/ && $2 !~ /\(/ && $2 !~ /^FP8_(API|H|VERSION_[A-Z]+)$/ && NF > 2 {
      name = $2; $1 = ""; $2 = ""; sub(/^ +/, ""); print name, $0
    }' | LC_ALL=C sort
}

# fp8_check_definitions ABI HEADER
#   Fails, naming them, if ABI mentions structs that HEADER defines (typedef struct fp8_x { ... })
#   but holds no definition of them: abidw then did not take the DWARF's header for HEADER (another
#   path), and a struct known only as a declaration would hide every change to its layout.
fp8_check_definitions() {
  local abi=$1 header=$2 name missing=""
  for name in $(grep -o 'typedef struct fp8_[a-z0-9_]* {' "$header" | awk '{print $3}' | LC_ALL=C sort -u); do
    if grep "<class-decl name='$name' " "$abi" >/dev/null &&
       ! grep "<class-decl name='$name' size-in-bits=" "$abi" >/dev/null; then
      missing="$missing $name"
    fi
  done
  [ -z "$missing" ] && return 0
  echo "$abi has no definition of:$missing (does the library's DWARF name $header as their header?)"
  return 1
}
