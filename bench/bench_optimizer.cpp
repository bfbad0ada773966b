// The AdamW step over 2^30 parameters at each storage level (te, O1, O2, O3): 16 bias-free Linears of
// 8192 x 8192 (l0..l15; no forward is run), weights ~ N(0, 0.02), gradients ~ N(0, 1e-3). Per level:
// the step's time (median of 20 CUDA-event-timed steps after 3 warm-ups, as peer_optimizer.py times
// torch's fused AdamW), the bytes it moves per parameter, and the device memory the training state
// takes, measured with cudaMemGetInfo (model + optimizer after one step) and as the optimizer's stats
// count it (training_bytes / parameters; the peak while the optimizer converts the FP32 weights is
// not visible either way).
// Correctness first: a small model steps on the GPU and on the CPU reference from identical weights
// and gradients, and every parameter must come out bit-identical, at every level.
// Usage: bench_optimizer [out.json]
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "fp8.h"

namespace {

cudaStream_t stream = nullptr;

// Fast reproducible normals (splitmix64 + Box-Muller): 2^27 of them take well under a second,
// where std::normal_distribution over 2^30 values per array would take minutes.
std::vector<float> normals(size_t n, float sd, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&s] {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (size_t i = 0; i < n; i += 2) {
    const uint64_t r = next();
    const double u1 = (static_cast<double>(r >> 40) + 1.0) / 16777217.0;  // (0, 1]
    const double u2 = static_cast<double>(r & 0xFFFFFF) / 16777216.0;     // [0, 1)
    const double rad = std::sqrt(-2.0 * std::log(u1)) * sd;
    v[i] = static_cast<float>(rad * std::cos(6.283185307179586 * u2));
    if (i + 1 < n) v[i + 1] = static_cast<float>(rad * std::sin(6.283185307179586 * u2));
  }
  return v;
}

struct Level {
  const char* name;
  int32_t backend, opt_level;  // recipe values
  int32_t stats_level;         // what fp8_optimizer_get_stats must report
};
const Level kLevels[] = {{"te", FP8_BACKEND_TE, FP8_OPT_O2, 0},
                         {"O1", FP8_BACKEND_MSAMP, FP8_OPT_O1, FP8_OPT_O1},
                         {"O2", FP8_BACKEND_MSAMP, FP8_OPT_O2, FP8_OPT_O2},
                         {"O3", FP8_BACKEND_MSAMP, FP8_OPT_O3, FP8_OPT_O3}};

// Bytes one step moves per Linear-weight parameter at a level, as kernels/optim/optimizer.cu does it:
// the norm pass reads the gradient, then the update pass reads value, gradient, m, v (and the O3 F16
// master) and writes value, m, v (and the master; at O3 the value is the E4M3 weight).
int bytes_moved(int32_t level) {
  int value = 4, grad = 4, m = 4, v = 4, master = 0;
  if (level == FP8_OPT_O1) value = 2, grad = 1;
  if (level == FP8_OPT_O2) value = 2, grad = 1, m = 1, v = 2;
  if (level == FP8_OPT_O3) value = 1, grad = 1, m = 1, v = 2, master = 2;
  const int read = value + grad + m + v + master, written = value + m + v + master;
  return grad + read + written;  // te 32, O1 22, O2 12, O3 14
}

void make_converted(fp8_model_t* model, const Level& lv) {
  fp8_recipe_t* r = nullptr;
  CHECK_FP8(fp8_recipe_create(&r));
  CHECK_FP8(fp8_recipe_set_int(r, FP8_RECIPE_BACKEND, lv.backend));
  CHECK_FP8(fp8_recipe_set_int(r, FP8_RECIPE_OPT_LEVEL, lv.opt_level));
  CHECK_FP8(fp8_recipe_set_int(r, FP8_RECIPE_SMALL_LAYER_FALLBACK, 0));
  CHECK_FP8(fp8_convert_model(model, r, nullptr));
  fp8_recipe_destroy(r);
}

fp8_optimizer_stats_t get_stats(const fp8_optimizer_t* o) {
  fp8_optimizer_stats_t s;
  fp8_optimizer_stats_init(&s);
  CHECK_FP8(fp8_optimizer_get_stats(o, &s));
  return s;
}

std::vector<unsigned char> raw_bytes(const fp8_tensor_t* t) {
  int64_t n = 0;
  fp8_dtype_t dt = 0;
  CHECK_FP8(fp8_tensor_numel(t, &n));
  CHECK_FP8(fp8_tensor_dtype(t, &dt));
  std::vector<unsigned char> b(static_cast<size_t>(n) * fp8_dtype_size(dt));
  CHECK_FP8(fp8_tensor_copy_to_host(t, b.data(), b.size()));
  return b;
}

// ---- correctness: GPU vs CPU reference, bit for bit -----------------------------------------------

// A small model on `ctx`, converted for `lv`, weights written, an AdamW made and the gradients given:
// l0 512 -> 256 with a bias (an FP32 parameter beside the compact weights), l1 256 -> 512 without.
struct Small {
  fp8_model_t* model = nullptr;
  fp8_optimizer_t* opt = nullptr;
};
Small make_small(fp8_context_t* ctx, const Level& lv) {
  Small s;
  CHECK_FP8(fp8_model_create(&s.model, ctx));
  CHECK_FP8(fp8_model_add_linear(s.model, "l0", 512, 256, 1, nullptr));
  CHECK_FP8(fp8_model_add_linear(s.model, "l1", 256, 512, 0, nullptr));
  int32_t count = 0;
  CHECK_FP8(fp8_model_parameter_count(s.model, &count));
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t* value = nullptr;
    CHECK_FP8(fp8_model_parameter_at(s.model, i, nullptr, &value, nullptr));
    int64_t n = 0;
    CHECK_FP8(fp8_tensor_numel(value, &n));
    const std::vector<float> w = normals(static_cast<size_t>(n), 0.02f, 100 + i);
    CHECK_FP8(fp8_tensor_copy_from_host(value, w.data(), w.size() * sizeof(float)));
  }
  make_converted(s.model, lv);  // FP32 weights written first: the conversion stores them at the level
  CHECK_FP8(fp8_optimizer_create(&s.opt, s.model, FP8_OPTIMIZER_ADAMW));
  CHECK_FP8(fp8_optimizer_set_float(s.opt, FP8_OPTIM_LR, 1e-3));
  CHECK_FP8(fp8_optimizer_set_float(s.opt, FP8_OPTIM_WEIGHT_DECAY, 0.01));
  CHECK_FP8(fp8_optimizer_zero_grad(s.opt));
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t* value = nullptr;
    CHECK_FP8(fp8_model_parameter_at(s.model, i, nullptr, &value, nullptr));
    int64_t n = 0;
    CHECK_FP8(fp8_tensor_numel(value, &n));
    const std::vector<float> g = normals(static_cast<size_t>(n), 1e-3f, 200 + i);
    fp8_tensor_t* tmp = nullptr;
    CHECK_FP8(fp8_tensor_create(&tmp, ctx, FP8_DTYPE_F32, 1, &n));
    CHECK_FP8(fp8_tensor_copy_from_host(tmp, g.data(), g.size() * sizeof(float)));
    CHECK_FP8(fp8_model_accumulate_grad(s.model, i, tmp));
    fp8_tensor_destroy(tmp);  // copy_to_host/from_host synchronise, and destroy follows queued work
  }
  return s;
}

