// The FP8 gradient exchange's local pass on the GPU (core/exchange_rule.hpp), bit for bit the CPU
// reference (src/backend/cpu_exchange.cpp):
//   exchange_bounds (a bucket's first slice): one thread per tensor, its bound and exchange_finish;
//   exchange_kernel: one block per chunk; the senders' scale_inv are staged in shared memory, each
//     thread reads its elements' codes from every sender's piece (4-byte loads), sums them in rank
//     order, divides, and encodes with the bound's scale (4-byte code stores): N + 1 bytes per element.
//   divide: a grid-stride pass, 4 elements per 16-byte access.
// The peer exchange (dist::PeerWindows) runs the same chunk kernel over the other GPUs' memory:
// each rank's codes read where that rank keeps them and the means written into every rank's arena
// (NVLink loads and stores instead of NCCL's transfers), after gather_peer_scales and between two
// peer_barrier kernels.
// In the chunk kernel thread t takes the 4 consecutive elements at 4 * (t + kThreads * g) of its
// chunk for g = 0..3, so that each warp's loads and stores are contiguous: 16-byte stores at a
// 64-byte stride per thread instead reach 1.34 TB/s on an H100, contiguous ones 3.2 TB/s.
// Codes that are not 4-byte aligned (pieces, piece_bytes or the output) and a chunk's last partial
// group of 4 take scalar paths; the sums are the same in every path.
#include <type_traits>

#include "core/exchange_rule.hpp"
#include "kernels/common.cuh"
#include "kernels/launch.hpp"

namespace fp8::kernels {

namespace {

constexpr int kThreads = kSumThreads;
constexpr int kGroups = 4;  // groups of 4 consecutive elements per thread
static_assert(kOptimChunk == kThreads * kGroups * 4, "a chunk is one block's 4 x 4 elements per thread");
constexpr int kScaleBatch = kThreads;  // senders whose scale_inv a block holds at once (any nranks: in batches)
constexpr int kInFlight = 4;           // senders whose codes a thread loads before it sums them
constexpr int kReduceBlocksPerSm = 5;  // 48 registers: measured best with kInFlight = 4 (H100)

// The chunk offset of thread t's group g.
__device__ __forceinline__ int group_offset(int g) {
  return 4 * (g * kThreads + static_cast<int>(threadIdx.x));
}

// dequantize_rn of two codes (the low byte first) with one conversion instruction: dequantize_rn
// runs this same instruction with a zero in the other lane.
template <bool E5M2>
__device__ __forceinline__ float2 dequantize2(uint32_t pair, float scale_inv) {
  const float2 f =
      __half22float2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), E5M2 ? __NV_E5M2 : __NV_E4M3));
  return make_float2(mul_rn(f.x, scale_inv), mul_rn(f.y, scale_inv));
}

// Where sender k's codes of a chunk start: in the buffer of received pieces (one after another),
// or in the sender's own memory (the peer exchange).
struct ReceivedPieces {
  const uint8_t* first;  // sender 0's code of the chunk's first element
  int64_t piece_bytes;
  __device__ __forceinline__ const uint8_t* operator()(int32_t k) const { return first + k * piece_bytes; }
};
struct PeerPieces {
  const uint8_t* const* peers;  // every rank's codes arena
  int64_t at;                   // the chunk's first element in each
  __device__ __forceinline__ const uint8_t* operator()(int32_t k) const { return peers[k] + at; }
};

// The codes of the thread's first `groups` groups from senders [k, k + n), n <= kInFlight: one 4-byte
// load per group and sender, or 4 byte loads where the codes are not 4-byte aligned. FULL: aligned
// and all groups, the case of every thread but at a tensor's end, compiled without a branch per load.
template <bool FULL, class Src>
__device__ __forceinline__ void load_codes(uint32_t (&q)[kInFlight][kGroups], const Src& src, bool aligned, int groups,
                                           int32_t k, int n) {
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    if (u >= n) continue;
    const uint8_t* piece = src(k + u);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (!FULL && g >= groups) continue;
      const uint8_t* at = piece + group_offset(g);
      if (FULL || aligned) {
        q[u][g] = __ldg(reinterpret_cast<const uint32_t*>(at));
      } else {
        q[u][g] = static_cast<uint32_t>(__ldg(at)) | static_cast<uint32_t>(__ldg(at + 1)) << 8 |
                  static_cast<uint32_t>(__ldg(at + 2)) << 16 | static_cast<uint32_t>(__ldg(at + 3)) << 24;
      }
    }
  }
}

