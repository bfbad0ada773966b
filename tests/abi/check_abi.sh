#!/usr/bin/env bash
# The shared library's ABI: SONAME libfp8.so.<major>, and the exported symbols are exactly the
# functions that fp8.h declares with FP8_API (nothing else leaks, nothing declared is missing).
# With the version script (src/libfp8.map) and the project's minor version also given:
# - the map names exactly those functions, each once, in nodes FP8_<major>.<minor'> (minor' no
#   newer than the project's), with no wildcard among the global symbols, so a new function cannot
#   be forgotten in it (it would silently become local);
# - every exported symbol carries a version (the default one, @@), the node the map puts it in.
set -euo pipefail
lib=$1 header=$2 major=$3 map=${4:-} minor=${5:-}

soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = "libfp8.so.$major" ] || { echo "SONAME is '$soname', expected libfp8.so.$major"; exit 1; }

# name@@VERSION (or a bare name) for every defined function or object in the dynamic symbol table.
exported_versioned=$(nm -D --defined-only --with-symbol-versions "$lib" | awk '$2 ~ /^[TtWwDdBbRr]$/ {print $3}' | sort -u)
exported=$(echo "$exported_versioned" | sed 's/@.*//' | sort -u)
declared=$(tr '\n' ' ' < "$header" | grep -o 'FP8_API [^;{]*(' | grep -o 'fp8_[a-z0-9_]*($' | tr -d '(' | sort -u)

extra=$(comm -23 <(echo "$exported") <(echo "$declared"))
missing=$(comm -13 <(echo "$exported") <(echo "$declared"))
[ -z "$extra" ] || { echo "exported but not declared in fp8.h:"; echo "$extra"; exit 1; }
[ -z "$missing" ] || { echo "declared in fp8.h but not exported:"; echo "$missing"; exit 1; }
echo "ABI ok: SONAME $soname, $(echo "$declared" | wc -l) functions exported, all declared in fp8.h"

[ -n "$map" ] || exit 0
[ -n "$minor" ] || { echo "usage: check_abi.sh LIB HEADER MAJOR [MAP MINOR]"; exit 2; }

# The map as "node symbol" lines for its global symbols, "node <local>" for its local patterns and
# "node ^parent" for each node's parent; comments stripped.
parsed=$(sed 's/#.*//' "$map" | tr '\n\t' '  ' | sed 's|/\*|\x01|g; s|\*/|\x02|g; s|\x01[^\x02]*\x02| |g' |
  sed 's/[{};]/ & /g; s/[[:space:]]*:/: /g' | tr -s ' ' '\n' | awk '
    NF == 0 { next }
    depth == 0 && $0 == "{" { depth = 1; section = "global:"; next }
    depth == 0 && $0 == ";" { node = ""; closed = 0; next }
    depth == 0 && node == "" { node = $0; next }
    depth == 0 && closed { print node, "^" $0; next }
    depth == 1 && $0 == "}" { depth = 0; closed = 1; next }
    depth == 1 && ($0 == "global:" || $0 == "local:") { section = $0; next }
    depth == 1 && $0 == ";" { next }
    depth == 1 && section == "global:" { print node, $0; next }
    depth == 1 { print node, "<local>", $0 }')
nodes=$(echo "$parsed" | awk '{print $1}' | sort -u)
[ -n "$nodes" ] || { echo "$map: no version node found"; exit 1; }
fail=0
for node in $nodes; do
  if ! [[ $node =~ ^FP8_${major}\.([0-9]+)$ ]]; then
    echo "$map: node '$node' is not named FP8_${major}.<minor> (the scheme of this major version)"; fail=1
  elif [ "${BASH_REMATCH[1]}" -gt "$minor" ]; then
    echo "$map: node '$node' is newer than the project's version ${major}.${minor} (CMakeLists.txt's project())"; fail=1
  fi
done
mapped=$(echo "$parsed" | awk '$2 != "<local>" && $2 !~ /^\^/ {print $2}')
wild=$(echo "$mapped" | grep '[][*?]' || true)
[ -z "$wild" ] || { echo "$map: wildcards among the global symbols (name every function): $wild"; fail=1; }
twice=$(echo "$mapped" | sort | uniq -d)
[ -z "$twice" ] || { echo "$map: listed more than once: $twice"; fail=1; }
not_mapped=$(comm -13 <(echo "$mapped" | sort -u) <(echo "$declared"))
not_declared=$(comm -23 <(echo "$mapped" | sort -u) <(echo "$declared"))
if [ -n "$not_mapped" ]; then
  echo "declared in fp8.h with FP8_API but not listed in $map (add them to the node of this release, FP8_${major}.${minor}):"
  echo "$not_mapped"; fail=1
fi
if [ -n "$not_declared" ]; then
  echo "listed in $map but not declared in fp8.h with FP8_API:"; echo "$not_declared"; fail=1
fi

# Every exported symbol has a version, the one of the node that lists it.
expected=$(echo "$parsed" | awk '$2 != "<local>" && $2 !~ /^\^/ {print $2 "@@" $1}' | sort -u)
unversioned=$(echo "$exported_versioned" | grep -v '@' || true)
[ -z "$unversioned" ] || { echo "exported without a symbol version:"; echo "$unversioned"; fail=1; }
wrong=$(comm -13 <(echo "$expected") <(echo "$exported_versioned" | grep '@'))
[ -z "$wrong" ] || { echo "exported with another version than the map gives (or a non-default one):"; echo "$wrong"; fail=1; }
[ "$fail" = 0 ] || exit 1
echo "symbol versions ok: $(echo "$mapped" | wc -l) functions in $(echo "$nodes" | wc -w) node(s) ($(echo "$nodes" | tr "\n" " " | sed "s/ $//")), all versioned"
