#!/usr/bin/env bash
# The test deb_packages: cpack -G DEB makes the two Debian packages (cmake/fp8Packaging.cmake) in a
# scratch directory; they are checked (names, version, Depends, maintainer, description, which
# files each holds: together exactly what `cmake --install` installs), unpacked with dpkg-deb -x
# into a scratch root, and the pkg-config and find_package consumers are built against that tree
# and run (build_consumers.sh, as install_consumers does for cmake --install).
#   deb_packages.sh BUILD_DIR CONSUMER_SRC_DIR CC EXAMPLE
# Skipped (77) without dpkg-deb.
set -euo pipefail
build_dir=$1 src_dir=$2 cc=$3 example=$4
for tool in dpkg-deb cpack; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found (dpkg-deb: apt-get install dpkg)"; exit 77; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build_dir/CMakeCache.txt"; }
version=$(cache CMAKE_PROJECT_VERSION)
libdir=$(cache CMAKE_INSTALL_LIBDIR)
static=$(cache FP8_BUILD_STATIC)
major=${version%%.*}
arch=$(dpkg --print-architecture)

cpack --config "$build_dir/CPackConfig.cmake" -G DEB -B "$work/out" > "$work/cpack.log" 2>&1 ||
  { cat "$work/cpack.log"; echo "cpack -G DEB failed"; exit 1; }
runtime=$work/out/libfp8_${version}_${arch}.deb
dev=$work/out/libfp8-dev_${version}_${arch}.deb
fail=0
for deb in "$runtime" "$dev"; do
  [ -f "$deb" ] || { echo "cpack did not make $(basename "$deb"):"; ls "$work/out"; exit 1; }
done
[ "$(find "$work/out" -maxdepth 1 -name '*.deb' | wc -l)" = 2 ] || { echo "cpack made other packages:"; ls "$work/out"; fail=1; }

# The control fields.
field() { dpkg-deb -f "$1" "$2"; }
expect_field() {  # DEB FIELD REGEX
  local value
  value=$(field "$1" "$2")
  if ! [[ $value =~ $3 ]]; then echo "$(basename "$1"): $2 is '$value', expected /$3/"; fail=1; fi
}
expect_field "$runtime" Package '^libfp8$'
expect_field "$dev" Package '^libfp8-dev$'
for deb in "$runtime" "$dev"; do
  expect_field "$deb" Version "^${version//./\\.}$"
  expect_field "$deb" Architecture "^$arch$"
  expect_field "$deb" Maintainer '^[^<>]+ <[^<>@]+@[^<>@]+>$'
  expect_field "$deb" Description '^[^[:space:]].*'$'\n'' .+'  # a synopsis and an extended description
done
expect_field "$runtime" Section '^libs$'
expect_field "$dev" Section '^libdevel$'
expect_field "$dev" Depends "(^|, )libfp8 \\(= ${version//./\\.}\\)(,|$)"
# The runtime depends on the Debian libraries libfp8 links (versions from dpkg-shlibdeps), never on itself.
expect_field "$runtime" Depends '(^|, )libc6( |,|$)'
expect_field "$runtime" Depends '(^|, )libstdc\+\+6( |,|$)'
expect_field "$runtime" Depends '(^|, )zlib1g( |,|$)'
if [[ $(field "$runtime" Depends) =~ libfp8 ]]; then echo "libfp8 depends on itself"; fail=1; fi
[ "$(field "$runtime" Description | head -n1)" != "$(field "$dev" Description | head -n1)" ] ||
  { echo "both packages have the synopsis '$(field "$dev" Description | head -n1)'"; fail=1; }
# libfp8 tells dpkg-shlibdeps of packages built against it which libfp8 they need.
dpkg-deb -e "$runtime" "$work/control_runtime"
grep -Fx "libfp8 $major libfp8 (>= $version)" "$work/control_runtime/shlibs" >/dev/null ||
  { echo "libfp8's shlibs file: $(cat "$work/control_runtime/shlibs" 2>/dev/null)"; fail=1; }

