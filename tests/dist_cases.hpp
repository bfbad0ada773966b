// Data-parallel test cases shared by the CPU suite (tests/unit/test_dist_cpu.cpp) and the GPU suite
// (tests/gpu/gpu_dist.cpp): groups of ranks on threads, a small MLP, each rank's data, and the bytes
// that must be identical on every rank.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>

#include "fp8_test_util.hpp"

namespace fp8test::dist_cases {

constexpr int64_t kIn = 32, kHidden = 64, kOut = 16, kRows = 32;

struct CommDeleter {
  void operator()(fp8_comm_t* c) const { fp8_comm_destroy(c); }
};
using Comm = std::unique_ptr<fp8_comm_t, CommDeleter>;

// Runs fn(rank) on one thread per rank and waits for all of them (a hang ends the program).
inline void on_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::future<void>> done;
  for (int r = 0; r < n; ++r) done.push_back(std::async(std::launch::async, fn, r));
  for (auto& f : done)
    if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
      // A rank waits for a collective the others never call: a bug, reported instead of hanging CI.
      std::fprintf(stderr, "%s: a rank still waits after 120 s; a collective hangs\n",
                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
      std::_Exit(1);
    }
  for (auto& f : done) f.get();
}

// One rank: its context, model and optimizer, and its end of the group.
struct Rank {
  explicit Rank(int32_t device = FP8_DEVICE_CPU) : ctx(make_context(device)) {}
  Context ctx;
  Model model;
  Optimizer opt;
  Comm comm;
};

// fc1 (in -> hidden, bias), gelu, fc2 (hidden -> out, bias), with weights from `seed`, converted
// with `recipe` (nullptr: not converted) and trained in FP8 by the autowrap.
inline Model build_model(fp8_context_t* ctx, const char* recipe, uint32_t seed, int64_t hidden = kHidden) {
  Model m = make_model(ctx);
  EXPECT_OK(fp8_model_add_linear(m.get(), "fc1", kIn, hidden, 1, nullptr));
  EXPECT_OK(fp8_model_add_activation(m.get(), "act", FP8_ACTIVATION_GELU, nullptr));
  EXPECT_OK(fp8_model_add_linear(m.get(), "fc2", hidden, kOut, 1, nullptr));
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m.get(), &count));
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t* v = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m.get(), i, nullptr, &v, nullptr));
    int64_t n = 0;
    fp8_tensor_numel(v, &n);
    upload(v, randn(static_cast<size_t>(n), seed * 100 + static_cast<uint32_t>(i), 0.2f));
  }
  if (recipe) {
    Recipe r = make_recipe(recipe);
    EXPECT_OK(fp8_convert_model(m.get(), r.get(), nullptr));
    EXPECT_OK(fp8_model_set_autowrap(m.get(), 1));
  }
  return m;
}

// Makes rank r's model data-parallel over r.comm (collective: every rank at once, each on its own
// thread) and gives it an optimizer of `kind`: lr 0.05 (SGD) or 0.01, and `max_grad_norm` (0: none);
// `bucket_bytes` 0: the default buckets.
inline void make_data_parallel(Rank& r, fp8_optimizer_kind_t kind = FP8_OPTIMIZER_ADAM, float max_grad_norm = 0.0f,
                               size_t bucket_bytes = 0, bool backward_sync = false) {
  if (bucket_bytes) {
    EXPECT_OK(fp8_model_set_bucket_bytes(r.model.get(), bucket_bytes));
  }
  EXPECT_OK(fp8_model_set_comm(r.model.get(), r.comm.get()));
  if (backward_sync) {
    EXPECT_OK(fp8_model_set_backward_sync(r.model.get(), 1));
  }
  fp8_optimizer_t* o = nullptr;
  EXPECT_OK(fp8_optimizer_create(&o, r.model.get(), kind));
  r.opt.reset(o);
  EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_LR, kind == FP8_OPTIMIZER_SGD ? 0.05 : 0.01));
  if (max_grad_norm > 0.0f) {
    EXPECT_OK(fp8_optimizer_set_float(o, FP8_OPTIM_MAX_GRAD_NORM, max_grad_norm));
  }
}

