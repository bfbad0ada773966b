// DLPack (fp8.h, "DLPack": the 0.x and 1.x structs) and FP8 tensors over the caller's scale, on the
// CPU backend: a producer's tensor borrowed (its deleter runs exactly once, when the last holder lets
// go), a libfp8 tensor lent (its memory outlives the tensor and the model), round trips, FP8 through
// DLPack 1.1's type codes, and every refusal naming what it got.
#include "api/dlpack_versioned.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

// A producer's host tensor of `shape` at `data`, contiguous, as DLPack describes it.
void describe(DLTensor& t, void* data, std::vector<int64_t>& shape, DLDataType type) {
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = type;
  t.shape = shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
}

// A producer's tensor: host floats with a deleter that counts its calls.
struct Produced {
  std::vector<float> values;
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed{};
  int deleted = 0;

  Produced(std::vector<int64_t> dims, DLDataType type = {kDLFloat, 32, 1}) : shape(std::move(dims)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    values = randn(static_cast<size_t>(n) + 4, 17, 1.0f);
    describe(managed.dl_tensor, values.data(), shape, type);
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensor* m) { ++static_cast<Produced*>(m->manager_ctx)->deleted; };
  }
};

TEST(DlPack, ABorrowedTensorReadsTheProducersMemoryAndRunsItsDeleterOnce) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Produced p({3, 4});
  p.managed.dl_tensor.byte_offset = 2 * sizeof(float);  // starts two floats in
  fp8_tensor_t* t = nullptr;
  FP8_ASSERT_OK(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed));
  fp8_dtype_t dt = FP8_DTYPE_E4M3;
  int32_t ndim = 0;
  int64_t shape[FP8_MAX_DIMS] = {};
  EXPECT_OK(fp8_tensor_dtype(t, &dt));
  EXPECT_OK(fp8_tensor_shape(t, &ndim, shape));
  EXPECT_EQ(dt, FP8_DTYPE_F32);
  EXPECT_EQ(ndim, 2);
  EXPECT_EQ(shape[0], 3);
  EXPECT_EQ(shape[1], 4);
  std::vector<float> got(12);
  EXPECT_OK(fp8_tensor_copy_to_host(t, got.data(), got.size() * sizeof(float)));
  EXPECT_EQ(got, std::vector<float>(p.values.begin() + 2, p.values.begin() + 14));
  EXPECT_EQ(p.deleted, 0);
  fp8_tensor_destroy(t);
  EXPECT_EQ(p.deleted, 1);
}

TEST(DlPack, ExplicitContiguousStridesAndFreeStridesOnSizeOneDimensionsAreAccepted) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Produced p({2, 1, 5});
  p.strides = {5, 99, 1};
  p.managed.dl_tensor.strides = p.strides.data();
  fp8_tensor_t* t = nullptr;
  FP8_ASSERT_OK(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed));
  fp8_tensor_destroy(t);
  EXPECT_EQ(p.deleted, 1);
}

// An empty tensor's strides say nothing (torch exports torch.zeros(0, 5) with strides [1, 1]): it
// is taken with its shape, and its deleter still runs once.
TEST(DlPack, AnEmptyTensorIsTakenWhateverItsStrides) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Produced p({0, 5});
  p.strides = {1, 1};
  p.managed.dl_tensor.strides = p.strides.data();
  fp8_tensor_t* t = nullptr;
  FP8_ASSERT_OK(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed));
  int32_t ndim = 0;
  int64_t shape[FP8_MAX_DIMS] = {}, numel = -1;
  EXPECT_OK(fp8_tensor_shape(t, &ndim, shape));
  EXPECT_OK(fp8_tensor_numel(t, &numel));
  EXPECT_EQ(ndim, 2);
  EXPECT_EQ(shape[0], 0);
  EXPECT_EQ(shape[1], 5);
  EXPECT_EQ(numel, 0);
  fp8_tensor_destroy(t);
  EXPECT_EQ(p.deleted, 1);
}

