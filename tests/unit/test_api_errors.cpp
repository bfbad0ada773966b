// Misuse of the public C ABI, on the CPU reference backend: NULL arguments, bad dtypes and shapes,
// mismatched tensors, foreign contexts, bad counts, destroy order. Each call must return the status
// fp8.h documents, name the function and the culprit in fp8_last_error_message(), and leave every
// out-parameter, user buffer, tensor and scaling state exactly as it was.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fp8.h"

namespace {

// ---- RAII handles -------------------------------------------------------------------------------

struct Deleter {
  void operator()(fp8_context_t* p) const { fp8_context_destroy(p); }
  void operator()(fp8_recipe_t* p) const { fp8_recipe_destroy(p); }
  void operator()(fp8_tensor_t* p) const { fp8_tensor_destroy(p); }
  void operator()(fp8_scaling_t* p) const { fp8_scaling_destroy(p); }
};
using ContextPtr = std::unique_ptr<fp8_context_t, Deleter>;
using RecipePtr = std::unique_ptr<fp8_recipe_t, Deleter>;
using TensorPtr = std::unique_ptr<fp8_tensor_t, Deleter>;
using ScalingPtr = std::unique_ptr<fp8_scaling_t, Deleter>;

// Sentinels that out-parameters must keep when a call fails.
template <typename T>
T* sentinel() {
  return reinterpret_cast<T*>(uintptr_t{0xdead0000});
}

std::string last_error() { return fp8_last_error_message(); }

bool is_ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// `word` occurs in `text` as a whole identifier-like token ("in" in "'in' is NULL", not in "int").
// A word ending in '[' ("states[") only needs its left boundary.
bool names_word(const std::string& text, const std::string& word) {
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const bool left_ok = at == 0 || !is_ident(text[at - 1]);
    const size_t end = at + word.size();
    const bool right_ok = !is_ident(word.back()) || end >= text.size() || !is_ident(text[end]);
    if (left_ok && right_ok) return true;
  }
  return false;
}

// The last message starts with the function's name and names `arg`.
#define EXPECT_MESSAGE(fn, arg)                                                                      \
  do {                                                                                               \
    const std::string msg_ = last_error();                                                           \
    EXPECT_EQ(msg_.rfind(std::string(fn) + ":", 0), 0u) << "message does not start with " << (fn) \
                                                        << ": " << msg_;                           \
    EXPECT_TRUE(names_word(msg_, arg)) << "message does not name " << (arg) << ": " << msg_;        \
  } while (0)

// `call` returns `status` with a message naming `fn` and `arg`.
#define EXPECT_REFUSED(call, status, fn, arg)                                              \
  do {                                                                                     \
    const fp8_status_t st_ = (call);                                                       \
    EXPECT_EQ(st_, status) << #call << " returned " << fp8_status_string(st_) << ": "       \
                           << fp8_last_error_message();                                    \
    EXPECT_MESSAGE(fn, arg);                                                               \
  } while (0)

#define EXPECT_NULL_REFUSED(call, fn, arg) EXPECT_REFUSED(call, FP8_ERR_INVALID_ARGUMENT, fn, arg)

#define ASSERT_FP8_OK(call) ASSERT_EQ((call), FP8_OK) << #call << ": " << fp8_last_error_message()

ContextPtr cpu_context() {
  fp8_context_t* ctx = nullptr;
  EXPECT_EQ(fp8_context_create(&ctx, FP8_DEVICE_CPU), FP8_OK) << fp8_last_error_message();
  return ContextPtr(ctx);
}

RecipePtr recipe(const char* text = "") {
  fp8_recipe_t* r = nullptr;
  EXPECT_EQ(fp8_recipe_create(&r), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_recipe_parse(r, text), FP8_OK) << fp8_last_error_message();
  return RecipePtr(r);
}

TensorPtr tensor(fp8_context_t* ctx, fp8_dtype_t dtype, std::vector<int64_t> shape) {
  fp8_tensor_t* t = nullptr;
  EXPECT_EQ(fp8_tensor_create(&t, ctx, dtype, static_cast<int32_t>(shape.size()), shape.data()), FP8_OK)
      << fp8_last_error_message();
  return TensorPtr(t);
}

TensorPtr wrap(fp8_context_t* ctx, fp8_dtype_t dtype, std::vector<int64_t> shape, void* data) {
  fp8_tensor_t* t = nullptr;
  EXPECT_EQ(fp8_tensor_wrap(&t, ctx, dtype, static_cast<int32_t>(shape.size()), shape.data(), data), FP8_OK)
      << fp8_last_error_message();
  return TensorPtr(t);
}

ScalingPtr scaling(fp8_context_t* ctx, const fp8_recipe_t* r, fp8_role_t role = FP8_ROLE_FORWARD) {
  fp8_scaling_t* s = nullptr;
  EXPECT_EQ(fp8_scaling_create(&s, ctx, r, role), FP8_OK) << fp8_last_error_message();
  return ScalingPtr(s);
}

size_t nbytes(const fp8_tensor_t* t) {
  int64_t n = -1;
  fp8_dtype_t dt = -1;
  EXPECT_EQ(fp8_tensor_numel(t, &n), FP8_OK);
  EXPECT_EQ(fp8_tensor_dtype(t, &dt), FP8_OK);
  return static_cast<size_t>(n) * fp8_dtype_size(dt);
}

std::vector<uint8_t> bytes_of(const fp8_tensor_t* t) {
  std::vector<uint8_t> b(nbytes(t));
  EXPECT_EQ(fp8_tensor_copy_to_host(t, b.data(), b.size()), FP8_OK) << fp8_last_error_message();
  return b;
}

// Fills a tensor with a recognisable byte pattern (distinct per `seed`).
std::vector<uint8_t> fill(fp8_tensor_t* t, uint8_t seed) {
  std::vector<uint8_t> b(nbytes(t));
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(seed + 7 * i);
  EXPECT_EQ(fp8_tensor_copy_from_host(t, b.data(), b.size()), FP8_OK) << fp8_last_error_message();
  return b;
}

// Fills an F32 tensor with the values 1, -2, 3, ... so that its amax is its element count.
void fill_f32(fp8_tensor_t* t) {
  std::vector<float> v(nbytes(t) / sizeof(float));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i + 1) * (i % 2 ? -1.0f : 1.0f);
  EXPECT_EQ(fp8_tensor_copy_from_host(t, v.data(), v.size() * sizeof(float)), FP8_OK) << fp8_last_error_message();
}

fp8_scaling_info_t info_of(const fp8_scaling_t* s) {
  fp8_scaling_info_t info;
  fp8_scaling_info_init(&info);
  EXPECT_EQ(fp8_scaling_get_info(s, &info), FP8_OK) << fp8_last_error_message();
  return info;
}

std::vector<float> history_of(const fp8_scaling_t* s) {
  const fp8_scaling_info_t info = info_of(s);
  std::vector<float> h(static_cast<size_t>(info.amax_history_len));
  EXPECT_EQ(fp8_scaling_get_history(s, h.data(), info.amax_history_len), FP8_OK) << fp8_last_error_message();
  return h;
}

// Everything observable about a scaling state, for "unchanged" checks.
struct StateView {
  fp8_scaling_info_t info;
  std::vector<float> history;
};
StateView view(const fp8_scaling_t* s) { return {info_of(s), history_of(s)}; }

void expect_same_state(const StateView& a, const StateView& b, const char* what) {
  EXPECT_EQ(std::memcmp(&a.info.scale, &b.info.scale, sizeof(float)), 0) << what << ": scale changed";
  EXPECT_EQ(std::memcmp(&a.info.scale_inv, &b.info.scale_inv, sizeof(float)), 0) << what << ": scale_inv changed";
  EXPECT_EQ(std::memcmp(&a.info.amax, &b.info.amax, sizeof(float)), 0) << what << ": amax changed";
  EXPECT_EQ(a.info.update_count, b.info.update_count) << what;
  EXPECT_EQ(a.info.nonfinite_count, b.info.nonfinite_count) << what;
  EXPECT_EQ(a.info.amax_history_len, b.info.amax_history_len) << what;
  ASSERT_EQ(a.history.size(), b.history.size()) << what;
  EXPECT_EQ(std::memcmp(a.history.data(), b.history.data(), a.history.size() * sizeof(float)), 0)
      << what << ": history changed";
}

// ---- NULL for every pointer argument ------------------------------------------------------------

TEST(ApiNull, ContextAndDeviceCallsRefuseNullPointers) {
  ContextPtr ctx = cpu_context();

  EXPECT_NULL_REFUSED(fp8_context_create(nullptr, FP8_DEVICE_CPU), "fp8_context_create", "out");

  int32_t device = 777;
  EXPECT_NULL_REFUSED(fp8_context_device(nullptr, &device), "fp8_context_device", "ctx");
  EXPECT_EQ(device, 777);
  EXPECT_NULL_REFUSED(fp8_context_device(ctx.get(), nullptr), "fp8_context_device", "device");

  EXPECT_NULL_REFUSED(fp8_context_set_stream(nullptr, nullptr), "fp8_context_set_stream", "ctx");

  struct CUstream_st* stream = sentinel<struct CUstream_st>();
  EXPECT_NULL_REFUSED(fp8_context_get_stream(nullptr, &stream), "fp8_context_get_stream", "ctx");
  EXPECT_EQ(stream, sentinel<struct CUstream_st>());
  EXPECT_NULL_REFUSED(fp8_context_get_stream(ctx.get(), nullptr), "fp8_context_get_stream", "stream");

  EXPECT_NULL_REFUSED(fp8_context_synchronize(nullptr), "fp8_context_synchronize", "ctx");

  EXPECT_NULL_REFUSED(fp8_device_query(FP8_DEVICE_CPU, nullptr), "fp8_device_query", "info");
  EXPECT_NULL_REFUSED(fp8_device_count(nullptr), "fp8_device_count", "count");

  fp8_device_info_init(nullptr);   // does nothing
  fp8_scaling_info_init(nullptr);  // does nothing
}

