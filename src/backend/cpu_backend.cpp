// The CPU reference backend: plain loops that define the right answer for every operation.
// Simplicity over speed (except the GEMM, blocked and threaded with the naive loop's results; see
// there); the CUDA backend must reproduce these results bit for bit.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu_recipe_quantize.hpp"
#include "core/activation.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "core/recipe_scaling_rule.hpp"

namespace fp8 {

namespace {

float load_wide(const void* p, fp8_dtype_t dt, int64_t i) {
  switch (dt) {
    case FP8_DTYPE_F32: return static_cast<const float*>(p)[i];
    case FP8_DTYPE_F16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

void store_wide(void* p, fp8_dtype_t dt, int64_t i, float v) {
  switch (dt) {
    case FP8_DTYPE_F32: static_cast<float*>(p)[i] = v; break;
    case FP8_DTYPE_F16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
  }
}

// dbias[c] += sum over rows of in[r][c], summed in double.
void add_column_sums(const void* in, fp8_dtype_t dt, int64_t rows, int64_t cols, float* dbias) {
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += load_wide(in, dt, r * cols + c);
    dbias[c] = static_cast<float>(dbias[c] + sum);
  }
}

void max_into(float* slot, uint32_t abs) {
  if (abs > float_bits(*slot)) *slot = bits_float(abs);
}

// ---- GEMM ---------------------------------------------------------------------------------------
// The reference GEMM must stay exact enough to judge cuBLASLt and fast enough to train a small MLP
// on the CPU, hence a small BLIS-style structure instead of the naive triple loop:
//  - Each output keeps ONE double accumulator summed over k in ascending order, exactly as the naive
//    loop did, so the results are bit-identical to it and do not depend on blocking or threads. The
//    speed comes from computing kMR x kNR outputs at once (independent add chains that the compiler
//    vectorises and pipelines), not from reassociating any sum.
//  - The operands are widened to double once (O(mk + nk)) and packed into micro-panels, A as
//    [m / kMR][k][kMR] and B as [n / kNR][k][kNR] with zero-padded tails, so the inner loop reads both
//    contiguously whatever the stored layout (transposed operands are read row by row).
//  - k is cut into blocks of kKC so that a B micro-panel (kKC x kNR) stays in L1 and the A block of a
//    tile (kMC x kKC) in L2; a tile's partial sums wait between k blocks in a per-thread double buffer.
//  - Threads (std::thread, none for small products) pack panels, then take whole kMC x kNC output
//    tiles from a shared counter: every output is computed by one thread in the fixed order above,
//    and the FP8 amax is the max of the per-thread maxima.
constexpr int64_t kMR = 4, kNR = 4;      // micro-tile: 8 two-wide accumulators, fits 16 registers
constexpr int64_t kKC = 256;             // k block: an 8 KiB micro-panel of B
constexpr int64_t kMC = 64, kNC = 256;   // output tile taken by one thread at a time
constexpr int64_t kPackRows = 64;        // rows (of A or B) packed per task
constexpr double kMinMacsPerThread = 1 << 20;  // less work than this per thread: not worth a thread
constexpr int64_t kMaxThreads = 16;
static_assert(kMC % kMR == 0 && kNC % kNR == 0, "tiles are made of whole micro-tiles");

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// c[i][j] (ldc apart) = (first ? 0 : c[i][j]) + sum over p < kc of a[p][i] * b[p][j], in p order.
void gemm_micro_kernel(int64_t kc, const double* a, const double* b, double* c, int64_t ldc, bool first) {
  double s[kMR][kNR];
  for (int64_t i = 0; i < kMR; ++i)
    for (int64_t jj = 0; jj < kNR; ++jj) s[i][jj] = first ? 0.0 : c[i * ldc + jj];
  for (int64_t p = 0; p < kc; ++p, a += kMR, b += kNR)
    for (int64_t i = 0; i < kMR; ++i)
      for (int64_t jj = 0; jj < kNR; ++jj) s[i][jj] += a[i] * b[jj];
  for (int64_t i = 0; i < kMR; ++i)
    for (int64_t jj = 0; jj < kNR; ++jj) c[i * ldc + jj] = s[i][jj];
}

// Calls f(load) with load(i) = element i of p widened to double (FP8 decoded), one dtype dispatch.
template <class F>
void with_operand_loader(const void* p, fp8_dtype_t dt, const double* fp8_table, F&& f) {
  if (dtype_is_fp8(dt)) {
    const uint8_t* q = static_cast<const uint8_t*>(p);
    f([q, fp8_table](int64_t i) { return fp8_table[q[i]]; });
  } else if (dt == FP8_DTYPE_F32) {
    const float* q = static_cast<const float*>(p);
    f([q](int64_t i) { return static_cast<double>(q[i]); });
  } else {
    const uint16_t* q = static_cast<const uint16_t*>(p);
    if (dt == FP8_DTYPE_F16)
      f([q](int64_t i) { return static_cast<double>(f16_to_float(q[i])); });
    else
      f([q](int64_t i) { return static_cast<double>(bf16_to_float(q[i])); });
  }
}

// Packs rows [r0, r1) of an operand with `rows` rows of length k (element (r, kk) at src[r * k + kk],
// or at src[kk * rows + r] when transposed) into W-wide micro-panels: dst[r / W][kk][r % W]. r0 is a
// multiple of W; when r1 == rows, the rest of the last panel is zeroed. With `cells` (an FP8
// operand of per-row or block scales, never transposed), each element is multiplied by the scale of
// its cell: exact in double (a decoded FP8 value has 4 significant bits, a float scale 24).
template <int64_t W>
void pack_operand(const void* src, fp8_dtype_t dt, const double* fp8_table, bool transposed, int64_t rows,
                  int64_t k, int64_t r0, int64_t r1, double* dst, const ScaleDesc* cells = nullptr) {
  with_operand_loader(src, dt, fp8_table, [&](auto load) {
    if (transposed) {  // source rows are k: read each contiguously across the panels
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t r = r0; r < r1; ++r) dst[(r / W) * k * W + kk * W + r % W] = load(kk * rows + r);
    } else if (cells) {
      const ScaleBlock b = scale_block(cells->mode, rows, k);
      for (int64_t r = r0; r < r1; ++r) {
        double* d = dst + (r / W) * k * W + r % W;
        for (int64_t kk = 0; kk < k; ++kk)
          d[kk * W] = load(r * k + kk) * static_cast<double>(cells->ptr[cells->at(r / b.rows, kk / b.cols)]);
      }
    } else {
      for (int64_t r = r0; r < r1; ++r) {
        double* d = dst + (r / W) * k * W + r % W;
        for (int64_t kk = 0; kk < k; ++kk) d[kk * W] = load(r * k + kk);
      }
    }
  });
  if (r1 == rows)
    for (int64_t r = r1; r < round_up(r1, W); ++r)
      for (int64_t kk = 0; kk < k; ++kk) dst[(r / W) * k * W + kk * W + r % W] = 0.0;
}

// Runs work(t) for t in [0, threads): t = 0 on the calling thread, the others on their own threads
// (on the calling thread too when a thread cannot be started). work must not throw.
template <class F>
void run_on_threads(unsigned threads, const F& work) {
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (unsigned t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(work, t);
    } catch (const std::system_error&) {
      work(t);
    }
  }
  work(0);
  for (std::thread& th : pool) th.join();
}

void cpu_gemm(const GemmJob& j) {
  const int64_t m = j.m, n = j.n, k = j.k;
  // Per-tensor scales scale the sum; finer ones (check_gemm_scales) scale each element as it is packed.
  const ScaleDesc* a_cells = j.a_scale_inv.is_tensor() ? nullptr : &j.a_scale_inv;
  const ScaleDesc* b_cells = j.b_scale_inv.is_tensor() ? nullptr : &j.b_scale_inv;
  const double scale = static_cast<double>(j.alpha) * (j.a_scale_inv.ptr && !a_cells ? *j.a_scale_inv.ptr : 1.0f) *
                       (j.b_scale_inv.ptr && !b_cells ? *j.b_scale_inv.ptr : 1.0f);
  const bool fp8_out = j.d_state != nullptr;
  const float d_scale = fp8_out ? j.d_state->scale : 1.0f;

  double a_codes[256], b_codes[256];  // FP8 operands: every code decoded once
  for (int c = 0; c < 256; ++c) {
    a_codes[c] = decode_fp8(static_cast<uint8_t>(c), j.a_dtype == FP8_DTYPE_E5M2);
    b_codes[c] = decode_fp8(static_cast<uint8_t>(c), j.b_dtype == FP8_DTYPE_E5M2);
  }

  const int64_t row_tiles = (m + kMC - 1) / kMC, col_tiles = (n + kNC - 1) / kNC;
  const int64_t tiles = row_tiles * col_tiles;
  unsigned threads = 1;
  const double macs = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if (macs >= 2 * kMinMacsPerThread) {
    const int64_t hw = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, kMaxThreads);
    threads = static_cast<unsigned>(std::min({hw, tiles, static_cast<int64_t>(macs / kMinMacsPerThread)}));
  }