// Fills `ranks` (empty) with rank k on devices[k], each with its end of one group
// (fp8_comm_create_local, whose status it returns): CPU contexts or CUDA contexts sharing a GPU are
// joined by the in-process transport, CUDA contexts each on a GPU of its own by NCCL
// (ncclCommInitAll), as is one rank on a GPU.
inline fp8_status_t join_ranks(std::vector<Rank>& ranks, const std::vector<int32_t>& devices) {
  const int n = static_cast<int>(devices.size());
  for (int32_t device : devices) ranks.emplace_back(device);
  std::vector<fp8_context_t*> ctxs;
  for (Rank& r : ranks) ctxs.push_back(r.ctx.get());
  std::vector<fp8_comm_t*> comms(static_cast<size_t>(n));
  const fp8_status_t status = fp8_comm_create_local(comms.data(), ctxs.data(), n);
  for (int k = 0; k < n; ++k) ranks[k].comm.reset(comms[k]);
  return status;
}

// A group of ranks, each with its own model (rank k built from seed k + 1, so
// set_comm has something to broadcast), data-parallel, with an optimizer of `kind`.
struct Group {
  std::vector<Rank> ranks;
  // Rank k on devices[k] (join_ranks).
  Group(const std::vector<int32_t>& devices, const char* recipe, fp8_optimizer_kind_t kind = FP8_OPTIMIZER_ADAM,
        float max_grad_norm = 0.0f, size_t bucket_bytes = 0, bool backward_sync = false, int64_t hidden = kHidden) {
    const int n = static_cast<int>(devices.size());
    EXPECT_OK(join_ranks(ranks, devices));
    for (int k = 0; k < n; ++k)
      ranks[k].model = build_model(ranks[k].ctx.get(), recipe, static_cast<uint32_t>(k + 1), hidden);
    on_ranks(n, [&](int k) { make_data_parallel(ranks[k], kind, max_grad_norm, bucket_bytes, backward_sync); });
  }
  // n ranks, every one on `device` (FP8_DEVICE_CPU, or one GPU: NCCL for one rank, else the
  // in-process transport through the host).
  Group(int n, const char* recipe, fp8_optimizer_kind_t kind = FP8_OPTIMIZER_ADAM, float max_grad_norm = 0.0f,
        int32_t device = FP8_DEVICE_CPU, size_t bucket_bytes = 0, bool backward_sync = false)
      : Group(std::vector<int32_t>(static_cast<size_t>(n), device), recipe, kind, max_grad_norm, bucket_bytes,
              backward_sync) {}
  int size() const { return static_cast<int>(ranks.size()); }
};

inline std::vector<float> batch_x(int step, int rank) {
  return randn(kRows * kIn, 7000u + 97u * step + rank, 1.0f);
}
inline std::vector<float> batch_dy(int step, int rank) {
  return randn(kRows * kOut, 9000u + 97u * step + rank, 0.05f + 0.05f * rank);
}

// One forward and backward of `rows` rows of x and dy (accumulating into the gradients).
inline void forward_backward(fp8_context_t* ctx, fp8_model_t* m, const std::vector<float>& x,
                             const std::vector<float>& dy) {
  const int64_t rows = static_cast<int64_t>(x.size()) / kIn;
  Tensor tx = make_tensor(ctx, FP8_DTYPE_F32, {rows, kIn});
  Tensor ty = make_tensor(ctx, FP8_DTYPE_F32, {rows, kOut});
  Tensor tdy = make_tensor(ctx, FP8_DTYPE_F32, {rows, kOut});
  upload(tx.get(), x);
  upload(tdy.get(), dy);
  EXPECT_OK(fp8_model_forward(m, tx.get(), ty.get()));
  EXPECT_OK(fp8_model_backward(m, tdy.get(), nullptr));
}

// What each rank's fp8_model_sync_grads returned after a forward and backward of step 0, with its
// error message.
struct Outcome {
  fp8_status_t status;
  std::string message;
};
inline std::vector<Outcome> sync_outcomes(Group& g) {
  std::vector<Outcome> out(g.ranks.size());
  on_ranks(g.size(), [&](int k) {
    Rank& r = g.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    out[k] = {fp8_model_sync_grads(r.model.get()), fp8_last_error_message()};
  });
  return out;
}

