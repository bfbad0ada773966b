// The cost of data parallelism on one GPU (NCCL with one rank): a Linear training step at MS-AMP O2
// (forward, backward, AdamW step, zero_grad) without a communicator, with one, and with one and
// backward sync (each bucket's exchange started from inside the backward). (A group of one rank has
// nothing to average or agree on: what remains is the checks for NCCL's asynchronous errors and the
// bookkeeping of the buckets.)
//
// With --ranks N, data-parallel scaling over N GPUs instead: the training step of bench_linear's
// MLP block (LayerNorm -> Linear 4096->16384 -> GELU -> Linear 16384->4096, bias on both Linears,
// bf16 activations, 16384 tokens per rank: weak scaling, as DDP is used) at MS-AMP O2 with AdamW,
// on 1 GPU without a communicator and on N GPUs (every rank in this process on a thread of its own,
// one CUDA context per GPU, joined by fp8_comm_create_local: NCCL), with backward sync (each
// bucket's exchange started in the backward) and without (the exchange at the step). One step =
// fp8_model_forward, fp8_model_backward (the output gradient random, dx computed as for a block
// inside a network), fp8_optimizer_step, fp8_optimizer_zero_grad. Timing: 5 warm-ups, then 30
// repetitions, the three steps alternating within each; each repetition the ranks synchronise, meet
// at a host barrier and time their step with CUDA events on their own stream; the repetition's time
// is the slowest rank's; the median of the 30. Throughput = N * 16384 tokens / step time; scaling =
// throughput(N) / throughput(1). Checks (exit status 3 when one fails): the ranks' weights are
// bit-identical after the timed steps (every dtype's flat value storage, byte for byte), every step
// was applied with a finite non-zero gradient norm, the weights moved, the outputs are finite and
// not zero, and the 1-GPU step is not faster than the GPU's FP8 peak allows (work was skipped).
// NCCL_NVLS_ENABLE is set to 0 (NVLink multicast off).
//
// Usage: bench_dist [out.json]
//        bench_dist --ranks N [out.json]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.hpp"

namespace {

using fp8bench::event_ms;

fp8_context_t* ctx = nullptr;
cudaStream_t stream = nullptr;
FILE* json = nullptr;
bool first_row = true;

void row(const std::string& name, double ms) {
  std::printf("%-52s %9.4f ms\n", name.c_str(), ms);
  std::fflush(stdout);
  std::fprintf(json, "%s {\"name\": \"%s\", \"ms\": %.5f}", first_row ? "" : ",\n", name.c_str(), ms);
  first_row = false;
}

struct Step {
  fp8_model_t* model = nullptr;
  fp8_optimizer_t* opt = nullptr;
  fp8_comm_t* comm = nullptr;
};

// Converts `m` with `recipe` and turns its autowrap on (forward and backward in FP8). A failure
// ends the process at once (fp8bench::die: a rank's threads call it too).
void convert(fp8_model_t* m, const char* recipe) {
  fp8_recipe_t* r = nullptr;
  RCHECK_FP8(fp8_recipe_create(&r));
  RCHECK_FP8(fp8_recipe_parse(r, recipe));
  RCHECK_FP8(fp8_convert_model(m, r, nullptr));
  fp8_recipe_destroy(r);
  RCHECK_FP8(fp8_model_set_autowrap(m, 1));
}

// Linear k -> n with bias at O2, data-parallel over a one-rank NCCL communicator when `dp`, with
// backward sync when `backward_sync`.
Step make_step(int64_t k, int64_t n, bool dp, bool backward_sync) {
  Step s;
  CHECK_FP8(fp8_model_create(&s.model, ctx));
  CHECK_FP8(fp8_model_add_linear(s.model, "fc", k, n, 1, nullptr));
  fp8_tensor_t *w = nullptr, *b = nullptr;
  CHECK_FP8(fp8_model_parameter(s.model, "fc.weight", &w, nullptr));
  CHECK_FP8(fp8_model_parameter(s.model, "fc.bias", &b, nullptr));
  fp8bench::fill_normal(w, 1.0f / std::sqrt(static_cast<float>(k)), 1);
  fp8bench::fill_normal(b, 0.1f, 2);
  convert(s.model, "backend=msamp, opt_level=O2, small_layer_fallback=0");
  if (dp) {
    CHECK_FP8(fp8_comm_create_local(&s.comm, &ctx, 1));
    CHECK_FP8(fp8_model_set_comm(s.model, s.comm));
    if (backward_sync) CHECK_FP8(fp8_model_set_backward_sync(s.model, 1));
  }
  CHECK_FP8(fp8_optimizer_create(&s.opt, s.model, FP8_OPTIMIZER_ADAMW));
  return s;
}

void destroy(Step& s) {
  fp8_optimizer_destroy(s.opt);
  fp8_model_destroy(s.model);
  fp8_comm_destroy(s.comm);
}

}  // namespace

