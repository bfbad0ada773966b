// The work items the backends execute. Plain structs of pointers and sizes, shared by the API
// layer, the CPU reference and the CUDA launchers; every pointer is device memory of the backend.
// Every scale travels as a ScaleDesc (core/scale_desc.hpp); the backends implement per-tensor
// scales only and refuse the other modes (FP8_ERR_UNSUPPORTED).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/dtype.hpp"
#include "core/optim_rule.hpp"
#include "core/scale_desc.hpp"
#include "core/scaling_rule.hpp"
#include "fp8.h"

namespace fp8 {

// Column sums (the bias gradient) are reduced in two deterministic stages: one partial sum per
// kBiasGradRows rows and column, then the partials of each column in order. A caller provides
// bias_grad_partials(rows, cols) floats of device memory for the first stage.
constexpr int64_t kBiasGradRows = 128;
inline int64_t bias_grad_partials(int64_t rows, int64_t cols) {
  return (rows + kBiasGradRows - 1) / kBiasGradRows * cols;
}

// out[r][c] = encode(in[r][c] * state.scale); out_t[c][r] = the same code (when out_t != nullptr);
// state history slot 0 = max(slot 0, amax(in)); out_scale_inv / out_t_scale_inv = state.scale_inv.
// With dbias: dbias[c] += sum_r in[r][c] as well (the Linear's bias gradient from the dy pass).
struct QuantizeJob {
  const void* in;
  fp8_dtype_t in_dtype;  // F32, F16 or BF16
  int64_t rows, cols;    // the input viewed as a row-major matrix
  uint8_t* out;
  uint8_t* out_t;  // [cols][rows], or nullptr (also when out_t is requested but empty)
  bool e5m2;
  ScalingHeader* state;
  ScaleDesc out_scale_inv;
  ScaleDesc out_t_scale_inv;        // ptr set exactly when a transposed copy is requested
  ScaleDesc out_scale = {};         // if ptr is set, receives state.scale (the scale the codes were made with)
  float* dbias = nullptr;           // cols floats, accumulated into; nullptr: no column sums
  float* dbias_partials = nullptr;  // bias_grad_partials(rows, cols) floats when dbias is set
  // Current scaling (fp8.h): history slot 0 of `state` is replaced by amax(in) and the scale made
  // from it (recipe_scale with current_fp8_max and current_pow2) is recorded in the state
  // (record_current_scale) before the cast uses it. false: the state's scale as it is.
  bool current = false;
  float current_fp8_max = 0.0f;
  bool current_pow2 = false;
  // An activation folded into the cast (core/activation.hpp), ReLU or GELU: with act_forward the
  // values cast are act(in) (its output handed to the Linear after it, x's cast); with act_x set
  // they are act_grad(act_x, in) (its backward, in the dy cast of the Linear before it; act_x is the
  // activation's input, in_dtype, [rows, cols]), also for the column sums. Only with a transposed
  // copy and without current scaling (require_tensor_scales refuses the rest).
  fp8_activation_t act = FP8_ACTIVATION_GELU;
  bool act_forward = false;
  const void* act_x = nullptr;
  bool folds_activation() const { return act_forward || act_x; }
};

// Fused amax + quantize under the scaling recipes' scale grids (core/recipe_scaling_rule.hpp).
// in: a row-major [rows, cols] matrix of F32, F16 or BF16 (widened exactly to float).
// out[r][c] = encode_fp8(in[r][c] * scale of (r, c)); out_scale_inv receives 1 / scale of every
// cell of its grid, whose mode is the recipe's mode (the grid and ld as core/scale_desc.hpp
// defines them for a [rows, cols] operand; check_scale_desc is applied).
// With out_t_scale_inv.ptr set: out_t ([cols][rows]) is the transposed copy, quantised along its
// own K from `in` (core/recipe_scaling_rule.hpp), with out_t_scale_inv's grid for a [cols, rows]
// operand of the same mode.
// nonfinite_cells, when set, is increased by the number of cells of out's grid whose amax is NaN or
// infinite (each such cell has scale 1).
struct RecipeQuantizeJob {
  const void* in;
  fp8_dtype_t in_dtype;  // F32, F16 or BF16
  int64_t rows, cols;
  bool e5m2;
  int32_t margin;    // 0..32: scale = fp8_max * 2^-margin / amax
  bool pow2_scales;  // round every scale down to a power of two
  uint8_t* out;
  ScaleDesc out_scale_inv;
  uint8_t* out_t = nullptr;
  ScaleDesc out_t_scale_inv = {};
  int64_t* nonfinite_cells = nullptr;  // host memory on the CPU backend, device memory on CUDA
  // CUDA only: recipe_quantize_workspace(mode, rows, cols) bytes of device memory for the amaxes
  // that span tiles (per-row and per-tensor modes); nullptr where that is 0.
  uint32_t* workspace = nullptr;
};

// Bytes of RecipeQuantizeJob::workspace the CUDA kernels need: the row and column amaxes of the
// per-row mode, the one amax of the per-tensor mode, none for the block modes (a tile holds their
// cells).
inline size_t recipe_quantize_workspace(ScaleMode mode, int64_t rows, int64_t cols) {
  if (mode == ScaleMode::kRow) return static_cast<size_t>(rows + cols) * sizeof(uint32_t);
  return mode == ScaleMode::kTensor ? sizeof(uint32_t) : 0;
}

// dbias[c] += sum_r dy[r][c] (two stages, see kBiasGradRows).
struct BiasGradJob {
  const void* dy;
  fp8_dtype_t dtype;  // F32, F16 or BF16
  int64_t rows, cols;
  float* dbias;
  float* partials;
};

// out[i] = convert(in[i]) between wide dtypes (round to nearest even).
struct ConvertJob {
  const void* in;
  fp8_dtype_t in_dtype;
  void* out;
  fp8_dtype_t out_dtype;
  int64_t n;
};

// out[c][r] = in[r][c] for FP8 codes; *out_scale_inv = *in_scale_inv (the transposed copy of an
// FP8 tensor that arrived already quantised).
struct TransposeJob {
  const uint8_t* in;
  int64_t rows, cols;
  uint8_t* out;
  ScaleDesc in_scale_inv;  // read only
  ScaleDesc out_scale_inv;
};

// out[i] = convert(decode(in[i]) * *scale_inv)
struct DequantizeJob {
  const uint8_t* in;
  bool e5m2;
  ScaleDesc scale_inv;  // read only
  void* out;
  fp8_dtype_t out_dtype;
  int64_t n;
};

// *out = amax(in); *accumulate = max(*accumulate, amax(in)) when accumulate != nullptr.
struct AmaxJob {
  const void* in;
  fp8_dtype_t dtype;
  int64_t n;
  float* out;
  float* accumulate;
};

// One state of a batched scaling update (the rule in core/scaling_rule.hpp).
struct ScalingUpdateItem {
  ScalingHeader* state;
  float fp8_max_scaled;  // fp8_max * 2^-margin for the state's format
};

struct ScalingUpdateJob {
  const ScalingUpdateItem* items;  // host array
  int32_t count;
  int32_t history_len;
  int64_t interval;
  bool algo_max;     // false: most_recent
  bool pow2_scales;  // the recipe's power_2_scales
};

// out = act(x), or dx = dy * act'(x) when backward; x is rows x cols; an FP8 out is
// encode(value * out_state.scale) with amax(value) max-accumulated into out_state's slot 0.
struct ActivationJob {
  fp8_activation_t act;
  bool backward;
  const void* x;
  const void* dy;  // backward only; x's dtype, the forward output's shape
  fp8_dtype_t x_dtype;
  int64_t rows, cols;
  void* out;
  fp8_dtype_t out_dtype;
  ScalingHeader* out_state;  // FP8 out only
  ScaleDesc out_scale_inv;   // FP8 out only
  // Backward into a wide dx: dx = convert(float(base[i]) + value), base of out's dtype and shape
  // (out itself to accumulate; another tensor for a residual's gradient); nullptr: dx = value.
  const void* base = nullptr;
};

// The largest d (cols) a norm backward takes, on every backend: the CUDA backend sums dgamma and
// dbeta through partial rows in its context's scratch, which holds two partial rows of both at this
// d. fp8_norm_backward refuses a larger x, fp8_model_add_layernorm / add_rmsnorm a larger dim.
constexpr int64_t kMaxNormBackwardDim = int64_t{1} << 20;
// Floats of that scratch.
constexpr size_t kNormScratchFloats = 4 * static_cast<size_t>(kMaxNormBackwardDim);

// Per row of x (rows x cols): LayerNorm (rms = false) or RMSNorm. Forward writes y (FP8 when
// y_state), mean (LayerNorm) and rstd when non-null. Backward writes dx, dgamma, dbeta (if non-null);
// cols <= kMaxNormBackwardDim.
struct NormJob {
  bool rms;
  bool backward;
  const void* x;
  fp8_dtype_t x_dtype;
  int64_t rows, cols;
  const float* gamma;
  const float* beta;  // forward, may be nullptr
  float eps;
  void* y;            // forward
  fp8_dtype_t y_dtype;
  ScalingHeader* y_state;  // FP8 y only
  ScaleDesc y_scale_inv;   // FP8 y only
  float* mean;             // forward: written if non-null; backward: read (LayerNorm)
  float* rstd;             // forward: written if non-null; backward: read
  const void* dy;          // backward
  fp8_dtype_t dy_dtype;
  void* dx;
  fp8_dtype_t dx_dtype;
  float* dgamma;
  float* dbeta;  // may be nullptr
  bool accumulate_params = false;  // backward: dgamma/dbeta += (gradient accumulation) instead of =
  // Backward: dx = convert(float(dx_base[i]) + value), dx_base of dx's dtype and shape (dx itself to
  // accumulate; another tensor for a residual's gradient); nullptr: dx = value.
  const void* dx_base = nullptr;
};

// d[m][n] = alpha * sa * sb * sum_k a[m][k] * b[n][k] (+ bias[n]) (+ c if accumulate); an FP8 d
// is encode(value * d_state.scale) with amax(value) max-accumulated into d_state's slot 0.
// a_transposed / b_transposed: the operand is stored [k][m] / [k][n] instead (wide operands only;
// FP8 tensor cores take the K-major "TN" layout alone).
struct GemmJob {
  const void* a;
  const void* b;
  fp8_dtype_t a_dtype, b_dtype;  // both FP8, or both the same wide dtype
  bool a_transposed = false, b_transposed = false;
  ScaleDesc a_scale_inv;  // FP8 operands (read only): device scalars, 16-byte aligned (cuBLASLt
                          // refuses others at run time); ptr nullptr for wide operands
  ScaleDesc b_scale_inv;
  int64_t m, n, k;
  const void* bias;  // nullptr or n elements of bias_dtype
  fp8_dtype_t bias_dtype;
  void* d;
  fp8_dtype_t d_dtype;
  ScalingHeader* d_state;  // FP8 d only
  ScaleDesc d_scale_inv;   // FP8 d only: receives d_state.scale_inv
  float alpha;
  bool accumulate;
  bool fast_accumulation;
  const void* c = nullptr;  // with accumulate (wide d only): d's dtype and layout; nullptr: d itself
  const void* addend() const { return c ? c : d; }  // what accumulate adds: C
};

// Adds `add` (n elements of add_dtype, F32 or BF16) into an FP8 gradient in one requantising pass
// (core/optim_rule.hpp, grad_sum_*): scales->add_amax = amax(add); codes = encode((decode(codes) *
// scale_inv + add) * grad_sum_scale), or encode(add * grad_sum_scale) onto zeros; then
// grad_sum_finish. With codes == nullptr: f32[i] += add[i] (an FP32 gradient).
struct GradAccumulateJob {
  uint8_t* codes;
  bool e5m2;
  const void* add;
  int64_t n;
  GradScales* scales;
  float* f32 = nullptr;
  fp8_dtype_t add_dtype = FP8_DTYPE_F32;
};

// One optimizer step over every chunk of every tensor (core/optim_rule.hpp): the squared norm in
// its fixed order (per-chunk partials, then their sum), finish_step into *scalars, then the
// element updates unless scalars->skip (compact tensors: finish_compact before, promote_compact after).
// tensors and chunks are device memory, built once.
struct OptimizerStepJob {
  const OptimTensor* tensors;
  int64_t tensor_count;
  const OptimChunk* chunks;
  int64_t chunk_count;
  double* partials;  // chunk_count doubles
  OptimScalars* scalars;
  const OptimHyper* hyper;  // device memory: read by the step itself (settable between graph replays)
  OptimElementArgs* args;   // device memory: element_args(*hyper), written by the step's finish
  // fp8_optimizer_step_joint: the squared norm of gradients outside the model, added to the model's
  // (one float in device memory), and where the clip factor of that joint norm goes (nullptr: none).
  const float* other_sumsq = nullptr;
  float* clip_out = nullptr;
};

// FP8 gradient exchange at the receiver (core/exchange_rule.hpp), over a slice of this rank's shard
// of the FP8 gradient arena: every sender's codes of the slice with every sender's per-tensor scales.
// Chunk offsets are element offsets in the slice. One pass:
//   with `scales` (a bucket's first slice): bounds[t] = exchange_bound(t) and
//     exchange_finish(scales[t], bounds[t]) for every tensor t, first (each rank sets all alike);
//   codes[i] = encode(exchange_mean(i) * fp8_scale_for_bound(bounds[tensor])).
// The peer exchange (dist::PeerWindows) reads the senders' codes where they are: with `peer_codes`,
// sender k's code of slice element i is peer_codes[k][peer_at + i] (pieces and piece_bytes unused),
// and with `peer_outputs` the encoded mean goes to peer_outputs[k][peer_at + i] for every rank k
// instead of to codes[i]. Both are tables of nranks pointers in the backend's memory.
struct GradExchangeJob {
  const uint8_t* pieces;  // nranks pieces of piece_bytes: sender k's codes of this slice at k * piece_bytes
  int32_t nranks;
  int64_t piece_bytes;
  const GradScales* sender_scales;  // [nranks][tensor_count]: every sender's scales, in rank order
  int32_t tensor_count;
  const OptimChunk* chunks;  // device memory
  int64_t chunk_count;
  bool e5m2;
  float* bounds;       // tensor_count: written with `scales`, read by every slice of the bucket
  uint8_t* codes;      // this rank's codes of the slice
  GradScales* scales;  // tensor_count, or nullptr: the bucket's bounds are already in `bounds`
  const uint8_t* const* peer_codes = nullptr;
  uint8_t* const* peer_outputs = nullptr;
  int64_t peer_at = 0;
  int32_t peer_alignment = 1;               // a power of two dividing every pointer of both tables
  const uint32_t* peer_poisoned = nullptr;  // (PeerWindows::poisoned) nonzero: do nothing
};

// The peer exchange's scales (a bucket's, before its codes): every sender's scales of tensors
// [first, first + tensor_count), read from each rank's own scale array (peer_scales: a table of
// nranks pointers in the backend's memory), into senders[k * tensor_count + t], and
// bounds[t] = exchange_bound(t).
struct PeerScalesJob {
  const GradScales* const* peer_scales;
  int32_t nranks;
  int64_t first;
  int32_t tensor_count;
  GradScales* senders;
  float* bounds;
  const uint32_t* poisoned;  // (PeerWindows::poisoned) nonzero: do nothing
};

// x[i] = x[i] / divisor (round to nearest): the mean of an FP32 gradient sum over the ranks.
struct DivideJob {
  float* x;
  int64_t n;
  float divisor;
};

// The one place where a backend refuses the scale modes it does not run yet (all but per-tensor),
// before any work: each operation that takes scales calls its job's overload first. `backend`
// ("CPU", "CUDA") goes into the message.
inline void require_tensor_scales(const QuantizeJob& j, const char* backend) {
  if (j.folds_activation() &&
      (j.act_forward == (j.act_x != nullptr) || !j.out_t_scale_inv.ptr || j.current ||
       (j.act != FP8_ACTIVATION_RELU && j.act != FP8_ACTIVATION_GELU) || (j.act_forward && (j.e5m2 || j.dbias))))
    fail(FP8_ERR_INTERNAL, backend, " quantize: an activation folds only into a delayed-scaling cast with a ",
         "transposed copy, for ReLU or GELU, forward (E4M3, no column sums) or backward");
  require_tensor_scale(j.out_scale_inv, "quantize's out_scale_inv", backend);
  require_tensor_scale(j.out_t_scale_inv, "quantize's out_t_scale_inv", backend);
  require_tensor_scale(j.out_scale, "quantize's out_scale", backend);
}
inline void require_tensor_scales(const TransposeJob& j, const char* backend) {
  require_tensor_scale(j.in_scale_inv, "transpose's in_scale_inv", backend);
  require_tensor_scale(j.out_scale_inv, "transpose's out_scale_inv", backend);
}
inline void require_tensor_scales(const DequantizeJob& j, const char* backend) {
  require_tensor_scale(j.scale_inv, "dequantize's scale_inv", backend);
}
inline void require_tensor_scales(const ActivationJob& j, const char* backend) {
  require_tensor_scale(j.out_scale_inv, "activation's out_scale_inv", backend);
}
inline void require_tensor_scales(const NormJob& j, const char* backend) {
  require_tensor_scale(j.y_scale_inv, "norm's y_scale_inv", backend);
}
// A GEMM operand's grid of scales as cuBLASLt reads it (cublaslt_gemm.cpp), for an operand of
// [rows, k] scaled along K in `mode`, at p: per-row one float per row; 1x128 column-major with
// ld = rows; 128x128 row-major with ld = ceil(k / 128) rounded up to 4; per-tensor one float.
inline ScaleDesc gemm_grid(ScaleMode mode, int64_t rows, int64_t k, float* p) {
  const ScaleGrid g = scale_grid(mode, rows, k);
  ScaleDesc d{mode, p, g.rows, g.cols, 1, false};
  if (mode == ScaleMode::kBlock1x128) d.col_major = true, d.ld = rows > 0 ? rows : 1;
  if (mode == ScaleMode::kBlock128x128) d.ld = (std::max<int64_t>(g.cols, 1) + 3) / 4 * 4;
  return d;
}
// Floats that grid occupies (16-byte multiples, so grids can follow one another aligned).
inline size_t gemm_grid_floats(ScaleMode mode, int64_t rows, int64_t k) {
  const ScaleDesc d = gemm_grid(mode, rows, k, nullptr);
  const int64_t lines = std::max<int64_t>(d.col_major ? d.cols : d.rows, 1);
  return static_cast<size_t>((lines * d.ld + 3) / 4 * 4);
}

// The block modes, and whether a GEMM multiplies grids of modes a and b (the pairs listed below;
// check_gemm_scales and fp8_gemm_scaled both ask).
inline bool is_block_mode(ScaleMode m) {
  return m == ScaleMode::kBlock1x128 || m == ScaleMode::kBlock128x128;
}
inline bool gemm_scale_pair(ScaleMode a, ScaleMode b) {
  if (is_block_mode(a) && is_block_mode(b)) return !(a == ScaleMode::kBlock128x128 && b == ScaleMode::kBlock128x128);
  return a == b && (a == ScaleMode::kTensor || a == ScaleMode::kRow);
}

// The scale modes a GEMM takes, on both backends (each operand's grid is that of its [rows, k]
// operand scaled along K): per-tensor x per-tensor; per-row x per-row; 1x128 x 1x128, 1x128 x
// 128x128 and 128x128 x 1x128 (cuBLASLt has no 128x128 x 128x128 GEMM). The finer modes need FP8
// operands stored K-major (not transposed), a wide D (no FP8 output: its scale would need the
// whole D) and, for the block modes, no fast accumulation (cuBLASLt refuses it with block scales).
inline void check_gemm_scales(const GemmJob& j, const char* backend) {
  require_tensor_scale(j.d_scale_inv, "gemm's d_scale_inv", backend);
  const ScaleMode a = j.a_scale_inv.mode, b = j.b_scale_inv.mode;
  if (a == ScaleMode::kTensor && b == ScaleMode::kTensor) return;
  const bool blocks = is_block_mode(a) && is_block_mode(b);
  if (!gemm_scale_pair(a, b) && !blocks)
    fail(FP8_ERR_UNSUPPORTED, "gemm: a has ", scale_mode_name(a), " scales and b ", scale_mode_name(b),
         "; the pairs are per-tensor x per-tensor, per-row x per-row, and 1x128 or 128x128 with 1x128 or 128x128");
  if (a == ScaleMode::kBlock128x128 && b == ScaleMode::kBlock128x128)
    fail(FP8_ERR_UNSUPPORTED, "gemm: both operands have 128x128-block scales, which cuBLASLt does not multiply; "
         "quantise one of them (the activation or gradient) in 1x128 blocks");
  if (!dtype_is_fp8(j.a_dtype) || !dtype_is_fp8(j.b_dtype))
    fail(FP8_ERR_DTYPE, "gemm: ", scale_mode_name(a), " scales need FP8 operands, not ", dtype_name(j.a_dtype), " x ",
         dtype_name(j.b_dtype));
  if (j.a_transposed || j.b_transposed)
    fail(FP8_ERR_INVALID_ARGUMENT, "gemm: operands with ", scale_mode_name(a), " scales must be stored K-major (not "
         "transposed)");
  if (dtype_is_fp8(j.d_dtype))
    fail(FP8_ERR_UNSUPPORTED, "gemm: an FP8 D takes per-tensor-scaled operands only, not ", scale_mode_name(a), " x ",
         scale_mode_name(b), "; write D in bf16 or f32");
  if (blocks && j.fast_accumulation)
    fail(FP8_ERR_INVALID_ARGUMENT, "gemm: fast accumulation with block scales (cuBLASLt accumulates those GEMMs in "
         "full precision only)");
  check_scale_desc(j.a_scale_inv, j.m, j.k, "gemm's a_scale_inv");
  check_scale_desc(j.b_scale_inv, j.n, j.k, "gemm's b_scale_inv");
  if (j.m * j.k > 0) require_arg(j.a_scale_inv.ptr, "a_scale_inv.ptr");
  if (j.n * j.k > 0) require_arg(j.b_scale_inv.ptr, "b_scale_inv.ptr");
}

}  // namespace fp8
