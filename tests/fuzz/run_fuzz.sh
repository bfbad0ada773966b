#!/usr/bin/env bash
# Builds the readers' libFuzzer targets with clang++ (not the project's compiler), seeds them with
# valid files from the encoders, and runs each for a bounded time under ASan and UBSan.
#   run_fuzz.sh <source dir> <work dir>
# FP8_FUZZ_SECONDS (default 30) per fuzzer; FP8_FUZZ_CXX (default clang++). Exits 77 (skipped) only
# when clang++ cannot build a -fsanitize=fuzzer program; 1 when a fuzzer finds something.
set -uo pipefail
src=$(cd "$1" && pwd)
work=$2
seconds=${FP8_FUZZ_SECONDS:-30}
cxx=${FP8_FUZZ_CXX:-clang++}
mkdir -p "$work"
work=$(cd "$work" && pwd)

if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz_readers: SKIPPED: $cxx not found (Debian: apt-get install clang libclang-rt-14-dev)"
  exit 77
fi
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$work/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$work/probe.cpp" -o "$work/probe" >"$work/probe.log" 2>&1; then
  echo "fuzz_readers: SKIPPED: $cxx cannot build with -fsanitize=fuzzer,address,undefined" \
    "(Debian: apt-get install libclang-rt-14-dev):"
  cat "$work/probe.log"
  exit 77
fi

io_sources=("$src/src/io/bytes.cpp" "$src/src/io/container.cpp" "$src/src/io/safetensors.cpp"
  "$src/src/io/checkpoint_format.cpp" "$src/src/backend/cpu_optimizer.cpp" "$src/src/core/dtype.cpp"
  "$src/src/core/error.cpp")
includes=(-I"$src/src" -I"$src/include")
fuzz_flags=(-std=c++17 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
  -fno-sanitize-recover=undefined)

echo "fuzz_readers: building with $("$cxx" --version | head -n1)"
pids=()
for name in fuzz_checkpoint fuzz_safetensors; do
  "$cxx" "${fuzz_flags[@]}" "${includes[@]}" "$src/tests/fuzz/$name.cpp" "${io_sources[@]}" -lz \
    -o "$work/$name" >"$work/$name.build.log" 2>&1 &
  pids+=($!)
done
"$cxx" -std=c++17 -O1 "${includes[@]}" "$src/tests/fuzz/make_seeds.cpp" "${io_sources[@]}" -lz \
  -o "$work/make_seeds" >"$work/make_seeds.build.log" 2>&1 || { cat "$work/make_seeds.build.log"; exit 1; }
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    cat "$work"/*.build.log
    echo "fuzz_readers: FAILED to build the fuzzers"
    exit 1
  fi
done

rm -rf "$work/seeds" "$work/artifacts"
mkdir -p "$work/seeds/checkpoint" "$work/seeds/safetensors" "$work/artifacts"
"$work/make_seeds" "$work/seeds" || { echo "fuzz_readers: FAILED to write the seeds"; exit 1; }

# Both fuzzers at once (one core each), each with a fresh working corpus grown from the seeds.
run() {  # name, seed kind, extra flags...
  local name=$1 kind=$2
  shift 2
  rm -rf "$work/corpus_$kind"
  mkdir -p "$work/corpus_$kind"
  "$work/$name" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=30 -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/$name-" "$@" "$work/corpus_$kind" "$work/seeds/$kind" >"$work/$name.log" 2>&1
}
echo "fuzz_readers: running each fuzzer for ${seconds} s"
run fuzz_checkpoint checkpoint &
p1=$!
run fuzz_safetensors safetensors -dict="$src/tests/fuzz/safetensors.dict" &
p2=$!
status=0
wait $p1 || status=1
wait $p2 || status=1
for name in fuzz_checkpoint fuzz_safetensors; do
  echo "---- $name"
  grep -E "^stat::(number_of_executed_units|peak_rss_mb|new_units_added)|Done [0-9]+ runs" "$work/$name.log" || true
done
if [ "$status" -ne 0 ]; then
  for name in fuzz_checkpoint fuzz_safetensors; do
    if grep -qE "ERROR: |==ERROR|runtime error|deadly signal|Test unit written" "$work/$name.log"; then
      echo "==== $name found a problem:"
      tail -n 60 "$work/$name.log"
    fi
  done
  echo "fuzz_readers: FAILED; reproducers in $work/artifacts:"
  ls -l "$work/artifacts"
  exit 1
fi
echo "fuzz_readers: passed"
