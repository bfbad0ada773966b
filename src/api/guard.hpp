// What every extern "C" entry point shares: the exception-to-status guard and the checks that
// relate handles to each other. Messages name the function, the argument and what was expected.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"

namespace fp8 {

// Sets the per-thread message "fn: what", falling back to a static one if even that allocation fails.
inline void report(const char* fn, const char* what) noexcept {
  try {
    set_last_error(std::string(fn) + ": " + what);
  } catch (...) {
    set_last_error_static("out of host memory while reporting an error");
  }
}

// Runs `body`; turns any exception into a status and the per-thread message.
template <typename F>
fp8_status_t guard(const char* fn, F&& body) noexcept {
  try {
    body();
    return FP8_OK;
  } catch (const Error& e) {
    report(fn, e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    report(fn, "out of host memory");
    return FP8_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    report(fn, (std::string("internal error: ") + e.what()).c_str());
    return FP8_ERR_INTERNAL;
  } catch (...) {
    report(fn, "internal error (unknown exception)");
    return FP8_ERR_INTERNAL;
  }
}

// An int32_t flag of the API (`name` as the caller wrote it: "on", "options->linear"): 0 or 1.
inline void require_flag(int32_t v, const char* name) {
  if (v != 0 && v != 1) fail(FP8_ERR_INVALID_ARGUMENT, name, " = ", v, "; expected 0 or 1");
}

// The tensor or state `name` must have been made from `ctx`.
template <typename Obj>
void require_same_context(const fp8_context* ctx, const Obj* obj, const char* name) {
  if (obj->backend != ctx->backend)
    fail(FP8_ERR_INVALID_ARGUMENT, name, " belongs to another context (device ", obj->backend->device(),
         "); expected one made from ctx (device ", ctx->backend->device(), ")");
}

// The tensor `name` (not NULL) must belong to the context of `model` (an fp8_model).
template <typename Model>
void require_tensor(const Model* model, const fp8_tensor* t, const char* name) {
  require_arg(t, name);
  if (t->backend != model->backend)
    fail(FP8_ERR_INVALID_ARGUMENT, name, " belongs to another context (device ", t->backend->device(),
         "); expected one of the model's (device ", model->backend->device(), ")");
}

inline void require_wide(const fp8_tensor* t, const char* name) {
  if (!dtype_is_wide(t->dtype))
    fail(FP8_ERR_DTYPE, name, " has dtype ", dtype_name(t->dtype), "; expected f32, f16 or bf16");
}

inline void require_fp8(const fp8_tensor* t, const char* name) {
  if (!dtype_is_fp8(t->dtype)) fail(FP8_ERR_DTYPE, name, " has dtype ", dtype_name(t->dtype), "; expected e4m3 or e5m2");
}

inline void require_same_shape(const fp8_tensor* t, const char* name, const fp8_tensor* like, const char* like_name) {
  bool same = t->ndim == like->ndim;
  for (int32_t i = 0; same && i < t->ndim; ++i) same = t->shape[i] == like->shape[i];
  if (!same)
    fail(FP8_ERR_SHAPE, name, " has shape ", shape_string(t->ndim, t->shape), ", expected ",
         shape_string(like->ndim, like->shape), " like ", like_name);
}

// Two tensors whose bytes overlap cannot be input and output of one call.
inline bool overlap(const fp8_tensor* a, const fp8_tensor* b) {
  const char* pa = static_cast<const char*>(a->data);
  const char* pb = static_cast<const char*>(b->data);
  return a->nbytes() && b->nbytes() && pa < pb + b->nbytes() && pb < pa + a->nbytes();
}
inline void require_disjoint(const fp8_tensor* a, const char* a_name, const fp8_tensor* b, const char* b_name) {
  if (overlap(a, b))
    fail(FP8_ERR_INVALID_ARGUMENT, a_name, " and ", b_name, " overlap in memory; expected separate buffers");
}

// An output `name` of a call on `model` (an fp8_model) must not be the model's own memory: writing
// into a parameter's value or gradient (tensors fp8_model_parameter lends out) would overwrite the
// weights. (The layers' parameters walked in place: the per-layer calls are on the hot path.)
template <typename Model>
void require_not_parameter(const Model* model, const fp8_tensor* out, const char* name) {
  for (const auto& layer : model->layers)
    for (const auto& p : layer->parameters())
      for (const auto& [t, what] :
           {std::pair<const fp8_tensor*, const char*>{p.value.get(), "value"}, {p.grad.get(), "gradient"}})
        if (t && overlap(out, t))
          fail(FP8_ERR_INVALID_ARGUMENT, name, " overlaps the ", what, " of the model's parameter '", p.name,
               "'; expected a buffer of the caller's");
}

// An output that may be FP8: an FP8 `out` needs a scaling state of its dtype, any other must come
// without one. Returns whether `out` is FP8.
inline bool require_output_scaling(const fp8_tensor* out, const char* out_name, const fp8_scaling* scaling,
                                   const char* scaling_name) {
  if (dtype_is_fp8(out->dtype)) {
    if (!scaling) fail(FP8_ERR_INVALID_ARGUMENT, "argument '", scaling_name, "' is NULL; an FP8 ", out_name, " needs one");
    if (scaling->dtype != out->dtype)
      fail(FP8_ERR_DTYPE, out_name, " has dtype ", dtype_name(out->dtype), " but ", scaling_name, " quantizes to ",
           dtype_name(scaling->dtype));
    if (scaling->current)
      fail(FP8_ERR_UNSUPPORTED, scaling_name, " scales with current scaling, which needs the amax of ", out_name,
           " before its cast; give a state made with scaling=delayed, or write ", out_name,
           " in high precision and fp8_quantize it");
    return true;
  }
  if (scaling)
    fail(FP8_ERR_INVALID_ARGUMENT, scaling_name, " is given but ", out_name, " has dtype ", dtype_name(out->dtype),
         "; expected NULL (only an FP8 output is scaled)");
  return false;
}

// Copies `text` and its NUL into the caller's buffer of `cap` bytes; *needed (if given) = its size,
// also when the buffer is too small (the one out-parameter a refusal sets, so the caller can retry).
inline void write_text(const std::string& text, char* buf, size_t cap, size_t* needed) {
  const size_t size = text.size() + 1;
  if (cap < size) {
    if (needed) *needed = size;
    fail(FP8_ERR_BUFFER_TOO_SMALL, "cap = ", cap, " bytes; the text needs ", size, " (see *needed)");
  }
  require_arg(buf, "buf");
  if (needed) *needed = size;
  std::memcpy(buf, text.c_str(), size);
}

// ---- Versioned structs (the rule is in fp8.h's conventions) --------------------------------------
// Each begins with uint32_t struct_size, the size the caller compiled against; releases only append
// fields. The size of each struct's first release, named by its last field: the smallest struct_size
// a call accepts. These never change (tests/headertest pins the layouts).
constexpr size_t kDeviceInfoV1Size = offsetof(fp8_device_info_t, cublaslt_version) + sizeof(int64_t);
constexpr size_t kScalingInfoV1Size = offsetof(fp8_scaling_info_t, nonfinite_count) + sizeof(int64_t);
constexpr size_t kGemmOptionsV1Size = offsetof(fp8_gemm_options_t, fast_accumulation) + sizeof(int32_t);
constexpr size_t kConvertOptionsV1Size = offsetof(fp8_convert_options_t, activation) + sizeof(int32_t);
constexpr size_t kLayerReportV1Size = offsetof(fp8_layer_report_t, reason) + sizeof(char[200]);
constexpr size_t kOptimizerStatsV1Size = offsetof(fp8_optimizer_stats_t, state_bytes) + sizeof(int64_t);

// The caller's struct_size must cover at least the struct's first release, `v1_size`.
template <typename T>
void require_struct_size(const T* s, size_t v1_size, const char* name, const char* init_fn) {
  if (s->struct_size < v1_size)
    fail(FP8_ERR_INVALID_ARGUMENT, name, "->struct_size = ", s->struct_size, "; expected at least ", v1_size,
         " (call ", init_fn, " first)");
}

// Versioned out-structs (fp8_device_info_t, ...): after require_struct_size, the result is copied up
// to the caller's size (at most sizeof(T)), keeping struct_size, so a program built against an
// older, shorter struct keeps working and the bytes of a newer, longer one past sizeof(T) stay as
// they were.
template <typename T>
void write_versioned(T* dst, T full) {
  full.struct_size = dst->struct_size;
  std::memcpy(dst, &full, dst->struct_size < sizeof(T) ? dst->struct_size : sizeof(T));
}

// Versioned in-structs (fp8_gemm_options_t, fp8_convert_options_t): `opts` holds the defaults; the
// caller's struct is copied over them up to min(struct_size, sizeof(T)), so the fields an older
// caller lacks keep their defaults. Bytes past sizeof(T) are fields of a newer release this build
// does not know: accepted only if zero, else FP8_ERR_UNSUPPORTED naming the first nonzero offset.
// Nothing is read before every check has passed.
template <typename T>
void read_versioned(T& opts, const T* s, size_t v1_size, const char* name, const char* init_fn) {
  require_struct_size(s, v1_size, name, init_fn);
  const size_t size = s->struct_size;
  // No release will grow a struct this far: such a size is an uninitialised struct, whose "newer
  // fields" would send the check below through memory that is not the caller's.
  constexpr size_t kMaxStructSize = 4096;
  if (size > kMaxStructSize)
    fail(FP8_ERR_INVALID_ARGUMENT, name, "->struct_size = ", size, "; expected at most ", kMaxStructSize, " (call ",
         init_fn, " first)");
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(s);
  for (size_t i = sizeof(T); i < size; ++i)
    if (bytes[i] != 0)
      fail(FP8_ERR_UNSUPPORTED, name, "->struct_size = ", size, " but the byte at offset ", i,
           " is nonzero: a field newer than this libfp8, which knows the first ", sizeof(T),
           " bytes; expected every byte from offset ", sizeof(T), " on to be 0");
  std::memcpy(&opts, s, size < sizeof(T) ? size : sizeof(T));
  opts.struct_size = static_cast<uint32_t>(sizeof(T));
}

// An fp8_scale_mode_t as the backends' ScaleMode; FP8_ERR_INVALID_ARGUMENT naming `name` otherwise.
inline ScaleMode scale_mode_of(fp8_scale_mode_t mode, const char* name) {
  switch (mode) {
    case FP8_SCALE_MODE_ROW: return ScaleMode::kRow;
    case FP8_SCALE_MODE_BLOCK_1X128: return ScaleMode::kBlock1x128;
    case FP8_SCALE_MODE_BLOCK_128X128: return ScaleMode::kBlock128x128;
    default:
      fail(FP8_ERR_INVALID_ARGUMENT, name, " = ", mode, "; expected FP8_SCALE_MODE_ROW (1), FP8_SCALE_MODE_BLOCK_1X128 (2) "
           "or FP8_SCALE_MODE_BLOCK_128X128 (3)");
  }
}

// The shape of the F32 tensor that holds the grid of an operand of [rows, cols] in `mode`, laid out
// as gemm_grid (backend/jobs.hpp) reads it (fp8.h, "Scale grids").
inline void grid_tensor_shape(ScaleMode mode, int64_t rows, int64_t cols, int64_t shape[2]) {
  const ScaleDesc d = gemm_grid(mode, rows, cols, nullptr);
  if (mode == ScaleMode::kBlock1x128) {
    shape[0] = d.cols, shape[1] = rows;  // column-major: a row of the tensor per block of K
  } else {
    shape[0] = d.rows, shape[1] = d.cols == 0 ? 0 : d.ld;
  }
}

// Checks that `grid` is a 2-D F32 tensor of the shape an operand of [rows, cols] has in `mode`
// (naming `name`, `operand` and the expected shape), and returns its descriptor.
inline ScaleDesc require_grid(const fp8_tensor* grid, const char* name, ScaleMode mode, int64_t rows, int64_t cols,
                              const char* operand) {
  int64_t want[2];
  grid_tensor_shape(mode, rows, cols, want);
  if (grid->dtype != FP8_DTYPE_F32)
    fail(FP8_ERR_DTYPE, name, " has dtype ", dtype_name(grid->dtype), "; scale grids are f32");
  if (grid->ndim != 2 || grid->shape[0] != want[0] || grid->shape[1] != want[1])
    fail(FP8_ERR_SHAPE, name, " has shape ", shape_string(grid->ndim, grid->shape), ", expected ", shape_string(2, want),
         " (the ", scale_mode_name(mode), " grid of ", operand, ", [", rows, ", ", cols, "]: fp8_scale_grid_shape)");
  return gemm_grid(mode, rows, cols, static_cast<float*>(grid->data));
}

}  // namespace fp8
