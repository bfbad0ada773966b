// libfp8's FP8 gradient exchange against NCCL's all-reduces, on every GPU of the machine (N =
// cudaGetDeviceCount(); every rank in this process on a thread of its own; it runs with N = 1 too).
// Paths, for gradients of 2^20 .. 2^28 elements:
//  - libfp8: one Linear "fc" (no bias, rows x cols = count) converted with "backend=msamp,
//    opt_level=O2, small_layer_fallback=0" (HYBRID: E5M2 gradients), data-parallel over a borrowed
//    NCCL communicator (fp8_comm_wrap_nccl); rank k's gradient is fp8_model_accumulate_grad of
//    N(0, (1e-3 (1 + k))^2) values; timed: fp8_model_sync_grads alone, twice: the peer exchange
//    (FP8_PEER_EXCHANGE=on: each rank reads its piece of every rank's codes over NVLink, sums,
//    requantises and writes the result into every rank's gradient, between two GPU barriers), and
//    over NCCL's collectives (FP8_PEER_EXCHANGE=off: in slices, all-to-all of the codes with the
//    scales, FP32 sums and requantisation on a second stream, all-gather);
//  - NCCL fp32 and bf16 all-reduce (sum, then / N);
//  - NCCL transfers alone (N > 1): the bytes libfp8's exchange moves, by NCCL without any sums
//    (an all-to-all of the codes as grouped ncclSend/ncclRecv, then ncclAllGather of the pieces);
//  - NCCL's native FP8 all-reduce (ncclFloat8e5m2, ncclFloat8e4m3; sum): every rank encodes with
//    one scale agreed beforehand, fp8_max / (N * max over the ranks of amax), which leaves room for
//    the sum of N ranks; the sum is decoded and divided by N (encode and decode are not timed).
// Every path starts from the same inputs: rank k's FP8 gradient as libfp8 stores it after
// accumulate_grad (its E5M2 codes times its scale_inv); the NCCL paths get those values (fp32 as
// they are, bf16 rounded to nearest even, FP8 encoded as above with libfp8's rule). Timing: each
// repetition, every rank synchronises its stream, the ranks meet at a host barrier, each times the
// operation with CUDA events on its own stream; the repetition's time is the slowest rank's; the
// median of 20 after 3 warm-ups. Bus bandwidth = 2 (N-1)/N * count * wire bytes per element / time
// (4 fp32, 2 bf16, 1 FP8 and libfp8), 0 at N = 1.
//
// Errors (at 2^20 and 2^24): relative L2 error ||result - ref|| / ||ref||, ref = the float64 mean
// over the ranks of the inputs above. Two are shown per path: (a) "wire", the path's own result
// (what the all-reduce delivered, decoded and divided by N), and (b) "stored E5M2", that result
// requantised as an E5M2 gradient (scale = 57344 / amax(result), round to nearest even: an
// FP8 gradient requantised with its own amax). (b) is what matters for training at MS-AMP O1..O3: there the
// averaged gradient is stored in FP8 whatever the wire carried, so an fp32 or bf16 all-reduce's
// precision ends in one more E5M2 rounding, and that stored gradient is what the optimizer sees.
// libfp8's exchange already ends in that one rounding, so its (a) and (b) are both its decoded
// exchanged gradient.
//
// Checks (exit status 1 when one fails; PASS/FAIL lines): at every size, every rank ends with rank
// 0's codes and scale_inv; at 2^20 and 2^24, the codes and scale are those of the documented rule
// (core/exchange_rule.hpp: the FP32 sum in rank order / N, scale = 57344 / the mean of the senders'
// amaxes, evaluated on the host; a group of one rank keeps its gradient as it is), and libfp8's
// stored-E5M2 error is below 0.1 (E5M2 has 2 mantissa bits: one rounding gives about 0.05).
// NCCL_NVLS_ENABLE is set to 0 unless already set (NVLink multicast off).
//
// Usage: bench_allreduce [out.json]   (default bench_allreduce.json; ALLREDUCE_MIN_LOG2 and
//        ALLREDUCE_MAX_LOG2 = 20..28 bound the sizes, default 20 and 28)
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.hpp"
#include "core/exchange_rule.hpp"

