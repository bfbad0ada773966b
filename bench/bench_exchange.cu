// The FP8 gradient exchange's kernels (kernels/dist/exchange.cu) called directly: first checked
// against the CPU reference (src/backend/cpu_exchange.cpp) bit for bit over awkward cases (tails,
// 1..300 senders, misaligned buffers, NaN/inf codes, thousands of tensors), then timed on 2^26
// elements against a device-to-device copy measured in the same run. Exits 1 on any mismatch.
// Usage: bench_exchange (no arguments; NOTIME=1 skips the timing)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <functional>

#include "backend/jobs.hpp"
#include "kernels/launch.hpp"

#include "backend/backend.hpp"  // the CPU reference (cpu_grad_exchange)

using namespace fp8;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)
static uint32_t fb(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static int failures = 0;


struct Case {
  const char* name;
  std::vector<int64_t> sizes;
  int nranks;
  bool e5m2;
  int64_t piece_pad = 0;   // piece_bytes = round_up(shard, 256) + pad
  int pieces_shift = 0;    // misalign the pieces pointer by this many bytes
  int codes_shift = 0;     // misalign the requantised codes by this many bytes
  bool specials = false;   // NaN/inf codes and overflowing scales
};

static void run_case(const Case& c, std::mt19937& rng) {
  const int32_t T = static_cast<int32_t>(c.sizes.size());
  std::vector<OptimChunk> chunks;
  int64_t off = 0;
  for (int32_t t = 0; t < T; ++t) {
    for (int64_t s = 0; s < c.sizes[t]; s += kOptimChunk)
      chunks.push_back({t, static_cast<int32_t>(std::min<int64_t>(kOptimChunk, c.sizes[t] - s)), off + s});
    off += (c.sizes[t] + 15) / 16 * 16;
  }
  const int64_t shard = off;
  const int64_t piece_bytes = (shard + 255) / 256 * 256 + c.piece_pad;
  const int N = c.nranks;
  std::vector<uint8_t> pieces(N * piece_bytes + 16);
  uint8_t* P = pieces.data() + c.pieces_shift;
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : pieces) {
    int v = byte(rng);
    if (!c.specials) {
      if (!c.e5m2 && (v & 0x7F) == 0x7F) v = 0x3C;
      if (c.e5m2 && (v & 0x7F) >= 0x7C) v = 0x3C;
    } else if (byte(rng) < 250) {  // keep specials rare
      if (!c.e5m2 && (v & 0x7F) == 0x7F) v = 0x3C;
      if (c.e5m2 && (v & 0x7F) >= 0x7C) v = 0x3C;
    }
    b = static_cast<uint8_t>(v);
  }
  std::vector<GradScales> ss(static_cast<size_t>(N) * T);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-30, 10);
  for (auto& g : ss) {
    g = {};
    g.scale_inv = std::ldexp(mant(rng), ex(rng));
    g.amax = std::ldexp(mant(rng), ex(rng) / 2);  // the bound's terms: any positive values
  }
  if (T > 3) ss[3].amax = 0.0f;                             // a tensor whose bound is only the others'
  if (T > 4) for (int k = 0; k < N; ++k) ss[static_cast<size_t>(k) * T + 4].amax = 0.0f;  // all zero: scale 1
  if (c.specials && T > 2) ss[static_cast<size_t>(N - 1) * T].amax = INFINITY;              // a non-finite bound
  if (T > 1) for (int k = 0; k < N; ++k) ss[static_cast<size_t>(k) * T + 1].scale_inv = std::ldexp(mant(rng), -140);  // subnormal products
  if (c.specials && T > 2) for (int k = 0; k < N; ++k) ss[static_cast<size_t>(k) * T + 2].scale_inv = (k % 2 ? 1 : -1) * 3e34f;  // overflow to +-inf
  std::vector<float> bound_cpu(T, 0.0f), bound_gpu(T);
  // device
  uint8_t* dP; GradScales* dS; OptimChunk* dC; float* dA;
  CK(cudaMalloc(&dP, pieces.size())); CK(cudaMalloc(&dS, ss.size() * sizeof(GradScales)));
  CK(cudaMalloc(&dC, chunks.size() * sizeof(OptimChunk))); CK(cudaMalloc(&dA, T * 4));
  CK(cudaMemcpy(dP, pieces.data(), pieces.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dS, ss.data(), ss.size() * sizeof(GradScales), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dC, chunks.data(), chunks.size() * sizeof(OptimChunk), cudaMemcpyHostToDevice));
  CK(cudaMemset(dA, 0, T * 4));
  // requantised codes (the output) and scales, written over a filled buffer
  std::vector<uint8_t> codes_cpu(piece_bytes + 8, 0xAA), codes_gpu(piece_bytes + 8);
  std::vector<GradScales> sc_cpu(T), sc_gpu(T);
  for (auto& g : sc_cpu) g = {1, 2, 3, 4};
  uint8_t* dK; GradScales* dG;
  CK(cudaMalloc(&dK, codes_cpu.size())); CK(cudaMalloc(&dG, T * sizeof(GradScales)));
  CK(cudaMemcpy(dK, codes_cpu.data(), codes_cpu.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dG, sc_cpu.data(), T * sizeof(GradScales), cudaMemcpyHostToDevice));
  const GradExchangeJob hj{P, N, piece_bytes, ss.data(), T, chunks.data(), (int64_t)chunks.size(), c.e5m2, bound_cpu.data(), codes_cpu.data() + c.codes_shift, sc_cpu.data()};
  cpu_grad_exchange(hj);
  const GradExchangeJob dj{dP + c.pieces_shift, N, piece_bytes, dS, T, dC, (int64_t)chunks.size(), c.e5m2, dA, dK + c.codes_shift, dG};
  kernels::grad_exchange(dj, nullptr);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(bound_gpu.data(), dA, T * 4, cudaMemcpyDeviceToHost));
  int abad = 0, anan = 0;
  for (int t = 0; t < T; ++t)
    if (fb(bound_cpu[t]) != fb(bound_gpu[t])) {
      if (std::isnan(bound_cpu[t]) && std::isnan(bound_gpu[t])) ++anan;
      else { ++abad; if (abad < 3) printf("   bound[%d] cpu %08x gpu %08x\n", t, fb(bound_cpu[t]), fb(bound_gpu[t])); }
    }
  CK(cudaMemcpy(codes_gpu.data(), dK, codes_gpu.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sc_gpu.data(), dG, T * sizeof(GradScales), cudaMemcpyDeviceToHost));
  int64_t cbad = 0;
  for (size_t i = 0; i < codes_cpu.size(); ++i) if (codes_cpu[i] != codes_gpu[i]) { if (cbad < 3) printf("   code[%zu] cpu %02x gpu %02x\n", i, codes_cpu[i], codes_gpu[i]); ++cbad; }
  int sbad = 0, snan = 0;
  for (int t = 0; t < T; ++t) {
    const uint32_t* a = reinterpret_cast<const uint32_t*>(&sc_cpu[t]);
    const uint32_t* b = reinterpret_cast<const uint32_t*>(&sc_gpu[t]);
    for (int f = 0; f < 4; ++f)
      if (a[f] != b[f]) {
        if ((a[f] & 0x7FFFFFFFu) > 0x7F800000u && (b[f] & 0x7FFFFFFFu) > 0x7F800000u) ++snan;
        else { ++sbad; if (sbad < 3) printf("   scales[%d].%d cpu %08x gpu %08x\n", t, f, a[f], b[f]); }
      }
  }
  const bool ok = !abad && !cbad && !sbad;
  if (!ok) ++failures;
  if (!ok || getenv("VERBOSE")) printf("%-34s N=%3d %s elems=%9lld chunks=%6zu: bounds bad %d (NaN-only %d), codes bad %lld, scales bad %d (NaN-only %d)  %s\n",
         c.name, N, c.e5m2 ? "e5m2" : "e4m3", (long long)shard, chunks.size(), abad, anan, (long long)cbad, sbad, snan, ok ? "OK" : "FAIL");
  cudaFree(dP); cudaFree(dS); cudaFree(dC); cudaFree(dA); cudaFree(dK); cudaFree(dG);
}