TEST(ApiNull, RecipeCallsRefuseNullPointers) {
  RecipePtr r = recipe("margin=3");
  fp8_recipe_t* out = sentinel<fp8_recipe_t>();
  EXPECT_NULL_REFUSED(fp8_recipe_create(nullptr), "fp8_recipe_create", "out");
  EXPECT_NULL_REFUSED(fp8_recipe_clone(nullptr, r.get()), "fp8_recipe_clone", "out");
  EXPECT_NULL_REFUSED(fp8_recipe_clone(&out, nullptr), "fp8_recipe_clone", "src");
  EXPECT_EQ(out, sentinel<fp8_recipe_t>());
  EXPECT_NULL_REFUSED(fp8_recipe_set_int(nullptr, FP8_RECIPE_MARGIN, 1), "fp8_recipe_set_int", "recipe");
  int64_t value = -777;
  EXPECT_NULL_REFUSED(fp8_recipe_get_int(nullptr, FP8_RECIPE_MARGIN, &value), "fp8_recipe_get_int", "recipe");
  EXPECT_EQ(value, -777);
  EXPECT_NULL_REFUSED(fp8_recipe_get_int(r.get(), FP8_RECIPE_MARGIN, nullptr), "fp8_recipe_get_int", "value");
  EXPECT_NULL_REFUSED(fp8_recipe_parse(nullptr, "margin=1"), "fp8_recipe_parse", "recipe");
  EXPECT_NULL_REFUSED(fp8_recipe_parse(r.get(), nullptr), "fp8_recipe_parse", "text");
  char buf[4] = {'a', 'b', 'c', 'd'};
  size_t needed = 4321;
  EXPECT_NULL_REFUSED(fp8_recipe_to_string(nullptr, buf, sizeof buf, &needed), "fp8_recipe_to_string", "recipe");
  EXPECT_EQ(needed, 4321u);
  EXPECT_EQ(std::memcmp(buf, "abcd", 4), 0);
  fp8_dtype_t dt = 77;
  EXPECT_NULL_REFUSED(fp8_recipe_dtype_for(nullptr, FP8_ROLE_FORWARD, &dt), "fp8_recipe_dtype_for", "recipe");
  EXPECT_EQ(dt, 77);
  EXPECT_NULL_REFUSED(fp8_recipe_dtype_for(r.get(), FP8_ROLE_FORWARD, nullptr), "fp8_recipe_dtype_for", "dtype");
  // attr_bounds documents every output as optional.
  EXPECT_EQ(fp8_recipe_attr_bounds(FP8_RECIPE_MARGIN, nullptr, nullptr, nullptr, nullptr), FP8_OK);
  // The recipe is untouched by all of the above.
  EXPECT_EQ(fp8_recipe_get_int(r.get(), FP8_RECIPE_MARGIN, &value), FP8_OK);
  EXPECT_EQ(value, 3);
}

TEST(ApiNull, TensorCallsRefuseNullPointers) {
  ContextPtr ctx = cpu_context();
  const int64_t shape[2] = {2, 3};
  float host[6] = {1, 2, 3, 4, 5, 6};
  fp8_tensor_t* out = sentinel<fp8_tensor_t>();

  EXPECT_NULL_REFUSED(fp8_tensor_create(nullptr, ctx.get(), FP8_DTYPE_F32, 2, shape), "fp8_tensor_create", "out");
  EXPECT_NULL_REFUSED(fp8_tensor_create(&out, nullptr, FP8_DTYPE_F32, 2, shape), "fp8_tensor_create", "ctx");
  EXPECT_NULL_REFUSED(fp8_tensor_create(&out, ctx.get(), FP8_DTYPE_F32, 2, nullptr), "fp8_tensor_create", "shape");
  EXPECT_EQ(out, sentinel<fp8_tensor_t>());

  EXPECT_NULL_REFUSED(fp8_tensor_wrap(nullptr, ctx.get(), FP8_DTYPE_F32, 2, shape, host), "fp8_tensor_wrap", "out");
  EXPECT_NULL_REFUSED(fp8_tensor_wrap(&out, nullptr, FP8_DTYPE_F32, 2, shape, host), "fp8_tensor_wrap", "ctx");
  EXPECT_NULL_REFUSED(fp8_tensor_wrap(&out, ctx.get(), FP8_DTYPE_F32, 2, nullptr, host), "fp8_tensor_wrap", "shape");
  EXPECT_NULL_REFUSED(fp8_tensor_wrap(&out, ctx.get(), FP8_DTYPE_F32, 2, shape, nullptr), "fp8_tensor_wrap", "data");
  EXPECT_EQ(out, sentinel<fp8_tensor_t>());

  TensorPtr t = tensor(ctx.get(), FP8_DTYPE_F32, {2, 3});
  TensorPtr t8 = tensor(ctx.get(), FP8_DTYPE_E4M3, {2, 3});
  const std::vector<uint8_t> content = fill(t.get(), 11);
  ASSERT_FP8_OK(fp8_tensor_set_scale_inv(t8.get(), 0.5f));

  fp8_dtype_t dt = 77;
  EXPECT_NULL_REFUSED(fp8_tensor_dtype(nullptr, &dt), "fp8_tensor_dtype", "tensor");
  EXPECT_EQ(dt, 77);
  EXPECT_NULL_REFUSED(fp8_tensor_dtype(t.get(), nullptr), "fp8_tensor_dtype", "dtype");

  int32_t ndim = 77;
  int64_t dims[FP8_MAX_DIMS] = {-5, -5, -5, -5, -5, -5, -5, -5};
  EXPECT_NULL_REFUSED(fp8_tensor_shape(nullptr, &ndim, dims), "fp8_tensor_shape", "tensor");
  EXPECT_NULL_REFUSED(fp8_tensor_shape(t.get(), nullptr, dims), "fp8_tensor_shape", "ndim");
  EXPECT_EQ(ndim, 77);
  for (int64_t d : dims) EXPECT_EQ(d, -5);
  // shape is optional.
  EXPECT_EQ(fp8_tensor_shape(t.get(), &ndim, nullptr), FP8_OK);
  EXPECT_EQ(ndim, 2);

  int64_t numel = -77;
  EXPECT_NULL_REFUSED(fp8_tensor_numel(nullptr, &numel), "fp8_tensor_numel", "tensor");
  EXPECT_EQ(numel, -77);
  EXPECT_NULL_REFUSED(fp8_tensor_numel(t.get(), nullptr), "fp8_tensor_numel", "numel");

  void* data = sentinel<void>();
  EXPECT_NULL_REFUSED(fp8_tensor_data(nullptr, &data), "fp8_tensor_data", "tensor");
  EXPECT_EQ(data, sentinel<void>());
  EXPECT_NULL_REFUSED(fp8_tensor_data(t.get(), nullptr), "fp8_tensor_data", "data");

  EXPECT_NULL_REFUSED(fp8_tensor_copy_from_host(nullptr, host, sizeof host), "fp8_tensor_copy_from_host", "tensor");
  EXPECT_NULL_REFUSED(fp8_tensor_copy_from_host(t.get(), nullptr, sizeof host), "fp8_tensor_copy_from_host", "src");
  EXPECT_EQ(bytes_of(t.get()), content);

  float dst[6] = {-1, -1, -1, -1, -1, -1};
  EXPECT_NULL_REFUSED(fp8_tensor_copy_to_host(nullptr, dst, sizeof dst), "fp8_tensor_copy_to_host", "tensor");
  for (float v : dst) EXPECT_EQ(v, -1.0f);
  EXPECT_NULL_REFUSED(fp8_tensor_copy_to_host(t.get(), nullptr, sizeof dst), "fp8_tensor_copy_to_host", "dst");

  float scale_inv = -3.0f;
  EXPECT_NULL_REFUSED(fp8_tensor_get_scale_inv(nullptr, &scale_inv), "fp8_tensor_get_scale_inv", "tensor");
  EXPECT_EQ(scale_inv, -3.0f);
  EXPECT_NULL_REFUSED(fp8_tensor_get_scale_inv(t8.get(), nullptr), "fp8_tensor_get_scale_inv", "scale_inv");
  EXPECT_NULL_REFUSED(fp8_tensor_set_scale_inv(nullptr, 2.0f), "fp8_tensor_set_scale_inv", "tensor");
  ASSERT_FP8_OK(fp8_tensor_get_scale_inv(t8.get(), &scale_inv));
  EXPECT_EQ(scale_inv, 0.5f);
}

