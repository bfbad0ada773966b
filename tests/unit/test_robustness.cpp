// Robustness of the C ABI at its edges, on the CPU reference backend: what fp8_device_query reports
// for each architecture, versioned structs of every size from their first release on, tensors the
// library lends, the recipe keys the header documents, and the limits of the norm layers.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "api/guard.hpp"
#include "backend/device_info.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

// ---- fp8_device_query: fp8_block_scaling --------------------------------------------------------

TEST(DeviceInfo, BlockScalingNeedsHopperAndCublasLt129) {
  // Hopper: cuBLASLt runs per-row, 1x128 and 128x128 scales from 12.9 (cublasLtGetVersion() 120900) on.
  EXPECT_TRUE(fp8::fp8_block_scaling_supported(90, 120900));
  EXPECT_TRUE(fp8::fp8_block_scaling_supported(90, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(90, 120805));
  // Blackwell: cuBLASLt's block scaling there is MXFP8; these modes are refused.
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(100, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(120, 130000));
  // Ada and older: never.
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(89, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(80, 130100));
  EXPECT_FALSE(fp8::fp8_block_scaling_supported(0, 130100));  // the CPU backend
}

TEST(DeviceInfo, TheCpuBackendReportsNoBlockScaling) {
  fp8_device_info_t info;
  fp8_device_info_init(&info);
  info.fp8_block_scaling = 7;
  FP8_ASSERT_OK(fp8_device_query(FP8_DEVICE_CPU, &info));
  EXPECT_EQ(info.fp8_block_scaling, 0);
  EXPECT_GT(info.cublaslt_version, 0);
}

// ---- Versioned structs ----------------------------------------------------------------------------

#if defined(__x86_64__) || defined(_M_X64)
// The first-release sizes the library accepts, pinned (tests/headertest pins every field).
static_assert(fp8::kDeviceInfoV1Size == 304, "fp8_device_info_t's first release ends at 304 bytes");
static_assert(fp8::kScalingInfoV1Size == 40, "fp8_scaling_info_t's first release ends at 40 bytes");
static_assert(fp8::kGemmOptionsV1Size == 16, "fp8_gemm_options_t's first release ends at 16 bytes");
static_assert(fp8::kConvertOptionsV1Size == 20, "fp8_convert_options_t's first release ends at 20 bytes");
static_assert(fp8::kLayerReportV1Size == 240, "fp8_layer_report_t's first release ends at 240 bytes");
static_assert(fp8::kOptimizerStatsV1Size == 48, "fp8_optimizer_stats_t's first release ends at 48 bytes");
#endif

// A caller's struct of `size` bytes (struct_size = size) that starts as `init` (as far as it
// reaches) and is filled with `fill` past it: what a program built against another release of the
// header passes.
template <typename T>
struct Versioned {
  std::vector<uint64_t> storage;  // 8-byte aligned
  size_t size;
  Versioned(const T& init, size_t size_, unsigned char fill) : storage((size_ + sizeof(T) + 64) / 8), size(size_) {
    std::memset(storage.data(), fill, storage.size() * 8);
    std::memcpy(storage.data(), &init, std::min(size, sizeof(T)));
    get()->struct_size = static_cast<uint32_t>(size);
  }
  T* get() { return reinterpret_cast<T*>(storage.data()); }
  unsigned char* bytes() { return reinterpret_cast<unsigned char*>(storage.data()); }
  // Every byte from `from` to the end of the storage still `fill`.
  bool untouched_from(size_t from, unsigned char fill) {
    for (size_t i = from; i < storage.size() * 8; ++i)
      if (bytes()[i] != fill) return false;
    return true;
  }
};

struct ModelFixture : ::testing::Test {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  Recipe recipe = make_recipe();
  void SetUp() override {
    FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc", 32, 32, 1, nullptr));
    FP8_ASSERT_OK(fp8_model_add_layernorm(model.get(), "ln", 32, 1e-5f, nullptr));
  }
  int32_t converted(int32_t layer) {
    fp8_layer_report_t r;
    fp8_layer_report_init(&r);
    EXPECT_OK(fp8_layer_get_report(model.get(), layer, &r));
    return r.converted;
  }
};

using VersionedStructs = ModelFixture;

TEST_F(VersionedStructs, ConvertOptionsFromANewerHeaderWithZeroNewFieldsAreRead) {
  fp8_convert_options_t o;
  fp8_convert_options_init(&o);
  o.norm = 0;  // a field inside this release: must be honoured
  Versioned<fp8_convert_options_t> newer(o, sizeof o + 12, 0);
  FP8_ASSERT_OK(fp8_convert_model(model.get(), recipe.get(), newer.get()));
  EXPECT_EQ(converted(0), 1);
  EXPECT_EQ(converted(1), 0) << "options->norm = 0 was not read";
  EXPECT_EQ(newer.get()->struct_size, sizeof o + 12) << "the caller's struct was changed";
}

TEST_F(VersionedStructs, ConvertOptionsWithANonzeroUnknownFieldAreRefusedNamingTheOffset) {
  fp8_convert_options_t o;
  fp8_convert_options_init(&o);
  Versioned<fp8_convert_options_t> newer(o, sizeof o + 12, 0);
  newer.bytes()[24] = 1;  // a newer field at offset 24, not at its zero default
  EXPECT_REFUSED_WORDS(fp8_convert_model(model.get(), recipe.get(), newer.get()), FP8_ERR_UNSUPPORTED,
                       "fp8_convert_model", "options", "offset 24", "20");
  EXPECT_EQ(converted(0), 0) << "a refused call changed the model";
  int32_t has = -1;
  FP8_ASSERT_OK(fp8_model_has_fp8_layers(model.get(), &has));
  EXPECT_EQ(has, 0);
  // The bytes past struct_size are not the struct's: never read, whatever they hold.
  Versioned<fp8_convert_options_t> exact(o, sizeof o, 0xFF);
  FP8_ASSERT_OK(fp8_convert_model(model.get(), recipe.get(), exact.get()));
  EXPECT_EQ(converted(0), 1);
}

TEST_F(VersionedStructs, ConvertOptionsBelowTheFirstReleaseAreRefused) {
  fp8_convert_options_t o;
  fp8_convert_options_init(&o);
  Versioned<fp8_convert_options_t> old(o, fp8::kConvertOptionsV1Size - 4, 0);
  EXPECT_REFUSED_WORDS(fp8_convert_model(model.get(), recipe.get(), old.get()), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_convert_model", "options->struct_size", "at least 20");
  EXPECT_EQ(converted(0), 0);
}

// A struct_size no release will reach is an uninitialised struct: refused before anything is read.
TEST_F(VersionedStructs, AnImplausiblyLargeStructSizeIsRefused) {
  fp8_convert_options_t o;
  fp8_convert_options_init(&o);
  o.struct_size = 0x7FFFFFF0u;
  EXPECT_REFUSED_WORDS(fp8_convert_model(model.get(), recipe.get(), &o), FP8_ERR_INVALID_ARGUMENT, "fp8_convert_model",
                       "options->struct_size", "at most 4096");
  EXPECT_EQ(converted(0), 0);
}

TEST_F(VersionedStructs, GemmOptionsFollowTheSameRule) {
  Tensor a = make_tensor(ctx.get(), FP8_DTYPE_F32, {2, 16}), b = make_tensor(ctx.get(), FP8_DTYPE_F32, {16, 16});
  Tensor d = make_tensor(ctx.get(), FP8_DTYPE_F32, {2, 16});
  upload(a.get(), std::vector<float>(32, 1.0f));
  upload(b.get(), std::vector<float>(256, 0.5f));
  upload(d.get(), std::vector<float>(32, 3.0f));
  fp8_gemm_options_t o;
  fp8_gemm_options_init(&o);
  o.alpha = 2.0f;
  Versioned<fp8_gemm_options_t> newer(o, sizeof o + 8, 0);
  FP8_ASSERT_OK(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d.get(), nullptr, newer.get()));
  EXPECT_EQ(download<float>(d.get())[0], 16.0f);  // 2 * 16 * 0.5
  newer.bytes()[sizeof o + 4] = 0x80;
  upload(d.get(), std::vector<float>(32, 3.0f));
  EXPECT_REFUSED_WORDS(fp8_gemm(ctx.get(), a.get(), b.get(), nullptr, d.get(), nullptr, newer.get()),
                       FP8_ERR_UNSUPPORTED, "fp8_gemm", "options", "offset 20");
  EXPECT_EQ(download<float>(d.get())[0], 3.0f) << "a refused call wrote d";
}

TEST_F(VersionedStructs, OutputStructsAreWrittenOnlyUpToTheCallersSize) {
  const unsigned char fill = 0xA5;
  {  // newer caller: the bytes past the library's struct stay as they were
    fp8_device_info_t i;
    fp8_device_info_init(&i);
    Versioned<fp8_device_info_t> newer(i, sizeof i + 16, 0);
    std::memset(newer.bytes() + sizeof i, fill, newer.storage.size() * 8 - sizeof i);
    FP8_ASSERT_OK(fp8_device_query(FP8_DEVICE_CPU, newer.get()));
    EXPECT_EQ(newer.get()->struct_size, sizeof i + 16);
    EXPECT_EQ(newer.get()->device, FP8_DEVICE_CPU);
    EXPECT_TRUE(newer.untouched_from(sizeof i, fill));
  }
  {  // the first release of fp8_optimizer_stats_t (through state_bytes): nothing written past it
    Optimizer opt = make_optimizer(model.get(), FP8_OPTIMIZER_SGD);
    fp8_optimizer_stats_t s;
    fp8_optimizer_stats_init(&s);
    Versioned<fp8_optimizer_stats_t> old(s, fp8::kOptimizerStatsV1Size, fill);
    FP8_ASSERT_OK(fp8_optimizer_get_stats(opt.get(), old.get()));
    EXPECT_EQ(old.get()->struct_size, fp8::kOptimizerStatsV1Size);
    EXPECT_EQ(old.get()->parameters, 32 * 32 + 32 + 32 + 32);
    EXPECT_TRUE(old.untouched_from(fp8::kOptimizerStatsV1Size, fill));
    Versioned<fp8_optimizer_stats_t> newer(s, sizeof s + 8, fill);
    FP8_ASSERT_OK(fp8_optimizer_get_stats(opt.get(), newer.get()));
    EXPECT_EQ(newer.get()->training_bytes, stats_of(opt.get()).training_bytes);
    EXPECT_TRUE(newer.untouched_from(sizeof s, fill));
  }
  {
    fp8_layer_report_t r;
    fp8_layer_report_init(&r);
    Versioned<fp8_layer_report_t> newer(r, sizeof r + 24, fill);
    FP8_ASSERT_OK(fp8_layer_get_report(model.get(), 1, newer.get()));
    EXPECT_EQ(newer.get()->kind, FP8_LAYER_LAYERNORM);
    EXPECT_TRUE(newer.untouched_from(sizeof r, fill));
    Versioned<fp8_layer_report_t> short_(r, fp8::kLayerReportV1Size - 1, fill);
    const std::vector<uint64_t> before = short_.storage;
    EXPECT_REFUSED(fp8_layer_get_report(model.get(), 1, short_.get()), FP8_ERR_INVALID_ARGUMENT, "fp8_layer_get_report",
                   "struct_size");
    EXPECT_EQ(short_.storage, before) << "a refused call wrote the report";
  }
  {
    Scaling sc = make_scaling(ctx.get(), recipe.get(), FP8_ROLE_FORWARD);
    fp8_scaling_info_t i;
    fp8_scaling_info_init(&i);
    Versioned<fp8_scaling_info_t> newer(i, sizeof i + 8, fill);
    FP8_ASSERT_OK(fp8_scaling_get_info(sc.get(), newer.get()));
    EXPECT_EQ(newer.get()->scale, 1.0f);
    EXPECT_TRUE(newer.untouched_from(sizeof i, fill));
  }
}

// ---- Tensors the library lends --------------------------------------------------------------------

// fp8_tensor_destroy(t) left t alone and said that its model owns it.
void expect_destroy_refused(fp8_tensor_t* t, const std::string& what) {
  fp8_tensor_destroy(t);
  const std::string msg = fp8_last_error_message();
  EXPECT_EQ(msg.rfind("fp8_tensor_destroy:", 0), 0u) << what << ": " << msg;
  EXPECT_NE(msg.find("model"), std::string::npos) << what << ": " << msg;
}

using LentTensors = ModelFixture;

TEST_F(LentTensors, DestroyingAParameterTensorLeavesItToTheModel) {
  FP8_ASSERT_OK(fp8_model_add_linear(model.get(), "fc2", 32, 16, 1, nullptr));
  set_param(model.get(), "fc.weight", randn(32 * 32, 3, 0.1f));
  set_param(model.get(), "fc2.weight", randn(16 * 32, 4, 0.1f));
  int32_t count = 0;
  FP8_ASSERT_OK(fp8_model_parameter_count(model.get(), &count));
  ASSERT_EQ(count, 6);
  std::vector<std::vector<uint8_t>> before;
  for (int32_t i = 0; i < count; ++i) {
    const char* name = nullptr;
    fp8_tensor_t *value = nullptr, *grad = nullptr;
    FP8_ASSERT_OK(fp8_model_parameter_at(model.get(), i, &name, &value, &grad));
    before.push_back(tensor_bytes(value));
    expect_destroy_refused(value, std::string(name) + " value");
    expect_destroy_refused(grad, std::string(name) + " grad");
  }
  expect_destroy_refused(param_tensor(model.get(), "fc.bias"), "fc.bias from fp8_model_parameter");
  // Every tensor is still the model's and intact, and the model trains.
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t* value = nullptr;
    FP8_ASSERT_OK(fp8_model_parameter_at(model.get(), i, nullptr, &value, nullptr));
    EXPECT_EQ(tensor_bytes(value), before[static_cast<size_t>(i)]) << i;
  }
  Optimizer o = make_optimizer(model.get(), FP8_OPTIMIZER_ADAM);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 32}), y = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 16});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 16});
  upload(x.get(), randn(128, 1, 1.0f));
  upload(dy.get(), randn(64, 2, 1.0f));
  FP8_ASSERT_OK(fp8_model_forward(model.get(), x.get(), y.get()));
  FP8_ASSERT_OK(fp8_model_backward(model.get(), dy.get(), nullptr));
  FP8_ASSERT_OK(fp8_optimizer_step(o.get()));
  EXPECT_NE(tensor_bytes(param_tensor(model.get(), "fc.weight")), before[0]) << "the step changed nothing";
  // A tensor of the caller's is still released as before (and the error message is not touched).
  Tensor own = make_tensor(ctx.get(), FP8_DTYPE_F32, {3});
  fp8_tensor_destroy(own.release());
}