// What fp8_tensor_wrap checks, fp8_tensor_from_dlpack checks too: a data pointer (with its
// byte_offset) not aligned to the dtype's size, and a negative size.
TEST(DlPack, MisalignedDataAndNegativeSizesAreRefused) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  fp8_tensor_t* t = nullptr;
  {
    Produced p({2, 3});
    p.managed.dl_tensor.byte_offset = 2;  // half a float in
    const fp8_status_t st = fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed);
    EXPECT_NE(st, FP8_OK);
    EXPECT_NE(std::string(fp8_last_error_message()).find("align"), std::string::npos) << fp8_last_error_message();
    EXPECT_EQ(t, nullptr);
    EXPECT_EQ(p.deleted, 0);
  }
  {
    Produced p({2, 3});
    p.shape[0] = -2;
    EXPECT_REFUSED(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_SHAPE, "fp8_tensor_from_dlpack", "-2");
    EXPECT_EQ(t, nullptr);
    EXPECT_EQ(p.deleted, 0);
  }
}

TEST(DlPack, RefusalsNameWhatTheyGotAndLeaveTheTensorWithTheCaller) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  fp8_tensor_t* t = nullptr;
  {
    Produced p({4, 4});
    p.strides = {1, 4};  // a transpose
    p.managed.dl_tensor.strides = p.strides.data();
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_SHAPE, "fp8_tensor_from_dlpack",
                         "strides are [1, 4]", "contiguous");
    EXPECT_EQ(p.deleted, 0);
  }
  {
    Produced p({4}, {kDLInt, 32, 1});
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_DTYPE, "fp8_tensor_from_dlpack",
                         "int32", "float32");
    EXPECT_EQ(p.deleted, 0);
  }
  {
    Produced p({4}, {kDLFloat, 32, 4});
    EXPECT_REFUSED(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_DTYPE, "fp8_tensor_from_dlpack",
                   "float32x4");
  }
  {
    Produced p({4});
    p.managed.dl_tensor.device = {kDLCUDA, 0};
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_INVALID_ARGUMENT,
                         "fp8_tensor_from_dlpack", "kDLCUDA 0", "kDLCPU");
    EXPECT_EQ(p.deleted, 0);
  }
  {
    Produced p({1, 1, 1, 1, 1, 1, 1, 1, 1});
    EXPECT_REFUSED(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_SHAPE, "fp8_tensor_from_dlpack",
                   "9 dimensions");
  }
  {
    Produced p({2, -1});
    EXPECT_REFUSED(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_SHAPE, "fp8_tensor_from_dlpack",
                   "shape[1] = -1");
    EXPECT_EQ(p.deleted, 0);
  }
  EXPECT_REFUSED(fp8_tensor_from_dlpack(&t, ctx.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_tensor_from_dlpack",
                 "managed");
  EXPECT_EQ(t, nullptr);
  DLManagedTensor* lent = nullptr;
  EXPECT_REFUSED(fp8_tensor_to_dlpack(nullptr, &lent), FP8_ERR_INVALID_ARGUMENT, "fp8_tensor_to_dlpack", "tensor");
}

// A lent tensor describes the tensor, and its memory stays allocated after the tensor is destroyed
// (under AddressSanitizer, reading freed memory would fail the sanitize build).
TEST(DlPack, ALentTensorOutlivesTheTensorUntilTheConsumersDeleter) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Tensor t = make_tensor(ctx.get(), FP8_DTYPE_BF16, {2, 3, 4});
  std::vector<uint16_t> bits(24);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<uint16_t>(0x3F80 + i);
  EXPECT_OK(fp8_tensor_copy_from_host(t.get(), bits.data(), bits.size() * 2));
  DLManagedTensor* lent = nullptr;
  FP8_ASSERT_OK(fp8_tensor_to_dlpack(t.get(), &lent));
  const DLTensor& dl = lent->dl_tensor;
  EXPECT_EQ(dl.device.device_type, kDLCPU);
  EXPECT_EQ(dl.dtype.code, kDLBfloat);
  EXPECT_EQ(dl.dtype.bits, 16);
  ASSERT_EQ(dl.ndim, 3);
  EXPECT_EQ(std::vector<int64_t>(dl.shape, dl.shape + 3), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(std::vector<int64_t>(dl.strides, dl.strides + 3), (std::vector<int64_t>{12, 4, 1}));
  t.reset();
  const auto* seen = static_cast<const uint16_t*>(dl.data);
  EXPECT_EQ(std::vector<uint16_t>(seen, seen + 24), bits);
  lent->deleter(lent);

  // Borrowed back: libfp8 -> DLPack -> libfp8 reads the same values.
  Tensor u = make_tensor(ctx.get(), FP8_DTYPE_F32, {5});
  upload(u.get(), std::vector<float>{1, 2, 3, 4, 5});
  FP8_ASSERT_OK(fp8_tensor_to_dlpack(u.get(), &lent));
  fp8_tensor_t* back = nullptr;
  FP8_ASSERT_OK(fp8_tensor_from_dlpack(&back, ctx.get(), lent));
  u.reset();
  std::vector<float> got(5);
  EXPECT_OK(fp8_tensor_copy_to_host(back, got.data(), sizeof(float) * 5));
  EXPECT_EQ(got, (std::vector<float>{1, 2, 3, 4, 5}));
  fp8_tensor_destroy(back);  // runs the lent tensor's deleter, which releases the memory
}