// Two steps (the second one runs with the scales the first one chose); every parameter value compared
// as raw bytes after each. Returns false with a message on the first difference.
bool check_level(fp8_context_t* gpu, fp8_context_t* cpu, const Level& lv) {
  Small a = make_small(gpu, lv), b = make_small(cpu, lv);
  bool ok = true;
  for (int step = 1; step <= 2 && ok; ++step) {
    CHECK_FP8(fp8_optimizer_step(a.opt));
    CHECK_FP8(fp8_optimizer_step(b.opt));
    int32_t count = 0;
    CHECK_FP8(fp8_model_parameter_count(a.model, &count));
    for (int32_t i = 0; i < count && ok; ++i) {
      const char* name = nullptr;
      fp8_tensor_t *va = nullptr, *vb = nullptr;
      CHECK_FP8(fp8_model_parameter_at(a.model, i, &name, &va, nullptr));
      CHECK_FP8(fp8_model_parameter_at(b.model, i, nullptr, &vb, nullptr));
      const std::vector<unsigned char> ra = raw_bytes(va), rb = raw_bytes(vb);
      if (ra.size() != rb.size() || std::memcmp(ra.data(), rb.data(), ra.size()) != 0) {
        size_t first = 0;
        while (first < ra.size() && first < rb.size() && ra[first] == rb[first]) ++first;
        std::fprintf(stderr, "level %s, step %d: parameter %s differs between GPU and CPU (%zu vs %zu bytes, first byte %zu)\n",
                     lv.name, step, name, ra.size(), rb.size(), first);
        ok = false;
      }
    }
    const fp8_optimizer_stats_t sa = get_stats(a.opt), sb = get_stats(b.opt);
    if (ok && (sa.steps != step || sa.skipped_steps != 0 || sa.opt_level != lv.stats_level || sb.steps != step ||
               std::memcmp(&sa.last_grad_norm, &sb.last_grad_norm, sizeof(float)) != 0)) {
      std::fprintf(stderr, "level %s, step %d: stats differ: GPU steps %lld skipped %lld level %d norm %.9g; CPU steps %lld norm %.9g\n",
                   lv.name, step, static_cast<long long>(sa.steps), static_cast<long long>(sa.skipped_steps),
                   sa.opt_level, sa.last_grad_norm, static_cast<long long>(sb.steps), sb.last_grad_norm);
      ok = false;
    }
  }
  for (Small* s : {&a, &b}) {
    fp8_optimizer_destroy(s->opt);
    fp8_model_destroy(s->model);
  }
  return ok;
}