TEST_F(LentTensors, TheWeightsAnOptimizerStoresAreLentToo) {
  Recipe r = make_recipe("backend=msamp, opt_level=O1");
  FP8_ASSERT_OK(fp8_convert_model(model.get(), r.get(), nullptr));
  set_param(model.get(), "fc.weight", randn(32 * 32, 3, 0.1f));
  Optimizer o = make_optimizer(model.get(), FP8_OPTIMIZER_ADAM);
  fp8_tensor_t *value = nullptr, *grad = nullptr;
  FP8_ASSERT_OK(fp8_model_parameter(model.get(), "fc.weight", &value, &grad));
  ASSERT_EQ(dtype_of(value), FP8_DTYPE_F16);  // the optimizer's new storage
  const auto bytes = tensor_bytes(value);
  expect_destroy_refused(value, "O1 weight");
  expect_destroy_refused(grad, "O1 FP8 gradient");
  EXPECT_EQ(tensor_bytes(value), bytes);
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 32}), y = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 32});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {4, 32});
  upload(x.get(), randn(128, 1, 1.0f));
  upload(dy.get(), randn(128, 2, 1.0f));
  FP8_ASSERT_OK(fp8_model_forward(model.get(), x.get(), y.get()));
  FP8_ASSERT_OK(fp8_model_backward(model.get(), dy.get(), nullptr));
  FP8_ASSERT_OK(fp8_optimizer_step(o.get()));
  EXPECT_EQ(stats_of(o.get()).steps, 1);
  EXPECT_NE(tensor_bytes(value), bytes);
}