// DLPack 1.x (fp8_tensor_from_dlpack_versioned / to_dlpack_versioned): a versioned producer's
// tensor, FP8 through DLPack 1.1's type codes both ways, and the version and read-only refusals.
constexpr uint8_t kFloat8E4M3fn = 10, kFloat8E5M2 = 12;  // DLPack 1.1's type codes

struct ProducedVersioned {
  std::vector<unsigned char> bytes;
  std::vector<int64_t> shape;
  DLManagedTensorVersioned managed{};
  int deleted = 0;

  ProducedVersioned(std::vector<int64_t> dims, DLDataType type) : shape(std::move(dims)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bytes.resize(static_cast<size_t>(n) * ((type.bits + 7) / 8));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 37 + 11);
    managed.version = {1, 1};
    managed.flags = 0;
    describe(managed.dl_tensor, bytes.data(), shape, type);
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensorVersioned* m) { ++static_cast<ProducedVersioned*>(m->manager_ctx)->deleted; };
  }
};

TEST(DlPackVersioned, FP8TensorsAreBorrowedWithTheirTypeCodesAndAScaleOfOne) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  for (const auto& [code, want] : {std::pair{kFloat8E4M3fn, FP8_DTYPE_E4M3}, std::pair{kFloat8E5M2, FP8_DTYPE_E5M2}}) {
    ProducedVersioned p({3, 5}, {code, 8, 1});
    fp8_tensor_t* t = nullptr;
    FP8_ASSERT_OK(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed));
    fp8_dtype_t dt = FP8_DTYPE_F32;
    EXPECT_OK(fp8_tensor_dtype(t, &dt));
    EXPECT_EQ(dt, want);
    std::vector<unsigned char> got(15);
    EXPECT_OK(fp8_tensor_copy_to_host(t, got.data(), got.size()));
    EXPECT_EQ(got, p.bytes);  // the producer's memory, not a copy
    float scale_inv = 0.0f;
    EXPECT_OK(fp8_tensor_get_scale_inv(t, &scale_inv));
    EXPECT_EQ(scale_inv, 1.0f);
    EXPECT_EQ(p.deleted, 0);
    fp8_tensor_destroy(t);
    EXPECT_EQ(p.deleted, 1);
  }
  // The 16- and 32-bit dtypes as through fp8_tensor_from_dlpack, any 1.y version.
  ProducedVersioned p({2, 2}, {kDLBfloat, 16, 1});
  p.managed.version = {1, 3};
  fp8_tensor_t* t = nullptr;
  FP8_ASSERT_OK(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed));
  fp8_dtype_t dt = FP8_DTYPE_F32;
  EXPECT_OK(fp8_tensor_dtype(t, &dt));
  EXPECT_EQ(dt, FP8_DTYPE_BF16);
  fp8_tensor_destroy(t);
  EXPECT_EQ(p.deleted, 1);
}

