// What the benchmark programs share: checks that stop the program with the library's message.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "fp8.h"

#define CHECK_FP8(call)                                                                             \
  do {                                                                                              \
    fp8_status_t s_ = (call);                                                                       \
    if (s_ != FP8_OK) {                                                                             \
      std::fprintf(stderr, "%s: %s: %s\n", #call, fp8_status_string(s_), fp8_last_error_message()); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

#define CHECK_CUDA(call)                                               \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)