// ---- Recipe keys: what the parser accepts is what fp8.h lists ------------------------------------

// The list of keys in the comment block above `typedef struct fp8_recipe` in fp8.h.
std::string header_recipe_keys_block() {
  std::ifstream in(FP8_HEADER_PATH);
  EXPECT_TRUE(in.good()) << "cannot read " << FP8_HEADER_PATH;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string h = ss.str();
  const size_t begin = h.find("Keys and values:", h.find("Text form (fp8_recipe_parse"));
  const size_t end = h.find("typedef struct fp8_recipe ");
  EXPECT_NE(begin, std::string::npos);
  EXPECT_NE(end, std::string::npos);
  if (begin == std::string::npos || end == std::string::npos || end < begin) return "";
  return h.substr(begin, end - begin);
}

// key -> value of the recipe's text form ("backend=auto, opt_level=O2, ...").
std::map<std::string, std::string> text_form(const fp8_recipe_t* r) {
  char buf[1024];
  EXPECT_OK(fp8_recipe_to_string(r, buf, sizeof buf, nullptr));
  std::map<std::string, std::string> pairs;
  std::stringstream ss(buf);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t eq = item.find('=');
    const size_t b = item.find_first_not_of(' ');
    pairs[item.substr(b, eq - b)] = item.substr(eq + 1);
  }
  return pairs;
}