// ---- the 2^30-parameter runs ---------------------------------------------------------------------

constexpr int kLayers = 16;
constexpr int64_t kDim = 8192;
constexpr int64_t kPerLayer = kDim * kDim;  // 2^26
constexpr int64_t kParams = kLayers * kPerLayer;  // 2^30
constexpr size_t kShift = 1021;  // floats: layer i takes pool[i * kShift ..], so no two layers are equal
constexpr int kWarmup = 3, kReps = 20;

FILE* json = nullptr;
bool first_row = true;

size_t free_bytes() {
  size_t free = 0, total = 0;
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemGetInfo(&free, &total));
  return free;
}

void bench_level(fp8_context_t* ctx, const Level& lv, const std::vector<float>& wpool, const std::vector<float>& gpool,
                 double grad_norm) {
  const size_t free_before = free_bytes();
  fp8_model_t* model = nullptr;
  CHECK_FP8(fp8_model_create(&model, ctx));
  for (int i = 0; i < kLayers; ++i) {
    const std::string name = "l" + std::to_string(i);
    CHECK_FP8(fp8_model_add_linear(model, name.c_str(), kDim, kDim, 0, nullptr));
  }
  for (int i = 0; i < kLayers; ++i) {  // FP32 weights, one 256 MiB layer at a time, before the conversion
    fp8_tensor_t* value = nullptr;
    CHECK_FP8(fp8_model_parameter_at(model, i, nullptr, &value, nullptr));
    CHECK_FP8(fp8_tensor_copy_from_host(value, wpool.data() + i * kShift, kPerLayer * sizeof(float)));
  }
  make_converted(model, lv);  // stores them at the level
  fp8_optimizer_t* opt = nullptr;
  CHECK_FP8(fp8_optimizer_create(&opt, model, FP8_OPTIMIZER_ADAMW));
  CHECK_FP8(fp8_optimizer_set_float(opt, FP8_OPTIM_LR, 1e-3));
  CHECK_FP8(fp8_optimizer_set_float(opt, FP8_OPTIM_WEIGHT_DECAY, 0.01));
  CHECK_FP8(fp8_optimizer_zero_grad(opt));
  fp8_tensor_t* tmp = nullptr;  // te writes its FP32 gradients directly; the compact levels add an F32 tensor
  if (lv.stats_level != 0) CHECK_FP8(fp8_tensor_create(&tmp, ctx, FP8_DTYPE_F32, 1, &kPerLayer));
  for (int i = 0; i < kLayers; ++i) {
    const float* g = gpool.data() + i * kShift;
    if (!tmp) {
      fp8_tensor_t* grad = nullptr;
      CHECK_FP8(fp8_model_parameter_at(model, i, nullptr, nullptr, &grad));
      CHECK_FP8(fp8_tensor_copy_from_host(grad, g, kPerLayer * sizeof(float)));
    } else {  // copy_from_host is ordered after the previous accumulate on the context's stream
      CHECK_FP8(fp8_tensor_copy_from_host(tmp, g, kPerLayer * sizeof(float)));
      CHECK_FP8(fp8_model_accumulate_grad(model, i, tmp));
    }
  }
  if (tmp) {
    CHECK_FP8(fp8_context_synchronize(ctx));
    fp8_tensor_destroy(tmp);
  }
  CHECK_FP8(fp8_optimizer_step(opt));
  CHECK_FP8(fp8_context_synchronize(ctx));
  const size_t free_after = free_bytes();
  const fp8_optimizer_stats_t s1 = get_stats(opt);
  if (s1.opt_level != lv.stats_level || s1.parameters != kParams || s1.steps != 1 || s1.skipped_steps != 0) {
    std::fprintf(stderr, "level %s: unexpected stats after one step: opt_level %d, parameters %lld, steps %lld, skipped %lld\n",
                 lv.name, s1.opt_level, static_cast<long long>(s1.parameters), static_cast<long long>(s1.steps),
                 static_cast<long long>(s1.skipped_steps));
    std::exit(1);
  }
  // The gradient norm the step saw against the host's (FP8 gradients round each element: a few %).
  const double norm_err = std::fabs(s1.last_grad_norm - grad_norm) / grad_norm;
  if (!(norm_err < (lv.stats_level == 0 ? 1e-4 : 0.03))) {
    std::fprintf(stderr, "level %s: gradient norm %.6g, expected %.6g: the gradients did not arrive\n", lv.name,
                 s1.last_grad_norm, grad_norm);
    std::exit(1);
  }

  const double ms = fp8bench::median_ms(stream, [&](int) { CHECK_FP8(fp8_optimizer_step(opt)); }, 1, kWarmup, kReps);
  const fp8_optimizer_stats_t s = get_stats(opt);
  const int64_t want_steps = 1 + kWarmup + kReps;
  if (s.steps != want_steps || s.skipped_steps != 0) {
    std::fprintf(stderr, "level %s: after the timed steps the stats say steps %lld, skipped %lld; expected %lld and 0\n",
                 lv.name, static_cast<long long>(s.steps), static_cast<long long>(s.skipped_steps),
                 static_cast<long long>(want_steps));
    std::exit(1);
  }
  const double measured = (static_cast<double>(free_before) - static_cast<double>(free_after)) / static_cast<double>(kParams);
  const double stats_bpp = static_cast<double>(s.training_bytes) / static_cast<double>(s.parameters);
  const int moved = bytes_moved(lv.stats_level);
  const double gparam = static_cast<double>(kParams) / (ms * 1e6);
  const double gbps = gparam * moved;
  char name[64];
  std::snprintf(name, sizeof name, "libfp8 adamw %s 2^30", lv.name);
  std::printf("%-24s %9.3f ms %8.1f Gparam/s %7.0f GB/s (%2d B/param moved)  state %5.2f B/param (stats), %5.2f (measured)  norm %.4g\n",
              name, ms, gparam, gbps, moved, stats_bpp, measured, s1.last_grad_norm);
  std::fflush(stdout);
  std::fprintf(json,
               "%s {\"name\": \"%s\", \"ms\": %.5f, \"gparam_per_s\": %.3f, \"gb_per_s\": %.1f, \"bytes_moved_per_param\": %d, "
               "\"bytes_per_param_measured\": %.4f, \"bytes_per_param_stats\": %.4f, \"opt_level\": %d, \"state_bytes\": %lld, "
               "\"steps\": %lld}",
               first_row ? "" : ",\n", name, ms, gparam, gbps, moved, measured, stats_bpp, s.opt_level,
               static_cast<long long>(s.state_bytes), static_cast<long long>(s.steps));
  std::fflush(json);
  first_row = false;
  fp8_optimizer_destroy(opt);
  fp8_model_destroy(model);
}

}  // namespace

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "bench_optimizer.json";
  fp8_context_t *ctx = nullptr, *cpu = nullptr;
  CHECK_FP8(fp8_context_create(&ctx, 0));
  CHECK_FP8(fp8_context_create(&cpu, FP8_DEVICE_CPU));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_FP8(fp8_context_set_stream(ctx, stream));

  for (const Level& lv : kLevels)
    if (!check_level(ctx, cpu, lv)) {
      std::fprintf(stderr, "AdamW step: GPU and CPU reference disagree at level %s\n", lv.name);
      return 1;
    }
  std::printf("check: AdamW, 2 steps, GPU == CPU reference bit for bit at te, O1, O2, O3\n");
  fp8_context_destroy(cpu);

  const size_t pool = static_cast<size_t>(kPerLayer) + kLayers * kShift;
  const std::vector<float> wpool = normals(pool, 0.02f, 1), gpool = normals(pool, 1e-3f, 2);
  double sumsq = 0.0;
  for (int i = 0; i < kLayers; ++i)
    for (int64_t k = 0; k < kPerLayer; ++k) {
      const double g = gpool[i * kShift + static_cast<size_t>(k)];
      sumsq += g * g;
    }
  const double grad_norm = std::sqrt(sumsq);

  json = std::fopen(path, "w");
  if (!json) {
    std::fprintf(stderr, "cannot write %s\n", path);
    return 1;
  }
  std::fprintf(json, "[\n");
  for (const Level& lv : kLevels) bench_level(ctx, lv, wpool, gpool, grad_norm);
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  fp8_context_destroy(ctx);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
