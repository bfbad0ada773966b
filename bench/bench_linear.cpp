// Linear forward + backward and an MLP block through the model API, as a trainer calls them: one
// step = autocast_begin, forward, autocast_end (the batched scaling update), backward (dx, dW, db),
// with fp8_model_weights_changed before each step so the FP8 weight cast is paid every step, as
// after every optimizer step. Three variants per shape: FP8 forced (small_layer_fallback=off),
// bf16 (not converted), and auto (the default recipe: the per-layer fallback rule decides); at the
// headline shapes also FP8 forced under the other recipes: "fp8 current" (scaling=current: every cast
// scaled by its own tensor's amax, no FP8 hand-offs; the recipe torch.compile's FP8 peer follows),
// "fp8 rowwise" and "fp8 block" (grids of scales per row, or per 1x128 / 128x128 block).
// Before timing, each FP8 result is checked against the bf16 path of the same layer. The "gemm
// floor" rows time the FP8 GEMMs of the Linear and the MLP block alone (issue 17's floor).
// Timing: median of 20 CUDA-event-timed steps after 3 warm-ups, as the torch peer (peer_linear.py).
// `--profile-mlp` runs only the FP8 MLP step and its GEMM floor, three warm-ups each, then one step
// of each between cudaProfilerStart and Stop, for `ncu --profile-from-start off` (issue 17's
// kernel-by-kernel table).
// Usage: bench_linear [out.json] | bench_linear --profile-mlp
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "core/format.hpp"
#include "fp8.h"

