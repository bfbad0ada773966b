#include "backend/cublaslt_gemm.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "backend/device_info.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "kernels/launch.hpp"

namespace fp8 {

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // what cuBLAS recommends for Hopper

void check(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  fail(st == CUBLAS_STATUS_NOT_SUPPORTED ? FP8_ERR_UNSUPPORTED : FP8_ERR_CUBLAS, what, " failed: ",
       cublasLtGetStatusName(st), " (", cublasLtGetStatusString(st), ")");
}

cudaDataType_t cuda_type(fp8_dtype_t dt) {
  switch (dt) {
    case FP8_DTYPE_F32: return CUDA_R_32F;
    case FP8_DTYPE_F16: return CUDA_R_16F;
    case FP8_DTYPE_BF16: return CUDA_R_16BF;
    case FP8_DTYPE_E4M3: return CUDA_R_8F_E4M3;
    default: return CUDA_R_8F_E5M2;
  }
}

// The largest power of two up to 256 that divides the address (cuBLASLt assumes 256 unless told).
uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// cuBLASLt's scale mode (cublasLtMatmulMatrixScale_t) for an operand scaled in `mode`.
int32_t cublaslt_scale_mode(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::kRow: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;  // one float per row
    case ScaleMode::kBlock1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::kBlock128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

// Throws FP8_ERR_INVALID_ARGUMENT naming `what` unless the grid of an operand of `rows` rows is laid
// out as cuBLASLt reads it (cuBLAS docs, "Scaling factors layouts"; there is no leading-dimension
// attribute, so the layout is implied by the shape):
//   per-row   one contiguous float per row (ld 1, or column-major);
//   1x128     column-major, ld = rows: the rows' scales of one K block side by side;
//   128x128   row-major, ld = ceil(k / 128) rounded up to a multiple of 4;
// and the grid 16-byte aligned.
void require_cublaslt_grid(const ScaleDesc& d, int64_t rows, int64_t k, const char* what) {
  const int64_t k_blocks = (k + kScaleBlock - 1) / kScaleBlock, padded = (k_blocks + 3) / 4 * 4;
  bool ok = true;
  const char* want = "";
  switch (d.mode) {
    case ScaleMode::kRow:
      ok = d.col_major || d.ld == 1;
      want = "one contiguous float per row";
      break;
    case ScaleMode::kBlock1x128:
      ok = d.col_major && d.ld == rows;
      want = "column-major with ld = the operand's rows";
      break;
    case ScaleMode::kBlock128x128:
      ok = !d.col_major && d.ld == padded;
      want = "row-major with ld = ceil(k / 128) rounded up to a multiple of 4";
      break;
    default:
      return;
  }
  if (!ok)
    fail(FP8_ERR_INVALID_ARGUMENT, what, " is laid out ", d.col_major ? "column-major" : "row-major", " with ld ", d.ld,
         "; cuBLASLt reads ", scale_mode_name(d.mode), " scales ", want, " (here ",
         d.mode == ScaleMode::kBlock128x128 ? padded : rows, ")");
  if (reinterpret_cast<uintptr_t>(d.ptr) % 16 != 0)
    fail(FP8_ERR_INVALID_ARGUMENT, what, " is not 16-byte aligned, which cuBLASLt needs for scale grids");
}

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  check(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof value), "cublasLtMatmulDescSetAttribute");
}

}  // namespace

CublasLtGemm::CublasLtGemm(int device) {
  // (the caller has made `device` current) What the device can run, as fp8_device_query says.
  fp8_device_info_t info{};
  query_device(device, &info);
  description_ = std::string(info.name) + " with cuBLASLt " + std::to_string(info.cublaslt_version);
  scaled_modes_ = info.fp8_block_scaling != 0;
  check(cublasLtCreate(&handle_), "cublasLtCreate");
  try {
    kernels::cuda_check(cudaMalloc(&workspace_, kWorkspaceBytes), "cudaMalloc of the GEMM workspace");
    kernels::cuda_check(cudaMalloc(reinterpret_cast<void**>(&amax_), sizeof(float)), "cudaMalloc of the GEMM amax");
  } catch (...) {
    cudaFree(workspace_);
    cublasLtDestroy(handle_);
    throw;
  }
}