// exchange_mean's additions for n senders' codes of the thread's first `groups` groups, in rank order
// per element as in the rule (which keeps one running sum where a thread keeps 16).
template <bool E5M2, bool FULL>
__device__ __forceinline__ void add_codes(float (&sum)[kGroups][4], const uint32_t (&q)[kInFlight][kGroups],
                                          const float* scale_inv, int groups, int n) {
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    if (u >= n) continue;
    const float si = scale_inv[u];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (!FULL && g >= groups) continue;
      const float2 lo = dequantize2<E5M2>(q[u][g] & 0xFFFFu, si);
      const float2 hi = dequantize2<E5M2>(q[u][g] >> 16, si);
      sum[g][0] = add_rn(sum[g][0], lo.x);
      sum[g][1] = add_rn(sum[g][1], lo.y);
      sum[g][2] = add_rn(sum[g][2], hi.x);
      sum[g][3] = add_rn(sum[g][3], hi.y);
    }
  }
}

// Every tensor's bound and final scales (the job's `scales`), one thread each.
template <bool E5M2>
__global__ void __launch_bounds__(kThreads) exchange_bounds(GradExchangeJob j) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= j.tensor_count || (j.peer_poisoned && *j.peer_poisoned)) return;
  const float bound = exchange_bound(j.sender_scales, j.nranks, j.tensor_count, static_cast<int32_t>(t));
  j.bounds[t] = bound;
  exchange_finish(j.scales[t], bound, E5M2);
}

// One chunk (by one block): the means of its elements, encoded with the scale of their tensor's bound.
// PEERS: the senders' codes are read from every rank's arena and the codes written to every rank's
// (GradExchangeJob's peer fields).
template <bool E5M2, bool PEERS>
__device__ __forceinline__ void exchange_chunk(const GradExchangeJob& j, const OptimChunk ch, float* scale_inv,
                                               bool codes_aligned, bool out_aligned) {
  // Groups wholly inside the chunk: a prefix of the thread's groups (all of them but at a tensor's end).
  int groups = 0;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) groups += group_offset(g) + 4 <= ch.len;
  using Src = std::conditional_t<PEERS, PeerPieces, ReceivedPieces>;
  Src src;
  if constexpr (PEERS)
    src = {j.peer_codes, j.peer_at + ch.offset};
  else
    src = {j.pieces + ch.offset, j.piece_bytes};
  const bool codes_vec = codes_aligned && ch.offset % 4 == 0;
  const bool full = codes_vec && groups == kGroups;  // the thread's loads need no check
  // The first senders' codes are on their way while the block gathers their scales.
  uint32_t q[kInFlight][kGroups];
  const int n0 = min(kInFlight, j.nranks);
  if (full)
    load_codes<true>(q, src, true, kGroups, 0, n0);
  else if (groups > 0)
    load_codes<false>(q, src, codes_vec, groups, 0, n0);
  // The rule starts from sender 0's value; -0 + x is x, bit for bit, for every x (+0 and -0
  // included; any NaN comes out as the GPU's one NaN either way), so the sums start at -0.
  float sum[kGroups][4];
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int e = 0; e < 4; ++e) sum[g][e] = -0.0f;
  for (int32_t k0 = 0; k0 < j.nranks; k0 += kScaleBatch) {
    const int count = min(kScaleBatch, j.nranks - k0);
    __syncthreads();  // every thread is done with the previous batch's scales
    if (static_cast<int>(threadIdx.x) < count)
      scale_inv[threadIdx.x] =
          j.sender_scales[static_cast<int64_t>(k0 + threadIdx.x) * j.tensor_count + ch.tensor].scale_inv;
    __syncthreads();
    if (groups == 0) continue;
    for (int k = 0; k < count; k += kInFlight) {
      const int n = min(kInFlight, count - k);
      if (full) {
        if (k0 + k > 0) load_codes<true>(q, src, true, kGroups, k0 + k, n);
        add_codes<E5M2, true>(sum, q, scale_inv + k, kGroups, n);
      } else {
        if (k0 + k > 0) load_codes<false>(q, src, codes_vec, groups, k0 + k, n);
        add_codes<E5M2, false>(sum, q, scale_inv + k, groups, n);
      }
    }
  }
  const float scale = fp8_scale_for_bound(j.bounds[ch.tensor], E5M2);
  // Dividing by a power of two is multiplying by its inverse, bit for bit (both round the same
  // quotient once), and far cheaper than a correctly rounded division.
  const float n = static_cast<float>(j.nranks);
  const bool pow2 = (j.nranks & (j.nranks - 1)) == 0;
  const float inv = 1.0f / n;
  const bool out_vec = out_aligned && ch.offset % 4 == 0;
  // Element i's code goes to this rank's slice, or to every rank's arena.
  const int32_t outputs = PEERS && j.peer_outputs ? j.nranks : 1;
  const auto out = [&](int32_t k, int64_t i) {
    if constexpr (PEERS)
      if (j.peer_outputs) return j.peer_outputs[k] + j.peer_at + i;
    return j.codes + i;
  };
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int64_t i = ch.offset + group_offset(g);
    if (g < groups) {
      float m[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) m[e] = pow2 ? mul_rn(sum[g][e], inv) : div_rn(sum[g][e], n);
      if (out_vec) {
        const uint32_t packed =
            cast4<E5M2>(mul_rn(m[0], scale), mul_rn(m[1], scale), mul_rn(m[2], scale), mul_rn(m[3], scale));
        for (int32_t k = 0; k < outputs; ++k) *reinterpret_cast<uint32_t*>(out(k, i)) = packed;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint8_t code = encode_fp8_rn(mul_rn(m[e], scale), E5M2);
          for (int32_t k = 0; k < outputs; ++k) *out(k, i + e) = code;
        }
      }
    } else {  // the chunk's last few elements (at a tensor's end), by the rule itself
      for (int64_t x = i; x < ch.offset + ch.len && x < i + 4; ++x) {
        float m;
        if constexpr (PEERS)
          m = exchange_mean_of([&](int32_t k) { return j.peer_codes[k][j.peer_at + x]; }, j.nranks, j.sender_scales,
                               j.tensor_count, ch.tensor, E5M2);
        else
          m = exchange_mean(j.pieces, j.piece_bytes, j.nranks, x, j.sender_scales, j.tensor_count, ch.tensor, E5M2);
        const uint8_t code = encode_fp8_rn(mul_rn(m, scale), E5M2);
        for (int32_t k = 0; k < outputs; ++k) *out(k, x) = code;
      }
    }
  }
}