TEST(RecipeKeys, EveryAttributeKeyParsesAndIsListedInTheHeader) {
  const std::string block = header_recipe_keys_block();
  std::set<std::string> listed;
  const std::regex key_re("([a-z_0-9]+)=");
  for (auto it = std::sregex_iterator(block.begin(), block.end(), key_re); it != std::sregex_iterator(); ++it)
    listed.insert((*it)[1]);
  ASSERT_FALSE(listed.empty());

  Recipe defaults = make_recipe();
  const auto form = text_form(defaults.get());
  const auto overrides = form.find("override_linear_precision");
  ASSERT_NE(overrides, form.end());
  std::set<std::string> keys;
  for (fp8_recipe_attr_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a) {
    int64_t lo = 0, hi = 0, def = 0;
    const char* key = nullptr;
    FP8_ASSERT_OK(fp8_recipe_attr_bounds(a, &lo, &hi, &def, &key));
    ASSERT_NE(key, nullptr);
    SCOPED_TRACE(key);
    keys.insert(key);
    EXPECT_EQ(listed.count(key), 1u) << "fp8.h's list of recipe keys does not name '" << key << "'";
    // The default's text: from the text form, where override_fprop/dgrad/wgrad are one f/d/w key.
    std::string value;
    if (form.count(key)) {
      value = form.at(key);
    } else {
      const int part = a == FP8_RECIPE_OVERRIDE_FPROP ? 0 : a == FP8_RECIPE_OVERRIDE_DGRAD ? 1 : 2;
      ASSERT_TRUE(a == FP8_RECIPE_OVERRIDE_FPROP || a == FP8_RECIPE_OVERRIDE_DGRAD || a == FP8_RECIPE_OVERRIDE_WGRAD)
          << "fp8_recipe_to_string does not write this key";
      std::stringstream flags(overrides->second);
      for (int i = 0; i <= part; ++i) std::getline(flags, value, '/');
    }
    // "key=<default>" parses, and sets this attribute back from another value.
    Recipe r = make_recipe();
    FP8_ASSERT_OK(fp8_recipe_set_int(r.get(), a, def != lo ? lo : hi));
    const std::string text = std::string(key) + "=" + value;
    FP8_ASSERT_OK(fp8_recipe_parse(r.get(), text.c_str()));
    int64_t got = -1;
    FP8_ASSERT_OK(fp8_recipe_get_int(r.get(), a, &got));
    EXPECT_EQ(got, def) << text;
  }
  // And the other way: every key the header lists is one the parser knows.
  for (const std::string& k : listed) {
    if (k == "override_linear_precision") continue;  // the three override flags at once (checked above)
    EXPECT_EQ(keys.count(k), 1u) << "fp8.h lists recipe key '" << k << "', which is no attribute's key";
  }
}