namespace {

fp8_context_t* ctx = nullptr;
cudaStream_t stream = nullptr;

std::vector<float> read_bf16(const fp8_tensor_t* t) {
  int64_t n = 0;
  fp8_tensor_numel(t, &n);
  std::vector<uint16_t> raw(static_cast<size_t>(n));
  CHECK_FP8(fp8_tensor_copy_to_host(t, raw.data(), raw.size() * 2));
  std::vector<float> v(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) v[i] = fp8::bf16_to_float(raw[i]);
  return v;
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

enum class Variant { Fp8, Bf16, Auto, Fp8Current, Fp8Rowwise, Fp8Block };
const char* variant_name(Variant v) {
  switch (v) {
    case Variant::Fp8: return "fp8";
    case Variant::Bf16: return "bf16";
    case Variant::Auto: return "auto";
    case Variant::Fp8Current: return "fp8 current";
    case Variant::Fp8Rowwise: return "fp8 rowwise";
    default: return "fp8 block";
  }
}
// The recipe's scaling of a forced-FP8 variant.
int64_t scaling_of(Variant v) {
  return v == Variant::Fp8Current   ? FP8_SCALING_CURRENT
         : v == Variant::Fp8Rowwise ? FP8_SCALING_ROWWISE
         : v == Variant::Fp8Block   ? FP8_SCALING_BLOCK
                                    : FP8_SCALING_DELAYED;
}

fp8_model_t* convert(fp8_model_t* m, Variant v) {
  if (v == Variant::Bf16) return m;
  fp8_recipe_t* r = nullptr;
  CHECK_FP8(fp8_recipe_create(&r));
  // TransformerEngine's layer, FP32 weights and gradients as the torch peers keep them (backend te):
  // the MS-AMP levels store F16 weights and FP8 gradients, whose accumulation adds a pass over dW.
  CHECK_FP8(fp8_recipe_set_int(r, FP8_RECIPE_BACKEND, FP8_BACKEND_TE));
  if (v != Variant::Auto) CHECK_FP8(fp8_recipe_set_int(r, FP8_RECIPE_SMALL_LAYER_FALLBACK, 0));
  CHECK_FP8(fp8_recipe_set_int(r, FP8_RECIPE_SCALING, scaling_of(v)));
  CHECK_FP8(fp8_convert_model(m, r, nullptr));
  fp8_recipe_destroy(r);
  return m;
}

// Layers run in order forward and in reverse backward; acts[i] is layer i's input, acts[n] the
// output; grads[i] the gradient of acts[i] (grads[0] may be NULL: no input gradient). Layer by
// layer (fp8_layer_forward/backward, as a framework that owns the graph calls them), or the whole
// model as one run (fp8_model_forward/backward: the model keeps the activations between layers,
// and folds a GELU into the casts of the Linears around it).
struct Chain {
  fp8_model_t* model;
  std::vector<fp8_tensor_t*> acts, grads;
  bool fp8;
  bool whole_model = false;
  void step() const {
    CHECK_FP8(fp8_model_weights_changed(model));
    if (fp8) CHECK_FP8(fp8_autocast_begin(model));
    if (whole_model) {
      CHECK_FP8(fp8_model_forward(model, acts.front(), acts.back()));
    } else {
      for (size_t i = 0; i + 1 < acts.size(); ++i)
        CHECK_FP8(fp8_layer_forward(model, static_cast<int32_t>(i), acts[i], acts[i + 1]));
    }
    if (fp8) CHECK_FP8(fp8_autocast_end(model));
    if (whole_model) {
      CHECK_FP8(fp8_model_backward(model, grads.back(), grads.front()));
    } else {
      for (size_t i = acts.size() - 1; i-- > 0;)
        CHECK_FP8(fp8_layer_backward(model, static_cast<int32_t>(i), grads[i + 1], grads[i]));
    }
  }
};

FILE* json = nullptr;
bool first_row = true;
bool profile = false;  // --profile-mlp

// Times fn as a step (median_ms); under --profile-mlp, runs it three times, then once between
// cudaProfilerStart and Stop, and returns 0.
double time_step(const std::function<void()>& fn) {
  if (!profile)
    return fp8bench::median_ms(
        stream, [&](int) { fn(); }, 1, 3, 20);
  for (int i = 0; i < 3; ++i) fn();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaProfilerStart());
  fn();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaProfilerStop());
  return 0.0;
}
// path: what the automatic rule chose ("fp8" or "bf16"), for the auto rows.
void row(const std::string& name, double ms, const char* path = nullptr) {
  if (profile) {  // (no time measured, nothing written)
    std::printf("%-44s profiled\n", name.c_str());
    return;
  }
  std::printf("%-44s %9.4f ms  %s\n", name.c_str(), ms, path ? path : "");
  std::fflush(stdout);
  std::fprintf(json, "%s {\"name\": \"%s\", \"ms\": %.5f", first_row ? "" : ",\n", name.c_str(), ms);
  if (path) std::fprintf(json, ", \"path\": \"%s\"", path);
  std::fprintf(json, "}");
  first_row = false;
}

// One Linear m x k -> n with bias, bf16 activations; returns y of the first step for the check.
std::vector<float> bench_linear(int64_t m, int64_t k, int64_t n, Variant v, bool check_only = false) {
  fp8_model_t* model = nullptr;
  CHECK_FP8(fp8_model_create(&model, ctx));
  CHECK_FP8(fp8_model_add_linear(model, "fc", k, n, 1, nullptr));
  fp8_tensor_t *w = nullptr, *b = nullptr;
  CHECK_FP8(fp8_model_parameter(model, "fc.weight", &w, nullptr));
  CHECK_FP8(fp8_model_parameter(model, "fc.bias", &b, nullptr));
  fp8bench::fill_normal(w, 1.0f / std::sqrt(static_cast<float>(k)), 1);
  fp8bench::fill_normal(b, 0.1f, 2);
  convert(model, v);
  fp8_tensor_t *x = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, k), *y = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, n);
  fp8_tensor_t *dy = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, n), *dx = fp8bench::matrix(ctx, FP8_DTYPE_BF16, m, k);
  fp8bench::fill_normal(x, 1.0f, 3);
  fp8bench::fill_normal(dy, 1e-3f, 4);
  const Chain chain{model, {x, y}, {dx, dy}, v != Variant::Bf16};
  std::vector<float> out;
  if (check_only) {  // the second step runs with scales from the first one's amaxes
    chain.step();
    chain.step();
    out = read_bf16(y);
  } else {
    char name[96];
    std::snprintf(name, sizeof name, "libfp8 %s linear %lldx%lld->%lld", variant_name(v), static_cast<long long>(m),
                  static_cast<long long>(k), static_cast<long long>(n));
    fp8_layer_report_t rep;
    fp8_layer_report_init(&rep);
    const double ms = time_step([&] { chain.step(); });
    CHECK_FP8(fp8_layer_get_report(model, 0, &rep));
    row(name, ms, v == Variant::Auto ? (rep.fprop == 1 ? "fp8" : "bf16") : nullptr);
  }
  for (fp8_tensor_t* t : {x, y, dy, dx}) fp8_tensor_destroy(t);
  fp8_model_destroy(model);
  return out;
}