TEST(DlPackVersioned, ALentFP8TensorCarriesItsTypeCodeAndComesBackTheSame) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  for (const auto& [dtype, code] : {std::pair{FP8_DTYPE_E4M3, kFloat8E4M3fn}, std::pair{FP8_DTYPE_E5M2, kFloat8E5M2}}) {
    Tensor t = make_tensor(ctx.get(), dtype, {4, 8});
    std::vector<unsigned char> codes(32);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<unsigned char>(i * 7 + 3);
    EXPECT_OK(fp8_tensor_copy_from_host(t.get(), codes.data(), codes.size()));
    DLManagedTensorVersioned* lent = nullptr;
    FP8_ASSERT_OK(fp8_tensor_to_dlpack_versioned(t.get(), &lent));
    EXPECT_EQ(lent->version.major, 1u);
    EXPECT_EQ(lent->version.minor, 1u);
    EXPECT_EQ(lent->flags, 0u);
    const DLTensor& dl = lent->dl_tensor;
    EXPECT_EQ(dl.device.device_type, kDLCPU);
    EXPECT_EQ(dl.dtype.code, code);
    EXPECT_EQ(dl.dtype.bits, 8);
    EXPECT_EQ(dl.dtype.lanes, 1);
    ASSERT_EQ(dl.ndim, 2);
    EXPECT_EQ(std::vector<int64_t>(dl.shape, dl.shape + 2), (std::vector<int64_t>{4, 8}));
    EXPECT_EQ(std::vector<int64_t>(dl.strides, dl.strides + 2), (std::vector<int64_t>{8, 1}));
    t.reset();  // the lent memory outlives the tensor
    const auto* seen = static_cast<const unsigned char*>(dl.data);
    EXPECT_EQ(std::vector<unsigned char>(seen, seen + 32), codes);
    fp8_tensor_t* back = nullptr;  // and is borrowed back as the same dtype
    FP8_ASSERT_OK(fp8_tensor_from_dlpack_versioned(&back, ctx.get(), lent));
    fp8_dtype_t dt = FP8_DTYPE_F32;
    EXPECT_OK(fp8_tensor_dtype(back, &dt));
    EXPECT_EQ(dt, dtype);
    std::vector<unsigned char> got(32);
    EXPECT_OK(fp8_tensor_copy_to_host(back, got.data(), got.size()));
    EXPECT_EQ(got, codes);
    fp8_tensor_destroy(back);  // runs the lent tensor's deleter
  }
  // The unversioned struct still lends FP8 as uint8 codes.
  Tensor t = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {2});
  DLManagedTensor* old = nullptr;
  FP8_ASSERT_OK(fp8_tensor_to_dlpack(t.get(), &old));
  EXPECT_EQ(old->dl_tensor.dtype.code, kDLUInt);
  old->deleter(old);
}

TEST(DlPackVersioned, RefusalsNameWhatTheyGotAndLeaveTheTensorWithTheCaller) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  fp8_tensor_t* t = nullptr;
  const char* fn = "fp8_tensor_from_dlpack_versioned";
  {
    ProducedVersioned p({4}, {kDLFloat, 32, 1});
    p.managed.version = {2, 0};
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_VERSION, fn,
                         "version is 2.0", "expected 1.x");
    p.managed.version = {0, 8};
    EXPECT_REFUSED(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_VERSION, fn, "0.8");
    EXPECT_EQ(p.deleted, 0);
  }
  {
    ProducedVersioned p({4}, {kDLFloat, 32, 1});
    p.managed.flags = 1;  // DLPACK_FLAG_BITMASK_READ_ONLY
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_INVALID_ARGUMENT, fn,
                         "read-only", "writable");
    p.managed.flags = 2;  // DLPACK_FLAG_BITMASK_IS_COPIED: taken
    FP8_ASSERT_OK(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed));
    fp8_tensor_destroy(t);
    t = nullptr;
    EXPECT_EQ(p.deleted, 1);
  }
  {
    ProducedVersioned p({4}, {11, 8, 1});  // float8_e4m3fnuz: not libfp8's E4M3
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_DTYPE, fn, "code 11 8",
                         "float8_e4m3fn or float8_e5m2");
    EXPECT_EQ(p.deleted, 0);
  }
  {
    ProducedVersioned p({4}, {kFloat8E4M3fn, 8, 2});
    EXPECT_REFUSED(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_DTYPE, fn, "float8_e4m3fnx2");
  }
  {
    ProducedVersioned p({4, 4}, {kFloat8E5M2, 8, 1});
    std::vector<int64_t> strides = {1, 4};
    p.managed.dl_tensor.strides = strides.data();
    EXPECT_REFUSED(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_SHAPE, fn,
                   "strides are [1, 4]");
    EXPECT_EQ(p.deleted, 0);
  }
  {  // the unversioned call names the versioned one for FP8 type codes
    Produced p({4}, {kFloat8E4M3fn, 8, 1});
    EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack(&t, ctx.get(), &p.managed), FP8_ERR_DTYPE, "fp8_tensor_from_dlpack",
                         "float8_e4m3fn", "fp8_tensor_from_dlpack_versioned");
  }
  EXPECT_REFUSED(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, fn, "managed");
  EXPECT_REFUSED(fp8_tensor_from_dlpack_versioned(nullptr, ctx.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, fn, "out");
  EXPECT_EQ(t, nullptr);
  DLManagedTensorVersioned* lent = nullptr;
  EXPECT_REFUSED(fp8_tensor_to_dlpack_versioned(nullptr, &lent), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_tensor_to_dlpack_versioned", "tensor");
  EXPECT_EQ(lent, nullptr);
}

// A model's parameters lent out keep their memory after the model is gone; FP8 values travel as
// their uint8 codes.
TEST(DlPack, AModelsParametersAreLentAsViewsOfItsStorage) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model m = make_model(ctx.get());
  EXPECT_OK(fp8_model_add_linear(m.get(), "fc", 32, 16, 1, nullptr));
  fp8_tensor_t *w = nullptr, *g = nullptr;
  EXPECT_OK(fp8_model_parameter(m.get(), "fc.weight", &w, &g));
  const std::vector<float> values = randn(32 * 16, 4, 0.1f);
  upload(w, values);
  DLManagedTensor* lent = nullptr;
  FP8_ASSERT_OK(fp8_tensor_to_dlpack(w, &lent));
  void* data = nullptr;
  EXPECT_OK(fp8_tensor_data(w, &data));
  EXPECT_EQ(lent->dl_tensor.data, data) << "a view of the model's storage, not a copy";
  m.reset();
  const auto* seen = static_cast<const float*>(lent->dl_tensor.data);
  EXPECT_EQ(std::vector<float>(seen, seen + values.size()), values);
  lent->deleter(lent);

  Tensor codes = make_tensor(ctx.get(), FP8_DTYPE_E5M2, {8});
  FP8_ASSERT_OK(fp8_tensor_to_dlpack(codes.get(), &lent));
  EXPECT_EQ(lent->dl_tensor.dtype.code, kDLUInt);
  EXPECT_EQ(lent->dl_tensor.dtype.bits, 8);
  lent->deleter(lent);
}