// The peer exchange's whole chunks where every pointer and the chunk are 16-byte aligned: thread t
// takes the chunk's 16 consecutive elements at 16 t, one 16-byte load per sender and one 16-byte
// store per rank (wider requests over NVLink than exchange_chunk's 4-byte ones). The same sums in
// the same order as exchange_chunk.
template <bool E5M2>
__device__ __forceinline__ void exchange_chunk_wide(const GradExchangeJob& j, const OptimChunk ch, float* scale_inv) {
  constexpr int kWords = 4;  // 16 codes
  const int64_t at = j.peer_at + ch.offset + 16 * static_cast<int64_t>(threadIdx.x);
  float sum[kWords][4];
#pragma unroll
  for (int w = 0; w < kWords; ++w)
#pragma unroll
    for (int e = 0; e < 4; ++e) sum[w][e] = -0.0f;  // (see exchange_chunk)
  for (int32_t k0 = 0; k0 < j.nranks; k0 += kScaleBatch) {
    const int count = min(kScaleBatch, j.nranks - k0);
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < count)
      scale_inv[threadIdx.x] =
          j.sender_scales[static_cast<int64_t>(k0 + threadIdx.x) * j.tensor_count + ch.tensor].scale_inv;
    __syncthreads();
    for (int k = 0; k < count; k += kInFlight) {
      const int n = min(kInFlight, count - k);
      uint4 q[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (u < n) q[u] = __ldg(reinterpret_cast<const uint4*>(j.peer_codes[k0 + k + u] + at));
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (u >= n) continue;
        const float si = scale_inv[k + u];
        const uint32_t words[kWords] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          const float2 lo = dequantize2<E5M2>(words[w] & 0xFFFFu, si);
          const float2 hi = dequantize2<E5M2>(words[w] >> 16, si);
          sum[w][0] = add_rn(sum[w][0], lo.x);
          sum[w][1] = add_rn(sum[w][1], lo.y);
          sum[w][2] = add_rn(sum[w][2], hi.x);
          sum[w][3] = add_rn(sum[w][3], hi.y);
        }
      }
    }
  }
  const float scale = fp8_scale_for_bound(j.bounds[ch.tensor], E5M2);
  const float n = static_cast<float>(j.nranks);
  const bool pow2 = (j.nranks & (j.nranks - 1)) == 0;
  const float inv = 1.0f / n;
  uint32_t packed[kWords];
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    float m[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) m[e] = pow2 ? mul_rn(sum[w][e], inv) : div_rn(sum[w][e], n);
    packed[w] = cast4<E5M2>(mul_rn(m[0], scale), mul_rn(m[1], scale), mul_rn(m[2], scale), mul_rn(m[3], scale));
  }
  const uint4 out = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if (!j.peer_outputs) {
    *reinterpret_cast<uint4*>(j.codes + ch.offset + 16 * static_cast<int64_t>(threadIdx.x)) = out;
    return;
  }
  for (int32_t k = 0; k < j.nranks; ++k) *reinterpret_cast<uint4*>(j.peer_outputs[k] + at) = out;
}