TEST(ApiNull, ScalingCallsRefuseNullPointers) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4");
  ScalingPtr s = scaling(ctx.get(), r.get());
  const StateView before = view(s.get());

  fp8_scaling_t* out = sentinel<fp8_scaling_t>();
  EXPECT_NULL_REFUSED(fp8_scaling_create(nullptr, ctx.get(), r.get(), FP8_ROLE_FORWARD), "fp8_scaling_create", "out");
  EXPECT_NULL_REFUSED(fp8_scaling_create(&out, nullptr, r.get(), FP8_ROLE_FORWARD), "fp8_scaling_create", "ctx");
  EXPECT_NULL_REFUSED(fp8_scaling_create(&out, ctx.get(), nullptr, FP8_ROLE_FORWARD), "fp8_scaling_create", "recipe");
  EXPECT_EQ(out, sentinel<fp8_scaling_t>());

  fp8_dtype_t dt = 77;
  EXPECT_NULL_REFUSED(fp8_scaling_dtype(nullptr, &dt), "fp8_scaling_dtype", "scaling");
  EXPECT_EQ(dt, 77);
  EXPECT_NULL_REFUSED(fp8_scaling_dtype(s.get(), nullptr), "fp8_scaling_dtype", "dtype");

  fp8_scaling_info_t info;
  std::memset(&info, 0xab, sizeof info);
  info.struct_size = sizeof info;
  fp8_scaling_info_t copy = info;
  EXPECT_NULL_REFUSED(fp8_scaling_get_info(nullptr, &info), "fp8_scaling_get_info", "scaling");
  EXPECT_EQ(std::memcmp(&info, &copy, sizeof info), 0);
  EXPECT_NULL_REFUSED(fp8_scaling_get_info(s.get(), nullptr), "fp8_scaling_get_info", "info");

  float hist[4] = {-1, -1, -1, -1};
  EXPECT_NULL_REFUSED(fp8_scaling_get_history(nullptr, hist, 4), "fp8_scaling_get_history", "scaling");
  for (float h : hist) EXPECT_EQ(h, -1.0f);
  EXPECT_NULL_REFUSED(fp8_scaling_get_history(s.get(), nullptr, 4), "fp8_scaling_get_history", "history");

  EXPECT_NULL_REFUSED(fp8_scaling_set_scale(nullptr, 2.0f), "fp8_scaling_set_scale", "scaling");

  fp8_scaling_t* states[1] = {s.get()};
  EXPECT_NULL_REFUSED(fp8_scaling_update(nullptr, states, 1, r.get()), "fp8_scaling_update", "ctx");
  EXPECT_NULL_REFUSED(fp8_scaling_update(ctx.get(), states, 1, nullptr), "fp8_scaling_update", "recipe");
  EXPECT_NULL_REFUSED(fp8_scaling_update(ctx.get(), nullptr, 1, r.get()), "fp8_scaling_update", "states");

  expect_same_state(view(s.get()), before, "after NULL arguments");
}

TEST(ApiNull, CastCallsRefuseNullPointers) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4");
  ScalingPtr s = scaling(ctx.get(), r.get());  // E4M3
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_F32, {2, 3});
  TensorPtr q = tensor(ctx.get(), FP8_DTYPE_E4M3, {2, 3});
  TensorPtr deq = tensor(ctx.get(), FP8_DTYPE_F32, {2, 3});
  TensorPtr amax = tensor(ctx.get(), FP8_DTYPE_F32, {1});
  fill_f32(in.get());
  const std::vector<uint8_t> q_bytes = fill(q.get(), 1);
  const std::vector<uint8_t> deq_bytes = fill(deq.get(), 2);
  const std::vector<uint8_t> amax_bytes = fill(amax.get(), 3);
  const StateView before = view(s.get());

  EXPECT_NULL_REFUSED(fp8_quantize(nullptr, in.get(), q.get(), nullptr, s.get()), "fp8_quantize", "ctx");
  EXPECT_NULL_REFUSED(fp8_quantize(ctx.get(), nullptr, q.get(), nullptr, s.get()), "fp8_quantize", "in");
  EXPECT_NULL_REFUSED(fp8_quantize(ctx.get(), in.get(), nullptr, nullptr, s.get()), "fp8_quantize", "out");
  EXPECT_NULL_REFUSED(fp8_quantize(ctx.get(), in.get(), q.get(), nullptr, nullptr), "fp8_quantize", "scaling");

  EXPECT_NULL_REFUSED(fp8_dequantize(nullptr, q.get(), deq.get()), "fp8_dequantize", "ctx");
  EXPECT_NULL_REFUSED(fp8_dequantize(ctx.get(), nullptr, deq.get()), "fp8_dequantize", "in");
  EXPECT_NULL_REFUSED(fp8_dequantize(ctx.get(), q.get(), nullptr), "fp8_dequantize", "out");

  EXPECT_NULL_REFUSED(fp8_amax(nullptr, in.get(), amax.get(), s.get()), "fp8_amax", "ctx");
  EXPECT_NULL_REFUSED(fp8_amax(ctx.get(), nullptr, amax.get(), s.get()), "fp8_amax", "in");
  EXPECT_NULL_REFUSED(fp8_amax(ctx.get(), in.get(), nullptr, s.get()), "fp8_amax", "amax");

  EXPECT_EQ(bytes_of(q.get()), q_bytes);
  EXPECT_EQ(bytes_of(deq.get()), deq_bytes);
  EXPECT_EQ(bytes_of(amax.get()), amax_bytes);
  expect_same_state(view(s.get()), before, "after NULL arguments");

  // The optional pointers really are optional.
  EXPECT_EQ(fp8_quantize(ctx.get(), in.get(), q.get(), nullptr, s.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_amax(ctx.get(), in.get(), amax.get(), nullptr), FP8_OK) << fp8_last_error_message();
}

TEST(ApiNull, DestroyNullDoesNothing) {
  fp8_context_destroy(nullptr);
  fp8_recipe_destroy(nullptr);
  fp8_tensor_destroy(nullptr);
  fp8_scaling_destroy(nullptr);
  SUCCEED();
}

// ---- library-wide functions ---------------------------------------------------------------------

TEST(Library, StatusStringNamesEveryStatus) {
#define FP8_CHECK_STATUS_NAME(s) EXPECT_STREQ(fp8_status_string(s), #s)
  FP8_CHECK_STATUS_NAME(FP8_OK);
  FP8_CHECK_STATUS_NAME(FP8_ERR_INVALID_ARGUMENT);
  FP8_CHECK_STATUS_NAME(FP8_ERR_DTYPE);
  FP8_CHECK_STATUS_NAME(FP8_ERR_SHAPE);
  FP8_CHECK_STATUS_NAME(FP8_ERR_INVALID_STATE);
  FP8_CHECK_STATUS_NAME(FP8_ERR_OUT_OF_MEMORY);
  FP8_CHECK_STATUS_NAME(FP8_ERR_CUDA);
  FP8_CHECK_STATUS_NAME(FP8_ERR_CUBLAS);
  FP8_CHECK_STATUS_NAME(FP8_ERR_NCCL);
  FP8_CHECK_STATUS_NAME(FP8_ERR_UNSUPPORTED);
  FP8_CHECK_STATUS_NAME(FP8_ERR_IO);
  FP8_CHECK_STATUS_NAME(FP8_ERR_CORRUPT);
  FP8_CHECK_STATUS_NAME(FP8_ERR_VERSION);
  FP8_CHECK_STATUS_NAME(FP8_ERR_BUFFER_TOO_SMALL);
  FP8_CHECK_STATUS_NAME(FP8_ERR_NO_DEVICE);
  FP8_CHECK_STATUS_NAME(FP8_ERR_INTERNAL);
#undef FP8_CHECK_STATUS_NAME
  // The pinned numbers.
  EXPECT_EQ(FP8_OK, 0);
  EXPECT_EQ(FP8_ERR_INTERNAL, 15);
}

TEST(Library, StatusStringOfAnUnknownValueIsUnknown) {
  for (fp8_status_t s : {int32_t{-1}, int32_t{16}, int32_t{100}, std::numeric_limits<int32_t>::min(),
                         std::numeric_limits<int32_t>::max()})
    EXPECT_STREQ(fp8_status_string(s), "FP8_ERR_UNKNOWN") << s;
}

TEST(Library, LastErrorMessageIsEmptyOnAFreshThreadAndNeverNull) {
  bool fresh_null = true, failed_null = true;
  std::string fresh = "(unset)", after_failure;
  std::thread worker([&] {
    const char* m = fp8_last_error_message();
    fresh_null = m == nullptr;
    if (m) fresh = m;
    EXPECT_EQ(fp8_device_count(nullptr), FP8_ERR_INVALID_ARGUMENT);
    m = fp8_last_error_message();
    failed_null = m == nullptr;
    if (m) after_failure = m;
  });
  worker.join();
  EXPECT_FALSE(fresh_null);
  EXPECT_EQ(fresh, "") << "a new thread's message before any failure";
  EXPECT_FALSE(failed_null);
  EXPECT_NE(after_failure.find("fp8_device_count"), std::string::npos) << after_failure;
  EXPECT_NE(fp8_last_error_message(), nullptr);
}

TEST(Library, LastErrorMessageIsPerThreadAndSurvivesSuccess) {
  EXPECT_EQ(fp8_context_synchronize(nullptr), FP8_ERR_INVALID_ARGUMENT);
  const std::string mine = last_error();
  ASSERT_NE(mine.find("fp8_context_synchronize"), std::string::npos) << mine;

  std::thread worker([] { EXPECT_EQ(fp8_device_count(nullptr), FP8_ERR_INVALID_ARGUMENT); });
  worker.join();
  EXPECT_EQ(last_error(), mine) << "another thread's failure replaced this thread's message";

  int32_t count = -1;
  ASSERT_EQ(fp8_device_count(&count), FP8_OK);
  RecipePtr r = recipe();
  EXPECT_EQ(last_error(), mine) << "a successful call cleared the message";
  ASSERT_NE(fp8_last_error_message(), nullptr);
}

