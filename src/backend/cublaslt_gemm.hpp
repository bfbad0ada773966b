// The CUDA backend's GEMM: cuBLASLt with one handle and one workspace per context, and the
// matmul descriptors, layouts and chosen algorithm cached per shape and type combination.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <map>
#include <string>
#include <tuple>

#include "backend/jobs.hpp"

namespace fp8 {

class CublasLtGemm {
 public:
  explicit CublasLtGemm(int device);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // Queues the GEMM on `stream` (the caller has made the device current).
  void run(const GemmJob& job, cudaStream_t stream);
  // Whether per-row and block scales run here, and the device and cuBLASLt in words.
  bool scaled_modes() const { return scaled_modes_; }
  const std::string& describe() const { return description_; }

 private:
  // m, n, k, a, b, d, bias dtypes (-1: none), accumulate, fast accumulation, a and b transposed, the
  // alignments of a, b and d (the algorithm must not assume more than the pointers have), and the
  // scale modes of a, b and d (plans of different modes never collide)
  using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, int, bool, bool, bool, bool, uint32_t, uint32_t,
                         uint32_t, ScaleMode, ScaleMode, ScaleMode>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan_for(const GemmJob& job);
  static void destroy(Plan& p) noexcept;

  cublasLtHandle_t handle_ = nullptr;
  bool scaled_modes_ = false;  // per-row and block scales run here (fp8_block_scaling_supported)
  std::string description_;    // the device and its cuBLASLt, for refusals
  void* workspace_ = nullptr;
  float* amax_ = nullptr;  // cuBLASLt's amax of an FP8 output, folded into the state afterwards
  std::map<Key, Plan> plans_;
};

}  // namespace fp8