# The files: the runtime has the library and nothing to build with; the dev package has the rest;
# together they hold exactly what cmake --install installs (an install() without COMPONENT would
# land in neither package).
files() { dpkg-deb -c "$1" | awk '$1 !~ /^d/ {sub(/^\.\//, "", $6); print $6}' | LC_ALL=C sort; }
files "$runtime" > "$work/runtime.txt"
files "$dev" > "$work/dev.txt"
must() {  # LIST PATH-REGEX WHAT
  grep -E "$2" "$1" >/dev/null || { echo "$(basename "$1" .txt) package lacks $3 ($2):"; sed 's/^/    /' "$1"; fail=1; }
}
must_not() {
  ! grep -E "$2" "$1" >/dev/null || { echo "$(basename "$1" .txt) package holds $3: $(grep -E "$2" "$1" | tr '\n' ' ')"; fail=1; }
}
L="usr/${libdir//./\\.}"
must "$work/runtime.txt" "^$L/libfp8\\.so\\.$major\$" "the SONAME link libfp8.so.$major"
must "$work/runtime.txt" "^$L/libfp8\\.so\\.${version//./\\.}\$" "the library libfp8.so.$version"
must_not "$work/runtime.txt" '\.h$|\.pc$|\.cmake$|\.a$|libfp8\.so$' "development files"
[ "$(wc -l < "$work/runtime.txt")" = 2 ] || { echo "runtime package holds more than the library:"; cat "$work/runtime.txt"; fail=1; }
must "$work/dev.txt" '^usr/include/fp8\.h$' "the header"
must "$work/dev.txt" "^$L/libfp8\\.so\$" "the libfp8.so link"
must "$work/dev.txt" "^$L/pkgconfig/fp8\\.pc\$" "fp8.pc"
for f in fp8Config.cmake fp8ConfigVersion.cmake fp8Targets.cmake FindNCCL.cmake; do
  must "$work/dev.txt" "^$L/cmake/fp8/$f\$" "$f"
done
if [ "$static" = ON ]; then
  must "$work/dev.txt" "^$L/libfp8\\.a\$" "the static library"
  must "$work/dev.txt" "^$L/cmake/fp8/fp8StaticTargets\\.cmake\$" "fp8StaticTargets.cmake"
fi
must_not "$work/dev.txt" 'libfp8\.so\.' "the shared library itself"
# dpkg-deb -c lists a symlink as "name -> target": the SONAME link must point to the library.
dpkg-deb -c "$runtime" | grep -E "libfp8\\.so\\.$major -> libfp8\\.so\\.${version//./\\.}\$" >/dev/null ||
  { echo "libfp8.so.$major does not point to libfp8.so.$version"; fail=1; }
dpkg-deb -c "$dev" | grep -E "libfp8\\.so -> libfp8\\.so\\.$major\$" >/dev/null ||
  { echo "libfp8.so does not point to libfp8.so.$major"; fail=1; }
DESTDIR="$work/installed" cmake --install "$build_dir" --prefix /usr >/dev/null
(cd "$work/installed" && find . ! -type d | sed 's|^\./||' | LC_ALL=C sort) > "$work/installed.txt"
if ! diff <(LC_ALL=C sort "$work/runtime.txt" "$work/dev.txt") "$work/installed.txt" > "$work/diff.txt"; then
  echo "the two packages together differ from what cmake --install installs (< packages, > install):"
  cat "$work/diff.txt"; fail=1
fi
[ "$fail" = 0 ] || exit 1
echo "packages: $(basename "$runtime") ($(wc -l < "$work/runtime.txt") files), $(basename "$dev") ($(wc -l < "$work/dev.txt") files)"

# Unpacked into a scratch root, they are a usable libfp8 for both kinds of consumers.
dpkg-deb -x "$runtime" "$work/root"
dpkg-deb -x "$dev" "$work/root"
bash "$(dirname "$0")/build_consumers.sh" "$work/root/usr" "$libdir" "$src_dir" "$cc" "$example" "$work"
# The consumers ran against the unpacked library, not the build tree's.
loaded=$(ldd "$work/consumer_pc" | awk '$1 == "libfp8.so.'"$major"'" {print $3}')
if [ -z "$loaded" ] || [ "$(readlink -f "$loaded")" != "$(readlink -f "$work/root/usr/$libdir/libfp8.so.$major")" ]; then
  echo "the pkg-config consumer does not load the unpacked libfp8.so.$major:"; ldd "$work/consumer_pc"; exit 1
fi
echo "deb packages ok"
