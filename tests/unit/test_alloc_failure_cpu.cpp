// An application's allocator (fp8_context_set_allocator), and what an allocation that fails does:
// every allocation a call makes is failed in turn, and the call must then change nothing.
#include <cstdlib>
#include <map>

#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

// Counts the blocks it hands out; once armed, refuses the `fail_at`-th request (0 = the next).
struct CountingAllocator {
  int64_t live = 0, total = 0;
  int64_t fail_at = -1;  // -1: never
  std::map<void*, size_t> sizes;
  size_t live_bytes = 0;
  static void* alloc(void* user, size_t bytes, int32_t device, CUstream_st*) {
    auto* a = static_cast<CountingAllocator*>(user);
    EXPECT_EQ(device, FP8_DEVICE_CPU);
    if (a->fail_at == 0) {
      a->fail_at = -1;
      return nullptr;
    }
    if (a->fail_at > 0) --a->fail_at;
    ++a->live, ++a->total;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    a->sizes[p] = bytes;
    a->live_bytes += bytes;
    return p;
  }
  static void free(void* user, void* p, int32_t, CUstream_st*) {
    auto* a = static_cast<CountingAllocator*>(user);
    --a->live;
    a->live_bytes -= a->sizes[p];
    a->sizes.erase(p);
    std::free(p);
  }
};

// What a refused call must leave as it was: every parameter's dtype, place and bytes, every layer's
// conversion.
struct Snapshot {
  std::vector<fp8_dtype_t> dtypes;
  std::vector<void*> places;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<int32_t> converted;
  bool operator==(const Snapshot& o) const {
    return dtypes == o.dtypes && places == o.places && bytes == o.bytes && converted == o.converted;
  }
};

Snapshot snapshot(fp8_model_t* m) {
  Snapshot s;
  int32_t count = 0, layers = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t *v = nullptr, *g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, nullptr, &v, &g));
    for (fp8_tensor_t* t : {v, g}) {
      void* data = nullptr;
      EXPECT_OK(fp8_tensor_data(t, &data));
      s.dtypes.push_back(dtype_of(t));
      s.places.push_back(data);
      s.bytes.push_back(tensor_bytes(t));
    }
  }
  EXPECT_OK(fp8_model_layer_count(m, &layers));
  for (int32_t l = 0; l < layers; ++l) {
    fp8_layer_report_t r;
    fp8_layer_report_init(&r);
    EXPECT_OK(fp8_layer_get_report(m, l, &r));
    s.converted.push_back(r.converted);
  }
  return s;
}

struct Stack {
  CountingAllocator counter;
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model;
  Stack() {
    EXPECT_OK(fp8_context_set_allocator(ctx.get(), CountingAllocator::alloc, CountingAllocator::free, &counter));
    model = make_model(ctx.get());
    fp8_model_t* m = model.get();
    EXPECT_OK(fp8_model_add_linear(m, "fc1", 64, 48, 1, nullptr));
    EXPECT_OK(fp8_model_add_layernorm(m, "ln", 48, 1e-5f, nullptr));
    EXPECT_OK(fp8_model_add_activation(m, "act", FP8_ACTIVATION_GELU, nullptr));
    EXPECT_OK(fp8_model_add_linear(m, "fc2", 48, 32, 0, nullptr));
    set_param(m, "fc1.weight", randn(64 * 48, 1, 0.2f));
    set_param(m, "fc1.bias", randn(48, 2, 0.2f));
    set_param(m, "fc2.weight", randn(48 * 32, 3, 0.2f));
  }
};

// The model's memory comes from the application's allocator, and goes back to it.
TEST(Allocator, TheModelsMemoryComesFromItAndGoesBack) {
  int64_t live = 0;
  {
    Stack s;
    EXPECT_GT(s.counter.total, 0);
    EXPECT_GT(s.counter.live, 0);
    s.model.reset();
    live = s.counter.live;
    EXPECT_EQ(live, 0) << "blocks not given back to the allocator that gave them";
  }
}