// ---- Norm layers: dim at most what fp8_norm_backward takes ---------------------------------------

TEST(NormLimits, ANormLayerWiderThanTheBackwardTakesIsRefused) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model m = make_model(ctx.get());
  const int64_t max_d = int64_t{1} << 20;
  int32_t id = -7;
  EXPECT_REFUSED_WORDS(fp8_model_add_layernorm(m.get(), "ln", max_d + 1, 1e-5f, &id), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_model_add_layernorm", "dim = 1048577", "1..1048576", "2^20");
  EXPECT_REFUSED_WORDS(fp8_model_add_rmsnorm(m.get(), "rms", int64_t{1} << 31, 1e-5f, &id), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_model_add_rmsnorm", "dim = 2147483648", "1..1048576");
  EXPECT_EQ(id, -7);
  int32_t count = -1;
  FP8_ASSERT_OK(fp8_model_layer_count(m.get(), &count));
  EXPECT_EQ(count, 0);

  // At the limit: the layer is made, and its backward (which runs fp8_norm_backward's rule) works.
  FP8_ASSERT_OK(fp8_model_add_layernorm(m.get(), "ln", max_d, 1e-5f, &id));
  FP8_ASSERT_OK(fp8_model_add_rmsnorm(m.get(), "rms", max_d, 1e-5f, nullptr));
  Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {1, max_d}), y = make_tensor(ctx.get(), FP8_DTYPE_F32, {1, max_d});
  Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {1, max_d}), dx = make_tensor(ctx.get(), FP8_DTYPE_F32, {1, max_d});
  upload(x.get(), randn(static_cast<size_t>(max_d), 1, 1.0f));
  upload(dy.get(), randn(static_cast<size_t>(max_d), 2, 1.0f));
  FP8_ASSERT_OK(fp8_model_forward(m.get(), x.get(), y.get()));
  FP8_ASSERT_OK(fp8_model_backward(m.get(), dy.get(), dx.get()));
  EXPECT_GT(amax_of(download<float>(param_tensor(m.get(), "ln.weight", true))), 0.0f);

  // fp8_norm_backward itself: the same limit.
  Tensor wide = make_tensor(ctx.get(), FP8_DTYPE_F32, {1, max_d + 1});
  Tensor gamma = make_tensor(ctx.get(), FP8_DTYPE_F32, {max_d + 1}), rstd = make_tensor(ctx.get(), FP8_DTYPE_F32, {1});
  EXPECT_REFUSED_WORDS(fp8_norm_backward(ctx.get(), FP8_NORM_RMSNORM, wide.get(), gamma.get(), nullptr, rstd.get(),
                                         wide.get(), wide.get(), gamma.get(), nullptr),
                       FP8_ERR_SHAPE, "fp8_norm_backward", "1048577", "at most 1048576");
}

}  // namespace