TEST(Library, DtypeSizeAndName) {
  EXPECT_EQ(fp8_dtype_size(FP8_DTYPE_F32), 4u);
  EXPECT_EQ(fp8_dtype_size(FP8_DTYPE_F16), 2u);
  EXPECT_EQ(fp8_dtype_size(FP8_DTYPE_BF16), 2u);
  EXPECT_EQ(fp8_dtype_size(FP8_DTYPE_E4M3), 1u);
  EXPECT_EQ(fp8_dtype_size(FP8_DTYPE_E5M2), 1u);
  for (fp8_dtype_t bad : {int32_t{-1}, int32_t{5}, int32_t{1000}, std::numeric_limits<int32_t>::min()})
    EXPECT_EQ(fp8_dtype_size(bad), 0u) << bad;

  EXPECT_STREQ(fp8_dtype_name(FP8_DTYPE_BF16), "bf16");
  EXPECT_STREQ(fp8_dtype_name(FP8_DTYPE_E4M3), "e4m3");
  // The other names are not spelled out in fp8.h: they must exist, be distinct and not "unknown".
  std::vector<std::string> names;
  for (fp8_dtype_t dt = FP8_DTYPE_F32; dt <= FP8_DTYPE_E5M2; ++dt) {
    const char* name = fp8_dtype_name(dt);
    ASSERT_NE(name, nullptr) << dt;
    EXPECT_GT(std::strlen(name), 0u) << dt;
    EXPECT_STRNE(name, "unknown") << dt;
    for (const std::string& other : names) EXPECT_NE(other, name) << dt;
    names.push_back(name);
  }
  for (fp8_dtype_t bad : {int32_t{-1}, int32_t{5}, int32_t{1000}, std::numeric_limits<int32_t>::min()})
    EXPECT_STREQ(fp8_dtype_name(bad), "unknown") << bad;
}

TEST(Library, VersionMatchesTheHeader) {
  EXPECT_EQ(fp8_version_number(), static_cast<uint32_t>(FP8_VERSION_NUMBER));
  EXPECT_EQ(FP8_VERSION_NUMBER, FP8_VERSION_MAJOR * 10000 + FP8_VERSION_MINOR * 100 + FP8_VERSION_PATCH);
  const std::string expect = std::to_string(FP8_VERSION_MAJOR) + "." + std::to_string(FP8_VERSION_MINOR) + "." +
                             std::to_string(FP8_VERSION_PATCH);
  ASSERT_NE(fp8_version_string(), nullptr);
  EXPECT_EQ(std::string(fp8_version_string()), expect);
}

// ---- contexts and devices -----------------------------------------------------------------------

TEST(Context, CreateOnAMissingDeviceIsNoDevice) {
  for (int32_t device : {int32_t{12345}, std::numeric_limits<int32_t>::max()}) {
    fp8_context_t* ctx = sentinel<fp8_context_t>();
    EXPECT_EQ(fp8_context_create(&ctx, device), FP8_ERR_NO_DEVICE) << device << ": " << fp8_last_error_message();
    EXPECT_EQ(ctx, sentinel<fp8_context_t>());
    EXPECT_MESSAGE("fp8_context_create", std::to_string(device));
  }
}

TEST(Context, CreateOnDeviceZeroFollowsTheDeviceCount) {
  int32_t count = -1;
  ASSERT_FP8_OK(fp8_device_count(&count));
  ASSERT_GE(count, 0);
  fp8_context_t* ctx = sentinel<fp8_context_t>();
  const fp8_status_t st = fp8_context_create(&ctx, 0);
  if (count == 0) {
    EXPECT_EQ(st, FP8_ERR_NO_DEVICE) << fp8_last_error_message();
    EXPECT_EQ(ctx, sentinel<fp8_context_t>());
    EXPECT_MESSAGE("fp8_context_create", "0");
    return;
  }
  // A GPU is present: device 0 works if it has FP8 tensor cores (8.9+), else it is unsupported.
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  ASSERT_FP8_OK(fp8_device_query(0, &info));
  if (info.compute_capability >= 89) {
    ASSERT_EQ(st, FP8_OK) << fp8_last_error_message();
    int32_t device = -7;
    EXPECT_EQ(fp8_context_device(ctx, &device), FP8_OK);
    EXPECT_EQ(device, 0);
    fp8_context_destroy(ctx);
  } else {
    EXPECT_EQ(st, FP8_ERR_UNSUPPORTED) << fp8_last_error_message();
    EXPECT_EQ(ctx, sentinel<fp8_context_t>());
  }
}

TEST(Context, CpuContextReportsCpuDeviceAndNullStream) {
  ContextPtr ctx = cpu_context();
  int32_t device = 77;
  ASSERT_FP8_OK(fp8_context_device(ctx.get(), &device));
  EXPECT_EQ(device, FP8_DEVICE_CPU);
  struct CUstream_st* stream = sentinel<struct CUstream_st>();
  ASSERT_FP8_OK(fp8_context_get_stream(ctx.get(), &stream));
  EXPECT_EQ(stream, nullptr);
  EXPECT_EQ(fp8_context_synchronize(ctx.get()), FP8_OK);
}

