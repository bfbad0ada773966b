// DLPack on a CUDA context (fp8.h, "DLPack"): tensors lent as kDLCUDA with the context's device id
// through both structs (FP8 as uint8 codes through DLPack 0.x's, as float8_e4m3fn / float8_e5m2
// through 1.x's), borrowed back with the same bytes; a producer's cudaMalloc and cudaMallocManaged
// memory borrowed (its deleter run once); host memory and another device id refused.
#include <cuda_runtime.h>

#include "api/dlpack_versioned.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

std::vector<unsigned char> device_bytes(const void* p, size_t n) {
  std::vector<unsigned char> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 37 + seed);
  return v;
}

TEST(GpuDlPack, FP8TensorsAreLentOnTheDeviceThroughBothStructsAndBorrowedBack) {
  Context ctx = make_context(0);
  for (fp8_dtype_t dtype : {FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    Tensor t = make_tensor(ctx.get(), dtype, {64, 48});
    const std::vector<unsigned char> codes = pattern(64 * 48, dtype);
    EXPECT_OK(fp8_tensor_copy_from_host(t.get(), codes.data(), codes.size()));
    EXPECT_OK(fp8_context_synchronize(ctx.get()));

    DLManagedTensorVersioned* v = nullptr;
    FP8_ASSERT_OK(fp8_tensor_to_dlpack_versioned(t.get(), &v));
    EXPECT_EQ(v->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ(v->dl_tensor.device.device_id, 0);
    EXPECT_EQ(v->dl_tensor.dtype.code, dtype == FP8_DTYPE_E4M3 ? 10 : 12);
    EXPECT_EQ(device_bytes(v->dl_tensor.data, codes.size()), codes);
    DLManagedTensor* u = nullptr;
    FP8_ASSERT_OK(fp8_tensor_to_dlpack(t.get(), &u));
    EXPECT_EQ(u->dl_tensor.dtype.code, kDLUInt);
    EXPECT_EQ(u->dl_tensor.data, v->dl_tensor.data);
    u->deleter(u);
    t.reset();  // the lent memory stays

    fp8_tensor_t* back = nullptr;
    FP8_ASSERT_OK(fp8_tensor_from_dlpack_versioned(&back, ctx.get(), v));
    fp8_dtype_t dt = FP8_DTYPE_F32;
    EXPECT_OK(fp8_tensor_dtype(back, &dt));
    EXPECT_EQ(dt, dtype);
    std::vector<unsigned char> got(codes.size());
    EXPECT_OK(fp8_tensor_copy_to_host(back, got.data(), got.size()));
    EXPECT_EQ(got, codes);
    float scale_inv = 0.0f;
    EXPECT_OK(fp8_tensor_get_scale_inv(back, &scale_inv));
    EXPECT_EQ(scale_inv, 1.0f);
    fp8_tensor_destroy(back);
  }
}

// A producer's device memory (cudaMalloc, cudaMallocManaged), float32 through the versioned struct.
struct DeviceProduced {
  void* data = nullptr;
  std::vector<int64_t> shape = {32, 16};
  DLManagedTensorVersioned managed{};
  int deleted = 0;

  DeviceProduced(bool managed_memory, const std::vector<float>& values) {
    const size_t bytes = values.size() * sizeof(float);
    EXPECT_EQ(managed_memory ? cudaMallocManaged(&data, bytes) : cudaMalloc(&data, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, values.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    managed.version = {1, 0};
    DLTensor& t = managed.dl_tensor;
    t.data = data;
    t.device = {managed_memory ? kDLCUDAManaged : kDLCUDA, 0};
    t.ndim = 2;
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape.data();
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensorVersioned* m) { ++static_cast<DeviceProduced*>(m->manager_ctx)->deleted; };
  }
  ~DeviceProduced() { cudaFree(data); }
};

TEST(GpuDlPack, AProducersDeviceMemoryIsBorrowedAndOtherDevicesAreRefused) {
  Context ctx = make_context(0);
  const std::vector<float> values = randn(32 * 16, 5, 1.0f);
  for (bool managed_memory : {false, true}) {
    SCOPED_TRACE(managed_memory ? "cudaMallocManaged" : "cudaMalloc");
    DeviceProduced p(managed_memory, values);
    fp8_tensor_t* t = nullptr;
    FP8_ASSERT_OK(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed));
    std::vector<float> got(values.size());
    EXPECT_OK(fp8_tensor_copy_to_host(t, got.data(), got.size() * sizeof(float)));
    EXPECT_EQ(got, values);
    EXPECT_EQ(p.deleted, 0);
    fp8_tensor_destroy(t);
    EXPECT_EQ(p.deleted, 1);
  }
  DeviceProduced p(false, values);
  fp8_tensor_t* t = nullptr;
  p.managed.dl_tensor.device = {kDLCUDA, 7};
  EXPECT_REFUSED_WORDS(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_tensor_from_dlpack_versioned", "kDLCUDA 7", "kDLCUDA 0");
  p.managed.dl_tensor.device = {kDLCPU, 0};
  EXPECT_REFUSED(fp8_tensor_from_dlpack_versioned(&t, ctx.get(), &p.managed), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_tensor_from_dlpack_versioned", "kDLCPU 0");
  EXPECT_EQ(p.deleted, 0);
  EXPECT_EQ(t, nullptr);
}

}  // namespace