  // Everything is allocated up front: the work run on threads does not throw.
  std::vector<double> a(static_cast<size_t>(round_up(m, kMR) * k)), b(static_cast<size_t>(round_up(n, kNR) * k));
  std::vector<double> acc(static_cast<size_t>(threads) * kMC * kNC);
  std::vector<uint32_t> amax(threads, 0);

  // Phase 1: pack A and B, kPackRows rows per task.
  const int64_t a_tasks = (m + kPackRows - 1) / kPackRows, b_tasks = (n + kPackRows - 1) / kPackRows;
  std::atomic<int64_t> next_pack{0};
  run_on_threads(threads, [&](unsigned) {
    for (int64_t t; (t = next_pack.fetch_add(1)) < a_tasks + b_tasks;) {
      if (t < a_tasks) {
        const int64_t r0 = t * kPackRows;
        pack_operand<kMR>(j.a, j.a_dtype, a_codes, j.a_transposed, m, k, r0, std::min(m, r0 + kPackRows), a.data(),
                          a_cells);
      } else {
        const int64_t r0 = (t - a_tasks) * kPackRows;
        pack_operand<kNR>(j.b, j.b_dtype, b_codes, j.b_transposed, n, k, r0, std::min(n, r0 + kPackRows), b.data(),
                          b_cells);
      }
    }
  });