// fp8_tensor_wrap_scaled: FP8 codes and a scale the caller owns, read where they are.
TEST(WrapScaled, UsesTheCallersScaleAndRefusesWhatHasNone) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  std::vector<uint8_t> codes = {0x38, 0x40, 0xC0, 0x00};  // E4M3: 1, 2, -2, 0
  float scale_inv = 0.5f;
  fp8_tensor_t* t = nullptr;
  const int64_t shape[] = {4};
  FP8_ASSERT_OK(fp8_tensor_wrap_scaled(&t, ctx.get(), FP8_DTYPE_E4M3, 1, shape, codes.data(), &scale_inv));
  float got = 0.0f;
  EXPECT_OK(fp8_tensor_get_scale_inv(t, &got));
  EXPECT_EQ(got, 0.5f);
  Tensor out = make_tensor(ctx.get(), FP8_DTYPE_F32, {4});
  EXPECT_OK(fp8_dequantize(ctx.get(), t, out.get()));
  EXPECT_EQ(download<float>(out.get()), (std::vector<float>{0.5f, 1.0f, -1.0f, 0.0f}));
  scale_inv = 2.0f;  // the caller's scale, read where it is
  EXPECT_OK(fp8_dequantize(ctx.get(), t, out.get()));
  EXPECT_EQ(download<float>(out.get()), (std::vector<float>{2.0f, 4.0f, -4.0f, 0.0f}));
  fp8_tensor_destroy(t);
  fp8_tensor_t* bad = nullptr;
  EXPECT_REFUSED_WORDS(fp8_tensor_wrap_scaled(&bad, ctx.get(), FP8_DTYPE_F32, 1, shape, codes.data(), &scale_inv),
                       FP8_ERR_DTYPE, "fp8_tensor_wrap_scaled", "f32", "FP8_DTYPE_E4M3");
  EXPECT_REFUSED(fp8_tensor_wrap_scaled(&bad, ctx.get(), FP8_DTYPE_E4M3, 1, shape, codes.data(), nullptr),
                 FP8_ERR_INVALID_ARGUMENT, "fp8_tensor_wrap_scaled", "scale_inv");
  EXPECT_EQ(bad, nullptr);
}

}  // namespace
