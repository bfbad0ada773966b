// Scale descriptors: how a work item (backend/jobs.hpp) finds the scales of an FP8 operand.
//
// Today every FP8 tensor has one scale (per-tensor scaling, ScaleMode::kTensor): a single float in
// device memory. The descriptor also names the finer modes of the scaling recipes, so that they
// change the kernels and not every signature; until they are implemented, both backends refuse
// any other mode with FP8_ERR_UNSUPPORTED (require_tensor_scale, called in one place per backend).
//
// The grid of scales of an operand viewed as a row-major [rows, cols] matrix, scaled along its
// columns (K, the reduced dimension of a GEMM operand stored K-major):
//   kTensor        one scale for the whole operand:              [1, 1]
//   kRow           one scale per row:                            [rows, 1]
//   kBlock1x128    one scale per 1x128 block of a row:           [rows, ceil(cols / 128)]
//   kBlock128x128  one scale per 128x128 block:                  [ceil(rows / 128), ceil(cols / 128)]
// (scale_grid() is this rule.) The grid is row-major (the scale of grid cell (i, j) at
// ptr[i * ld + j], ld >= the grid's columns) or, with col_major, column-major (at ptr[j * ld + i],
// ld >= the grid's rows). cuBLASLt reads 1x128 scales column-major (the rows' scales of one K block
// contiguous, ld = the operand's rows) and 128x128 scales row-major with ld a multiple of 4.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/error.hpp"
#include "core/format.hpp"  // (FP8_HD)

namespace fp8 {

enum class ScaleMode : int32_t { kTensor = 0, kRow = 1, kBlock1x128 = 2, kBlock128x128 = 3 };

// The side of a scaling block, along K for kBlock1x128 and along both dimensions for kBlock128x128.
constexpr int64_t kScaleBlock = 128;

inline const char* scale_mode_name(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::kTensor:
      return "per-tensor";
    case ScaleMode::kRow:
      return "per-row";
    case ScaleMode::kBlock1x128:
      return "1x128-block";
    case ScaleMode::kBlock128x128:
      return "128x128-block";
  }
  return "unknown";
}

// The shape of a grid of scales.
struct ScaleGrid {
  int64_t rows, cols;
};

// The grid `mode` implies for an operand of [rows, cols] scaled along its columns (the rule above).
// An empty operand has an empty grid, except per-tensor, which always has its one scale.
constexpr ScaleGrid scale_grid(ScaleMode mode, int64_t rows, int64_t cols) {
  const auto blocks = [](int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; };
  switch (mode) {
    case ScaleMode::kRow:
      return {rows, 1};
    case ScaleMode::kBlock1x128:
      return {rows, blocks(cols)};
    case ScaleMode::kBlock128x128:
      return {blocks(rows), blocks(cols)};
    default:
      return {1, 1};
  }
}

// Where the dequantisation scales (scale_inv: value = code * scale_inv) of one FP8 operand are, or
// the scales its codes were made with (QuantizeJob::out_scale). ptr is device memory of the
// backend; it may be nullptr where the job says a scale is absent (a wide operand). A descriptor
// of an input (a GemmJob's a_scale_inv, say) is only read, whatever the constness of ptr.
struct ScaleDesc {
  ScaleMode mode = ScaleMode::kTensor;
  float* ptr = nullptr;
  int64_t rows = 1, cols = 1;  // grid of scales
  int64_t ld = 1;              // leading dimension of the grid, in floats
  bool col_major = false;      // cell (i, j) at ptr[j * ld + i] instead of ptr[i * ld + j]

  bool is_tensor() const { return mode == ScaleMode::kTensor; }
  // Offset of grid cell (i, j) from ptr, in floats.
  FP8_HD int64_t at(int64_t i, int64_t j) const { return col_major ? j * ld + i : i * ld + j; }
};

// One scale for the whole tensor at p (nullptr: none).
inline ScaleDesc tensor_scale(float* p) {
  return {ScaleMode::kTensor, p, 1, 1, 1, false};
}
// The same for a scale that the job only reads.
inline ScaleDesc tensor_scale(const float* p) {
  return tensor_scale(const_cast<float*>(p));
}

// Throws FP8_ERR_SHAPE naming `what` unless d's grid is the one its mode implies for a [rows, cols]
// operand scaled along its columns and ld covers a grid row; FP8_ERR_INVALID_ARGUMENT for a mode
// outside the enum.
inline void check_scale_desc(const ScaleDesc& d, int64_t rows, int64_t cols, const char* what) {
  switch (d.mode) {
    case ScaleMode::kTensor:
    case ScaleMode::kRow:
    case ScaleMode::kBlock1x128:
    case ScaleMode::kBlock128x128:
      break;
    default:
      fail(FP8_ERR_INVALID_ARGUMENT, what, " has scale mode ", static_cast<int32_t>(d.mode), ", not a ScaleMode");
  }
  const ScaleGrid want = scale_grid(d.mode, rows, cols);
  const int64_t min_ld = std::max<int64_t>(d.col_major ? want.rows : want.cols, 1);
  if (d.rows != want.rows || d.cols != want.cols || d.ld < min_ld)
    fail(FP8_ERR_SHAPE, what, " has a ", scale_mode_name(d.mode), d.col_major ? " column-major" : "", " scale grid of [",
         d.rows, ", ", d.cols, "] (ld ", d.ld, "); a [", rows, ", ", cols, "] operand needs [", want.rows, ", ",
         want.cols, "] (ld >= ", min_ld, ")");
}

// Throws FP8_ERR_UNSUPPORTED naming `what` and d's mode unless d is per-tensor: the only mode the
// backends implement so far. Each backend calls it where it takes a job, before any work.
inline void require_tensor_scale(const ScaleDesc& d, const char* what, const char* backend = nullptr) {
  if (!d.is_tensor())
    fail(FP8_ERR_UNSUPPORTED, what, backend ? " (" : "", backend ? backend : "", backend ? " backend)" : "", " has ",
         scale_mode_name(d.mode), " scales (mode ", static_cast<int32_t>(d.mode), "); only per-tensor scales are implemented");
}

}  // namespace fp8