static void divide_case(int64_t n, float d, int shift, std::mt19937& rng) {
  std::vector<float> x(n + 4);
  std::uniform_int_distribution<uint32_t> bits;
  for (auto& v : x) { uint32_t u = bits(rng); memcpy(&v, &u, 4); }
  float* dx; CK(cudaMalloc(&dx, x.size() * 4));
  CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  for (int64_t i = 0; i < n; ++i) x[shift + i] = x[shift + i] / d;
  kernels::LaunchLimits lim{0, 132};
  cudaDeviceGetAttribute(&lim.sm_count, cudaDevAttrMultiProcessorCount, 0);
  kernels::divide({dx + shift, n, d}, lim, nullptr);
  std::vector<float> y(x.size());
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(y.data(), dx, y.size() * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0, nan_only = 0;
  for (size_t i = 0; i < x.size(); ++i) if (fb(x[i]) != fb(y[i])) { if (std::isnan(x[i]) && std::isnan(y[i])) ++nan_only; else ++bad; }
  if (bad) ++failures;
  if (bad || getenv("VERBOSE")) printf("divide n=%lld by %g shift %d: bad %lld (NaN-payload-only %lld)  %s\n", (long long)n, d, shift, (long long)bad, (long long)nan_only, bad ? "FAIL" : "OK");
  cudaFree(dx);
}



int main() {
  std::mt19937 rng(42);
  cudaFree(nullptr);
  std::vector<Case> cases = {
      {"small tensors, tails", {1, 15, 16, 17, 100, 4095, 4096, 4097, 12345}, 2, false},
      {"small tensors, tails", {1, 15, 16, 17, 100, 4095, 4096, 4097, 12345}, 3, true},
      {"one rank", {5000, 77, 8192}, 1, false},
      {"8 ranks", {100000, 333, 70000, 16}, 8, false},
      {"8 ranks e5m2", {100000, 333, 70000, 16}, 8, true},
      {"64 ranks", {50000, 4100, 9}, 64, false},
      {"300 ranks (>1 scale batch)", {20000, 4097, 31}, 300, true},
      {"300 ranks e4m3", {20000, 4097, 31}, 257, false},
      {"piece_bytes not mult of 16", {30000, 4097, 31}, 5, false, 3},
      {"pieces ptr misaligned", {30000, 4097, 31}, 4, true, 0, 1},
      {"codes misaligned", {30000, 4097, 31}, 4, false, 0, 0, 1},
      {"pieces and codes misaligned", {30000, 4097, 31}, 3, true, 0, 1, 3},
      {"specials e4m3", {30000, 4097, 9000}, 4, false, 0, 0, 0, true},
      {"specials e5m2", {30000, 4097, 9000}, 4, true, 0, 0, 0, true},
      {"specials e5m2 16 ranks", {30000, 4097, 9000, 5}, 16, true, 0, 0, 0, true},
  };
  {
    std::vector<int64_t> many(3000);
    for (auto& s : many) s = 1 + rng() % 700;
    cases.push_back({"3000 tensors", many, 4, false});
  }
  for (auto& c : cases) run_case(c, rng);
  for (float d : {2.0f, 3.0f, 7.0f, 8.0f, 64.0f, 1e-3f, 3e38f}) divide_case(1000003, d, d == 3.0f ? 1 : 0, rng);

  // ---- timing ----
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto timeit = [&](auto&& f) {
    for (int i = 0; i < 3; ++i) f();
    std::vector<float> t;
    for (int i = 0; i < 15; ++i) { cudaEventRecord(e0); f(); cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms); }
    std::sort(t.begin(), t.end());
    CK(cudaGetLastError());
    return t[t.size() / 2];
  };
  const int64_t S = int64_t{1} << 26;
  uint8_t* big; CK(cudaMalloc(&big, 64 * S));  // pieces up to 64 ranks... only as many as used
  CK(cudaMemset(big, 0x3A, 64 * S));
  { std::vector<uint8_t> r(S); for (auto& b : r) { b = rng() & 0xFF; if ((b & 0x7F) >= 0x7C) b = 0x21; } for (int k = 0; k < 64; ++k) CK(cudaMemcpy(big + k * S, r.data(), S, cudaMemcpyHostToDevice)); }
  float* floats; CK(cudaMalloc(&floats, S * 4));
  float* other; CK(cudaMalloc(&other, S * 4));
  uint8_t* codes; CK(cudaMalloc(&codes, S));
  std::vector<OptimChunk> ch; for (int64_t o = 0; o < S; o += kOptimChunk) ch.push_back({static_cast<int32_t>((o / kOptimChunk) % 64), (int32_t)kOptimChunk, o});
  OptimChunk* dch; CK(cudaMalloc(&dch, ch.size() * sizeof(OptimChunk))); CK(cudaMemcpy(dch, ch.data(), ch.size() * sizeof(OptimChunk), cudaMemcpyHostToDevice));
  GradScales* dss; CK(cudaMalloc(&dss, 64 * 64 * sizeof(GradScales)));
  { std::vector<GradScales> s(64 * 64, GradScales{1e-3f, 0.1f, 0, 0}); CK(cudaMemcpy(dss, s.data(), s.size() * sizeof(GradScales), cudaMemcpyHostToDevice)); }
  float* da; CK(cudaMalloc(&da, 64 * 4));
  GradScales* dg; CK(cudaMalloc(&dg, 64 * sizeof(GradScales)));
  { std::vector<GradScales> s(64, GradScales{1e-3f, 100.0f, 0, 0}); CK(cudaMemcpy(dg, s.data(), s.size() * sizeof(GradScales), cudaMemcpyHostToDevice)); }
  const float copy_ms = timeit([&] { cudaMemcpyAsync(other, floats, S * 4, cudaMemcpyDeviceToDevice); });
  const double copy_gbs = 2.0 * S * 4 / copy_ms / 1e6;
  printf("correctness: %d failures\n", failures);
  if (getenv("NOTIME")) return failures ? 1 : 0;
  printf("%-40s %9s %9s %9s\n", "work (2^26 elements)", "ms", "GB/s", "of copy");
  printf("%-40s %9.3f %9.0f %8.0f%%\n", "D2D copy 256 MiB (read+write)", copy_ms, copy_gbs, 100.0);
  for (int N : {1, 2, 4, 8, 64}) for (bool e5 : {false, true}) {
    if (N == 64 && !e5) continue;
    const GradExchangeJob q{big, N, S, dss, 64, dch, (int64_t)ch.size(), e5, da, codes, dg};
    const float ms = timeit([&] { kernels::grad_exchange(q, nullptr); });
    const double gbs = (double)(N + 1) * S / ms / 1e6;
    printf("grad_exchange N=%-3d %s (N+1 B/elem)    %9.3f %9.0f %8.0f%%\n", N, e5 ? "e5m2" : "e4m3", ms, gbs, 100 * gbs / copy_gbs);
  }
  {
    kernels::LaunchLimits lim{0, 132};
    cudaDeviceGetAttribute(&lim.sm_count, cudaDevAttrMultiProcessorCount, 0);
    CK(cudaMemset(floats, 0x3F, S * 4));
    const float ms = timeit([&] { kernels::divide({floats, S, 3.0f}, lim, nullptr); });
    const double gbs = 8.0 * S / ms / 1e6;
    printf("divide by 3 (8 B/elem)                   %9.3f %9.0f %8.0f%%\n", ms, gbs, 100 * gbs / copy_gbs);
  }
  printf("\nfailures: %d\n", failures);
  return failures ? 1 : 0;
}