TEST(Context, SetStreamOnCpuAcceptsOnlyNull) {
  ContextPtr ctx = cpu_context();
  EXPECT_REFUSED(fp8_context_set_stream(ctx.get(), sentinel<struct CUstream_st>()), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_context_set_stream", "stream");
  struct CUstream_st* stream = sentinel<struct CUstream_st>();
  ASSERT_FP8_OK(fp8_context_get_stream(ctx.get(), &stream));
  EXPECT_EQ(stream, nullptr) << "the refused stream was kept";
  EXPECT_EQ(fp8_context_set_stream(ctx.get(), nullptr), FP8_OK) << fp8_last_error_message();
}

TEST(Device, QueryRefusesTooSmallStructSize) {
  for (uint32_t size : {uint32_t{0}, uint32_t{4}, static_cast<uint32_t>(sizeof(fp8_device_info_t) - 1)}) {
    fp8_device_info_t info;
    std::memset(&info, 0xcd, sizeof info);
    info.struct_size = size;
    fp8_device_info_t copy = info;
    EXPECT_REFUSED(fp8_device_query(FP8_DEVICE_CPU, &info), FP8_ERR_INVALID_ARGUMENT, "fp8_device_query",
                   "struct_size");
    EXPECT_EQ(std::memcmp(&info, &copy, sizeof info), 0) << "struct_size " << size << ": info was written";
  }
}

TEST(Device, QueryCpuSucceedsAfterInit) {
  fp8_device_info_t info;
  std::memset(&info, 0xcd, sizeof info);
  fp8_device_info_init(&info);
  EXPECT_EQ(info.struct_size, sizeof(fp8_device_info_t));
  ASSERT_FP8_OK(fp8_device_query(FP8_DEVICE_CPU, &info));
  EXPECT_EQ(info.struct_size, sizeof(fp8_device_info_t));
  EXPECT_EQ(info.device, FP8_DEVICE_CPU);
  EXPECT_EQ(info.compute_capability, 0);
  EXPECT_EQ(info.multiprocessor_count, 0);
  EXPECT_EQ(info.total_memory_bytes, 0u);
  EXPECT_NE(std::memchr(info.name, '\0', sizeof info.name), nullptr) << "name is not NUL-terminated";
}

TEST(Device, QueryOfAMissingDeviceIsNoDeviceAndWritesNothing) {
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  info.device = 4242;
  fp8_device_info_t copy = info;
  EXPECT_REFUSED(fp8_device_query(12345, &info), FP8_ERR_NO_DEVICE, "fp8_device_query", "12345");
  EXPECT_EQ(std::memcmp(&info, &copy, sizeof info), 0);
}

// ---- tensors ------------------------------------------------------------------------------------

TEST(Tensor, CreateAndWrapRefuseAnUnknownDtype) {
  ContextPtr ctx = cpu_context();
  const int64_t shape[1] = {4};
  float host[4] = {};
  for (fp8_dtype_t bad : {int32_t{-1}, int32_t{5}, int32_t{1000}}) {
    fp8_tensor_t* out = sentinel<fp8_tensor_t>();
    EXPECT_REFUSED(fp8_tensor_create(&out, ctx.get(), bad, 1, shape), FP8_ERR_DTYPE, "fp8_tensor_create", "dtype");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
    EXPECT_REFUSED(fp8_tensor_wrap(&out, ctx.get(), bad, 1, shape, host), FP8_ERR_DTYPE, "fp8_tensor_wrap", "dtype");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
  }
}

// Sizes beyond 2^62 bytes' worth of the dtype, alone or multiplied, and also in an empty tensor
// (its sizes still reach the grid and tile arithmetic of the casts).
TEST(Tensor, CreateRefusesSizesBeyondTheLimitEvenWhenEmpty) {
  ContextPtr ctx = cpu_context();
  constexpr int64_t kF32Limit = (int64_t{1} << 62) / 4;
  const std::vector<std::vector<int64_t>> bad = {{0, std::numeric_limits<int64_t>::max()},
                                                 {0, kF32Limit + 1},
                                                 {kF32Limit + 1},
                                                 {int64_t{1} << 31, int64_t{1} << 31}};
  for (const auto& shape : bad) {
    fp8_tensor_t* out = sentinel<fp8_tensor_t>();
    EXPECT_REFUSED(fp8_tensor_create(&out, ctx.get(), FP8_DTYPE_F32, static_cast<int32_t>(shape.size()), shape.data()),
                   FP8_ERR_SHAPE, "fp8_tensor_create", "shape");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
  }
  const int64_t at_limit[2] = {0, kF32Limit};  // empty, each size at the limit
  fp8_tensor_t* ok = nullptr;
  ASSERT_EQ(fp8_tensor_create(&ok, ctx.get(), FP8_DTYPE_F32, 2, at_limit), FP8_OK) << fp8_last_error_message();
  fp8_tensor_destroy(ok);
}

TEST(Tensor, CreateRefusesNdimOutsideZeroToMaxDims) {
  ContextPtr ctx = cpu_context();
  const int64_t shape[FP8_MAX_DIMS + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  float host[1] = {};
  for (int32_t ndim : {int32_t{-1}, int32_t{FP8_MAX_DIMS + 1}, std::numeric_limits<int32_t>::min()}) {
    fp8_tensor_t* out = sentinel<fp8_tensor_t>();
    EXPECT_REFUSED(fp8_tensor_create(&out, ctx.get(), FP8_DTYPE_F32, ndim, shape), FP8_ERR_SHAPE,
                   "fp8_tensor_create", "ndim");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
    EXPECT_REFUSED(fp8_tensor_wrap(&out, ctx.get(), FP8_DTYPE_F32, ndim, shape, host), FP8_ERR_SHAPE,
                   "fp8_tensor_wrap", "ndim");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
  }
  // The limits themselves are fine.
  TensorPtr t8 = tensor(ctx.get(), FP8_DTYPE_F32, std::vector<int64_t>(FP8_MAX_DIMS, 1));
  EXPECT_NE(t8, nullptr);
}

TEST(Tensor, CreateRefusesANegativeDimension) {
  ContextPtr ctx = cpu_context();
  for (std::vector<int64_t> shape : {std::vector<int64_t>{-1}, std::vector<int64_t>{4, -3},
                                     std::vector<int64_t>{2, 0, std::numeric_limits<int64_t>::min()}}) {
    fp8_tensor_t* out = sentinel<fp8_tensor_t>();
    EXPECT_REFUSED(fp8_tensor_create(&out, ctx.get(), FP8_DTYPE_F16, static_cast<int32_t>(shape.size()), shape.data()),
                   FP8_ERR_SHAPE, "fp8_tensor_create", "shape");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
  }
}

TEST(Tensor, CreateRefusesNullShapeWhenNdimIsPositive) {
  ContextPtr ctx = cpu_context();
  for (int32_t ndim : {int32_t{1}, int32_t{FP8_MAX_DIMS}}) {
    fp8_tensor_t* out = sentinel<fp8_tensor_t>();
    EXPECT_NULL_REFUSED(fp8_tensor_create(&out, ctx.get(), FP8_DTYPE_F32, ndim, nullptr), "fp8_tensor_create",
                        "shape");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
  }
  // ndim 0 with shape NULL is a scalar.
  fp8_tensor_t* raw = nullptr;
  ASSERT_FP8_OK(fp8_tensor_create(&raw, ctx.get(), FP8_DTYPE_F32, 0, nullptr));
  TensorPtr scalar(raw);
  int64_t numel = -1;
  ASSERT_FP8_OK(fp8_tensor_numel(scalar.get(), &numel));
  EXPECT_EQ(numel, 1);
}

TEST(Tensor, WrapRefusesNullDataUnlessEmpty) {
  ContextPtr ctx = cpu_context();
  for (std::vector<int64_t> shape : {std::vector<int64_t>{1}, std::vector<int64_t>{3, 5}, std::vector<int64_t>{}}) {
    fp8_tensor_t* out = sentinel<fp8_tensor_t>();
    EXPECT_NULL_REFUSED(
        fp8_tensor_wrap(&out, ctx.get(), FP8_DTYPE_BF16, static_cast<int32_t>(shape.size()), shape.data(), nullptr),
        "fp8_tensor_wrap", "data");
    EXPECT_EQ(out, sentinel<fp8_tensor_t>());
  }
  // An empty tensor may wrap NULL.
  const int64_t empty[2] = {3, 0};
  fp8_tensor_t* raw = nullptr;
  ASSERT_FP8_OK(fp8_tensor_wrap(&raw, ctx.get(), FP8_DTYPE_E4M3, 2, empty, nullptr));
  TensorPtr t(raw);
  int64_t numel = -1;
  ASSERT_FP8_OK(fp8_tensor_numel(t.get(), &numel));
  EXPECT_EQ(numel, 0);
}

TEST(Tensor, CopiesWithTheWrongByteCountAreShapeErrorsAndTouchNothing) {
  ContextPtr ctx = cpu_context();
  TensorPtr t = tensor(ctx.get(), FP8_DTYPE_F16, {3, 4});  // 24 bytes
  const std::vector<uint8_t> content = fill(t.get(), 5);
  ASSERT_EQ(content.size(), 24u);
  std::vector<uint8_t> src(64, 0xee);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{12}, size_t{23}, size_t{25}, size_t{48}}) {
    EXPECT_REFUSED(fp8_tensor_copy_from_host(t.get(), src.data(), bytes), FP8_ERR_SHAPE, "fp8_tensor_copy_from_host",
                   "bytes");
    EXPECT_EQ(bytes_of(t.get()), content) << "copy_from_host of " << bytes << " bytes changed the tensor";

    std::vector<uint8_t> dst(64, 0x5a);
    EXPECT_REFUSED(fp8_tensor_copy_to_host(t.get(), dst.data(), bytes), FP8_ERR_SHAPE, "fp8_tensor_copy_to_host",
                   "bytes");
    EXPECT_EQ(dst, std::vector<uint8_t>(64, 0x5a)) << "copy_to_host of " << bytes << " bytes wrote to dst";
  }
}

TEST(Tensor, ScaleInvOfANonFp8TensorIsADtypeError) {
  ContextPtr ctx = cpu_context();
  for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16}) {
    TensorPtr t = tensor(ctx.get(), dt, {2, 2});
    const std::vector<uint8_t> content = fill(t.get(), 9);
    float scale_inv = -3.0f;
    EXPECT_REFUSED(fp8_tensor_get_scale_inv(t.get(), &scale_inv), FP8_ERR_DTYPE, "fp8_tensor_get_scale_inv",
                   "tensor");
    EXPECT_EQ(scale_inv, -3.0f);
    EXPECT_REFUSED(fp8_tensor_set_scale_inv(t.get(), 2.0f), FP8_ERR_DTYPE, "fp8_tensor_set_scale_inv", "tensor");
    EXPECT_EQ(bytes_of(t.get()), content);
  }
}

TEST(Tensor, SetScaleInvRefusesZeroNegativeAndNonFinite) {
  ContextPtr ctx = cpu_context();
  for (fp8_dtype_t dt : {FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    TensorPtr t = tensor(ctx.get(), dt, {4});
    float scale_inv = 0.0f;
    ASSERT_FP8_OK(fp8_tensor_get_scale_inv(t.get(), &scale_inv));
    EXPECT_EQ(scale_inv, 1.0f) << "scale_inv at creation";
    ASSERT_FP8_OK(fp8_tensor_set_scale_inv(t.get(), 0.25f));
    for (float bad : {0.0f, -0.0f, -1.0f, -std::numeric_limits<float>::min(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      EXPECT_REFUSED(fp8_tensor_set_scale_inv(t.get(), bad), FP8_ERR_INVALID_ARGUMENT, "fp8_tensor_set_scale_inv",
                     "scale_inv");
      scale_inv = -5.0f;
      ASSERT_FP8_OK(fp8_tensor_get_scale_inv(t.get(), &scale_inv));
      EXPECT_EQ(scale_inv, 0.25f) << "refused value " << bad << " was stored";
    }
    // The smallest positive values are finite and > 0, so accepted.
    ASSERT_FP8_OK(fp8_tensor_set_scale_inv(t.get(), std::numeric_limits<float>::denorm_min()));
    ASSERT_FP8_OK(fp8_tensor_set_scale_inv(t.get(), std::numeric_limits<float>::max()));
  }
}

// ---- casts --------------------------------------------------------------------------------------

// One CPU context with an E4M3 (forward) state and matching tensors for quantize [4, 8].
struct QuantizeFixture {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4");
  ScalingPtr s = scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_F32, {4, 8});
  TensorPtr out = tensor(ctx.get(), FP8_DTYPE_E4M3, {4, 8});
  TensorPtr out_t = tensor(ctx.get(), FP8_DTYPE_E4M3, {8, 4});
  QuantizeFixture() {
    fill_f32(in.get());
    EXPECT_EQ(fp8_scaling_set_scale(s.get(), 2.0f), FP8_OK);
  }
};

// Runs `call`, which must fail with `status` naming `fn` and `arg`, and checks that none of `outs`
// (bytes and scale_inv) nor the scaling state changed.
class Unchanged {
 public:
  Unchanged(std::vector<fp8_tensor_t*> outs, fp8_scaling_t* s) : outs_(std::move(outs)), s_(s) {
    uint8_t seed = 40;
    for (fp8_tensor_t* t : outs_) {
      bytes_.push_back(fill(t, seed += 17));
      float si = 0.0f;
      fp8_dtype_t dt = -1;
      EXPECT_EQ(fp8_tensor_dtype(t, &dt), FP8_OK);
      if (dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2) {
        EXPECT_EQ(fp8_tensor_set_scale_inv(t, 0.125f), FP8_OK);
        EXPECT_EQ(fp8_tensor_get_scale_inv(t, &si), FP8_OK);
      }
      scale_inv_.push_back(si);
    }
    if (s_) state_ = view(s_);
  }
  void check(const std::string& what) const {
    for (size_t i = 0; i < outs_.size(); ++i) {
      EXPECT_EQ(bytes_of(outs_[i]), bytes_[i]) << what << ": output " << i << " was written";
      fp8_dtype_t dt = -1;
      EXPECT_EQ(fp8_tensor_dtype(outs_[i], &dt), FP8_OK);
      if (dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2) {
        float si = 0.0f;
        EXPECT_EQ(fp8_tensor_get_scale_inv(outs_[i], &si), FP8_OK);
        EXPECT_EQ(si, scale_inv_[i]) << what << ": output " << i << " scale_inv changed";
      }
    }
    if (s_) expect_same_state(view(s_), state_, what.c_str());
  }

 private:
  std::vector<fp8_tensor_t*> outs_;
  fp8_scaling_t* s_;
  std::vector<std::vector<uint8_t>> bytes_;
  std::vector<float> scale_inv_;
  StateView state_;
};

TEST(Quantize, RefusesAnInputThatIsNotF32F16OrBf16) {
  QuantizeFixture f;
  for (fp8_dtype_t dt : {FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    TensorPtr bad_in = tensor(f.ctx.get(), dt, {4, 8});
    fill(bad_in.get(), 3);
    Unchanged u({f.out.get(), f.out_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), bad_in.get(), f.out.get(), f.out_t.get(), f.s.get()), FP8_ERR_DTYPE,
                   "fp8_quantize", "in");
    u.check("fp8 input");
  }
}

TEST(Quantize, RefusesAnOutputDtypeOtherThanTheScalingStates) {
  QuantizeFixture f;
  fp8_dtype_t state_dtype = -1;
  ASSERT_FP8_OK(fp8_scaling_dtype(f.s.get(), &state_dtype));
  ASSERT_EQ(state_dtype, FP8_DTYPE_E4M3);
  for (fp8_dtype_t dt : {FP8_DTYPE_E5M2, FP8_DTYPE_F32, FP8_DTYPE_BF16}) {
    TensorPtr bad_out = tensor(f.ctx.get(), dt, {4, 8});
    Unchanged u({bad_out.get(), f.out_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), bad_out.get(), f.out_t.get(), f.s.get()), FP8_ERR_DTYPE,
                   "fp8_quantize", "out");
    u.check(std::string("out of dtype ") + fp8_dtype_name(dt));

    TensorPtr bad_t = tensor(f.ctx.get(), dt, {8, 4});
    Unchanged u2({f.out.get(), bad_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), f.out.get(), bad_t.get(), f.s.get()), FP8_ERR_DTYPE,
                   "fp8_quantize", "out_transposed");
    u2.check(std::string("out_transposed of dtype ") + fp8_dtype_name(dt));
  }
  // An E5M2 output is right for a backward (HYBRID) state.
  ScalingPtr back = scaling(f.ctx.get(), f.r.get(), FP8_ROLE_BACKWARD);
  TensorPtr out5 = tensor(f.ctx.get(), FP8_DTYPE_E5M2, {4, 8});
  EXPECT_EQ(fp8_quantize(f.ctx.get(), f.in.get(), out5.get(), nullptr, back.get()), FP8_OK) << fp8_last_error_message();
  Unchanged u({f.out.get()}, back.get());
  EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), f.out.get(), nullptr, back.get()), FP8_ERR_DTYPE,
                 "fp8_quantize", "out");
  u.check("e4m3 out with an e5m2 state");
}