// LayerNorm -> Linear d->f -> GELU -> Linear f->d, t tokens, bf16, run as one model (the "mlp"
// rows) or layer by layer ("mlp layer by layer"); FP8 with E4M3 hand-offs and the GELU folded into
// the Linears' casts in the model run (neither under current scaling: the Linears cast the bf16
// outputs of the norm and the GELU themselves).
std::vector<float> bench_mlp(int64_t t, int64_t d, int64_t f, Variant v, bool check_only = false,
                             bool layer_by_layer = false) {
  fp8_model_t* model = nullptr;
  CHECK_FP8(fp8_model_create(&model, ctx));
  CHECK_FP8(fp8_model_add_layernorm(model, "ln", d, 1e-5f, nullptr));
  CHECK_FP8(fp8_model_add_linear(model, "fc1", d, f, 1, nullptr));
  CHECK_FP8(fp8_model_add_activation(model, "gelu", FP8_ACTIVATION_GELU, nullptr));
  CHECK_FP8(fp8_model_add_linear(model, "fc2", f, d, 1, nullptr));
  for (auto [name, sd, seed] :
       {std::tuple{"fc1.weight", 1.0f / std::sqrt(static_cast<float>(d)), 1u}, std::tuple{"fc1.bias", 0.1f, 2u},
        std::tuple{"fc2.weight", 1.0f / std::sqrt(static_cast<float>(f)), 3u}, std::tuple{"fc2.bias", 0.1f, 4u}}) {
    fp8_tensor_t* p = nullptr;
    CHECK_FP8(fp8_model_parameter(model, name, &p, nullptr));
    fp8bench::fill_normal(p, sd, seed);
  }
  convert(model, v);
  const bool fp8 = v != Variant::Bf16;
  const fp8_dtype_t hand_off = fp8 && scaling_of(v) == FP8_SCALING_DELAYED ? FP8_DTYPE_E4M3 : FP8_DTYPE_BF16;
  fp8_tensor_t* x = fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, d);
  std::vector<fp8_tensor_t*> acts = {x, fp8bench::matrix(ctx, hand_off, t, d),
                                     fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, f), fp8bench::matrix(ctx, hand_off, t, f),
                                     fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, d)};
  std::vector<fp8_tensor_t*> grads = {
      fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, d), fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, d),
      fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, f), fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, f),
      fp8bench::matrix(ctx, FP8_DTYPE_BF16, t, d)};
  fp8bench::fill_normal(x, 1.0f, 5);
  fp8bench::fill_normal(grads[4], 1e-3f, 6);
  const Chain chain{model, acts, grads, fp8, !layer_by_layer};
  std::vector<float> out;
  if (check_only) {
    chain.step();
    chain.step();
    out = read_bf16(acts[4]);
  } else {
    char name[96];
    std::snprintf(name, sizeof name, "libfp8 %s mlp%s %lldx%lldx%lld", variant_name(v),
                  layer_by_layer ? " layer by layer" : "", static_cast<long long>(t), static_cast<long long>(d),
                  static_cast<long long>(f));
    row(name, time_step([&] { chain.step(); }));
  }
  for (fp8_tensor_t* p : acts) fp8_tensor_destroy(p);
  for (size_t i = 0; i < grads.size(); ++i) fp8_tensor_destroy(grads[i]);
  fp8_model_destroy(model);
  return out;
}