// One block per chunk. (A grid that leaves 32 SMs to NCCL's kernels running beside it, blocks
// taking chunks in turn, made the pass 45% slower and the exchange no faster on 2 x H200.)
template <bool E5M2>
__global__ void __launch_bounds__(kThreads, kReduceBlocksPerSm)
    exchange_kernel(GradExchangeJob j, bool codes_aligned, bool out_aligned) {
  __shared__ float scale_inv[kScaleBatch];
  exchange_chunk<E5M2, false>(j, j.chunks[blockIdx.x], scale_inv, codes_aligned, out_aligned);
}

// The peer exchange's pass (its 16-byte path needs more than 48 registers).
constexpr int kPeerBlocksPerSm = 4;
template <bool E5M2>
__global__ void __launch_bounds__(kThreads, kPeerBlocksPerSm)
    peer_exchange_kernel(GradExchangeJob j, bool codes_aligned, bool out_aligned, bool wide) {
  if (*j.peer_poisoned) return;
  __shared__ float scale_inv[kScaleBatch];
  const OptimChunk ch = j.chunks[blockIdx.x];
  if (wide && ch.len == kOptimChunk && (j.peer_at + ch.offset) % 16 == 0)
    exchange_chunk_wide<E5M2>(j, ch, scale_inv);
  else
    exchange_chunk<E5M2, true>(j, ch, scale_inv, codes_aligned, out_aligned);
}

// The peer exchange's scales of a bucket, one thread per tensor.
__global__ void __launch_bounds__(kThreads) gather_peer_scales_kernel(PeerScalesJob j) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= j.tensor_count || *j.poisoned) return;
  for (int32_t k = 0; k < j.nranks; ++k)
    j.senders[static_cast<int64_t>(k) * j.tensor_count + t] = j.peer_scales[k][j.first + t];
  j.bounds[t] = exchange_bound(j.senders, j.nranks, j.tensor_count, static_cast<int32_t>(t));
}

// Release and acquire at system scope: the other ranks' GPUs (and processes) observe them.
__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread k signals rank k and waits for rank k's signal; the epoch is the rank's count of barriers
// (on the device, so that a captured barrier replays with the next one). Kernel boundaries order the
// stream's work before and after (the fence makes the earlier kernels' writes, to any rank's memory,
// visible before the signal). An abort ends the wait and poisons the rank's windows: no later
// barrier signals, and the exchange's kernels do nothing.
__global__ void peer_barrier_kernel(uint32_t* const* signals, int32_t rank, int32_t nranks, uint32_t* epochs,
                                    uint32_t* poisoned, const volatile uint32_t* abort) {
  if (*poisoned) return;
  const int32_t k = static_cast<int32_t>(threadIdx.x);
  const uint32_t epoch = *epochs + 1;
  if (k < nranks) {
    __threadfence_system();
    store_release_sys(signals[k] + rank, epoch);
    const uint32_t* mine = signals[rank] + k;
    // (Epochs wrap: compared by their difference. The abort flag is host memory: read now and then.)
    for (uint32_t spins = 1; static_cast<int32_t>(load_acquire_sys(mine) - epoch) < 0; ++spins) {
      if (spins % 64 == 0 && *abort) {
        *poisoned = 1u;
        break;
      }
      __nanosleep(128);
    }
  }
  __syncthreads();
  if (k == 0) *epochs = epoch;
}

