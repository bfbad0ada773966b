// After a cuBLASLt GEMM with an FP8 output: fold the amax cuBLASLt wrote (it overwrites) into the
// scaling state's history slot 0 (which max-accumulates), and hand the state's scale_inv to D.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

__global__ void fp8_output_epilogue_kernel(const float* gemm_amax, ScalingHeader* state, float* d_scale_inv) {
  atomicMax(reinterpret_cast<unsigned int*>(scaling_history(state)), abs_bits(*gemm_amax));
  *d_scale_inv = state->scale_inv;
}

}  // namespace

void gemm_fp8_output_epilogue(const float* gemm_amax, ScalingHeader* state, float* d_scale_inv, cudaStream_t stream) {
  fp8_output_epilogue_kernel<<<1, 1, 0, stream>>>(gemm_amax, state, d_scale_inv);
  cuda_check(cudaGetLastError(), "gemm FP8-output epilogue launch");
}

}  // namespace fp8::kernels