namespace {

constexpr int kWarm = 3, kReps = 20;
constexpr double kErrorBound = 0.1;  // libfp8's stored-E5M2 relative L2 error must stay below this
constexpr double kTarget = 0.55;     // libfp8 time / NCCL bf16 time at 2^28 (the target)
constexpr int kLog2[] = {20, 22, 24, 26, 28};
bool error_size(int lg) {
  return lg == 20 || lg == 24;
}

enum Path { kLibfp8 = 0, kF32 = 1, kBf16 = 2, kE5m2 = 3, kE4m3 = 4, kTransfers = 5, kLibfp8Nccl = 6, kPaths = 7 };
const char* const kPathName[kPaths] = {
    "libfp8 FP8 exchange (E5M2)",   "NCCL fp32", "NCCL bf16", "NCCL fp8 e5m2", "NCCL fp8 e4m3", "NCCL transfers alone",
    "libfp8 FP8 exchange over NCCL"};
const char* const kPathKey[kPaths] = {"libfp8",        "nccl_fp32",      "nccl_bf16",  "nccl_fp8_e5m2",
                                      "nccl_fp8_e4m3", "nccl_transfers", "libfp8_nccl"};
constexpr int kWire[kPaths] = {1, 4, 2, 1, 1, 1, 1};  // bytes per element on the wire
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

using fp8bench::die;
using fp8bench::event_ms;
using fp8bench::SpinBarrier;
using fp8bench::this_rank;
#define RCHECK_NCCL(call)                                                                 \
  do {                                                                                    \
    const ncclResult_t r_ = (call);                                                       \
    if (r_ != ncclSuccess) die(#call, ncclGetErrorString(r_), ncclGetLastError(nullptr)); \
  } while (0)

struct Row {
  int lg = 0;
  int path = 0;
  double ms = 0;
  double err_wire = kNaN, err_stored = kNaN;  // NaN: not measured at this size
};

struct Shared {
  int n = 0;
  std::vector<int> sizes;  // log2 of the element counts
  std::vector<fp8_context_t*> ctxs;
  std::vector<ncclComm_t> nccls;
  std::vector<fp8_comm_t*> comms;
  bool nccl_fp8 = true;  // NCCL can reduce FP8 on every GPU
  SpinBarrier* barrier = nullptr;
  std::atomic<int> finished{0};
  // Per rank, for the size being run.
  std::vector<std::vector<uint8_t>> in_codes, out_codes;  // the gradient before and after the exchange
  std::vector<float> in_scale_inv, out_scale_inv, in_amax;
  std::vector<std::vector<float>> ms;  // [rank][rep]
  // Rank 0's.
  std::vector<double> ref;  // the float64 mean of the inputs (error sizes only)
  double ref_norm = 0;
  std::vector<Row> rows;
  int checks = 0, failures = 0;
};

std::string label(int lg) {
  return "2^" + std::to_string(lg);
}

void check(Shared& s, bool ok, const std::string& what) {
  ++s.checks;
  if (!ok) ++s.failures;
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  std::fflush(stdout);
}

// Rank k's input value i: its stored E5M2 code times its scale_inv, in float.
float input(const Shared& s, int k, size_t i) {
  return fp8::dequantize_fp8(s.in_codes[static_cast<size_t>(k)][i], true, s.in_scale_inv[static_cast<size_t>(k)]);
}

// Rank 0: (a) and (b) of `result` against s.ref (see the top).
void errors(const Shared& s, const std::vector<float>& result, double& wire, double& stored) {
  double e2 = 0;
  uint32_t amax = 0;
  for (size_t i = 0; i < result.size(); ++i) {
    const double d = static_cast<double>(result[i]) - s.ref[i];
    e2 += d * d;
    amax = std::max(amax, fp8::abs_bits(result[i]));
  }
  // Requantised as an E5M2 gradient with the result's own amax (scale = 57344 / amax).
  const float scale = fp8::fp8_scale_for_bound(fp8::bits_float(amax), true);
  const float scale_inv = 1.0f / scale;
  double q2 = 0;
  for (size_t i = 0; i < result.size(); ++i) {
    const float q = fp8::dequantize_rn(fp8::encode_fp8_rn(fp8::mul_rn(result[i], scale), true), true, scale_inv);
    const double d = static_cast<double>(q) - s.ref[i];
    q2 += d * d;
  }
  wire = std::sqrt(e2) / s.ref_norm;
  stored = std::sqrt(q2) / s.ref_norm;
}

// Rank 0, after every rank stored its input and libfp8's result: the checks, and at the error
// sizes the reference and libfp8's error (returned; NaN elsewhere).
double check_libfp8(Shared& s, int lg) {
  const size_t count = s.in_codes[0].size();
  const int n = s.n;
  int64_t bad_codes = 0;
  int bad_scales = 0;
  for (int k = 1; k < n; ++k) {
    const std::vector<uint8_t>& got = s.out_codes[static_cast<size_t>(k)];
    for (size_t i = 0; i < count; ++i) bad_codes += got[i] != s.out_codes[0][i];
    bad_scales += fp8::float_bits(s.out_scale_inv[static_cast<size_t>(k)]) != fp8::float_bits(s.out_scale_inv[0]);
  }
  check(s, bad_codes == 0 && bad_scales == 0,
        "[" + label(lg) + "] libfp8: every rank holds rank 0's averaged gradient (" + std::to_string(n) +
            " ranks; codes differing from rank 0's: " + std::to_string(bad_codes) +
            ", scale_inv differing: " + std::to_string(bad_scales) + ")");
  if (!error_size(lg)) return kNaN;

  // The reference.
  s.ref.assign(count, 0.0);
  double r2 = 0;
  for (size_t i = 0; i < count; ++i) {
    double sum = 0;
    for (int k = 0; k < n; ++k) sum += static_cast<double>(input(s, k, i));
    s.ref[i] = sum / n;
    r2 += s.ref[i] * s.ref[i];
  }
  s.ref_norm = std::sqrt(r2);

  // The documented rule, on the host (one rank keeps its gradient as it is).
  std::vector<uint8_t> want(s.in_codes[0]);
  float want_scale_inv = s.in_scale_inv[0];
  if (n > 1) {
    std::vector<fp8::GradScales> senders(static_cast<size_t>(n), fp8::GradScales{});
    // Each sender's amax: its largest decoded |value| (what accumulate_grad records).
    for (int k = 0; k < n; ++k) {
      fp8::GradScales& g = senders[static_cast<size_t>(k)];
      g.scale_inv = s.in_scale_inv[static_cast<size_t>(k)];
      uint32_t top = 0;
      for (size_t i = 0; i < count; ++i) top = std::max(top, fp8::abs_bits(input(s, k, i)));
      g.amax = fp8::bits_float(top);
    }
    const float bound = fp8::exchange_bound(senders.data(), n, 1, 0);
    fp8::GradScales fin{};
    fp8::exchange_finish(fin, bound, true);
    const float scale = fp8::fp8_scale_for_bound(bound, true);
    std::vector<uint8_t> column(static_cast<size_t>(n));
    for (size_t i = 0; i < count; ++i) {
      for (int k = 0; k < n; ++k) column[static_cast<size_t>(k)] = s.in_codes[static_cast<size_t>(k)][i];
      const float mean = fp8::exchange_mean(column.data(), 1, n, 0, senders.data(), 1, 0, true);
      want[i] = fp8::encode_fp8_rn(fp8::mul_rn(mean, scale), true);
    }
    want_scale_inv = fin.scale_inv;
  }
  int64_t off_rule = 0;
  for (size_t i = 0; i < count; ++i) off_rule += want[i] != s.out_codes[0][i];
  const bool scale_ok = fp8::float_bits(want_scale_inv) == fp8::float_bits(s.out_scale_inv[0]);
  char buf[160];
  std::snprintf(buf, sizeof buf, "codes differing: %lld of %lld, scale_inv %.9g (rule: %.9g)",
                static_cast<long long>(off_rule), static_cast<long long>(count),
                static_cast<double>(s.out_scale_inv[0]), static_cast<double>(want_scale_inv));
  check(s, off_rule == 0 && scale_ok,
        "[" + label(lg) + "] libfp8: the averaged gradient is bit for bit the documented rule's (" + buf + ")");

  std::vector<float> result(count);
  for (size_t i = 0; i < count; ++i) result[i] = fp8::dequantize_fp8(s.out_codes[0][i], true, s.out_scale_inv[0]);
  double wire = 0, stored = 0;
  errors(s, result, wire, stored);  // (stored: requantised once more; libfp8's own is `wire`)
  std::snprintf(buf, sizeof buf, "%.3e < %.2f", wire, kErrorBound);
  check(s, wire < kErrorBound, "[" + label(lg) + "] libfp8: relative L2 error of the averaged E5M2 gradient " + buf);
  return wire;
}

// Rank 0 after the timed repetitions: the row (slowest rank per repetition, median), printed.
void add_row(Shared& s, int lg, int path) {
  std::vector<double> reps;
  for (int r = 0; r < kReps; ++r) {
    double t = 0;
    for (int k = 0; k < s.n; ++k) t = std::max(t, static_cast<double>(s.ms[static_cast<size_t>(k)][r]));
    reps.push_back(t);
  }
  std::sort(reps.begin(), reps.end());
  Row row;
  row.lg = lg;
  row.path = path;
  row.ms = reps[reps.size() / 2];
  s.rows.push_back(row);
  const double count = std::ldexp(1.0, lg);
  const double bus = s.n > 1 ? 2.0 * (s.n - 1) / s.n * count * kWire[path] / (row.ms * 1e6) : 0.0;
  std::printf("[%s] %-28s %10.4f ms %9.1f GB/s bus\n", label(lg).c_str(), kPathName[path], row.ms, bus);
  std::fflush(stdout);
}

// The timed repetitions of one path on rank k: `prepare` untimed, `op` timed (see the top).
void time_path(Shared& s, int k, int lg, int path, cudaStream_t st, cudaEvent_t a, cudaEvent_t b,
               const std::function<void()>& prepare, const std::function<void()>& op) {
  for (int it = 0; it < kWarm + kReps; ++it) {
    if (prepare) prepare();
    RCHECK_CUDA(cudaStreamSynchronize(st));
    s.barrier->wait();
    const float t = event_ms(st, a, b, op);
    if (it >= kWarm) s.ms[static_cast<size_t>(k)][it - kWarm] = t;
  }
  ncclResult_t async = ncclSuccess;
  RCHECK_NCCL(ncclCommGetAsyncError(s.nccls[static_cast<size_t>(k)], &async));
  if (async != ncclSuccess) die("ncclCommGetAsyncError", "NCCL", ncclGetErrorString(async));
  s.barrier->wait();
  if (k == 0) add_row(s, lg, path);
}

// Rank k's input in `path`'s wire format (fp32, bf16 RNE, or FP8 codes of value * scale).
void stage(const Shared& s, int k, int path, float scale, std::vector<unsigned char>& out) {
  const size_t count = s.in_codes[static_cast<size_t>(k)].size();
  out.resize(count * static_cast<size_t>(kWire[path]));
  for (size_t i = 0; i < count; ++i) {
    const float x = input(s, k, i);
    if (path == kF32) {
      std::memcpy(&out[4 * i], &x, 4);
    } else if (path == kBf16) {
      const uint16_t h = fp8::float_to_bf16(x);
      std::memcpy(&out[2 * i], &h, 2);
    } else {
      out[i] = fp8::encode_fp8(x * scale, path == kE5m2);
    }
  }
}

// Rank 0: the all-reduced sum in `path`'s wire format, decoded and divided by N.
std::vector<float> unstage(const Shared& s, int path, float scale, const std::vector<unsigned char>& sum) {
  const size_t count = sum.size() / static_cast<size_t>(kWire[path]);
  const float n = static_cast<float>(s.n);
  std::vector<float> r(count);
  for (size_t i = 0; i < count; ++i) {
    if (path == kF32) {
      float x = 0;
      std::memcpy(&x, &sum[4 * i], 4);
      r[i] = x / n;
    } else if (path == kBf16) {
      uint16_t h = 0;
      std::memcpy(&h, &sum[2 * i], 2);
      r[i] = fp8::bf16_to_float(h) / n;
    } else {
      const double x = fp8::decode_fp8(sum[i], path == kE5m2);
      r[i] = static_cast<float>(x / (static_cast<double>(scale) * s.n));
    }
  }
  return r;
}

ncclDataType_t nccl_type(int path) {
  switch (path) {
    case kF32:
      return ncclFloat32;
    case kBf16:
      return ncclBfloat16;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
    case kE5m2:
      return ncclFloat8e5m2;
    case kE4m3:
      return ncclFloat8e4m3;
#endif
    default:  // (an older nccl.h has no FP8 types: those paths are skipped)
      return ncclNumTypes;
  }
}

void rank_main(Shared& s, int k) {
  this_rank = k;
  const size_t kk = static_cast<size_t>(k);
  RCHECK_CUDA(cudaSetDevice(k));  // (libfp8 sets the device for its own calls; this is for ours)
  fp8_context_t* c = s.ctxs[kk];
  cudaStream_t st = nullptr;
  RCHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  RCHECK_FP8(fp8_context_set_stream(c, st));
  cudaEvent_t a, b;
  RCHECK_CUDA(cudaEventCreate(&a));
  RCHECK_CUDA(cudaEventCreate(&b));
  std::vector<unsigned char> staging;

  for (int lg : s.sizes) {
    const int64_t count = int64_t{1} << lg;
    const int64_t rows = int64_t{1} << (lg / 2), cols = count / rows;
    const size_t bytes = static_cast<size_t>(count);

    // 1. libfp8: the peer exchange, then the exchange over NCCL's collectives.
    for (const int path : {kLibfp8, kLibfp8Nccl}) {
      // (Read once per layout, by each rank's first exchange below: set for all of them here.)
      s.barrier->wait();  // (every rank is done with the previous mode)
      if (k == 0) setenv("FP8_PEER_EXCHANGE", path == kLibfp8 ? "on" : "off", 1);
      s.barrier->wait();
      fp8_model_t* model = nullptr;
      RCHECK_FP8(fp8_model_create(&model, c));
      RCHECK_FP8(fp8_model_add_linear(model, "fc", cols, rows, 0, nullptr));
      fp8_recipe_t* recipe = nullptr;
      RCHECK_FP8(fp8_recipe_create(&recipe));
      RCHECK_FP8(fp8_recipe_parse(recipe, "backend=msamp, opt_level=O2, small_layer_fallback=0"));
      RCHECK_FP8(fp8_convert_model(model, recipe, nullptr));
      fp8_recipe_destroy(recipe);
      RCHECK_FP8(fp8_model_set_comm(model, s.comms[kk]));  // (collective: every rank's thread)
      fp8_tensor_t* grad = nullptr;
      RCHECK_FP8(fp8_model_parameter_at(model, 0, nullptr, nullptr, &grad));  // (after set_comm's new layout)
      fp8_dtype_t grad_dtype = 0;
      int64_t grad_numel = 0;
      RCHECK_FP8(fp8_tensor_dtype(grad, &grad_dtype));
      RCHECK_FP8(fp8_tensor_numel(grad, &grad_numel));
      if (grad_dtype != FP8_DTYPE_E5M2 || grad_numel != count)
        die("fp8_model_parameter_at(model, 0)", fp8_dtype_name(grad_dtype),
            "fc.weight's gradient is not E5M2 of `count` elements");
      fp8_tensor_t* g = fp8bench::matrix(c, FP8_DTYPE_F32, rows, cols);
      fp8bench::fill_normal(g, 1e-3f * static_cast<float>(1 + k),
                            7919u * static_cast<uint32_t>(k + 1) + static_cast<uint32_t>(lg));
      const auto prepare = [&] {
        RCHECK_FP8(fp8_model_zero_grad(model));
        RCHECK_FP8(fp8_model_accumulate_grad(model, 0, g));
      };
      // The input every path starts from, then one exchange to check.
      prepare();
      s.in_codes[kk].resize(bytes);
      RCHECK_FP8(fp8_tensor_copy_to_host(grad, s.in_codes[kk].data(), bytes));
      RCHECK_FP8(fp8_tensor_get_scale_inv(grad, &s.in_scale_inv[kk]));
      float amax = 0;
      for (size_t i = 0; i < bytes; ++i) amax = std::max(amax, std::fabs(input(s, k, i)));
      s.in_amax[kk] = amax;
      RCHECK_FP8(fp8_model_sync_grads(model));
      s.out_codes[kk].resize(bytes);
      RCHECK_FP8(fp8_tensor_copy_to_host(grad, s.out_codes[kk].data(), bytes));
      RCHECK_FP8(fp8_tensor_get_scale_inv(grad, &s.out_scale_inv[kk]));
      s.barrier->wait();
      const double libfp8_error = k == 0 ? check_libfp8(s, lg) : kNaN;
      time_path(s, k, lg, path, st, a, b, prepare, [&] { RCHECK_FP8(fp8_model_sync_grads(model)); });
      if (k == 0) s.rows.back().err_wire = s.rows.back().err_stored = libfp8_error;
      fp8_tensor_destroy(g);
      fp8_model_destroy(model);
      std::vector<uint8_t>().swap(s.out_codes[kk]);  // (rank 0 read them before the barriers above)
    }

    // 2-5. NCCL, from the same inputs.
    float max_amax = 0;  // (every rank stored its amax before the first barrier above)
    for (float x : s.in_amax) max_amax = std::max(max_amax, x);
    void *send = nullptr, *recv = nullptr;
    RCHECK_CUDA(cudaMalloc(&send, 4 * bytes));
    RCHECK_CUDA(cudaMalloc(&recv, 4 * bytes));
    for (int path = kF32; path <= kTransfers; ++path) {
      if (path == kTransfers) {
        // libfp8's bytes moved by NCCL alone, unsliced: the codes' all-to-all (grouped send/recv),
        // then the all-gather of the pieces; no sums (the wire's share of the exchange's time).
        if (s.n == 1) continue;
        const size_t piece = bytes / static_cast<size_t>(s.n);
        char* in = static_cast<char*>(send);
        char* out = static_cast<char*>(recv);
        time_path(s, k, lg, path, st, a, b, nullptr, [&] {
          RCHECK_NCCL(ncclGroupStart());
          for (int p = 0; p < s.n; ++p) {
            RCHECK_NCCL(ncclSend(in + p * piece, piece, ncclUint8, p, s.nccls[kk], st));
            RCHECK_NCCL(ncclRecv(out + p * piece, piece, ncclUint8, p, s.nccls[kk], st));
          }
          RCHECK_NCCL(ncclGroupEnd());
          RCHECK_NCCL(ncclAllGather(out + kk * piece, in, piece, ncclUint8, s.nccls[kk], st));
        });
        continue;
      }
      const bool fp8_path = path == kE5m2 || path == kE4m3;
      if (fp8_path && !s.nccl_fp8) {
        if (k == 0)
          std::printf("[%s] %-28s skipped: NCCL cannot reduce FP8 here\n", label(lg).c_str(), kPathName[path]);
        continue;
      }
      const float fp8_max = fp8::fp8_spec(path == kE5m2).max_value;
      const float scale = fp8_path && max_amax > 0.0f ? fp8_max / (static_cast<float>(s.n) * max_amax) : 1.0f;
      stage(s, k, path, scale, staging);
      RCHECK_CUDA(cudaMemcpyAsync(send, staging.data(), staging.size(), cudaMemcpyHostToDevice, st));
      RCHECK_CUDA(cudaStreamSynchronize(st));
      const ncclDataType_t type = nccl_type(path);
      time_path(s, k, lg, path, st, a, b, nullptr,
                [&] { RCHECK_NCCL(ncclAllReduce(send, recv, bytes, type, ncclSum, s.nccls[kk], st)); });
      if (k == 0 && error_size(lg)) {  // (the others wait for rank 0 at the next barrier)
        RCHECK_CUDA(cudaMemcpyAsync(staging.data(), recv, staging.size(), cudaMemcpyDeviceToHost, st));
        RCHECK_CUDA(cudaStreamSynchronize(st));
        Row& row = s.rows.back();
        errors(s, unstage(s, path, scale, staging), row.err_wire, row.err_stored);
        std::printf("[%s] %-28s rel. L2 error %.3e (wire), %.3e (stored as E5M2)\n", label(lg).c_str(), kPathName[path],
                    row.err_wire, row.err_stored);
        std::fflush(stdout);
      }
    }
    RCHECK_CUDA(cudaFree(send));
    RCHECK_CUDA(cudaFree(recv));
    s.barrier->wait();
  }

  RCHECK_FP8(fp8_context_set_stream(c, nullptr));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(st);
  s.finished.fetch_add(1);
}

std::string num(double v, const char* fmt) {
  if (std::isnan(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// The table, the ratio at 2^28 and the JSON rows, from rank 0's rows.
void report(const Shared& s, FILE* json) {
  const int n = s.n;
  const auto bf16_ms = [&s](int lg) {
    for (const Row& r : s.rows)
      if (r.lg == lg && r.path == kBf16) return r.ms;
    return kNaN;
  };
  std::printf("\n| elements | path | ms | bus GB/s | x bf16 time | rel. error (wire) | rel. error (stored E5M2) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::fprintf(json, "[\n");
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const Row& r = s.rows[i];
    const double count = std::ldexp(1.0, r.lg);
    const double bus = n > 1 ? 2.0 * (n - 1) / n * count * kWire[r.path] / (r.ms * 1e6) : 0.0;
    const double x_bf16 = r.ms / bf16_ms(r.lg);
    const auto err = [](double v) { return std::isnan(v) ? std::string("–") : num(v, "%.3e"); };
    std::printf("| %s | %s | %.4f | %.1f | %s | %s | %s |\n", label(r.lg).c_str(), kPathName[r.path], r.ms, bus,
                std::isnan(x_bf16) ? "–" : num(x_bf16, "%.3f").c_str(), err(r.err_wire).c_str(),
                err(r.err_stored).c_str());
    std::fprintf(json,
                 "%s {\"name\": \"%s %s, %d GPUs\", \"ms\": %.5f, \"path\": \"%s\", \"elements\": %lld, \"gpus\": %d, "
                 "\"wire_bytes\": %d, \"bus_gbs\": %.3f, \"x_bf16\": %s, \"err_wire\": %s, \"err_stored_e5m2\": %s, "
                 "\"checks\": \"%s\"}",
                 i ? ",\n" : "", kPathKey[r.path], label(r.lg).c_str(), n, r.ms, kPathKey[r.path],
                 static_cast<long long>(count), n, kWire[r.path], bus, num(x_bf16, "%.5f").c_str(),
                 num(r.err_wire, "%.6e").c_str(), num(r.err_stored, "%.6e").c_str(), s.failures ? "FAILED" : "passed");
  }
  std::fprintf(json, "\n]\n");
  std::fclose(json);
  for (const int path : {kLibfp8, kLibfp8Nccl}) {
    double lib28 = kNaN;
    for (const Row& r : s.rows)
      if (r.lg == 28 && r.path == path) lib28 = r.ms;
    const double ratio = lib28 / bf16_ms(28);
    if (std::isnan(ratio))
      std::printf("\n%s time / NCCL bf16 time at 2^28: not measured", kPathName[path]);
    else
      std::printf("\n%s time / NCCL bf16 time at 2^28, %d GPU%s: %.3f (issue target <= %.2f: %s)%s", kPathName[path], n,
                  n > 1 ? "s" : "", ratio, kTarget, ratio <= kTarget ? "met" : "NOT met",
                  n == 1 ? " (one GPU: nothing crosses a link)" : "");
  }
  std::printf("\n");
  std::printf("checks: %d of %d passed%s\n", s.checks - s.failures, s.checks, s.failures ? " (see FAIL above)" : "");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  fp8bench::die_program = "bench_allreduce";  // (its failures name the program)
  setenv("NCCL_NVLS_ENABLE", "0", 0);         // NVLink multicast off (before any NCCL call)
  const char* json_path = argc > 1 ? argv[1] : "bench_allreduce.json";
  int bounds[2] = {20, 28};
  const char* names[2] = {"ALLREDUCE_MIN_LOG2", "ALLREDUCE_MAX_LOG2"};
  for (int b = 0; b < 2; ++b)
    if (const char* e = std::getenv(names[b])) {
      char* end = nullptr;
      const long v = std::strtol(e, &end, 10);
      if (*e == '\0' || *end != '\0' || v < 20 || v > 28) {
        std::fprintf(stderr, "bench_allreduce: %s=%s; expected 20..28\n", names[b], e);
        return 2;
      }
      bounds[b] = static_cast<int>(v);
    }
  int n = 0;
  const cudaError_t device_error = cudaGetDeviceCount(&n);
  if (device_error != cudaSuccess || n < 1) {
    std::fprintf(stderr, "bench_allreduce: needs at least one CUDA GPU; cudaGetDeviceCount: %s (%d devices)\n",
                 device_error != cudaSuccess ? cudaGetErrorString(device_error) : "no error", n);
    return 1;
  }

  FILE* json = std::fopen(json_path, "w");
  if (!json) {
    std::fprintf(stderr, "bench_allreduce: cannot write %s\n", json_path);
    return 1;
  }

  Shared s;
  s.n = n;
  for (int lg : kLog2)
    if (lg >= bounds[0] && lg <= bounds[1]) s.sizes.push_back(lg);
  s.ctxs.resize(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    RCHECK_FP8(fp8_context_create(&s.ctxs[static_cast<size_t>(k)], k));
    fp8_device_info_t info;
    fp8_device_info_init(&info);
    RCHECK_FP8(fp8_device_query(k, &info));
    s.nccl_fp8 = s.nccl_fp8 && info.fp8_nccl_reduction == 1;
    std::printf("GPU %d: %s, compute capability %d.%d, NCCL FP8 reduction: %s\n", k, info.name,
                info.compute_capability / 10, info.compute_capability % 10, info.fp8_nccl_reduction ? "yes" : "no");
  }
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 24, 0)
  s.nccl_fp8 = false;  // (built against an nccl.h without ncclFloat8e4m3 and ncclFloat8e5m2)
#endif
  int nccl_version = 0;
  RCHECK_NCCL(ncclGetVersion(&nccl_version));
  s.nccls.resize(static_cast<size_t>(n));
  std::vector<int> devices(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) devices[static_cast<size_t>(k)] = k;
  RCHECK_NCCL(ncclCommInitAll(s.nccls.data(), n, devices.data()));
  s.comms.resize(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k)
    RCHECK_FP8(fp8_comm_wrap_nccl(&s.comms[static_cast<size_t>(k)], s.ctxs[static_cast<size_t>(k)],
                                  s.nccls[static_cast<size_t>(k)]));
  std::printf(
      "all-reduce of one gradient over %d GPU%s (NCCL %d.%d.%d, libfp8 %s, NCCL_NVLS_ENABLE=%s); median of %d "
      "after %d warm-ups, the slowest rank's time\n",
      n, n > 1 ? "s" : "", nccl_version / 10000, nccl_version / 100 % 100, nccl_version % 100, fp8_version_string(),
      std::getenv("NCCL_NVLS_ENABLE"), kReps, kWarm);
  std::fflush(stdout);

  s.in_codes.resize(static_cast<size_t>(n));
  s.out_codes.resize(static_cast<size_t>(n));
  s.in_scale_inv.assign(static_cast<size_t>(n), 0.0f);
  s.out_scale_inv.assign(static_cast<size_t>(n), 0.0f);
  s.in_amax.assign(static_cast<size_t>(n), 0.0f);
  s.ms.assign(static_cast<size_t>(n), std::vector<float>(kReps, 0.0f));
  SpinBarrier barrier(n);
  s.barrier = &barrier;
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) threads.emplace_back(rank_main, std::ref(s), k);
  // A rank that waits in a collective the others never call would hang the program: end it when the
  // ranks have not met for 300 s (the longest step between two meetings takes seconds).
  int last_gen = -1;
  auto last_change = std::chrono::steady_clock::now();
  while (s.finished.load() < n) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const int gen = barrier.generation();
    const auto now = std::chrono::steady_clock::now();
    if (gen != last_gen) {
      last_gen = gen;
      last_change = now;
    } else if (now - last_change > std::chrono::seconds(300)) {
      std::fflush(stdout);
      std::fprintf(stderr, "bench_allreduce: the ranks have not met for 300 s: a collective hangs\n");
      std::_Exit(1);
    }
  }
  for (std::thread& t : threads) t.join();

  report(s, json);

  for (fp8_comm_t* comm : s.comms) fp8_comm_destroy(comm);  // (the models went in the ranks' threads)
  for (ncclComm_t comm : s.nccls) ncclCommDestroy(comm);
  for (fp8_context_t* ctx : s.ctxs) fp8_context_destroy(ctx);
  return s.failures ? 1 : 0;
}