__global__ void __launch_bounds__(kThreads) divide_kernel(float* x, int64_t n, float divisor, bool aligned) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t n_vec = aligned ? n / 4 : 0;
  for (int64_t v = tid; v < n_vec; v += stride) {
    float4 a = reinterpret_cast<float4*>(x)[v];
    a.x = div_rn(a.x, divisor);
    a.y = div_rn(a.y, divisor);
    a.z = div_rn(a.z, divisor);
    a.w = div_rn(a.w, divisor);
    reinterpret_cast<float4*>(x)[v] = a;
  }
  for (int64_t i = n_vec * 4 + tid; i < n; i += stride) x[i] = div_rn(x[i], divisor);
}

}  // namespace

void grad_exchange(const GradExchangeJob& j, cudaStream_t stream) {
  if (j.nranks <= 0) return;
  if (j.scales && j.tensor_count > 0) {
    const auto blocks = static_cast<unsigned>((j.tensor_count + kThreads - 1) / kThreads);
    (j.e5m2 ? exchange_bounds<true> : exchange_bounds<false>)<<<blocks, kThreads, 0, stream>>>(j);
    cuda_check(cudaGetLastError(), "gradient exchange bounds kernel launch");
  }
  if (j.chunk_count <= 0) return;
  const auto aligned4 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; };
  bool codes_aligned, out_aligned, wide = false;
  if (j.peer_codes) {
    // (The tables are device memory: the job says how the pointers in them are aligned.)
    codes_aligned = j.peer_at % 4 == 0 && j.peer_alignment % 4 == 0;
    out_aligned = j.peer_outputs ? codes_aligned : aligned4(j.codes);
    wide = j.peer_alignment % 16 == 0;
  } else {
    codes_aligned = aligned4(j.pieces) && j.piece_bytes % 4 == 0;
    out_aligned = aligned4(j.codes);
  }
  const auto blocks = static_cast<unsigned>(j.chunk_count);
  if (j.peer_codes)
    (j.e5m2 ? peer_exchange_kernel<true> : peer_exchange_kernel<false>)<<<blocks, kThreads, 0, stream>>>(
        j, codes_aligned, out_aligned, wide);
  else
    (j.e5m2 ? exchange_kernel<true> : exchange_kernel<false>)<<<blocks, kThreads, 0, stream>>>(j, codes_aligned,
                                                                                              out_aligned);
  cuda_check(cudaGetLastError(), "gradient exchange kernel launch");
}

void gather_peer_scales(const PeerScalesJob& j, cudaStream_t stream) {
  if (j.nranks <= 0 || j.tensor_count <= 0) return;
  const auto blocks = static_cast<unsigned>((j.tensor_count + kThreads - 1) / kThreads);
  gather_peer_scales_kernel<<<blocks, kThreads, 0, stream>>>(j);
  cuda_check(cudaGetLastError(), "peer exchange scales kernel launch");
}

void peer_barrier(uint32_t* const* signals, int32_t rank, int32_t nranks, uint32_t* epochs, uint32_t* poisoned,
                  const volatile uint32_t* abort, cudaStream_t stream) {
  const unsigned threads = static_cast<unsigned>((nranks + 31) / 32 * 32);
  peer_barrier_kernel<<<1, threads, 0, stream>>>(signals, rank, nranks, epochs, poisoned, abort);
  cuda_check(cudaGetLastError(), "peer exchange barrier kernel launch");
}

void divide(const DivideJob& j, const LaunchLimits& lim, cudaStream_t stream) {
  if (j.n <= 0) return;
  const int grid = grid_size(reinterpret_cast<const void*>(divide_kernel), kThreads,
                             (j.n / 4 + kThreads - 1) / kThreads + 1, lim.sm_count);
  divide_kernel<<<grid, kThreads, 0, stream>>>(j.x, j.n, j.divisor, aligned16(j.x));
  cuda_check(cudaGetLastError(), "divide kernel launch");
}

}  // namespace fp8::kernels
