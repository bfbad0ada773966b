#!/usr/bin/env bash
# One call on a GPU machine: build (cmake + ninja), run the GPU test suite, run the benchmarks and
# their torch peers, print the ratio table last. Logs and JSON go to $OUT (default ./device-out).
# RUN_TESTS=0, RUN_EXAMPLE=0, RUN_BENCH=0, RUN_HOST=0, RUN_GRAPH=0 or RUN_PEER=0 leave a stage out; BENCHES (below) picks
# benchmarks. RUN_TORCH=1 adds the PyTorch stage (libfp8.torch's GPU tests, the GPT presets; see below);
# RUN_MULTI=1 the runs over several GPUs; RUN_SANITIZER=1 the GPU suite under compute-sanitizer.
# Dependencies missing on the GPU image (GoogleTest, zlib and DLPack headers, the Fashion-MNIST
# files) come from .device/ when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; nvcc --version | tail -2;
  git log -1 --format='commit %H' 2>/dev/null; date -u; } | tee "$OUT/run.log"

cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
if ! ls /usr/local/cuda/include/nccl.h /usr/include/nccl.h >/dev/null 2>&1; then
  nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else nvidia.nccl.__path__[0])' 2>/dev/null)
  cmake_args+=(-DNCCL_ROOT="$nccl_root")
fi
if [ ! -f /usr/include/zlib.h ] && [ -d .device/zlib/include ]; then
  libz=$(ldconfig -p | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')
  cmake_args+=(-DZLIB_INCLUDE_DIR="$PWD/.device/zlib/include" -DZLIB_LIBRARY="$libz")
fi
if [ ! -f /usr/include/dlpack/dlpack.h ] && [ -d .device/dlpack ]; then
  cmake_args+=(-DFP8_DLPACK_INCLUDE_DIR="$PWD/.device/dlpack")
fi
if ! ls /usr/lib/*/cmake/GTest /usr/lib/cmake/GTest >/dev/null 2>&1 && [ -d .device/googletest ]; then
  cmake_args+=(-DFP8_GTEST_SOURCE_DIR="$PWD/.device/googletest")
fi

t0=$(date +%s)
cmake -S . -B build/device "${cmake_args[@]}" ${EXTRA_CMAKE_ARGS:-} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cmake --build build/device -j 16 >> "$OUT/build.log" 2>&1 || { grep -E "error|Error" -A5 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

[ "${RUN_TESTS:-1}" = 1 ] && ctest --test-dir build/device -L gpu --output-on-failure --timeout 600 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

# RUN_SANITIZER=1: the GPU suite again under compute-sanitizer, each tool over every program (the
# exhaustive encoder check and the test of more than 2^31 elements left out: instrumented, they take
# hours), one summary line per tool; logs in $OUT/sanitizer_<tool>.log. CUDA API errors are not
# reported: libfp8 checks every call's status itself, and NCCL's communicator set-up probes its
# kernels with calls that fail by design (56 such reports drowned gpu_dist's memcheck summary).
# SANITIZER_TOOLS picks the tools (default all three), SANITIZER_TIMEOUT the limit per program.
if [ "${RUN_SANITIZER:-0}" = 1 ]; then
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
    programs=0 failed=""
    for t in build/device/tests/gpu_*; do
      [ -x "$t" ] && [ "${t##*/}" != gpu_encoder_exhaustive ] || continue
      programs=$((programs + 1))
      GTEST_FILTER='-*LargerThan2To31*' timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool "$tool" \
        --report-api-errors no --error-exitcode 99 "$t" >> "$OUT/sanitizer_$tool.log" 2>&1 || failed="$failed ${t##*/}($?)"
    done
    errors=$(grep -o "ERROR SUMMARY: [0-9]*" "$OUT/sanitizer_$tool.log" | awk '{n += $3} END {print n + 0}')
    echo "compute-sanitizer $tool: $programs programs, $errors errors, failed:${failed:- none}"
  done | tee "$OUT/sanitizer.md"
fi

# The main job on the real data: bf16 and FP8 runs side by side; fails when FP8 trails by > 0.5 points.
if [ "${RUN_EXAMPLE:-1}" = 1 ]; then
  data=/usr/share/datasets/fashion-mnist
  [ -d "$data" ] || data=$PWD/.device/fashion-mnist
  build/device/examples/train_fashion_mnist --data "$data" --max-accuracy-gap 0.5 ${EXAMPLE_ARGS:-} 2>&1 |
    tee "$OUT/fashion_mnist.log" | tail -30
fi