int scaling_main(int argc, char** argv);

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--ranks") == 0) return scaling_main(argc, argv);
  json = std::fopen(argc > 1 ? argv[1] : "bench_dist.json", "w");
  if (!json) return 1;
  CHECK_FP8(fp8_context_create(&ctx, 0));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_FP8(fp8_context_set_stream(ctx, stream));
  std::fprintf(json, "[\n");

  // A Linear training step, 16384 tokens, 8192 -> 8192, bf16 activations.
  const int64_t m = 16384, k = 8192, n = 8192;
  fp8_tensor_t *x = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, k), *y = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, n);
  fp8_tensor_t *dy = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, n), *dx = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, k);
  fp8bench::fill_normal(x, 1.0f, 3);
  fp8bench::fill_normal(dy, 1e-3f, 4);
  // The steps alternate, each timed by itself, so that clocks drifting over the run weigh on all
  // alike; the medians of 30 each after 3 warm-ups.
  constexpr int kSteps = 3;
  const char* const names[kSteps] = {"O2 linear step 16384x8192->8192, no communicator",
                                     "O2 linear step 16384x8192->8192, NCCL 1 rank",
                                     "O2 linear step 16384x8192->8192, NCCL 1 rank, backward sync"};
  Step steps[kSteps] = {make_step(k, n, false, false), make_step(k, n, true, false), make_step(k, n, true, true)};
  const auto run = [&](Step& s) {
    CHECK_FP8(fp8_model_forward(s.model, x, y));
    CHECK_FP8(fp8_model_backward(s.model, dy, dx));
    CHECK_FP8(fp8_optimizer_step(s.opt));
    CHECK_FP8(fp8_optimizer_zero_grad(s.opt));
  };
  for (int w = 0; w < 3; ++w)
    for (Step& s : steps) run(s);
  std::vector<double> ms[kSteps];
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int rep = 0; rep < 30; ++rep)
    for (int dp = 0; dp < kSteps; ++dp) ms[dp].push_back(event_ms(stream, a, b, [&] { run(steps[dp]); }));
  double step_ms[kSteps];
  for (int dp = 0; dp < kSteps; ++dp) {
    std::sort(ms[dp].begin(), ms[dp].end());
    step_ms[dp] = ms[dp][ms[dp].size() / 2];
    row(names[dp], step_ms[dp]);
    destroy(steps[dp]);
  }
  std::printf("data-parallel overhead at 1 rank: %+.2f%% (backward sync: %+.2f%%)\n",
              100.0 * (step_ms[1] / step_ms[0] - 1.0), 100.0 * (step_ms[2] / step_ms[0] - 1.0));
  for (fp8_tensor_t* t : {x, y, dy, dx}) fp8_tensor_destroy(t);
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  fp8_context_destroy(ctx);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// --ranks N: data-parallel scaling of the MLP block's training step over N GPUs (see the top).

