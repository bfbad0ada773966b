#!/usr/bin/env bash
# The shared library's ABI: SONAME libfp8.so.<major>, and the exported symbols are exactly the
# functions that fp8.h declares with FP8_API (nothing else leaks, nothing declared is missing).
set -euo pipefail
lib=$1 header=$2 major=$3

soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = "libfp8.so.$major" ] || { echo "SONAME is '$soname', expected libfp8.so.$major"; exit 1; }

exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TtWwDdBbRr]$/ {print $3}' | sed 's/@.*//' | sort -u)
declared=$(tr '\n' ' ' < "$header" | grep -o 'FP8_API [^;{]*(' | grep -o 'fp8_[a-z0-9_]*($' | tr -d '(' | sort -u)

extra=$(comm -23 <(echo "$exported") <(echo "$declared"))
missing=$(comm -13 <(echo "$exported") <(echo "$declared"))
[ -z "$extra" ] || { echo "exported but not declared in fp8.h:"; echo "$extra"; exit 1; }
[ -z "$missing" ] || { echo "declared in fp8.h but not exported:"; echo "$missing"; exit 1; }
echo "ABI ok: SONAME $soname, $(echo "$declared" | wc -l) functions exported, all declared in fp8.h"