TEST(Quantize, RefusesAnOutputOfAnotherShape) {
  QuantizeFixture f;
  for (std::vector<int64_t> shape : {std::vector<int64_t>{4, 9}, std::vector<int64_t>{5, 8}, std::vector<int64_t>{8, 4},
                                     std::vector<int64_t>{32}, std::vector<int64_t>{1, 4, 8}}) {
    TensorPtr bad_out = tensor(f.ctx.get(), FP8_DTYPE_E4M3, shape);
    Unchanged u({bad_out.get(), f.out_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), bad_out.get(), f.out_t.get(), f.s.get()), FP8_ERR_SHAPE,
                   "fp8_quantize", "out");
    u.check("out of another shape");
  }
}

TEST(Quantize, RefusesATransposedOutputThatIsNotColsByRows) {
  QuantizeFixture f;  // in [4, 8]: out_transposed must be [8, 4]
  for (std::vector<int64_t> shape : {std::vector<int64_t>{4, 8}, std::vector<int64_t>{8, 5}, std::vector<int64_t>{7, 4},
                                     std::vector<int64_t>{32}, std::vector<int64_t>{8, 4, 1},
                                     std::vector<int64_t>{1, 8, 4}}) {
    TensorPtr bad_t = tensor(f.ctx.get(), FP8_DTYPE_E4M3, shape);
    Unchanged u({f.out.get(), bad_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), f.out.get(), bad_t.get(), f.s.get()), FP8_ERR_SHAPE,
                   "fp8_quantize", "out_transposed");
    u.check("out_transposed of a wrong shape");
  }
  // A 3-D input is viewed as [rows = 2*2, cols = 8].
  TensorPtr in3 = tensor(f.ctx.get(), FP8_DTYPE_F32, {2, 2, 8});
  fill_f32(in3.get());
  TensorPtr out3 = tensor(f.ctx.get(), FP8_DTYPE_E4M3, {2, 2, 8});
  EXPECT_EQ(fp8_quantize(f.ctx.get(), in3.get(), out3.get(), f.out_t.get(), f.s.get()), FP8_OK)
      << fp8_last_error_message();
}

TEST(Quantize, RefusesOverlappingTensors) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4");
  ScalingPtr s = scaling(ctx.get(), r.get());
  alignas(64) static uint8_t buf[256];
  // in: F32 [2, 4] = bytes [0, 32). Outputs: E4M3, 8 bytes each.
  const float values[8] = {1, -2, 3, -4, 5, -6, 7, -8};
  std::memcpy(buf, values, sizeof values);
  for (size_t i = 32; i < sizeof buf; ++i) buf[i] = static_cast<uint8_t>(i);
  TensorPtr in = wrap(ctx.get(), FP8_DTYPE_F32, {2, 4}, buf);

  const StateView state = view(s.get());
  std::vector<uint8_t> snapshot(buf, buf + sizeof buf);
  auto expect_buffer_unchanged = [&](const char* what) {
    EXPECT_EQ(std::memcmp(buf, snapshot.data(), sizeof buf), 0) << what << ": the buffer was written";
    expect_same_state(view(s.get()), state, what);
  };

  // out overlaps in (at its start, its middle, its last byte).
  for (size_t offset : {size_t{0}, size_t{12}, size_t{31}}) {
    TensorPtr out = wrap(ctx.get(), FP8_DTYPE_E4M3, {2, 4}, buf + offset);
    EXPECT_REFUSED(fp8_quantize(ctx.get(), in.get(), out.get(), nullptr, s.get()), FP8_ERR_INVALID_ARGUMENT,
                   "fp8_quantize", "out");
    expect_buffer_unchanged("out overlaps in");
  }
  TensorPtr out = wrap(ctx.get(), FP8_DTYPE_E4M3, {2, 4}, buf + 64);
  // out_transposed overlaps in.
  {
    TensorPtr out_t = wrap(ctx.get(), FP8_DTYPE_E4M3, {4, 2}, buf + 28);
    EXPECT_REFUSED(fp8_quantize(ctx.get(), in.get(), out.get(), out_t.get(), s.get()), FP8_ERR_INVALID_ARGUMENT,
                   "fp8_quantize", "out_transposed");
    expect_buffer_unchanged("out_transposed overlaps in");
  }
  // out_transposed overlaps out.
  for (size_t offset : {size_t{64}, size_t{60}, size_t{71}}) {
    TensorPtr out_t = wrap(ctx.get(), FP8_DTYPE_E4M3, {4, 2}, buf + offset);
    EXPECT_REFUSED(fp8_quantize(ctx.get(), in.get(), out.get(), out_t.get(), s.get()), FP8_ERR_INVALID_ARGUMENT,
                   "fp8_quantize", "out_transposed");
    expect_buffer_unchanged("out_transposed overlaps out");
  }
  // Adjacent but disjoint buffers are fine: out right after in, out_transposed right after out.
  TensorPtr adjacent = wrap(ctx.get(), FP8_DTYPE_E4M3, {2, 4}, buf + 32);
  TensorPtr adjacent_t = wrap(ctx.get(), FP8_DTYPE_E4M3, {4, 2}, buf + 40);
  EXPECT_EQ(fp8_quantize(ctx.get(), in.get(), adjacent.get(), adjacent_t.get(), s.get()), FP8_OK)
      << fp8_last_error_message();
  EXPECT_EQ(std::memcmp(buf, values, sizeof values), 0) << "the input was written";
}

TEST(Quantize, RefusesTensorsAndStatesFromAnotherContext) {
  QuantizeFixture f;
  ContextPtr other = cpu_context();
  ScalingPtr other_s = scaling(other.get(), f.r.get());
  TensorPtr other_in = tensor(other.get(), FP8_DTYPE_F32, {4, 8});
  fill_f32(other_in.get());
  TensorPtr other_out = tensor(other.get(), FP8_DTYPE_E4M3, {4, 8});
  TensorPtr other_t = tensor(other.get(), FP8_DTYPE_E4M3, {8, 4});
  {
    Unchanged u({f.out.get(), f.out_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), other_in.get(), f.out.get(), f.out_t.get(), f.s.get()),
                   FP8_ERR_INVALID_ARGUMENT, "fp8_quantize", "in");
    u.check("in from another context");
  }
  {
    Unchanged u({other_out.get(), f.out_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), other_out.get(), f.out_t.get(), f.s.get()),
                   FP8_ERR_INVALID_ARGUMENT, "fp8_quantize", "out");
    u.check("out from another context");
  }
  {
    Unchanged u({f.out.get(), other_t.get()}, f.s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), f.out.get(), other_t.get(), f.s.get()),
                   FP8_ERR_INVALID_ARGUMENT, "fp8_quantize", "out_transposed");
    u.check("out_transposed from another context");
  }
  {
    Unchanged u({f.out.get(), f.out_t.get()}, other_s.get());
    EXPECT_REFUSED(fp8_quantize(f.ctx.get(), f.in.get(), f.out.get(), f.out_t.get(), other_s.get()),
                   FP8_ERR_INVALID_ARGUMENT, "fp8_quantize", "scaling");
    u.check("scaling from another context");
  }
  // The same objects with their own context work.
  EXPECT_EQ(fp8_quantize(other.get(), other_in.get(), other_out.get(), other_t.get(), other_s.get()), FP8_OK)
      << fp8_last_error_message();
}

