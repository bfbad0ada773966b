#!/usr/bin/env bash
# The Python package as a user installs it: pip (no network: --no-index --no-build-isolation
# --no-deps) builds and installs bindings/python into a scratch directory, and a program run from
# elsewhere imports libfp8 from there, against this build's library (FP8_LIBRARY), and uses it.
# Skipped (77) without pip, setuptools or wheel (Debian: python3-pip python3-setuptools python3-wheel).
# Usage: python_package.sh <bindings/python> <libfp8.so> [python]
set -euo pipefail
src=$1 lib=$(realpath "$2") python=${3:-python3}
"$python" -m pip --version >/dev/null 2>&1 || { echo "SKIP: no pip for $python"; exit 77; }
"$python" -c "import setuptools, wheel" 2>/dev/null || { echo "SKIP: no setuptools or wheel for $python"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$src" "$tmp/src"  # (pip builds in the source tree: the checkout stays clean)
rm -rf "$tmp/src/build" "$tmp/src"/*.egg-info
PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --no-index --no-build-isolation --no-deps \
  --target "$tmp/site" "$tmp/src"
test -d "$tmp/site/libfp8-0.1.0.dist-info" || { echo "FAIL: pip wrote no dist-info"; exit 1; }
if ls "$tmp/site" | grep -q "^test_"; then echo "FAIL: the tests were installed with the package"; exit 1; fi
cd "$tmp"
FP8_LIBRARY=$lib PYTHONPATH=$tmp/site "$python" - "$tmp/site" <<'PY'
import sys
import libfp8
site = sys.argv[1]
assert libfp8.__file__.startswith(site), f"libfp8 imported from {libfp8.__file__}, not the installed {site}"
# A use of the library through the installed package: E4M3 codes round trip.
for x in (1.0, -2.5, 448.0):
    assert libfp8.decode(libfp8.encode(x)) == x, x
try:
    import torch  # noqa: F401
except ImportError:
    print(f"libfp8 {libfp8.version()} installed and imported from {site} (no torch: libfp8.torch not imported)")
    sys.exit(0)
import libfp8.torch as lt
assert lt.__file__.startswith(site), lt.__file__
print(f"libfp8 {libfp8.version()} and libfp8.torch installed and imported from {site}")
PY