# PyTorch: libfp8.torch's tests on CUDA, then the GPT on the Bible's bytes at gpt2s and 1b, each as
# torch bf16 eager, torch.compile bf16, libfp8 FP8 te and O2 (TORCH_PRESETS, GPT_STEPS_<preset>,
# GPT_ARGS change that). The text: $KJV, .device/kjv.txt, or written by `bible` (Debian's bible-kjv).
if [ "${RUN_TORCH:-0}" = 1 ]; then
  export FP8_LIBRARY=$PWD/build/device/libfp8.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1
  python3 tests/gpu/test_torch_gpu.py 2>&1 | tee "$OUT/torch_gpu_tests.log" | tail -8
  kjv=${KJV:-$PWD/.device/kjv.txt}
  [ -f "$kjv" ] || { command -v bible >/dev/null && bible Genesis1:1-Revelation22:21 > "$OUT/kjv.txt" && kjv=$OUT/kjv.txt; }
  : > "$OUT/gpt_table.md"
  for preset in ${TORCH_PRESETS:-gpt2s 1b}; do
    steps_var=GPT_STEPS_${preset//-/_}
    steps=${!steps_var:-$([ "$preset" = 1b ] && echo 150 || echo 300)}
    python3 examples/train_gpt.py --preset "$preset" --data "$kjv" --steps "$steps" --compile \
      --json "$OUT/gpt_$preset.json" ${GPT_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/gpt_$preset.log" | grep -E "^(run|preset|\|)" 
    { echo "### $preset ($steps steps)"; grep "^|" "$OUT/gpt_$preset.log"; echo; } >> "$OUT/gpt_table.md"
  done
  grep -E "^(OK|FAILED|Ran)" "$OUT/torch_gpu_tests.log"
  cat "$OUT/gpt_table.md"
fi

# Several GPUs (RUN_MULTI=1; the GPU suite above already ran gpu_dist_multi over all of them): the
# example data-parallel over every GPU, with the ranks on threads (every level, against the one-GPU
# run above) and with one process per GPU; libfp8's FP8 gradient exchange against NCCL's
# all-reduces; the data-parallel training step's scaling against torch DDP. NVLink multicast stays
# off (NCCL_NVLS_ENABLE=0).
if [ "${RUN_MULTI:-0}" = 1 ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ngpu=$(nvidia-smi -L | wc -l)
  data=/usr/share/datasets/fashion-mnist
  [ -d "$data" ] || data=$PWD/.device/fashion-mnist
  build/device/examples/train_fashion_mnist --data "$data" --ranks "$ngpu" --max-accuracy-gap 0.5 ${EXAMPLE_ARGS:-} 2>&1 |
    tee "$OUT/fashion_mnist_ranks.log" | tail -12
  id=$(mktemp -u /tmp/fp8-id.XXXXXX)
  for ((r = 0; r < ngpu; ++r)); do
    FP8_COMM_ID_FILE=$id FP8_WORLD_SIZE=$ngpu FP8_RANK=$r timeout 300 build/device/examples/train_fashion_mnist \
      --data "$data" --levels O2,O3 ${EXAMPLE_ARGS:-} > "$OUT/fashion_mnist_process$r.log" 2>&1 &
  done
  wait
  for ((r = 0; r < ngpu; ++r)); do echo "process $r:"; tail -4 "$OUT/fashion_mnist_process$r.log"; done
  build/device/bench/bench_allreduce "$OUT/bench_allreduce.json" 2>&1 | tee "$OUT/allreduce.md" | tail -40
  build/device/bench/bench_dist --ranks "$ngpu" "$OUT/bench_dist_ranks.json" 2>&1 | tee -a "$OUT/run.log"
  PYTHONUNBUFFERED=1 python3 bench/peer_dist.py --ranks "$ngpu" "$OUT/peer_dist_ranks.json" 2>&1 | grep -v Warning |
    tee -a "$OUT/run.log"
  python3 bench/report_dist.py "$OUT/bench_dist_ranks.json" "$OUT/peer_dist_ranks.json" | tee "$OUT/scaling.md"
fi

[ "${RUN_BENCH:-1}" = 1 ] || exit 0
# The host time of a layer call through the C API.
[ "${RUN_HOST:-1}" = 1 ] && build/device/bench/bench_host 2>&1 | tee "$OUT/host.md"
# A captured training step replayed as a CUDA graph against the same step queued call by call.
[ "${RUN_GRAPH:-1}" = 1 ] && build/device/bench/bench_graph "$OUT/bench_graph.json" 2>&1 | tee "$OUT/graph.md"
# BENCHES picks among quantize, gemm, linear, optimizer and dist (default: all); each has bench_<name>,
# peer_<name>.py and report_<name>.py.
BENCHES=${BENCHES:-quantize gemm linear optimizer dist}
for b in $BENCHES; do build/device/bench/bench_$b "$OUT/bench_$b.json" 2>&1 | tee -a "$OUT/run.log"; done
[ "${RUN_PEER:-1}" = 1 ] || exit 0
for b in $BENCHES; do
  PYTHONUNBUFFERED=1 python3 bench/peer_$b.py "$OUT/peer_$b.json" 2>&1 | grep -v Warning | tee -a "$OUT/run.log"
done
echo
[ -f "$OUT/gpu_tests.log" ] && grep -E "tests passed|tests failed|Skipped|Failed|Passed" "$OUT/gpu_tests.log" | tail -6
for b in $BENCHES; do
  python3 bench/report_$b.py "$OUT/bench_$b.json" "$OUT/peer_$b.json"; echo
done | tee "$OUT/table.md"