TEST(Dequantize, RefusesAnInputThatIsNotFp8) {
  ContextPtr ctx = cpu_context();
  TensorPtr out = tensor(ctx.get(), FP8_DTYPE_F32, {3, 5});
  for (fp8_dtype_t dt : {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16}) {
    TensorPtr in = tensor(ctx.get(), dt, {3, 5});
    fill(in.get(), 1);
    Unchanged u({out.get()}, nullptr);
    EXPECT_REFUSED(fp8_dequantize(ctx.get(), in.get(), out.get()), FP8_ERR_DTYPE, "fp8_dequantize", "in");
    u.check(std::string("input of dtype ") + fp8_dtype_name(dt));
  }
}

TEST(Dequantize, RefusesAnFp8Output) {
  ContextPtr ctx = cpu_context();
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_E4M3, {3, 5});
  fill(in.get(), 1);
  for (fp8_dtype_t dt : {FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    TensorPtr out = tensor(ctx.get(), dt, {3, 5});
    Unchanged u({out.get()}, nullptr);
    EXPECT_REFUSED(fp8_dequantize(ctx.get(), in.get(), out.get()), FP8_ERR_DTYPE, "fp8_dequantize", "out");
    u.check(std::string("output of dtype ") + fp8_dtype_name(dt));
  }
}

TEST(Dequantize, RefusesAnOutputOfAnotherShape) {
  ContextPtr ctx = cpu_context();
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_E5M2, {3, 5});
  fill(in.get(), 1);
  for (std::vector<int64_t> shape : {std::vector<int64_t>{3, 6}, std::vector<int64_t>{5, 3},
                                     std::vector<int64_t>{15}, std::vector<int64_t>{1, 3, 5}}) {
    TensorPtr out = tensor(ctx.get(), FP8_DTYPE_BF16, shape);
    Unchanged u({out.get()}, nullptr);
    EXPECT_REFUSED(fp8_dequantize(ctx.get(), in.get(), out.get()), FP8_ERR_SHAPE, "fp8_dequantize", "out");
    u.check("output of another shape");
  }
}

TEST(Dequantize, RefusesTensorsFromAnotherContext) {
  ContextPtr ctx = cpu_context();
  ContextPtr other = cpu_context();
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_E4M3, {3, 5});
  TensorPtr other_in = tensor(other.get(), FP8_DTYPE_E4M3, {3, 5});
  TensorPtr out = tensor(ctx.get(), FP8_DTYPE_F32, {3, 5});
  TensorPtr other_out = tensor(other.get(), FP8_DTYPE_F32, {3, 5});
  fill(in.get(), 1);
  fill(other_in.get(), 1);
  {
    Unchanged u({out.get()}, nullptr);
    EXPECT_REFUSED(fp8_dequantize(ctx.get(), other_in.get(), out.get()), FP8_ERR_INVALID_ARGUMENT, "fp8_dequantize",
                   "in");
    u.check("in from another context");
  }
  {
    Unchanged u({other_out.get()}, nullptr);
    EXPECT_REFUSED(fp8_dequantize(ctx.get(), in.get(), other_out.get()), FP8_ERR_INVALID_ARGUMENT, "fp8_dequantize",
                   "out");
    u.check("out from another context");
  }
}

TEST(Amax, RefusesAnOutputThatIsNotF32) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4");
  ScalingPtr s = scaling(ctx.get(), r.get());
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_F32, {2, 8});
  fill_f32(in.get());
  for (fp8_dtype_t dt : {FP8_DTYPE_F16, FP8_DTYPE_BF16, FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    TensorPtr amax = tensor(ctx.get(), dt, {1});
    Unchanged u({amax.get()}, s.get());
    EXPECT_REFUSED(fp8_amax(ctx.get(), in.get(), amax.get(), s.get()), FP8_ERR_DTYPE, "fp8_amax", "amax");
    u.check(std::string("amax of dtype ") + fp8_dtype_name(dt));
  }
}

TEST(Amax, RefusesAnOutputThatIsNotOneElement) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4");
  ScalingPtr s = scaling(ctx.get(), r.get());
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_BF16, {2, 8});
  fill(in.get(), 3);
  for (std::vector<int64_t> shape : {std::vector<int64_t>{2}, std::vector<int64_t>{1, 2}, std::vector<int64_t>{0}}) {
    TensorPtr amax = tensor(ctx.get(), FP8_DTYPE_F32, shape);
    Unchanged u({amax.get()}, s.get());
    EXPECT_REFUSED(fp8_amax(ctx.get(), in.get(), amax.get(), s.get()), FP8_ERR_SHAPE, "fp8_amax", "amax");
    u.check("amax that is not one element");
  }
  // Any shape of one element is accepted.
  for (std::vector<int64_t> shape : {std::vector<int64_t>{}, std::vector<int64_t>{1, 1, 1}}) {
    TensorPtr amax = tensor(ctx.get(), FP8_DTYPE_F32, shape);
    EXPECT_EQ(fp8_amax(ctx.get(), in.get(), amax.get(), nullptr), FP8_OK) << fp8_last_error_message();
  }
}

TEST(Amax, RefusesAnFp8Input) {
  ContextPtr ctx = cpu_context();
  TensorPtr in = tensor(ctx.get(), FP8_DTYPE_E4M3, {2, 8});
  fill(in.get(), 3);
  TensorPtr amax = tensor(ctx.get(), FP8_DTYPE_F32, {1});
  Unchanged u({amax.get()}, nullptr);
  EXPECT_REFUSED(fp8_amax(ctx.get(), in.get(), amax.get(), nullptr), FP8_ERR_DTYPE, "fp8_amax", "in");
  u.check("fp8 input");
}

// ---- scaling states -----------------------------------------------------------------------------

// Two states with an amax already accumulated, so that any update would visibly change them.
struct UpdateFixture {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=4, margin=1");
  ScalingPtr a = scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  ScalingPtr b = scaling(ctx.get(), r.get(), FP8_ROLE_BACKWARD);
  UpdateFixture() {
    TensorPtr in = tensor(ctx.get(), FP8_DTYPE_F32, {3, 3});
    fill_f32(in.get());
    TensorPtr amax = tensor(ctx.get(), FP8_DTYPE_F32, {1});
    EXPECT_EQ(fp8_amax(ctx.get(), in.get(), amax.get(), a.get()), FP8_OK) << fp8_last_error_message();
    EXPECT_EQ(fp8_amax(ctx.get(), in.get(), amax.get(), b.get()), FP8_OK) << fp8_last_error_message();
  }
};

// A failed update leaves every state in `states` as it was, then a good update changes them (so the
// "unchanged" checks can fail).
void expect_update_refused(UpdateFixture& f, fp8_scaling_t* const* states, int32_t count, const fp8_recipe_t* r,
                           const char* arg, const char* what) {
  const StateView a = view(f.a.get());
  const StateView b = view(f.b.get());
  EXPECT_REFUSED(fp8_scaling_update(f.ctx.get(), states, count, r), FP8_ERR_INVALID_ARGUMENT, "fp8_scaling_update",
                 arg);
  expect_same_state(view(f.a.get()), a, what);
  expect_same_state(view(f.b.get()), b, what);
}