inline void train_step(Rank& r, int step, int rank) {
  forward_backward(r.ctx.get(), r.model.get(), batch_x(step, rank), batch_dy(step, rank));
  EXPECT_OK(fp8_optimizer_step(r.opt.get()));
  EXPECT_OK(fp8_optimizer_zero_grad(r.opt.get()));
}

// Appends the bytes of every scaling state (scale, then history) of layers 0 and 2 (the Linears of
// build_model) to *out; with `out` nullptr, only reads the states (each read checked).
inline void append_scaling_bytes(fp8_model_t* m, std::vector<unsigned char>* out) {
  for (int32_t layer : {0, 2})
    for (int32_t slot : {FP8_SCALING_INPUT, FP8_SCALING_WEIGHT, FP8_SCALING_GRAD_OUTPUT}) {
      fp8_scaling_t* s = nullptr;
      EXPECT_OK(fp8_layer_get_scaling(m, layer, slot, &s));
      if (!s || !out) continue;
      const fp8_scaling_info_t info = info_of(s);
      std::vector<float> history(static_cast<size_t>(info.amax_history_len));
      EXPECT_OK(fp8_scaling_get_history(s, history.data(), info.amax_history_len));
      const auto* a = reinterpret_cast<const unsigned char*>(&info.scale);
      out->insert(out->end(), a, a + sizeof info.scale);
      const auto* h = reinterpret_cast<const unsigned char*>(history.data());
      out->insert(out->end(), h, h + history.size() * sizeof(float));
    }
}