  // Phase 2: output tiles. Every operand element has been read: d may be written now.
  std::atomic<int64_t> next_tile{0};
  run_on_threads(threads, [&](unsigned thread) {
    double* c = acc.data() + static_cast<size_t>(thread) * kMC * kNC;
    uint32_t tile_amax = 0;
    for (int64_t t; (t = next_tile.fetch_add(1)) < tiles;) {
      const int64_t r0 = t / col_tiles * kMC, c0 = t % col_tiles * kNC;
      const int64_t rows = std::min(kMC, m - r0), cols = std::min(kNC, n - c0);
      const int64_t ldc = round_up(cols, kNR);
      if (k == 0) std::fill(c, c + kMC * kNC, 0.0);
      for (int64_t k0 = 0; k0 < k; k0 += kKC) {
        const int64_t kc = std::min(kKC, k - k0);
        for (int64_t jr = 0; jr < cols; jr += kNR) {
          const double* bp = b.data() + (c0 + jr) * k + k0 * kNR;  // panel (c0 + jr) / kNR, from k0
          for (int64_t ir = 0; ir < rows; ir += kMR)
            gemm_micro_kernel(kc, a.data() + (r0 + ir) * k + k0 * kMR, bp, c + ir * ldc + jr, ldc, k0 == 0);
        }
      }
      // Epilogue, as the naive loop had it: scale in double, then bias, then the old d.
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t col = 0; col < cols; ++col) {
          double v = scale * c[r * ldc + col];
          if (j.bias) v += load_wide(j.bias, j.bias_dtype, c0 + col);
          const int64_t i = (r0 + r) * n + c0 + col;
          if (j.accumulate) v += load_wide(j.addend(), j.d_dtype, i);
          const float value = static_cast<float>(v);
          if (fp8_out) {
            tile_amax = std::max(tile_amax, abs_bits(value));
            static_cast<uint8_t*>(j.d)[i] = encode_fp8(value * d_scale, j.d_dtype == FP8_DTYPE_E5M2);
          } else {
            store_wide(j.d, j.d_dtype, i, value);
          }
        }
      }
    }
    amax[thread] = tile_amax;
  });

  if (fp8_out) {
    max_into(scaling_history(j.d_state), *std::max_element(amax.begin(), amax.end()));
    *j.d_scale_inv.ptr = j.d_state->scale_inv;
  }
}