CublasLtGemm::~CublasLtGemm() {
  for (auto& [key, plan] : plans_) destroy(plan);
  cudaFree(amax_);
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

void CublasLtGemm::destroy(Plan& p) noexcept {
  if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  for (auto* layout : {p.a, p.b, p.c, p.d})
    if (layout) cublasLtMatrixLayoutDestroy(layout);
}

// Row-major D[m][n] = A[m][k] * B[n][k]^T is, in cuBLASLt's column-major terms,
// D'(n x m) = B'(k x n)^T * A'(k x m): cuBLASLt's "A" is our B (transposed), its "B" is our A.
// A transposed operand (stored [k][m] or [k][n], wide types only) flips its op and its layout.
CublasLtGemm::Plan& CublasLtGemm::plan_for(const GemmJob& j) {
  // (C and D share one layout and one alignment bound in the plan)
  const uint32_t align_a = alignment(j.a), align_b = alignment(j.b),
                 align_d = std::min(alignment(j.d), alignment(j.accumulate ? j.addend() : j.d));
  const Key key(j.m, j.n, j.k, j.a_dtype, j.b_dtype, j.d_dtype, j.bias ? j.bias_dtype : -1, j.accumulate,
                j.fast_accumulation, j.a_transposed, j.b_transposed, align_a, align_b, align_d, j.a_scale_inv.mode,
                j.b_scale_inv.mode, j.d_scale_inv.mode);
  auto found = plans_.find(key);
  if (found != plans_.end()) return found->second;

  Plan p;
  try {
    const bool fp8_in = dtype_is_fp8(j.a_dtype);
    const bool fp8_out = dtype_is_fp8(j.d_dtype);
    check(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, j.b_transposed ? CUBLAS_OP_N : CUBLAS_OP_T);
    set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, j.a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N);
    if (fp8_in) set(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(j.fast_accumulation));
    if (j.bias) {
      set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
      set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(cuda_type(j.bias_dtype)));
    }
    const auto k = static_cast<uint64_t>(j.k), m = static_cast<uint64_t>(j.m), n = static_cast<uint64_t>(j.n);
    check(j.b_transposed ? cublasLtMatrixLayoutCreate(&p.a, cuda_type(j.b_dtype), n, k, j.n)
                         : cublasLtMatrixLayoutCreate(&p.a, cuda_type(j.b_dtype), k, n, j.k),
          "cublasLtMatrixLayoutCreate");
    check(j.a_transposed ? cublasLtMatrixLayoutCreate(&p.b, cuda_type(j.a_dtype), m, k, j.m)
                         : cublasLtMatrixLayoutCreate(&p.b, cuda_type(j.a_dtype), k, m, j.k),
          "cublasLtMatrixLayoutCreate");
    // C is only read when accumulating (beta = 1); an FP8 D takes a BF16 C, as cuBLASLt requires.
    const fp8_dtype_t c_dtype = fp8_out ? FP8_DTYPE_BF16 : j.d_dtype;
    check(cublasLtMatrixLayoutCreate(&p.c, cuda_type(c_dtype), static_cast<uint64_t>(j.n), static_cast<uint64_t>(j.m), j.n),
          "cublasLtMatrixLayoutCreate");
    check(cublasLtMatrixLayoutCreate(&p.d, cuda_type(j.d_dtype), static_cast<uint64_t>(j.n), static_cast<uint64_t>(j.m), j.n),
          "cublasLtMatrixLayoutCreate");
    if (fp8_out) {
      // The heuristic must see that scale and amax pointers will be set.
      set(p.desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(amax_));
      set(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(amax_));
    }
    if (fp8_in) {
      set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(amax_));
      set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(amax_));
      // Per-tensor is cuBLASLt's default mode: set only the others (cuBLASLt's "A" is our b).
      if (!j.b_scale_inv.is_tensor())
        set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, cublaslt_scale_mode(j.b_scale_inv.mode));
      if (!j.a_scale_inv.is_tensor())
        set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, cublaslt_scale_mode(j.a_scale_inv.mode));
    }

    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t ws = kWorkspaceBytes;
    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    // cuBLASLt's "A" is our b, its "B" our a; C is D (or absent).
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attr, value] : aligns)
      if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.d, pref, 1, &result, &found_count);
    cublasLtMatmulPreferenceDestroy(pref);
    check(st, "cublasLtMatmulAlgoGetHeuristic");
    if (found_count == 0)
      fail(FP8_ERR_UNSUPPORTED, "cuBLASLt has no kernel for ", dtype_name(j.a_dtype), " x ", dtype_name(j.b_dtype),
           " -> ", dtype_name(j.d_dtype), " at m=", j.m, " n=", j.n, " k=", j.k, " on this device");
    p.algo = result.algo;
  } catch (...) {
    destroy(p);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

void CublasLtGemm::run(const GemmJob& j, cudaStream_t stream) {
  if (!j.a_scale_inv.is_tensor()) {  // (check_gemm_scales allowed the pair)
    if (!scaled_modes_)
      fail(FP8_ERR_UNSUPPORTED, "gemm: ", scale_mode_name(j.a_scale_inv.mode), " x ", scale_mode_name(j.b_scale_inv.mode),
           " scales need cuBLASLt >= 12.9 on an sm_90 GPU (fp8_device_query's fp8_block_scaling); this is ",
           describe());
    require_cublaslt_grid(j.a_scale_inv, j.m, j.k, "gemm's a_scale_inv");
    require_cublaslt_grid(j.b_scale_inv, j.n, j.k, "gemm's b_scale_inv");
    // cuBLASLt's own limits for these modes (TransformerEngine's checks, and the docs' "M and N
    // must be multiples of 4"): K-major rows of 16 bytes, and 8-aligned m and n.
    if (j.k % 16 != 0 || j.m % 8 != 0 || j.n % 8 != 0)
      fail(FP8_ERR_SHAPE, "gemm: m=", j.m, " n=", j.n, " k=", j.k, " with ", scale_mode_name(j.a_scale_inv.mode),
           " scales; cuBLASLt needs k a multiple of 16 and m and n multiples of 8");
  }
  Plan& p = plan_for(j);
  const bool fp8_out = dtype_is_fp8(j.d_dtype);
  if (dtype_is_fp8(j.a_dtype)) {
    set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(j.b_scale_inv.ptr));
    set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(j.a_scale_inv.ptr));
  }
  if (fp8_out) {
    set(p.desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(&j.d_state->scale));
    set(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(amax_));
  }
  if (j.bias) set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, j.bias);
  const float alpha = j.alpha, beta = j.accumulate ? 1.0f : 0.0f;
  // An FP8 D is never accumulated into, and cuBLASLt wants no C then (C = D would need C's type).
  const void* c = fp8_out ? nullptr : j.accumulate ? j.addend() : j.d;
  const cublasStatus_t st = cublasLtMatmul(handle_, p.desc, &alpha, j.b, p.a, j.a, p.b, &beta, c, p.c, j.d, p.d,
                                           &p.algo, workspace_, kWorkspaceBytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    const std::string what = std::string("cublasLtMatmul (") + dtype_name(j.a_dtype) + (j.a_transposed ? "^T" : "") +
                             " x " + dtype_name(j.b_dtype) + (j.b_transposed ? "^T" : "") + " -> " +
                             dtype_name(j.d_dtype) + (j.accumulate ? " accumulated" : "") + ", m=" + std::to_string(j.m) +
                             " n=" + std::to_string(j.n) + " k=" + std::to_string(j.k) + ")";
    check(st, what.c_str());
  }
  if (fp8_out) kernels::gemm_fp8_output_epilogue(amax_, j.d_state, j.d_scale_inv.ptr, stream);
}

}  // namespace fp8