// A Linear call's transient buffers (its casts of x and dy) are the model's, shared by every layer:
// each further layer costs its own memory (parameters, gradients, FP8 weight copies, the transposed
// FP8 copy of x its forward state kept), not another set of m x (in + 2 out) bytes of casts.
TEST(Allocator, ALayerCallsTransientBuffersAreSharedByEveryLayer) {
  constexpr int64_t m = 1024, d = 64;
  auto bytes_after_a_step = [&](int layers) {
    CountingAllocator counter;
    Context ctx = make_context(FP8_DEVICE_CPU);
    EXPECT_OK(fp8_context_set_allocator(ctx.get(), CountingAllocator::alloc, CountingAllocator::free, &counter));
    Model model = make_model(ctx.get());
    for (int l = 0; l < layers; ++l) {
      const std::string name = "fc" + std::to_string(l);
      EXPECT_OK(fp8_model_add_linear(model.get(), name.c_str(), d, d, 0, nullptr));
      set_param(model.get(), name + ".weight", randn(static_cast<size_t>(d * d), 10 + l, 0.1f));
    }
    Recipe r = make_recipe("backend=te, small_layer_fallback=0");
    EXPECT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
    EXPECT_OK(fp8_model_set_autowrap(model.get(), 1));
    std::vector<Tensor> acts;
    acts.push_back(make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d}));
    upload(acts[0].get(), randn(static_cast<size_t>(m * d), 1, 1.0f));
    std::vector<Saved> saved;
    for (int l = 0; l < layers; ++l) {  // every forward first, as an autograd framework runs them
      acts.push_back(make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d}));
      fp8_saved_t* s = nullptr;
      EXPECT_OK(fp8_layer_forward_saved(model.get(), l, acts[l].get(), acts[l + 1].get(), &s));
      saved.emplace_back(s);
    }
    Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d}), dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d});
    upload(dy.get(), randn(static_cast<size_t>(m * d), 2, 1.0f));
    for (int l = layers - 1; l >= 0; --l)
      EXPECT_OK(fp8_layer_backward_saved(model.get(), l, saved[static_cast<size_t>(l)].get(), dy.get(), dx.get(), 0));
    return static_cast<int64_t>(counter.live_bytes) -
           static_cast<int64_t>((layers + 3) * m * d * sizeof(float));  // (the test's own tensors)
  };
  const int64_t one = bytes_after_a_step(1), four = bytes_after_a_step(4);
  const int64_t per_layer = (four - one) / 3;
  const int64_t own = 2 * d * d * 4 + 2 * d * d + m * d;  // weight and gradient, W and W^T in FP8, x^T in FP8
  const int64_t casts = m * (d + 2 * d);                  // x's cast, dy's cast and its transpose
  EXPECT_GT(per_layer, own / 2) << "the measure missed the layers' own memory";
  EXPECT_LT(per_layer, own + casts / 2) << "each layer keeps transient buffers of its own";
}

// A call that casts nothing (a model not converted) takes none of the call scratch's cast buffers:
// after a forward and backward the model holds its parameters and gradients and nothing of m x d.
TEST(Allocator, AHighPrecisionCallTakesNoCastBuffers) {
  constexpr int64_t m = 1024, d = 64;
  CountingAllocator counter;
  Context ctx = make_context(FP8_DEVICE_CPU);
  FP8_ASSERT_OK(fp8_context_set_allocator(ctx.get(), CountingAllocator::alloc, CountingAllocator::free, &counter));
  Model model = make_model(ctx.get());
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", d, d, 0, nullptr));
  set_param(model.get(), "fc.weight", randn(static_cast<size_t>(d * d), 3, 0.1f));
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d}), y = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d}), dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {m, d});
  upload(x.get(), randn(static_cast<size_t>(m * d), 1, 1.0f));
  upload(dy.get(), randn(static_cast<size_t>(m * d), 2, 1.0f));
  const size_t before = counter.live_bytes;
  fp8_saved_t* s = nullptr;
  FP8_ASSERT_OK(fp8_layer_forward_saved(model.get(), 0, x.get(), y.get(), &s));
  Saved saved(s);
  FP8_ASSERT_OK(fp8_layer_backward_saved(model.get(), 0, saved.get(), dy.get(), dx.get(), 0));
  EXPECT_LT(counter.live_bytes - before, static_cast<size_t>(m * d / 4))
      << "a buffer of m x d for a call that casts nothing";
  // (The measure sees such buffers: the same calls converted to FP8 take x's and dy's casts.)
  Recipe r = make_recipe("backend=te, small_layer_fallback=0");
  FP8_ASSERT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
  FP8_ASSERT_OK(fp8_model_set_autowrap(model.get(), 1));
  const size_t converted = counter.live_bytes;
  FP8_ASSERT_OK(fp8_layer_forward_saved(model.get(), 0, x.get(), y.get(), &s));
  Saved fp8_saved(s);
  FP8_ASSERT_OK(fp8_layer_backward_saved(model.get(), 0, fp8_saved.get(), dy.get(), dx.get(), 0));
  EXPECT_GT(counter.live_bytes - converted, static_cast<size_t>(2 * m * d));
}