// The bytes of every flat storage arena of values (and of gradients) and of every scaling state
// (scale, history): what must be identical on every rank. (O3's F16 masters are not: each rank of
// a data-parallel model keeps its share of them.)
inline std::vector<unsigned char> state_bytes(const Rank& r, bool grads, bool scaling = true) {
  fp8_model_t* m = r.model.get();
  int32_t device = FP8_DEVICE_CPU;
  EXPECT_OK(fp8_context_device(r.ctx.get(), &device));
  // The context's work done (its stream may be on another GPU than this thread's), then read on
  // its own device.
  int previous = 0;
  if (device != FP8_DEVICE_CPU) {
    EXPECT_OK(fp8_context_synchronize(r.ctx.get()));
    EXPECT_EQ(cudaGetDevice(&previous), cudaSuccess);
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
  }
  std::vector<unsigned char> out;
  const fp8_storage_role_t roles[] = {FP8_STORAGE_VALUES, FP8_STORAGE_GRADS};
  for (fp8_storage_role_t role : roles) {
    if (role == FP8_STORAGE_GRADS && !grads) continue;
    for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
      void* data = nullptr;
      size_t bytes = 0;
      EXPECT_OK(fp8_model_flat_storage(m, role, dt, &data, &bytes));
      const size_t at = out.size();
      out.resize(at + bytes);
      if (bytes && device == FP8_DEVICE_CPU) std::memcpy(out.data() + at, data, bytes);
      if (bytes && device != FP8_DEVICE_CPU)
        EXPECT_EQ(cudaMemcpy(out.data() + at, data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
  }
  if (device != FP8_DEVICE_CPU) {
    EXPECT_EQ(cudaSetDevice(previous), cudaSuccess);
  }
  append_scaling_bytes(m, scaling ? &out : nullptr);
  return out;
}

// What exchanged_grads builds: build_model's model (fc1 in -> hidden), converted with `recipe`,
// data-parallel with `bucket_bytes` (0: the default) and backward sync on or off.
struct ExchangeCase {
  const char* recipe = "backend=msamp, opt_level=O2, small_layer_fallback=0";
  size_t bucket_bytes = 0;
  bool backward_sync = false;
  int64_t hidden = kHidden;
  const char* peer_exchange = nullptr;  // FP8_PEER_EXCHANGE (nullptr: unset)
};

// Sets an environment variable for a scope (nullptr: unset), unset again after.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() { unsetenv(name); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};

// Every rank's state after one forward and backward and fp8_model_sync_grads, rank k on devices[k]
// (join_ranks), the exchange cut in slices of FP8_EXCHANGE_SLICE_BYTES = `slice_bytes` (nullptr:
// the default), through the peer exchange or not as c.peer_exchange says; checks that the ranks
// agree and returns rank 0's.
inline std::vector<unsigned char> exchanged_grads(const std::vector<int32_t>& devices, const char* slice_bytes,
                                                  const ExchangeCase& c = {}) {
  const int n = static_cast<int>(devices.size());
  const ScopedEnv slices("FP8_EXCHANGE_SLICE_BYTES", slice_bytes), peers("FP8_PEER_EXCHANGE", c.peer_exchange);
  Group g(devices, c.recipe, FP8_OPTIMIZER_ADAM, 0.0f, c.bucket_bytes, c.backward_sync, c.hidden);
  on_ranks(n, [&](int k) {
    Rank& r = g.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    EXPECT_OK(fp8_model_sync_grads(r.model.get()));
  });
  const std::vector<unsigned char> want = state_bytes(g.ranks[0], true);
  for (int k = 1; k < n; ++k) EXPECT_EQ(state_bytes(g.ranks[k], true), want) << "rank " << k;
  return want;
}

// ZeRO at O3: what each of the ranks keeps. Rank k on devices[k] (fp8_comm_create_local), each with
// one 1024 x 1024 Linear "big" (no bias, weights from seed 5) converted with "backend=msamp,
// opt_level=O3", made data-parallel (collective) with an Adam optimizer.
struct ZeroO3Footprint {
  std::vector<int64_t> parameters;       // per rank: the parameters its optimizer updates
  std::vector<double> bytes_per_weight;  // per rank: its optimizer's training_bytes / parameters
  size_t masters_total = 0;              // the bytes of every rank's F16 master share, added up
};
// Fills *out (a fatal failure, for ASSERT_NO_FATAL_FAILURE, where the ranks cannot be joined).
inline void zero_o3_footprint(const std::vector<int32_t>& devices, ZeroO3Footprint* out) {
  const int n = static_cast<int>(devices.size());
  std::vector<Rank> ranks;
  FP8_ASSERT_OK(join_ranks(ranks, devices));
  for (int k = 0; k < n; ++k) {
    Rank& r = ranks[k];
    r.model = make_model(r.ctx.get());
    EXPECT_OK(fp8_model_add_linear(r.model.get(), "big", 1024, 1024, 0, nullptr));
    fp8_tensor_t* w = nullptr;
    EXPECT_OK(fp8_model_parameter_at(r.model.get(), 0, nullptr, &w, nullptr));
    upload(w, randn(1024 * 1024, 5, 0.03f));
    Recipe rec = make_recipe("backend=msamp, opt_level=O3");
    EXPECT_OK(fp8_convert_model(r.model.get(), rec.get(), nullptr));
  }
  on_ranks(n, [&](int k) {
    EXPECT_OK(fp8_model_set_comm(ranks[k].model.get(), ranks[k].comm.get()));
    ranks[k].opt = make_optimizer(ranks[k].model.get(), FP8_OPTIMIZER_ADAM);
  });
  *out = ZeroO3Footprint{};
  for (int k = 0; k < n; ++k) {
    const fp8_optimizer_stats_t s = stats_of(ranks[k].opt.get());
    out->parameters.push_back(s.parameters);
    out->bytes_per_weight.push_back(static_cast<double>(s.training_bytes) / static_cast<double>(s.parameters));
    void* data = nullptr;
    size_t bytes = 0;
    EXPECT_OK(fp8_model_flat_storage(ranks[k].model.get(), FP8_STORAGE_MASTERS, FP8_DTYPE_F16, &data, &bytes));
    out->masters_total += bytes;
  }
}

// A file of this test in the system's temporary directory.
inline std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("fp8_dist_") + name)).string();
}

inline float decode_e5m2(uint8_t c) {  // E5M2 is the top byte of an IEEE half
  const uint16_t h = static_cast<uint16_t>(c) << 8;
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return static_cast<float>((h & 0x8000) ? -v : v);
}

}  // namespace fp8test::dist_cases
