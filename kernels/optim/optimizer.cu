// The optimizer step on the GPU in four launches (optimizer_norm: 1; optimizer_update: 2 and 3;
// optimizer_promote: 4) and no host round trip:
//   1. one block per chunk sums its g^2 in double in core/optim_rule.hpp's order -> partials;
//   2. one block sums the partials in the same order, runs finish_step (skip, clip, bias
//      corrections) and, for each compact tensor, finish_compact (the scales of this step's writes);
//   3. one block per chunk updates its elements unless the scalars say skip: each thread takes 16
//      consecutive elements with 16-byte loads and stores, whatever the layout;
//   4. one block runs promote_compact for each compact tensor.
// And FP8 gradient accumulation (amax of the addend, one requantising pass, grad_sum_finish).
// Every step follows the CPU reference (src/backend/cpu_optimizer.cpp) bit for bit.
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

static_assert(kOptimChunk == 16 * kSumThreads, "each thread of a chunk block takes 16 elements");
constexpr int kPerThread = 16;

// Lane t holds its running sum; the block combines lanes as ordered_sum does.
__device__ double block_ordered_sum(double acc, double* s) {
  const int t = threadIdx.x;
  s[t] = acc;
  __syncthreads();
  for (int h = kSumThreads / 2; h > 0; h /= 2) {
    if (t < h) s[t] += s[t + h];
    __syncthreads();
  }
  return s[0];
}

__device__ __forceinline__ float grad_scale_inv(const OptimTensor& t) {
  return t.grad_scales ? t.grad_scales->scale_inv : 1.0f;
}

__global__ void __launch_bounds__(kSumThreads)
    chunk_sumsq_kernel(const OptimTensor* tensors, const OptimChunk* chunks, double* partials) {
  __shared__ double s[kSumThreads];
  const OptimChunk ch = chunks[blockIdx.x];
  const OptimTensor t = tensors[ch.tensor];
  const float si = grad_scale_inv(t);
  double acc = 0.0;
  for (int i = threadIdx.x; i < ch.len; i += kSumThreads) {
    const double v = grad_at(t, ch.offset + i, si);
    acc = __dadd_rn(acc, __dmul_rn(v, v));
  }
  const double total = block_ordered_sum(acc, s);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kSumThreads)
    finish_kernel(const OptimTensor* tensors, int64_t tensor_count, const double* partials, int64_t count,
                  OptimScalars* scalars, const OptimHyper* hyper_in, OptimElementArgs* args, const float* other_sumsq,
                  float* clip_out) {
  __shared__ double s[kSumThreads];
  const OptimHyper hyper = *hyper_in;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kSumThreads) acc = __dadd_rn(acc, partials[i]);
  const double total = block_ordered_sum(acc, s);
  if (threadIdx.x == 0) {
    finish_joint_step(*scalars, total, other_sumsq, clip_out, hyper);
    *args = element_args(hyper);
  }
  __syncthreads();
  const OptimScalars st = *scalars;
  for (int64_t i = threadIdx.x; i < tensor_count; i += kSumThreads) {
    const OptimTensor& t = tensors[i];
    if (t.scales) finish_compact(*t.scales, *t.grad_scales, st, hyper, t.layout);
  }
}

__global__ void __launch_bounds__(kSumThreads)
    promote_kernel(const OptimTensor* tensors, int64_t tensor_count, const OptimScalars* scalars) {
  const OptimScalars st = *scalars;
  for (int64_t i = threadIdx.x; i < tensor_count; i += kSumThreads) {
    const OptimTensor& t = tensors[i];
    if (t.scales) promote_compact(*t.scales, t.w_scale_inv, st, t.layout);
  }
}

// Bytes per element of each array of a layout (m and v where the tensor has them).
template <int LAYOUT>
struct ElementBytes {
  static constexpr bool kWideStates = LAYOUT == kLayoutF32 || LAYOUT == kLayoutO1;
  static constexpr int param = LAYOUT == kLayoutF32 ? 4 : LAYOUT == kLayoutO3 ? 1 : 2;
  static constexpr int grad = LAYOUT == kLayoutF32 ? 4 : 1;
  static constexpr int m = kWideStates ? 4 : 1;
  static constexpr int v = kWideStates ? 4 : 2;
  static constexpr int master = 2;
};

// 16 elements of one array, in registers: BYTES x 16 bytes.
struct Lane16 {
  uint4 q[4];
  template <int BYTES>
  __device__ __forceinline__ void load(const void* base, int64_t first) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(base) + first * BYTES);
#pragma unroll
    for (int k = 0; k < BYTES; ++k) q[k] = src[k];
  }
  template <int BYTES>
  __device__ __forceinline__ void store(void* base, int64_t first) const {
    uint4* dst = reinterpret_cast<uint4*>(static_cast<uint8_t*>(base) + first * BYTES);
#pragma unroll
    for (int k = 0; k < BYTES; ++k) dst[k] = q[k];
  }
};