namespace scaling {

constexpr int64_t kTokens = 16384, kModel = 4096, kHidden = 16384;
constexpr int kWarm = 5, kReps = 30;
// The three steps timed, alternating within each repetition: 1 GPU (rank 0 alone, no
// communicator), N GPUs with backward sync, N GPUs with the exchange at the step.
enum Config { kSingle = 0, kBackwardSync = 1, kAtStep = 2, kConfigs = 3 };
constexpr int kDtypes = 5;
constexpr fp8_dtype_t kDtype[kDtypes] = {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16, FP8_DTYPE_E4M3, FP8_DTYPE_E5M2};
const char* const kDtypeName[kDtypes] = {"F32", "F16", "BF16", "E4M3", "E5M2"};
// Multiply-adds x 2 of one step: three GEMMs (forward, dgrad, wgrad) per Linear, two Linears.
constexpr double kStepFlops = 3.0 * 2.0 * 2.0 * kTokens * kModel * kHidden;
// Above the dense FP8 peak of an H100 or H200 (1979 TFLOP/s): a step this fast skipped work.
constexpr double kMaxTflops = 2000.0;

using fp8bench::SpinBarrier;
using fp8bench::this_rank;

// What each rank found after the timed steps.
struct RankOut {
  bool present[kConfigs] = {};
  fp8_optimizer_stats_t stats[kConfigs];
  uint64_t initial_hash[kConfigs] = {}, final_hash[kConfigs] = {};
  std::vector<unsigned char> values[kConfigs][kDtypes];  // the data-parallel models' value storage
  int fp8_linears[kConfigs] = {};                        // Linears whose forward, dgrad and wgrad all ran in FP8
  int64_t y_bad = 0, y_zero = 0, dx_bad = 0, dx_zero = 0, elements = 0;
};

struct Shared {
  int n = 0;
  std::vector<fp8_context_t*> ctxs;
  std::vector<fp8_comm_t*> comms[kConfigs];  // [kBackwardSync] and [kAtStep]: a group each
  std::vector<float> params[4];              // fc1.weight, fc1.bias, fc2.weight, fc2.bias
  std::vector<float> times[kConfigs];        // [rep * n + rank], ms
  std::vector<RankOut> out;
  SpinBarrier* barrier = nullptr;
  std::atomic<int> finished{0};
};
const char* const kParamName[4] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

std::vector<float> normal_floats(size_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

fp8_tensor_t* bf16_matrix(fp8_context_t* c, int64_t rows, int64_t cols, float sd, uint32_t seed) {
  fp8_tensor_t* t = nullptr;
  const int64_t shape[2] = {rows, cols};
  RCHECK_FP8(fp8_tensor_create(&t, c, FP8_DTYPE_BF16, 2, shape));
  if (sd > 0.0f) {
    const std::vector<float> v = normal_floats(static_cast<size_t>(rows * cols), sd, seed);
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = fp8::float_to_bf16(v[i]);
    RCHECK_FP8(fp8_tensor_copy_from_host(t, h.data(), h.size() * 2));
  }
  return t;
}

struct Trained {
  fp8_model_t* model = nullptr;
  fp8_optimizer_t* opt = nullptr;
};

// The MLP block at MS-AMP O2 with AdamW, data-parallel over `comm` when it is not NULL (collective).
Trained make_mlp(const Shared& g, fp8_context_t* c, fp8_comm_t* comm, bool backward_sync) {
  Trained t;
  RCHECK_FP8(fp8_model_create(&t.model, c));
  RCHECK_FP8(fp8_model_add_layernorm(t.model, "ln", kModel, 1e-5f, nullptr));
  RCHECK_FP8(fp8_model_add_linear(t.model, "fc1", kModel, kHidden, 1, nullptr));
  RCHECK_FP8(fp8_model_add_activation(t.model, "gelu", FP8_ACTIVATION_GELU, nullptr));
  RCHECK_FP8(fp8_model_add_linear(t.model, "fc2", kHidden, kModel, 1, nullptr));
  for (int i = 0; i < 4; ++i) {
    fp8_tensor_t* p = nullptr;
    RCHECK_FP8(fp8_model_parameter(t.model, kParamName[i], &p, nullptr));
    RCHECK_FP8(fp8_tensor_copy_from_host(p, g.params[i].data(), g.params[i].size() * sizeof(float)));
  }
  convert(t.model, "backend=msamp, opt_level=O2");
  if (comm) {
    RCHECK_FP8(fp8_model_set_comm(t.model, comm));
    if (backward_sync) RCHECK_FP8(fp8_model_set_backward_sync(t.model, 1));
  }
  RCHECK_FP8(fp8_optimizer_create(&t.opt, t.model, FP8_OPTIMIZER_ADAMW));
  return t;
}

// The bytes of the model's flat value storage of each dtype (after the context's work).
void read_values(fp8_context_t* c, fp8_model_t* m, std::vector<unsigned char> (&out)[kDtypes]) {
  RCHECK_FP8(fp8_context_synchronize(c));
  for (int d = 0; d < kDtypes; ++d) {
    void* data = nullptr;
    size_t bytes = 0;
    RCHECK_FP8(fp8_model_flat_storage(m, FP8_STORAGE_VALUES, kDtype[d], &data, &bytes));
    out[d].assign(bytes, 0);
    if (bytes) RCHECK_CUDA(cudaMemcpy(out[d].data(), data, bytes, cudaMemcpyDeviceToHost));
  }
}

uint64_t fnv1a(const std::vector<unsigned char> (&v)[kDtypes]) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& bytes : v) {
    for (unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // (a dtype boundary)
  }
  return h;
}

// Non-finite and zero elements of a bf16 tensor.
void count_bf16(const fp8_tensor_t* t, int64_t& bad, int64_t& zero, int64_t& elements) {
  int64_t n = 0;
  RCHECK_FP8(fp8_tensor_numel(t, &n));
  std::vector<uint16_t> h(static_cast<size_t>(n));
  RCHECK_FP8(fp8_tensor_copy_to_host(t, h.data(), h.size() * 2));
  bad = zero = 0;
  for (uint16_t v : h) {
    const float f = fp8::bf16_to_float(v);
    bad += !std::isfinite(f);
    zero += f == 0.0f;
  }
  elements = n;
}

void rank_main(Shared& g, int k) {
  this_rank = k;
  RCHECK_CUDA(cudaSetDevice(k));  // (libfp8 sets the device for its own calls; this is for ours)
  fp8_context_t* c = g.ctxs[static_cast<size_t>(k)];
  cudaStream_t st = nullptr;
  RCHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  RCHECK_FP8(fp8_context_set_stream(c, st));
  // This rank's own data: x and the output gradient dy, random, never zeros.
  fp8_tensor_t* x = bf16_matrix(c, kTokens, kModel, 1.0f, 5u + 1000u * static_cast<uint32_t>(k));
  fp8_tensor_t* dy = bf16_matrix(c, kTokens, kModel, 1e-3f, 6u + 1000u * static_cast<uint32_t>(k));
  fp8_tensor_t* y = bf16_matrix(c, kTokens, kModel, 0.0f, 0);
  fp8_tensor_t* dx = bf16_matrix(c, kTokens, kModel, 0.0f, 0);

  Trained m[kConfigs];
  if (k == 0) m[kSingle] = make_mlp(g, c, nullptr, false);
  m[kBackwardSync] = make_mlp(g, c, g.comms[kBackwardSync][static_cast<size_t>(k)], true);
  m[kAtStep] = make_mlp(g, c, g.comms[kAtStep][static_cast<size_t>(k)], false);
  RankOut& o = g.out[static_cast<size_t>(k)];
  for (int cfg = 0; cfg < kConfigs; ++cfg)
    if (m[cfg].model) {
      std::vector<unsigned char> v[kDtypes];
      read_values(c, m[cfg].model, v);  // (after set_comm: rank 0's weights everywhere)
      o.initial_hash[cfg] = fnv1a(v);
    }

  const auto step = [&](const Trained& t) {
    RCHECK_FP8(fp8_model_forward(t.model, x, y));
    RCHECK_FP8(fp8_model_backward(t.model, dy, dx));
    RCHECK_FP8(fp8_optimizer_step(t.opt));
    RCHECK_FP8(fp8_optimizer_zero_grad(t.opt));
  };
  cudaEvent_t a, b;
  RCHECK_CUDA(cudaEventCreate(&a));
  RCHECK_CUDA(cudaEventCreate(&b));
  RCHECK_FP8(fp8_context_synchronize(c));
  for (int it = 0; it < kWarm + kReps; ++it)
    for (int cfg = 0; cfg < kConfigs; ++cfg) {
      g.barrier->wait();  // every rank has synchronised: its previous step is done
      if (!m[cfg].model) continue;
      const float ms = event_ms(st, a, b, [&] { step(m[cfg]); });
      if (it >= kWarm) g.times[cfg][static_cast<size_t>((it - kWarm) * g.n + k)] = ms;
    }
  g.barrier->wait();

  RCHECK_FP8(fp8_context_synchronize(c));
  for (int cfg = 0; cfg < kConfigs; ++cfg) {
    if (!m[cfg].model) continue;
    o.present[cfg] = true;
    fp8_optimizer_stats_init(&o.stats[cfg]);
    RCHECK_FP8(fp8_optimizer_get_stats(m[cfg].opt, &o.stats[cfg]));
    read_values(c, m[cfg].model, o.values[cfg]);
    o.final_hash[cfg] = fnv1a(o.values[cfg]);
    if (cfg == kSingle)
      for (auto& v : o.values[cfg]) std::vector<unsigned char>().swap(v);
    for (int32_t layer : {1, 3}) {
      fp8_layer_report_t rep;
      fp8_layer_report_init(&rep);
      RCHECK_FP8(fp8_layer_get_report(m[cfg].model, layer, &rep));
      o.fp8_linears[cfg] += rep.fprop == 1 && rep.dgrad == 1 && rep.wgrad == 1;
    }
  }
  count_bf16(y, o.y_bad, o.y_zero, o.elements);
  count_bf16(dx, o.dx_bad, o.dx_zero, o.elements);

  for (Trained& t : m) {
    fp8_optimizer_destroy(t.opt);
    fp8_model_destroy(t.model);
  }
  for (fp8_tensor_t* t : {x, dy, y, dx}) fp8_tensor_destroy(t);
  RCHECK_FP8(fp8_context_set_stream(c, nullptr));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(st);
  g.finished.fetch_add(1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace scaling

int scaling_main(int argc, char** argv) {
  using namespace scaling;
  char* end = nullptr;
  const long ranks = argc > 2 ? std::strtol(argv[2], &end, 10) : 0;
  if (argc < 3 || argc > 4 || *end != '\0' || ranks < 1 || ranks > 64) {
    std::fprintf(stderr, "usage: bench_dist --ranks N [out.json]   (N >= 1 GPUs)\n");
    return 2;
  }
  const int n = static_cast<int>(ranks);
  const char* path = argc > 3 ? argv[3] : "bench_dist_ranks.json";
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off (before NCCL starts)
  int devices = 0;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  if (devices < n) {
    std::fprintf(stderr, "--ranks %d needs %d GPUs; this machine has %d\n", n, n, devices);
    return 2;
  }
  FILE* out = std::fopen(path, "w");
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path);
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "data-parallel scaling: MLP block %lldx%lldx%lld (LayerNorm, Linear, GELU, Linear) per rank, MS-AMP O2, "
      "AdamW, bf16 activations; %d x %s\n",
      static_cast<long long>(kTokens), static_cast<long long>(kModel), static_cast<long long>(kHidden), n, prop.name);
  std::fflush(stdout);

  Shared g;
  g.n = n;
  g.ctxs.resize(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) CHECK_FP8(fp8_context_create(&g.ctxs[static_cast<size_t>(k)], k));
  for (int cfg : {kBackwardSync, kAtStep}) {
    g.comms[cfg].resize(static_cast<size_t>(n));
    CHECK_FP8(fp8_comm_create_local(g.comms[cfg].data(), g.ctxs.data(), n));  // NCCL: a GPU per rank
  }
  g.params[0] = normal_floats(static_cast<size_t>(kHidden * kModel), 1.0f / std::sqrt(static_cast<float>(kModel)), 1);
  g.params[1] = normal_floats(static_cast<size_t>(kHidden), 0.1f, 2);
  g.params[2] = normal_floats(static_cast<size_t>(kModel * kHidden), 1.0f / std::sqrt(static_cast<float>(kHidden)), 3);
  g.params[3] = normal_floats(static_cast<size_t>(kModel), 0.1f, 4);
  for (auto& t : g.times) t.assign(static_cast<size_t>(kReps * n), 0.0f);
  g.out.resize(static_cast<size_t>(n));
  SpinBarrier barrier(n);
  g.barrier = &barrier;

  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) threads.emplace_back(rank_main, std::ref(g), k);
  // A rank that waits in a collective the others never call would hang the program: end it.
  const auto start = std::chrono::steady_clock::now();
  while (g.finished.load() < n) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(300)) {
      std::fprintf(stderr, "a rank still runs after 300 s: a collective hangs\n");
      std::fflush(stdout);
      std::_Exit(1);
    }
  }
  for (std::thread& t : threads) t.join();

  // Each repetition's time is its slowest rank's; the median of the repetitions.
  double ms[kConfigs];
  for (int cfg = 0; cfg < kConfigs; ++cfg) {
    std::vector<double> reps;
    for (int r = 0; r < kReps; ++r) {
      double t = 0;
      for (int k = 0; k < (cfg == kSingle ? 1 : n); ++k)
        t = std::max(t, static_cast<double>(g.times[cfg][static_cast<size_t>(r * n + k)]));
      reps.push_back(t);
    }
    ms[cfg] = median(reps);
  }
  const int gpus[kConfigs] = {1, n, n};
  double tokens_per_s[kConfigs], scaling_factor[kConfigs];
  for (int cfg = 0; cfg < kConfigs; ++cfg) {
    tokens_per_s[cfg] = gpus[cfg] * static_cast<double>(kTokens) / (ms[cfg] * 1e-3);
    scaling_factor[cfg] = tokens_per_s[cfg] / tokens_per_s[kSingle];
  }

  // The checks.
  bool ok = true;
  const auto fail = [&](const std::string& what) {
    std::printf("FAIL: %s\n", what.c_str());
    ok = false;
  };
  const char* const config_name[kConfigs] = {"1 GPU", "backward sync", "exchange at the step"};
  for (int cfg = 0; cfg < kConfigs; ++cfg)
    for (int k = 0; k < (cfg == kSingle ? 1 : n); ++k) {
      const RankOut& o = g.out[static_cast<size_t>(k)];
      const std::string who = std::string(config_name[cfg]) + ", rank " + std::to_string(k);
      const fp8_optimizer_stats_t& s = o.stats[cfg];
      if (!o.present[cfg]) {
        fail(who + ": no model");
        continue;
      }
      if (s.steps != kWarm + kReps || s.skipped_steps != 0)
        fail(who + ": " + std::to_string(s.steps) + " steps applied, " + std::to_string(s.skipped_steps) +
             " skipped; expected " + std::to_string(kWarm + kReps) + " and none");
      if (!(std::isfinite(s.last_grad_norm) && s.last_grad_norm > 0.0f))
        fail(who + ": gradient norm " + std::to_string(s.last_grad_norm) + " of the last step; expected finite > 0");
      if (o.final_hash[cfg] == o.initial_hash[cfg]) fail(who + ": the weights did not change over the steps");
    }
  for (int k = 0; k < n; ++k) {
    const RankOut& o = g.out[static_cast<size_t>(k)];
    if (o.y_bad || o.dx_bad || o.y_zero == o.elements || o.dx_zero == o.elements)
      fail("rank " + std::to_string(k) + ": y has " + std::to_string(o.y_bad) + " non-finite and " +
           std::to_string(o.y_zero) + " zero elements, dx " + std::to_string(o.dx_bad) + " and " +
           std::to_string(o.dx_zero) + " (of " + std::to_string(o.elements) + ")");
  }
  std::printf(
      "check: outputs and input gradients finite and non-zero, every step applied with a finite non-zero "
      "gradient norm, weights moved: %s\n",
      ok ? "yes" : "NO (see FAIL above)");
  for (int cfg : {kBackwardSync, kAtStep}) {
    bool same = true;
    std::string sizes;
    for (int d = 0; d < kDtypes; ++d) {
      const std::vector<unsigned char>& want = g.out[0].values[cfg][d];
      if (!want.empty())
        sizes += std::string(sizes.empty() ? "" : ", ") + kDtypeName[d] + " " + std::to_string(want.size()) + " B";
      for (int k = 1; k < n; ++k) {
        const std::vector<unsigned char>& got = g.out[static_cast<size_t>(k)].values[cfg][d];
        if (got == want) continue;
        same = false;
        size_t differ = got.size() == want.size() ? 0 : std::max(got.size(), want.size());
        for (size_t i = 0; got.size() == want.size() && i < got.size(); ++i) differ += got[i] != want[i];
        fail(std::string(config_name[cfg]) + ": rank " + std::to_string(k) + "'s " + kDtypeName[d] +
             " weights differ from rank 0's (" + std::to_string(differ) + " bytes of " + std::to_string(want.size()) +
             ")");
      }
    }
    std::printf("check: %s: weights after %d steps bit-identical on all %d ranks: %s (%s)\n", config_name[cfg],
                kWarm + kReps, n, same ? "yes" : "NO", sizes.c_str());
  }
  for (int cfg = 0; cfg < kConfigs; ++cfg) {
    const double tflops = kStepFlops / (ms[cfg] * 1e-3) / 1e12;
    std::printf("check: %s: %.0f TFLOP/s per GPU (%.2f TFLOP a step), %d of 2 Linears in FP8 (forward, dgrad, wgrad)\n",
                config_name[cfg], tflops, kStepFlops / 1e12, g.out[0].fp8_linears[cfg]);
    if (tflops > kMaxTflops)
      fail(std::string(config_name[cfg]) + ": " + std::to_string(tflops) +
           " TFLOP/s per GPU is above the FP8 peak: the step skipped work");
  }

  // The rows.
  char names[kConfigs][128];
  std::snprintf(names[kSingle], sizeof names[kSingle], "O2 mlp step %lldx%lldx%lld, 1 GPU",
                static_cast<long long>(kTokens), static_cast<long long>(kModel), static_cast<long long>(kHidden));
  std::snprintf(names[kBackwardSync], sizeof names[kBackwardSync],
                "O2 mlp step %lldx%lldx%lld per rank, NCCL %d ranks, backward sync", static_cast<long long>(kTokens),
                static_cast<long long>(kModel), static_cast<long long>(kHidden), n);
  std::snprintf(names[kAtStep], sizeof names[kAtStep], "O2 mlp step %lldx%lldx%lld per rank, NCCL %d ranks",
                static_cast<long long>(kTokens), static_cast<long long>(kModel), static_cast<long long>(kHidden), n);
  const char* const config_key[kConfigs] = {"libfp8 O2", "libfp8 O2 backward sync", "libfp8 O2 exchange at step"};
  std::fprintf(out, "[\n");
  for (int cfg = 0; cfg < kConfigs; ++cfg) {
    std::printf("%-66s %9.4f ms %11.0f tokens/s  scaling %.3fx\n", names[cfg], ms[cfg], tokens_per_s[cfg],
                scaling_factor[cfg]);
    std::fprintf(out,
                 "%s {\"name\": \"%s\", \"ms\": %.5f, \"config\": \"%s\", \"gpus\": %d, \"tokens_per_rank\": %lld, "
                 "\"tokens_per_s\": %.1f, \"scaling\": %.4f, \"checks\": \"%s\"}",
                 cfg ? ",\n" : "", names[cfg], ms[cfg], config_key[cfg], gpus[cfg], static_cast<long long>(kTokens),
                 tokens_per_s[cfg], scaling_factor[cfg], ok ? "passed" : "FAILED");
  }
  std::fprintf(out, "\n]\n");
  std::fclose(out);
  std::printf(
      "scaling %d GPUs vs 1 (throughput ratio): backward sync %.3fx, exchange at the step %.3fx%s\n", n,
      scaling_factor[kBackwardSync], scaling_factor[kAtStep],
      n == 2 ? (scaling_factor[kBackwardSync] >= 1.85 ? "; target >= 1.85x: met" : "; target >= 1.85x: NOT met") : "");
  std::fflush(stdout);

  for (int cfg : {kBackwardSync, kAtStep})
    for (fp8_comm_t* comm : g.comms[cfg]) fp8_comm_destroy(comm);
  for (fp8_context_t* ctx_k : g.ctxs) fp8_context_destroy(ctx_k);
  return ok ? 0 : 3;
}