// A random operand: FP8 codes (E4M3 or E5M2) or bf16 values of normal(0, 1), a block of 2^20 drawn
// values tiled over the tensor (drawing 10^8 values one by one takes seconds).
fp8_tensor_t* random_operand(fp8_dtype_t dt, int64_t rows, int64_t cols, uint32_t seed) {
  fp8_tensor_t* t = fp8bench::matrix(ctx, dt, rows, cols);
  const size_t n = static_cast<size_t>(rows * cols), block = std::min<size_t>(n, size_t{1} << 20);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t elem = dt == FP8_DTYPE_BF16 ? 2 : 1;
  std::vector<uint8_t> bytes(n * elem);
  for (size_t i = 0; i < block; ++i) {
    if (elem == 2) {
      const uint16_t h = fp8::float_to_bf16(normal(rng));
      std::memcpy(&bytes[2 * i], &h, 2);
    } else {
      bytes[i] = fp8::encode_fp8(normal(rng), dt == FP8_DTYPE_E5M2);
    }
  }
  for (size_t at = block * elem; at < bytes.size(); at += block * elem)
    std::memcpy(&bytes[at], bytes.data(), std::min(block * elem, bytes.size() - at));
  CHECK_FP8(fp8_tensor_copy_from_host(t, bytes.data(), bytes.size()));
  return t;
}

// The GEMM floor of a step: the FP8 GEMMs the FP8 layers run, through fp8_gemm (cuBLASLt) alone on
// operands of the same shapes and types, timed as one sequence like the step. Per Linear m x k -> n
// (te): fprop x[m][k] E4M3 . W[n][k] E4M3 -> bf16 with bias and fast accumulation; dgrad
// dy[m][n] E5M2 . W^T[k][n] E4M3 -> bf16; wgrad dy^T[n][m] E5M2 . x^T[k][m] E4M3 added into the F32
// gradient.
struct FloorGemm {
  int64_t m, n, k;
  fp8_dtype_t a, d;
  bool fast, accumulate, bias;
};
std::vector<FloorGemm> linear_gemms(int64_t m, int64_t k, int64_t n) {
  return {{m, n, k, FP8_DTYPE_E4M3, FP8_DTYPE_BF16, true, false, true},
          {m, k, n, FP8_DTYPE_E5M2, FP8_DTYPE_BF16, false, false, false},
          {n, k, m, FP8_DTYPE_E5M2, FP8_DTYPE_F32, false, true, false}};
}
// The MLP block's: fc1 t x d -> f, then fc2 t x f -> d.
std::vector<FloorGemm> mlp_gemms(int64_t t, int64_t d, int64_t f) {
  std::vector<FloorGemm> gemms = linear_gemms(t, d, f);
  for (const FloorGemm& g : linear_gemms(t, f, d)) gemms.push_back(g);
  return gemms;
}
void gemm_floor(const std::string& name, const std::vector<FloorGemm>& gemms) {
  std::vector<fp8_tensor_t*> tensors;
  std::vector<std::function<void()>> calls;
  uint32_t seed = 100;
  for (const FloorGemm& g : gemms) {
    fp8_tensor_t* a = random_operand(g.a, g.m, g.k, seed++);
    fp8_tensor_t* b = random_operand(FP8_DTYPE_E4M3, g.n, g.k, seed++);
    fp8_tensor_t* d = fp8bench::matrix(ctx, g.d, g.m, g.n);
    void* d_data = nullptr;  // (zeroed: the wgrad adds into it)
    CHECK_FP8(fp8_tensor_data(d, &d_data));
    CHECK_CUDA(cudaMemset(d_data, 0, static_cast<size_t>(g.m * g.n) * (g.d == FP8_DTYPE_F32 ? 4 : 2)));
    fp8_tensor_t* bias = nullptr;
    if (g.bias) {
      const int64_t shape[1] = {g.n};
      CHECK_FP8(fp8_tensor_create(&bias, ctx, FP8_DTYPE_BF16, 1, shape));
      fp8bench::fill_normal(bias, 0.1f, seed++);
    }
    fp8_gemm_options_t opts;
    fp8_gemm_options_init(&opts);
    opts.fast_accumulation = g.fast;
    opts.accumulate = g.accumulate;
    calls.push_back([=] { CHECK_FP8(fp8_gemm(ctx, a, b, bias, d, nullptr, &opts)); });
    tensors.insert(tensors.end(), {a, b, d, bias});
  }
  row(name, time_step([&] {
        for (const auto& call : calls) call();
      }));
  for (fp8_tensor_t* t : tensors)
    if (t) fp8_tensor_destroy(t);
}

}  // namespace