TEST(ScalingUpdate, RefusesANegativeCount) {
  UpdateFixture f;
  fp8_scaling_t* states[2] = {f.a.get(), f.b.get()};
  for (int32_t count : {int32_t{-1}, std::numeric_limits<int32_t>::min()})
    expect_update_refused(f, states, count, f.r.get(), "count", "negative count");
  // count 0 is a valid empty update, with or without an array.
  EXPECT_EQ(fp8_scaling_update(f.ctx.get(), nullptr, 0, f.r.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_scaling_update(f.ctx.get(), states, 0, f.r.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(info_of(f.a.get()).update_count, 0);
}

TEST(ScalingUpdate, RefusesNullStatesWithAPositiveCount) {
  UpdateFixture f;
  expect_update_refused(f, nullptr, 2, f.r.get(), "states", "NULL states");
}

TEST(ScalingUpdate, RefusesANullEntry) {
  UpdateFixture f;
  fp8_scaling_t* states[3] = {f.a.get(), nullptr, f.b.get()};
  expect_update_refused(f, states, 3, f.r.get(), "states[", "NULL entry");
  EXPECT_NE(last_error().find("states[1]"), std::string::npos) << "the index of the NULL entry: " << last_error();
}

TEST(ScalingUpdate, RefusesAStateListedTwice) {
  UpdateFixture f;
  fp8_scaling_t* states[3] = {f.a.get(), f.b.get(), f.a.get()};
  expect_update_refused(f, states, 3, f.r.get(), "states[", "duplicated state");
  EXPECT_NE(last_error().find("states[2]"), std::string::npos) << "the index of the repeat: " << last_error();
}

TEST(ScalingUpdate, RefusesAStateWithAnotherHistoryLength) {
  UpdateFixture f;
  RecipePtr longer = recipe("amax_history_len=5, margin=1");
  fp8_scaling_t* states[2] = {f.a.get(), f.b.get()};
  expect_update_refused(f, states, 2, longer.get(), "amax_history_len", "recipe with another history length");
  EXPECT_NE(last_error().find("states[0]"), std::string::npos) << last_error();
  ScalingPtr c = scaling(f.ctx.get(), longer.get());
  fp8_scaling_t* mixed[3] = {f.a.get(), f.b.get(), c.get()};
  const StateView cv = view(c.get());
  expect_update_refused(f, mixed, 3, f.r.get(), "amax_history_len", "state with another history length");
  EXPECT_NE(last_error().find("states[2]"), std::string::npos) << last_error();
  expect_same_state(view(c.get()), cv, "state with another history length");
}

TEST(ScalingUpdate, RefusesAStateFromAnotherContext) {
  UpdateFixture f;
  ContextPtr other = cpu_context();
  ScalingPtr foreign = scaling(other.get(), f.r.get());
  const StateView fv = view(foreign.get());
  fp8_scaling_t* states[3] = {f.a.get(), f.b.get(), foreign.get()};
  expect_update_refused(f, states, 3, f.r.get(), "states[", "state from another context");
  expect_same_state(view(foreign.get()), fv, "state from another context");
  // With its own context that state updates fine.
  fp8_scaling_t* own[1] = {foreign.get()};
  EXPECT_EQ(fp8_scaling_update(other.get(), own, 1, f.r.get()), FP8_OK) << fp8_last_error_message();
}

// The refusal names the offending entry by its index, like the NULL-entry and duplicate refusals.
// Disabled: src/api/scaling_api.cpp passes the literal name "states[i]" to require_same_context.
TEST(ScalingUpdate, RefusalOfAForeignStateNamesItsIndex) {
  UpdateFixture f;
  ContextPtr other = cpu_context();
  ScalingPtr foreign = scaling(other.get(), f.r.get());
  fp8_scaling_t* states[3] = {f.a.get(), f.b.get(), foreign.get()};
  EXPECT_EQ(fp8_scaling_update(f.ctx.get(), states, 3, f.r.get()), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("states[2]"), std::string::npos) << last_error();
}

TEST(ScalingUpdate, AGoodUpdateChangesTheStatesTheRefusalsKept) {
  // The counterpart of the refusals above: the same states do change on a valid update.
  UpdateFixture f;
  const StateView a = view(f.a.get());
  ASSERT_GT(a.info.amax, 0.0f);
  fp8_scaling_t* states[2] = {f.a.get(), f.b.get()};
  ASSERT_FP8_OK(fp8_scaling_update(f.ctx.get(), states, 2, f.r.get()));
  const StateView after = view(f.a.get());
  EXPECT_EQ(after.info.update_count, a.info.update_count + 1);
  EXPECT_NE(after.info.scale, a.info.scale);
  EXPECT_EQ(after.history[1], a.history[0]);
}

TEST(Scaling, GetHistoryWithTheWrongLengthIsAShapeError) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=6");
  ScalingPtr s = scaling(ctx.get(), r.get());
  for (int32_t len : {int32_t{0}, int32_t{-1}, int32_t{5}, int32_t{7}, int32_t{1024}}) {
    std::vector<float> hist(2048, -9.0f);
    EXPECT_REFUSED(fp8_scaling_get_history(s.get(), hist.data(), len), FP8_ERR_SHAPE, "fp8_scaling_get_history",
                   "len");
    EXPECT_EQ(hist, std::vector<float>(2048, -9.0f)) << "len " << len << ": history was written";
  }
  std::vector<float> hist(6, -9.0f);
  ASSERT_FP8_OK(fp8_scaling_get_history(s.get(), hist.data(), 6));
  EXPECT_EQ(hist, std::vector<float>(6, 0.0f)) << "a new state's history is zeros";
}

TEST(Scaling, GetInfoRefusesTooSmallStructSize) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=2");
  ScalingPtr s = scaling(ctx.get(), r.get());
  for (uint32_t size : {uint32_t{0}, static_cast<uint32_t>(sizeof(fp8_scaling_info_t) - 1)}) {
    fp8_scaling_info_t info;
    std::memset(&info, 0xcd, sizeof info);
    info.struct_size = size;
    fp8_scaling_info_t copy = info;
    EXPECT_REFUSED(fp8_scaling_get_info(s.get(), &info), FP8_ERR_INVALID_ARGUMENT, "fp8_scaling_get_info",
                   "struct_size");
    EXPECT_EQ(std::memcmp(&info, &copy, sizeof info), 0);
  }
}

TEST(Scaling, CreateRefusesAnUnknownRole) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe();
  for (fp8_role_t role : {int32_t{-1}, int32_t{2}}) {
    fp8_scaling_t* out = sentinel<fp8_scaling_t>();
    EXPECT_REFUSED(fp8_scaling_create(&out, ctx.get(), r.get(), role), FP8_ERR_INVALID_ARGUMENT, "fp8_scaling_create",
                   "role");
    EXPECT_EQ(out, sentinel<fp8_scaling_t>());
  }
}

TEST(Scaling, SetScaleRefusesZeroNegativeAndNonFinite) {
  ContextPtr ctx = cpu_context();
  RecipePtr r = recipe("amax_history_len=2");
  ScalingPtr s = scaling(ctx.get(), r.get());
  ASSERT_FP8_OK(fp8_scaling_set_scale(s.get(), 4.0f));
  const StateView before = view(s.get());
  for (float bad : {0.0f, -0.0f, -2.0f, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_REFUSED(fp8_scaling_set_scale(s.get(), bad), FP8_ERR_INVALID_ARGUMENT, "fp8_scaling_set_scale", "scale");
    expect_same_state(view(s.get()), before, "refused scale");
  }
  EXPECT_EQ(before.info.scale, 4.0f);
  EXPECT_EQ(before.info.scale_inv, 0.25f);
}

// ---- destroy order ------------------------------------------------------------------------------

TEST(Lifetime, ObjectsOutliveTheirDestroyedContext) {
  fp8_context_t* ctx = nullptr;
  ASSERT_FP8_OK(fp8_context_create(&ctx, FP8_DEVICE_CPU));
  RecipePtr r = recipe("amax_history_len=3");
  TensorPtr in = tensor(ctx, FP8_DTYPE_F32, {2, 3});
  TensorPtr q = tensor(ctx, FP8_DTYPE_E4M3, {2, 3});
  TensorPtr amax = tensor(ctx, FP8_DTYPE_F32, {});
  ScalingPtr s = scaling(ctx, r.get());
  fill_f32(in.get());
  ASSERT_FP8_OK(fp8_scaling_set_scale(s.get(), 8.0f));
  ASSERT_FP8_OK(fp8_quantize(ctx, in.get(), q.get(), nullptr, s.get()));
  ASSERT_FP8_OK(fp8_amax(ctx, in.get(), amax.get(), nullptr));
  const std::vector<uint8_t> in_bytes = bytes_of(in.get());
  const std::vector<uint8_t> q_bytes = bytes_of(q.get());
  const StateView state = view(s.get());

  fp8_context_destroy(ctx);  // before its tensors and state

  EXPECT_EQ(bytes_of(in.get()), in_bytes);
  EXPECT_EQ(bytes_of(q.get()), q_bytes);
  float scale_inv = 0.0f;
  ASSERT_FP8_OK(fp8_tensor_get_scale_inv(q.get(), &scale_inv));
  EXPECT_EQ(scale_inv, 0.125f);
  float a = -1.0f;
  ASSERT_FP8_OK(fp8_tensor_copy_to_host(amax.get(), &a, sizeof a));
  EXPECT_EQ(a, 6.0f);  // max |1, -2, 3, -4, 5, -6|
  expect_same_state(view(s.get()), state, "after the context was destroyed");
  EXPECT_EQ(state.info.amax, 6.0f);
  // Writes still work too.
  const std::vector<uint8_t> fresh = fill(q.get(), 99);
  EXPECT_EQ(bytes_of(q.get()), fresh);
  ASSERT_FP8_OK(fp8_scaling_set_scale(s.get(), 2.0f));
  EXPECT_EQ(info_of(s.get()).scale_inv, 0.5f);
  // Destroying them afterwards (in any order) is clean; ASan/LSan checks that nothing leaks.
  s.reset();
  in.reset();
  q.reset();
  amax.reset();
}

TEST(Lifetime, TensorsOfOneContextStillMatchEachOtherAfterItIsDestroyed) {
  // Objects keep the context alive, so they still count as one context's objects: the context check
  // of another, live context refuses them, and a tensor made from it can be destroyed last.
  fp8_context_t* ctx = nullptr;
  ASSERT_FP8_OK(fp8_context_create(&ctx, FP8_DEVICE_CPU));
  TensorPtr in = tensor(ctx, FP8_DTYPE_F32, {4});
  fill_f32(in.get());
  fp8_context_destroy(ctx);
  ContextPtr other = cpu_context();
  TensorPtr amax = tensor(other.get(), FP8_DTYPE_F32, {1});
  Unchanged u({amax.get()}, nullptr);
  EXPECT_REFUSED(fp8_amax(other.get(), in.get(), amax.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_amax", "in");
  u.check("tensor of a destroyed context");
}

}  // namespace
