/* The layout of every versioned struct of fp8.h on x86-64, pinned field by field: an offset or size
 * that changes breaks every program built against an earlier header (releases may only append
 * fields). Shared by headertest.c and headertest.cpp, so C and C++ compilers agree too.
 * fp8_check_layouts() prints each difference and returns the number found (0 elsewhere than on
 * x86-64, where the numbers below do not apply). */
#ifndef FP8_HEADERTEST_LAYOUT_H
#define FP8_HEADERTEST_LAYOUT_H

#include <stddef.h>
#include <stdio.h>

#include "fp8.h"

/* X(type, field, offset, size) for every field; S(type, sizeof) for every struct. */
#define FP8_VERSIONED_LAYOUTS(X, S)                  \
  X(fp8_device_info_t, struct_size, 0, 4)            \
  X(fp8_device_info_t, device, 4, 4)                 \
  X(fp8_device_info_t, name, 8, 256)                 \
  X(fp8_device_info_t, compute_capability, 264, 4)   \
  X(fp8_device_info_t, multiprocessor_count, 268, 4) \
  X(fp8_device_info_t, total_memory_bytes, 272, 8)   \
  X(fp8_device_info_t, fp8_gemm, 280, 4)             \
  X(fp8_device_info_t, fp8_block_scaling, 284, 4)    \
  X(fp8_device_info_t, fp8_nccl_reduction, 288, 4)   \
  X(fp8_device_info_t, nccl_version, 292, 4)         \
  X(fp8_device_info_t, cublaslt_version, 296, 8)     \
  S(fp8_device_info_t, 304)                          \
  X(fp8_scaling_info_t, struct_size, 0, 4)           \
  X(fp8_scaling_info_t, scale, 4, 4)                 \
  X(fp8_scaling_info_t, scale_inv, 8, 4)             \
  X(fp8_scaling_info_t, amax, 12, 4)                 \
  X(fp8_scaling_info_t, amax_history_len, 16, 4)     \
  X(fp8_scaling_info_t, reserved, 20, 4)             \
  X(fp8_scaling_info_t, update_count, 24, 8)         \
  X(fp8_scaling_info_t, nonfinite_count, 32, 8)      \
  S(fp8_scaling_info_t, 40)                          \
  X(fp8_gemm_options_t, struct_size, 0, 4)           \
  X(fp8_gemm_options_t, alpha, 4, 4)                 \
  X(fp8_gemm_options_t, accumulate, 8, 4)            \
  X(fp8_gemm_options_t, fast_accumulation, 12, 4)    \
  S(fp8_gemm_options_t, 16)                          \
  X(fp8_convert_options_t, struct_size, 0, 4)        \
  X(fp8_convert_options_t, to_fp8, 4, 4)             \
  X(fp8_convert_options_t, linear, 8, 4)             \
  X(fp8_convert_options_t, norm, 12, 4)              \
  X(fp8_convert_options_t, activation, 16, 4)        \
  S(fp8_convert_options_t, 20)                       \
  X(fp8_layer_report_t, struct_size, 0, 4)           \
  X(fp8_layer_report_t, kind, 4, 4)                  \
  X(fp8_layer_report_t, converted, 8, 4)             \
  X(fp8_layer_report_t, fprop, 12, 4)                \
  X(fp8_layer_report_t, dgrad, 16, 4)                \
  X(fp8_layer_report_t, wgrad, 20, 4)                \
  X(fp8_layer_report_t, fp8_calls, 24, 8)            \
  X(fp8_layer_report_t, fallback_calls, 32, 8)       \
  X(fp8_layer_report_t, reason, 40, 200)             \
  X(fp8_layer_report_t, scaling, 240, 4)             \
  X(fp8_layer_report_t, reserved, 244, 4)            \
  S(fp8_layer_report_t, 248)                         \
  X(fp8_optimizer_stats_t, struct_size, 0, 4)        \
  X(fp8_optimizer_stats_t, steps, 8, 8)              \
  X(fp8_optimizer_stats_t, skipped_steps, 16, 8)     \
  X(fp8_optimizer_stats_t, last_skipped, 24, 4)      \
  X(fp8_optimizer_stats_t, last_grad_norm, 28, 4)    \
  X(fp8_optimizer_stats_t, parameters, 32, 8)        \
  X(fp8_optimizer_stats_t, state_bytes, 40, 8)       \
  X(fp8_optimizer_stats_t, opt_level, 48, 4)         \
  X(fp8_optimizer_stats_t, training_bytes, 56, 8)    \
  S(fp8_optimizer_stats_t, 64)

static int fp8_check_layouts(void) {
  int bad = 0;
#if defined(__x86_64__) || defined(_M_X64)
#define FP8_CHECK_FIELD(T, f, off, size)                                                             \
  if (offsetof(T, f) != (off) || sizeof(((T*)0)->f) != (size)) {                                     \
    printf("%s.%s: offset %u size %u, pinned offset %u size %u\n", #T, #f, (unsigned)offsetof(T, f), \
           (unsigned)sizeof(((T*)0)->f), (unsigned)(off), (unsigned)(size));                         \
    ++bad;                                                                                           \
  }
#define FP8_CHECK_SIZE(T, size)                                                        \
  if (sizeof(T) != (size)) {                                                           \
    printf("sizeof(%s) = %u, pinned %u\n", #T, (unsigned)sizeof(T), (unsigned)(size)); \
    ++bad;                                                                             \
  }
  FP8_VERSIONED_LAYOUTS(FP8_CHECK_FIELD, FP8_CHECK_SIZE)
#undef FP8_CHECK_FIELD
#undef FP8_CHECK_SIZE
#endif
  return bad;
}

#endif /* FP8_HEADERTEST_LAYOUT_H */