TEST(Allocator, OnlyBothOrNeither) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  EXPECT_REFUSED(fp8_context_set_allocator(ctx.get(), CountingAllocator::alloc, nullptr, nullptr),
                 FP8_ERR_INVALID_ARGUMENT, "fp8_context_set_allocator", "free_fn");
  EXPECT_REFUSED(fp8_context_set_allocator(nullptr, nullptr, nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_context_set_allocator", "'ctx'");
  EXPECT_OK(fp8_context_set_allocator(ctx.get(), nullptr, nullptr, nullptr));
}

// fp8_convert_model with every one of its allocations failing in turn, at each level: the call
// reports FP8_ERR_OUT_OF_MEMORY and the model is exactly as before; then it converts.
TEST(AllocationFailure, ConvertModelChangesNothingWhicheverAllocationFails) {
  for (const char* recipe : {"backend=te", "backend=msamp, opt_level=O2", "backend=msamp, opt_level=O3"}) {
    SCOPED_TRACE(recipe);
    Stack s;
    fp8_model_t* m = s.model.get();
    Recipe r = make_recipe(recipe);
    const Snapshot before = snapshot(m);
    int64_t k = 0;
    for (;; ++k) {
      s.counter.fail_at = k;
      const fp8_status_t st = fp8_convert_model(m, r.get(), nullptr);
      const bool failed = s.counter.fail_at == -1;  // the allocator refused one
      s.counter.fail_at = -1;
      if (!failed) {
        EXPECT_OK(st);
        break;
      }
      ASSERT_EQ(st, FP8_ERR_OUT_OF_MEMORY) << "allocation " << k << ": " << fp8_last_error_message();
      ASSERT_TRUE(snapshot(m) == before) << "allocation " << k << " failed and the model changed";
      int32_t has = 1;
      EXPECT_OK(fp8_model_has_fp8_layers(m, &has));
      EXPECT_EQ(has, 0);
    }
    EXPECT_GT(k, 3) << "the conversion made too few allocations for this test to mean anything";
    int32_t has = 0;
    EXPECT_OK(fp8_model_has_fp8_layers(m, &has));
    EXPECT_EQ(has, 1);
  }
}

// Adding a layer whose storage cannot be made leaves the model without it, and the others intact.
TEST(AllocationFailure, AddLayerChangesNothingWhicheverAllocationFails) {
  Stack s;
  fp8_model_t* m = s.model.get();
  const Snapshot before = snapshot(m);
  for (int64_t k = 0;; ++k) {
    s.counter.fail_at = k;
    const fp8_status_t st = fp8_model_add_linear(m, "fc3", 32, 16, 1, nullptr);
    const bool failed = s.counter.fail_at == -1;
    s.counter.fail_at = -1;
    if (!failed) {
      EXPECT_OK(st);
      break;
    }
    ASSERT_EQ(st, FP8_ERR_OUT_OF_MEMORY) << "allocation " << k;
    int32_t layers = 0;
    EXPECT_OK(fp8_model_layer_count(m, &layers));
    ASSERT_EQ(layers, 4) << "allocation " << k;
    ASSERT_TRUE(snapshot(m) == before) << "allocation " << k;
  }
}

// A forward whose state cannot get its buffer returns no state and the layer stays usable.
TEST(AllocationFailure, AForwardStateThatCannotBeMadeIsNotReturned) {
  Stack s;
  fp8_model_t* m = s.model.get();
  Tensor x = make_tensor(s.ctx.get(), FP8_DTYPE_F32, {16, 48});
  upload(x.get(), randn(16 * 48, 9, 1.0f));
  Tensor y = make_tensor(s.ctx.get(), FP8_DTYPE_F32, {16, 48});
  s.counter.fail_at = 0;
  fp8_saved_t* saved = nullptr;
  EXPECT_EQ(fp8_layer_forward_saved(m, 1, x.get(), y.get(), &saved), FP8_ERR_OUT_OF_MEMORY);
  EXPECT_EQ(saved, nullptr);
  s.counter.fail_at = -1;
  FP8_ASSERT_OK(fp8_layer_forward_saved(m, 1, x.get(), y.get(), &saved));
  fp8_saved_destroy(saved);
}

}  // namespace