// The thread's 16 elements in registers, updated through a view of the same layout over them. The
// layout and the SGD/Adam choice are compile-time constants here, so every access of the view
// resolves to a register.
template <int LAYOUT, bool SGD, bool HAS_M>
__device__ __forceinline__ void update16(const OptimTensor& t, int64_t first, float si, const CompactScales& cs,
                                         OptimElementArgs a, const OptimScalars& s, CompactMax& mx) {
  OptimTensor r = t;
  r.layout = LAYOUT;
  // adam_update tells Adam from AdamW by decay and weight_decay alone, so a constant kind is exact.
  a.kind = SGD ? FP8_OPTIMIZER_SGD : FP8_OPTIMIZER_ADAM;
  using B = ElementBytes<LAYOUT>;
  constexpr bool kO3 = LAYOUT == kLayoutO3;
  Lane16 p, g, m, v, master;
  p.load<B::param>(t.param, first);
  g.load<B::grad>(t.grad, first);
  if (HAS_M) m.load<B::m>(t.m, first);
  if (!SGD) v.load<B::v>(t.v, first);
  if (kO3) master.load<B::master>(t.master, first);
  r.param = p.q;
  r.grad = g.q;
  r.m = HAS_M ? m.q : nullptr;
  r.v = SGD ? nullptr : v.q;
  r.master = kO3 ? reinterpret_cast<uint16_t*>(master.q) : nullptr;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) update_element(r, k, si, cs, a, s, mx);
  p.store<B::param>(t.param, first);
  if (HAS_M) m.store<B::m>(t.m, first);
  if (!SGD) v.store<B::v>(t.v, first);
  if (kO3) master.store<B::master>(t.master, first);
}

template <bool SGD, bool HAS_M>
__device__ __forceinline__ void update16_any(const OptimTensor& t, int64_t first, float si, const CompactScales& cs,
                                             const OptimElementArgs& a, const OptimScalars& s, CompactMax& mx) {
  switch (t.layout) {
    case kLayoutF32: update16<kLayoutF32, SGD, HAS_M>(t, first, si, cs, a, s, mx); break;
    case kLayoutO1: update16<kLayoutO1, SGD, HAS_M>(t, first, si, cs, a, s, mx); break;
    case kLayoutO2: update16<kLayoutO2, SGD, HAS_M>(t, first, si, cs, a, s, mx); break;
    default: update16<kLayoutO3, SGD, HAS_M>(t, first, si, cs, a, s, mx); break;
  }
}

__global__ void __launch_bounds__(kSumThreads)
    update_kernel(const OptimTensor* tensors, const OptimChunk* chunks, const OptimScalars* scalars,
                  const OptimElementArgs* args) {
  const OptimScalars s = *scalars;
  const OptimElementArgs a = *args;
  if (s.skip) return;
  const OptimChunk ch = chunks[blockIdx.x];
  const OptimTensor t = tensors[ch.tensor];
  const float si = grad_scale_inv(t);
  const CompactScales cs = t.scales ? *t.scales : CompactScales{};
  CompactMax mx;
  const int64_t first = ch.offset + static_cast<int64_t>(threadIdx.x) * kPerThread;
  const int64_t end = ch.offset + ch.len;
  if (first + kPerThread <= end) {  // chunks start at multiples of 16 elements of 16-byte aligned arrays
    if (a.kind != FP8_OPTIMIZER_SGD) update16_any<false, true>(t, first, si, cs, a, s, mx);
    else if (t.m) update16_any<true, true>(t, first, si, cs, a, s, mx);
    else update16_any<true, false>(t, first, si, cs, a, s, mx);
  } else {
    for (int64_t i = first; i < end; ++i) update_element(t, i, si, cs, a, s, mx);
  }
  if (t.scales) {
    block_max_accumulate(mx.m, &t.scales->next_m_code);
    block_max_accumulate(mx.v, &t.scales->next_v_code);
    block_max_accumulate(mx.p, &t.scales->next_p_code);
  }
}

// ---- FP8 gradient accumulation --------------------------------------------------------------------
constexpr int kAccThreads = 256;

// Each thread takes 8 consecutive elements per turn (16- or 32-byte loads of `add`, 8 bytes of codes);
// `vec` says the pointers allow it, the tail goes one element at a time. Onto zeros (a uniform
// branch) the stored codes are not read.
template <fp8_dtype_t DT>
__global__ void __launch_bounds__(kAccThreads)
    grad_sum_kernel(uint8_t* codes, bool e5m2, const typename Wide<DT>::Raw* __restrict__ add, int64_t n, bool vec,
                    GradScales* scales) {
  const GradScales g = *scales;
  const float scale = grad_sum_scale(g, e5m2);
  const bool onto_zeros = grad_sum_onto_zeros(g);
  auto code = [&](uint8_t stored, float a) {
    return onto_zeros ? grad_sum_first_code(a, scale, e5m2) : grad_sum_code(stored, a, g.scale_inv, scale, e5m2);
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kAccThreads * 8;
  uint32_t top = 0;
  const int64_t n_vec = vec ? n / 8 * 8 : 0;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kAccThreads + threadIdx.x) * 8; i < n_vec; i += stride) {
    Vec8<DT> x;
    x.load(add + i);
    const uint2 old = onto_zeros ? make_uint2(0u, 0u) : *reinterpret_cast<const uint2*>(codes + i);
    uint32_t out[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t word = k < 4 ? old.x : old.y;
      const uint8_t c = code(static_cast<uint8_t>(word >> (8 * (k & 3))), x.get(k));
      top = max(top, static_cast<uint32_t>(c & 0x7Fu));
      out[k >> 2] |= static_cast<uint32_t>(c) << (8 * (k & 3));
    }
    *reinterpret_cast<uint2*>(codes + i) = make_uint2(out[0], out[1]);
  }
  for (int64_t i = n_vec + static_cast<int64_t>(blockIdx.x) * kAccThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kAccThreads) {
    codes[i] = code(onto_zeros ? uint8_t{0} : codes[i], Wide<DT>::to_float(add[i]));
    top = max(top, static_cast<uint32_t>(codes[i] & 0x7Fu));
  }
  block_max_accumulate(top, &scales->next_amax_code);
}