class CpuBackend final : public Backend {
 public:
  int32_t device() const override { return FP8_DEVICE_CPU; }

  void* native_allocate(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) fail(FP8_ERR_OUT_OF_MEMORY, "could not allocate ", bytes, " bytes of host memory");
    return p;
  }
  void native_release(void* p) noexcept override { std::free(p); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void check_device_pointer(const void*, const char*) const override {}

  void set_stream(CUstream_st* stream) override {
    if (stream != nullptr)
      fail(FP8_ERR_INVALID_ARGUMENT, "stream must be NULL on the CPU backend (device FP8_DEVICE_CPU)");
  }
  CUstream_st* stream() const override { return nullptr; }
  void synchronize() override {}

  void quantize(const QuantizeJob& j) override {
    require_tensor_scales(j, "CPU");
    if (j.current) {  // slot 0 := amax(in), as the CUDA backend does, then the scale made from it
      amax({j.in, j.in_dtype, j.rows * j.cols, scaling_history(j.state), nullptr});
      const float a = scaling_history(j.state)[0];
      record_current_scale(j.state, a, recipe_scale(a, j.current_fp8_max, j.current_pow2));
    }
    const float scale = j.state->scale;
    // A folded activation: the values are act(in) or act_grad(act_x, in), for the cast and the sums.
    std::vector<float> folded;
    if (j.folds_activation()) {
      folded.resize(static_cast<size_t>(j.rows * j.cols));
      for (size_t i = 0; i < folded.size(); ++i) {
        const float v = load_wide(j.in, j.in_dtype, static_cast<int64_t>(i));
        folded[i] = j.act_forward ? act_value(j.act, v)
                                  : act_grad(j.act, load_wide(j.act_x, j.in_dtype, static_cast<int64_t>(i)), v);
      }
    }
    const void* values = j.folds_activation() ? static_cast<const void*>(folded.data()) : j.in;
    const fp8_dtype_t values_dtype = j.folds_activation() ? FP8_DTYPE_F32 : j.in_dtype;
    uint32_t amax = 0;  // (under current scaling the same amax again: slot 0 keeps it)
    for (int64_t r = 0; r < j.rows; ++r) {
      for (int64_t c = 0; c < j.cols; ++c) {
        const float x = load_wide(values, values_dtype, r * j.cols + c);
        amax = std::max(amax, abs_bits(x));
        const uint8_t q = encode_fp8(x * scale, j.e5m2);
        j.out[r * j.cols + c] = q;
        if (j.out_t_scale_inv.ptr) j.out_t[c * j.rows + r] = q;
      }
    }
    max_into(scaling_history(j.state), amax);
    *j.out_scale_inv.ptr = j.state->scale_inv;
    if (j.out_t_scale_inv.ptr) *j.out_t_scale_inv.ptr = j.state->scale_inv;
    if (j.out_scale.ptr) *j.out_scale.ptr = j.state->scale;
    if (j.dbias) add_column_sums(values, values_dtype, j.rows, j.cols, j.dbias);
  }

  void recipe_quantize(const RecipeQuantizeJob& j) override { cpu_recipe_quantize(j); }

  void bias_grad(const BiasGradJob& j) override { add_column_sums(j.dy, j.dtype, j.rows, j.cols, j.dbias); }

  void convert(const ConvertJob& j) override {
    for (int64_t i = 0; i < j.n; ++i) store_wide(j.out, j.out_dtype, i, load_wide(j.in, j.in_dtype, i));
  }

  void transpose(const TransposeJob& j) override {
    require_tensor_scales(j, "CPU");
    for (int64_t r = 0; r < j.rows; ++r)
      for (int64_t c = 0; c < j.cols; ++c) j.out[c * j.rows + r] = j.in[r * j.cols + c];
    *j.out_scale_inv.ptr = *j.in_scale_inv.ptr;
  }

  void zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }

  void optimizer_norm(const OptimizerStepJob& j) override { cpu_optimizer_norm(j); }
  void optimizer_update(const OptimizerStepJob& j) override { cpu_optimizer_update(j); }
  void optimizer_promote(const OptimizerStepJob& j) override { cpu_optimizer_promote(j); }
  void grad_accumulate(const GradAccumulateJob& j) override { cpu_grad_accumulate(j); }
  void grad_exchange(const GradExchangeJob& j) override { cpu_grad_exchange(j); }
  void gather_peer_scales(const PeerScalesJob& j) override { cpu_gather_peer_scales(j); }
  void divide(const DivideJob& j) override {
    for (int64_t i = 0; i < j.n; ++i) {
      const float q = j.x[i] / j.divisor;
      j.x[i] = q != q ? bits_float(0x7FFFFFFFu) : q;  // canonical NaN, as the GPU's division
    }
  }
  void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) override {
    for (size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  }

  void dequantize(const DequantizeJob& j) override {
    require_tensor_scales(j, "CPU");
    const float scale_inv = *j.scale_inv.ptr;
    for (int64_t i = 0; i < j.n; ++i) store_wide(j.out, j.out_dtype, i, dequantize_fp8(j.in[i], j.e5m2, scale_inv));
  }

  void amax(const AmaxJob& j) override {
    uint32_t amax = 0;
    for (int64_t i = 0; i < j.n; ++i) amax = std::max(amax, abs_bits(load_wide(j.in, j.dtype, i)));
    *j.out = bits_float(amax);
    if (j.accumulate) max_into(j.accumulate, amax);
  }

  void scaling_update(const ScalingUpdateJob& j) override {
    for (int32_t s = 0; s < j.count; ++s) {
      const ScalingUpdateItem& item = j.items[s];
      ScalingHeader* h = item.state;
      float* hist = scaling_history(h);
      if (!is_finite_bits(abs_bits(hist[0]))) {
        ++h->nonfinite_count;
        hist[0] = 0.0f;
      }
      uint32_t a = float_bits(hist[0]);
      if (j.algo_max)
        for (int32_t k = 1; k < j.history_len; ++k) a = std::max(a, float_bits(hist[k]));
      if (scaling_recomputes(h->update_count, j.interval)) {
        h->scale = next_scale(bits_float(a), item.fp8_max_scaled, h->scale, j.pow2_scales);
        h->scale_inv = 1.0f / h->scale;
      }
      ++h->update_count;
      for (int32_t k = j.history_len - 1; k > 0; --k) hist[k] = hist[k - 1];
      hist[0] = 0.0f;
    }
  }

  void activation(const ActivationJob& j) override {
    require_tensor_scales(j, "CPU");
    const bool fp8_out = j.out_state != nullptr;
    const float scale = fp8_out ? j.out_state->scale : 1.0f;
    uint32_t amax = 0;
    auto put = [&](int64_t i, float v) {
      if (fp8_out) {
        amax = std::max(amax, abs_bits(v));
        static_cast<uint8_t*>(j.out)[i] = encode_fp8(v * scale, j.out_dtype == FP8_DTYPE_E5M2);
      } else {
        store_wide(j.out, j.out_dtype, i, j.base ? load_wide(j.base, j.out_dtype, i) + v : v);
      }
    };
    const int64_t half = j.cols / 2;
    for (int64_t r = 0; r < j.rows; ++r) {
      if (j.act == FP8_ACTIVATION_SWIGLU) {
        for (int64_t c = 0; c < half; ++c) {
          const float a = load_wide(j.x, j.x_dtype, r * j.cols + c), b = load_wide(j.x, j.x_dtype, r * j.cols + half + c);
          if (!j.backward) {
            put(r * half + c, swiglu(a, b));
          } else {
            const float dy = load_wide(j.dy, j.x_dtype, r * half + c);
            put(r * j.cols + c, swiglu_grad_a(a, b, dy));
            put(r * j.cols + half + c, swiglu_grad_b(a, dy));
          }
        }
        continue;
      }
      for (int64_t c = 0; c < j.cols; ++c) {
        const int64_t i = r * j.cols + c;
        const float x = load_wide(j.x, j.x_dtype, i);
        if (!j.backward) {
          put(i, j.act == FP8_ACTIVATION_RELU ? relu(x) : gelu(x));
        } else {
          const float dy = load_wide(j.dy, j.x_dtype, i);
          put(i, j.act == FP8_ACTIVATION_RELU ? relu_grad(x, dy) : gelu_grad(x, dy));
        }
      }
    }
    if (fp8_out) {
      max_into(scaling_history(j.out_state), amax);
      *j.out_scale_inv.ptr = j.out_state->scale_inv;
    }
  }

  void norm(const NormJob& j) override {
    require_tensor_scales(j, "CPU");
    const int64_t d = j.cols;
    if (!j.backward) {
      const bool fp8_out = j.y_state != nullptr;
      const float scale = fp8_out ? j.y_state->scale : 1.0f;
      uint32_t amax = 0;
      for (int64_t r = 0; r < j.rows; ++r) {
        double mean = 0, sq = 0;
        for (int64_t c = 0; c < d; ++c) mean += load_wide(j.x, j.x_dtype, r * d + c);
        mean = j.rms ? 0.0 : mean / static_cast<double>(d);
        for (int64_t c = 0; c < d; ++c) {
          const double v = load_wide(j.x, j.x_dtype, r * d + c) - mean;
          sq += v * v;
        }
        const float rstd = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(d) + j.eps));
        if (j.mean) j.mean[r] = static_cast<float>(mean);
        if (j.rstd) j.rstd[r] = rstd;
        for (int64_t c = 0; c < d; ++c) {
          const double xhat = (load_wide(j.x, j.x_dtype, r * d + c) - mean) * rstd;
          const float y = static_cast<float>(xhat * j.gamma[c] + (j.beta ? j.beta[c] : 0.0f));
          if (fp8_out) {
            amax = std::max(amax, abs_bits(y));
            static_cast<uint8_t*>(j.y)[r * d + c] = encode_fp8(y * scale, j.y_dtype == FP8_DTYPE_E5M2);
          } else {
            store_wide(j.y, j.y_dtype, r * d + c, y);
          }
        }
      }
      if (fp8_out) {
        max_into(scaling_history(j.y_state), amax);
        *j.y_scale_inv.ptr = j.y_state->scale_inv;
      }
      return;
    }
    std::vector<double> dgamma(static_cast<size_t>(d), 0.0), dbeta(static_cast<size_t>(d), 0.0);
    for (int64_t r = 0; r < j.rows; ++r) {
      const double mean = j.rms ? 0.0 : j.mean[r], rstd = j.rstd[r];
      double mean_g = 0, mean_gx = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double xhat = (load_wide(j.x, j.x_dtype, r * d + c) - mean) * rstd;
        const double dy = load_wide(j.dy, j.dy_dtype, r * d + c);
        const double g = dy * j.gamma[c];
        mean_g += g;
        mean_gx += g * xhat;
        dgamma[static_cast<size_t>(c)] += dy * xhat;
        dbeta[static_cast<size_t>(c)] += dy;
      }
      mean_g = j.rms ? 0.0 : mean_g / static_cast<double>(d);
      mean_gx /= static_cast<double>(d);
      for (int64_t c = 0; c < d; ++c) {
        const double xhat = (load_wide(j.x, j.x_dtype, r * d + c) - mean) * rstd;
        const double g = load_wide(j.dy, j.dy_dtype, r * d + c) * j.gamma[c];
        const float v = static_cast<float>(rstd * (g - mean_g - xhat * mean_gx));
        store_wide(j.dx, j.dx_dtype, r * d + c, j.dx_base ? load_wide(j.dx_base, j.dx_dtype, r * d + c) + v : v);
      }
    }
    for (int64_t c = 0; c < d; ++c) {
      const size_t i = static_cast<size_t>(c);
      j.dgamma[c] = static_cast<float>(j.accumulate_params ? j.dgamma[c] + dgamma[i] : dgamma[i]);
      if (j.dbeta) j.dbeta[c] = static_cast<float>(j.accumulate_params ? j.dbeta[c] + dbeta[i] : dbeta[i]);
    }
  }

  void gemm(const GemmJob& j) override {
    check_gemm_scales(j, "CPU");
    cpu_gemm(j);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace fp8