int main(int argc, char** argv) {
  profile = argc > 1 && std::strcmp(argv[1], "--profile-mlp") == 0;
  CHECK_FP8(fp8_context_create(&ctx, 0));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_FP8(fp8_context_set_stream(ctx, stream));
  if (profile) {
    gemm_floor("gemm floor mlp 16384x4096x16384", mlp_gemms(16384, 4096, 16384));
    bench_mlp(16384, 4096, 16384, Variant::Fp8);
    bench_mlp(16384, 4096, 16384, Variant::Fp8, false, true);
    fp8_context_destroy(ctx);
    return 0;
  }
  json = std::fopen(argc > 1 ? argv[1] : "bench_linear.json", "w");
  std::fprintf(json, "[\n");

  // Correctness first: FP8 against the bf16 path of the same layer (both checked against the CPU
  // reference by tests/gpu/gpu_layers); FP8 rounding of x, W (E4M3) bounds the difference.
  const double e_lin = relative_error(bench_linear(16384, 8192, 8192, Variant::Fp8, true),
                                      bench_linear(16384, 8192, 8192, Variant::Bf16, true));
  const std::vector<float> mlp_bf16 = bench_mlp(16384, 4096, 16384, Variant::Bf16, true);
  const double e_mlp = relative_error(bench_mlp(16384, 4096, 16384, Variant::Fp8, true), mlp_bf16);
  const std::vector<float> lin_bf16 = bench_linear(16384, 8192, 8192, Variant::Bf16, true);
  std::printf("check: FP8 vs bf16 relative error: linear 16384x8192->8192 y %.4f, mlp y %.4f\n", e_lin, e_mlp);
  bool close = e_lin < 0.08 && e_mlp < 0.08;
  for (Variant v : {Variant::Fp8Current, Variant::Fp8Rowwise, Variant::Fp8Block}) {
    const double e = relative_error(bench_linear(16384, 8192, 8192, v, true), lin_bf16);
    const double em = relative_error(bench_mlp(16384, 4096, 16384, v, true), mlp_bf16);
    std::printf("check: %s vs bf16 relative error: linear y %.4f, mlp y %.4f\n", variant_name(v), e, em);
    close = close && e < 0.08 && em < 0.08;
  }
  if (!close) {
    std::fprintf(stderr, "FP8 result too far from bf16\n");
    return 1;
  }

  // Issue 17's floors: the Linear's three FP8 GEMMs and the MLP block's six, alone.
  gemm_floor("gemm floor linear 16384x8192->8192", linear_gemms(16384, 8192, 8192));
  gemm_floor("gemm floor mlp 16384x4096x16384", mlp_gemms(16384, 4096, 16384));
  bench_mlp(16384, 4096, 16384, Variant::Fp8);
  bench_mlp(16384, 4096, 16384, Variant::Fp8, false, true);
  for (Variant v : {Variant::Fp8Current, Variant::Fp8Rowwise, Variant::Fp8Block}) {
    bench_mlp(16384, 4096, 16384, v);
    bench_linear(16384, 8192, 8192, v);
  }
  bench_mlp(16384, 4096, 16384, Variant::Bf16);
  for (int64_t m : {512, 1024, 2048, 4096, 8192, 16384})
    for (int64_t k : {1024, 2048, 4096, 8192})
      for (Variant v : {Variant::Fp8, Variant::Bf16, Variant::Auto}) bench_linear(m, k, k, v);
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  fp8_context_destroy(ctx);
  return 0;
}