template <fp8_dtype_t DT>
__global__ void __launch_bounds__(kAccThreads)
    add_f32_kernel(float* dst, const typename Wide<DT>::Raw* __restrict__ add, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kAccThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kAccThreads)
    dst[i] = __fadd_rn(dst[i], Wide<DT>::to_float(add[i]));
}

__global__ void grad_sum_finish_kernel(GradScales* scales, bool e5m2) { grad_sum_finish(*scales, e5m2); }

}  // namespace

void optimizer_norm(const OptimizerStepJob& job, cudaStream_t stream) {
  if (job.chunk_count <= 0) return;
  chunk_sumsq_kernel<<<static_cast<unsigned>(job.chunk_count), kSumThreads, 0, stream>>>(job.tensors, job.chunks,
                                                                                         job.partials);
  cuda_check(cudaGetLastError(), "optimizer norm kernel launch");
}

void optimizer_update(const OptimizerStepJob& job, cudaStream_t stream) {
  // (The finish runs for a model without parameters too, as on the CPU: the step counts, and a joint
  // step's clip factor is written.)
  finish_kernel<<<1, kSumThreads, 0, stream>>>(job.tensors, job.tensor_count, job.partials, job.chunk_count,
                                               job.scalars, job.hyper, job.args, job.other_sumsq, job.clip_out);
  cuda_check(cudaGetLastError(), "optimizer finish kernel launch");
  if (job.chunk_count <= 0) return;
  const unsigned blocks = static_cast<unsigned>(job.chunk_count);
  update_kernel<<<blocks, kSumThreads, 0, stream>>>(job.tensors, job.chunks, job.scalars, job.args);
  cuda_check(cudaGetLastError(), "optimizer update kernel launch");
}

void optimizer_promote(const OptimizerStepJob& job, cudaStream_t stream) {
  if (job.chunk_count <= 0) return;
  promote_kernel<<<1, kSumThreads, 0, stream>>>(job.tensors, job.tensor_count, job.scalars);
  cuda_check(cudaGetLastError(), "optimizer promote kernel launch");
}

void grad_accumulate(const GradAccumulateJob& job, const LaunchLimits& lim, cudaStream_t stream) {
  if (!job.codes) {
    if (job.n <= 0) return;
    const int grid = static_cast<int>(std::min<int64_t>((job.n + kAccThreads - 1) / kAccThreads, lim.sm_count * 8LL));
    if (job.add_dtype == FP8_DTYPE_BF16)
      add_f32_kernel<FP8_DTYPE_BF16>
          <<<grid, kAccThreads, 0, stream>>>(job.f32, static_cast<const uint16_t*>(job.add), job.n);
    else
      add_f32_kernel<FP8_DTYPE_F32>
          <<<grid, kAccThreads, 0, stream>>>(job.f32, static_cast<const float*>(job.add), job.n);
    cuda_check(cudaGetLastError(), "gradient add kernel launch");
    return;
  }
  amax({job.add, job.add_dtype, job.n, &job.scales->add_amax, nullptr}, lim, stream);
  if (job.n > 0) {
    const int64_t want = (job.n / 8 + kAccThreads - 1) / kAccThreads + 1;
    const int grid = static_cast<int>(std::min<int64_t>(want, static_cast<int64_t>(lim.sm_count) * 8));
    const bool vec = aligned16(job.add) && (reinterpret_cast<uintptr_t>(job.codes) & 7u) == 0;
    if (job.add_dtype == FP8_DTYPE_BF16)
      grad_sum_kernel<FP8_DTYPE_BF16><<<grid, kAccThreads, 0, stream>>>(
          job.codes, job.e5m2, static_cast<const uint16_t*>(job.add), job.n, vec, job.scales);
    else
      grad_sum_kernel<FP8_DTYPE_F32><<<grid, kAccThreads, 0, stream>>>(
          job.codes, job.e5m2, static_cast<const float*>(job.add), job.n, vec, job.scales);
    cuda_check(cudaGetLastError(), "gradient accumulation kernel launch");
  }
  grad_sum_finish_kernel<<<1, 1, 0, stream>>>(job.scales, job.e5m2);
  cuda_check(cudaGetLastError(), "gradient accumulation finish kernel launch");
}

}  // namespace fp8::kernels
