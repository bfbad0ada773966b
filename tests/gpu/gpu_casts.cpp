// Every cast kernel against the CPU reference, bit for bit: random data in every dtype, awkward
// shapes, misaligned buffers, specials, more than 2^31 elements, and CUDA-graph capture (which fails
// if any call synchronises with the host or allocates).
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>

#include "core/format.hpp"
#include "gpu/gpu_compare.hpp"

using namespace fp8test;

namespace {

constexpr fp8_dtype_t kWide[] = {FP8_DTYPE_F32, FP8_DTYPE_F16, FP8_DTYPE_BF16};

// Raw bytes of n random values of a wide dtype; with `specials`, about one in 5000 is NaN or +-inf.
std::vector<uint8_t> random_bytes(fp8_dtype_t dt, size_t n, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::vector<float> v = normal_floats(n, seed);
  for (auto& x : v) {
    x *= std::ldexp(1.0f, static_cast<int>(rng() % 16) - 8);
    if (specials && rng() % 5000 == 0) x = (rng() & 1) ? NAN : (rng() & 1) ? INFINITY : -INFINITY;
  }
  return to_wide_bytes(dt, v);
}

void* data_of(const fp8_tensor_t* t) {
  void* p = nullptr;
  EXPECT_EQ(fp8_tensor_data(t, &p), FP8_OK);
  return p;
}

void poison(fp8_tensor_t* t) {
  int64_t n = 0;
  fp8_dtype_t dt = 0;
  fp8_tensor_numel(t, &n);
  fp8_tensor_dtype(t, &dt);
  upload(t, std::vector<uint8_t>(static_cast<size_t>(n) * fp8_dtype_size(dt), 0xCD));
}

class GpuVsCpu : public ::testing::Test {
 protected:
  Context cpu = make_context(FP8_DEVICE_CPU);
  Context gpu = make_context(0);
  Recipe recipe = make_recipe();

  // Quantizes the same bytes on both backends (with and without the transposed copy) and compares
  // codes, transposed codes, scale_inv and the state afterwards (amax, scale, counts) bit for bit,
  // with states of `r` (the fixture's delayed recipe by default; a current-scaling one makes its
  // scale from this input).
  void check_quantize(fp8_dtype_t dt, fp8_role_t role, std::vector<int64_t> shape, size_t misalign, bool transpose,
                      bool specials, uint32_t seed, const fp8_recipe_t* r = nullptr) {
    if (!r) r = recipe.get();
    SCOPED_TRACE(::testing::Message() << fp8_dtype_name(dt) << " role " << role << " shape " << shape.size()
                                      << "-D [" << shape.front() << ".." << shape.back() << "] misalign " << misalign
                                      << " transpose " << transpose);
    int64_t n = 1;
    for (auto d : shape) n *= d;
    const int64_t cols = shape.back(), rows = n / cols;
    const auto bytes = random_bytes(dt, static_cast<size_t>(n), seed, specials);
    Scaling s_cpu = make_scaling(cpu.get(), r, role), s_gpu = make_scaling(gpu.get(), r, role);
    fp8_dtype_t q_dt = 0;
    fp8_scaling_dtype(s_cpu.get(), &q_dt);
    for (auto* s : {s_cpu.get(), s_gpu.get()}) ASSERT_EQ(fp8_scaling_set_scale(s, 3.7f), FP8_OK);

    Tensor in_cpu = make_tensor(cpu.get(), dt, shape), out_cpu = make_tensor(cpu.get(), q_dt, shape);
    Tensor t_cpu = make_tensor(cpu.get(), q_dt, {cols, rows});
    DeviceBuffer in_buf(bytes.size()), out_buf(static_cast<size_t>(n)), t_buf(static_cast<size_t>(n));
    Tensor in_gpu = wrap(gpu.get(), dt, shape, in_buf.at(misalign * fp8_dtype_size(dt)));
    Tensor out_gpu = wrap(gpu.get(), q_dt, shape, out_buf.at(misalign));
    Tensor t_gpu = wrap(gpu.get(), q_dt, {cols, rows}, t_buf.at(misalign));
    upload(in_cpu.get(), bytes);
    upload(in_gpu.get(), bytes);
    poison(out_gpu.get());
    poison(t_gpu.get());
    FP8_ASSERT_OK(fp8_quantize(cpu.get(), in_cpu.get(), out_cpu.get(), transpose ? t_cpu.get() : nullptr, s_cpu.get()));
    FP8_ASSERT_OK(fp8_quantize(gpu.get(), in_gpu.get(), out_gpu.get(), transpose ? t_gpu.get() : nullptr, s_gpu.get()));
    FP8_ASSERT_OK(fp8_context_synchronize(gpu.get()));
    EXPECT_EQ(download<uint8_t>(out_gpu.get()), download<uint8_t>(out_cpu.get()));
    if (transpose) EXPECT_EQ(download<uint8_t>(t_gpu.get()), download<uint8_t>(t_cpu.get()));
    const fp8_scaling_info_t i_gpu = info_of(s_gpu.get()), i_cpu = info_of(s_cpu.get());
    EXPECT_EQ(bits_of(i_gpu.amax), bits_of(i_cpu.amax));
    EXPECT_EQ(bits_of(i_gpu.scale), bits_of(i_cpu.scale));
    EXPECT_EQ(bits_of(i_gpu.scale_inv), bits_of(i_cpu.scale_inv));
    EXPECT_EQ(i_gpu.update_count, i_cpu.update_count);
    EXPECT_EQ(i_gpu.nonfinite_count, i_cpu.nonfinite_count);
    float si_cpu = 0, si_gpu = 0;
    FP8_ASSERT_OK(fp8_tensor_get_scale_inv(out_cpu.get(), &si_cpu));
    FP8_ASSERT_OK(fp8_tensor_get_scale_inv(out_gpu.get(), &si_gpu));
    EXPECT_EQ(bits_of(si_gpu), bits_of(si_cpu));
  }
};

const std::vector<std::vector<int64_t>> kShapes = {
    {1, 1},   {1, 7},    {7, 1},    {3, 5},      {17, 33},   {8, 8},     {32, 64},   {64, 64},
    {128, 256}, {1000, 24}, {24, 1000}, {8, 4104}, {4104, 8}, {2, 3, 40}, {255, 257}, {1, 100003},
    {100003, 1}, {513, 1024}, {1024, 513}, {96, 8, 16}, {5}, {4096, 4096},
    {1001, 1024}, {333, 256}, {2, 129, 384}};  // rows not a multiple of 16: vector loads, byte stores of out_t

TEST_F(GpuVsCpu, QuantizeWithTransposeIsBitExactForEveryDtypeShapeAndFormat) {
  uint32_t seed = 1;
  for (fp8_dtype_t dt : kWide)
    for (fp8_role_t role : {FP8_ROLE_FORWARD, FP8_ROLE_BACKWARD})
      for (const auto& shape : kShapes) check_quantize(dt, role, shape, 0, true, seed % 3 == 0, seed++);
}

TEST_F(GpuVsCpu, QuantizeWithoutTransposeIsBitExactForEveryDtypeShapeAndFormat) {
  uint32_t seed = 100;
  for (fp8_dtype_t dt : kWide)
    for (fp8_role_t role : {FP8_ROLE_FORWARD, FP8_ROLE_BACKWARD})
      for (const auto& shape : kShapes) check_quantize(dt, role, shape, 0, false, seed % 3 == 0, seed++);
}

TEST_F(GpuVsCpu, QuantizeOfMisalignedBuffersTakesTheScalarPathAndStaysExact) {
  uint32_t seed = 500;
  for (fp8_dtype_t dt : kWide)
    for (const auto& shape : {std::vector<int64_t>{64, 64}, std::vector<int64_t>{33, 130}, std::vector<int64_t>{4000}})
      for (bool transpose : {true, false}) check_quantize(dt, FP8_ROLE_FORWARD, shape, 3, transpose, true, seed++);
}

// Current scaling (the amax pass, then the cast kernels taking their scale from it): bit-exact on
// every dtype, format and shape, with and without the transposed copy, with specials (NaN and inf
// inputs give scale 1 and are counted), aligned and not, with a margin and power-of-two scales.
TEST_F(GpuVsCpu, CurrentScalingQuantizeIsBitExactForEveryDtypeShapeAndFormat) {
  uint32_t seed = 700;
  for (const char* text : {"scaling=current", "scaling=current, margin=3, power_2_scales=on"}) {
    SCOPED_TRACE(text);
    Recipe r = make_recipe(text);
    for (fp8_dtype_t dt : kWide)
      for (fp8_role_t role : {FP8_ROLE_FORWARD, FP8_ROLE_BACKWARD})
        for (const auto& shape : kShapes)
          for (bool transpose : {true, false})
            check_quantize(dt, role, shape, seed % 7 == 0 ? 3 : 0, transpose, seed % 3 == 0, seed++, r.get());
  }
}

TEST_F(GpuVsCpu, DequantizeIsBitExactForAllCodesAndEveryOutputDtype) {
  for (fp8_dtype_t q_dt : {FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
    for (fp8_dtype_t dt : kWide) {
      for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{4097}, int64_t{1} << 20}) {
        std::mt19937 rng(static_cast<uint32_t>(n));
        std::vector<uint8_t> codes(static_cast<size_t>(n));
        for (auto& c : codes) c = static_cast<uint8_t>(rng());
        Tensor q_cpu = make_tensor(cpu.get(), q_dt, {n}), q_gpu = make_tensor(gpu.get(), q_dt, {n});
        Tensor o_cpu = make_tensor(cpu.get(), dt, {n}), o_gpu = make_tensor(gpu.get(), dt, {n});
        upload(q_cpu.get(), codes);
        upload(q_gpu.get(), codes);
        FP8_ASSERT_OK(fp8_tensor_set_scale_inv(q_cpu.get(), 0.0173f));
        FP8_ASSERT_OK(fp8_tensor_set_scale_inv(q_gpu.get(), 0.0173f));
        poison(o_gpu.get());
        FP8_ASSERT_OK(fp8_dequantize(cpu.get(), q_cpu.get(), o_cpu.get()));
        FP8_ASSERT_OK(fp8_dequantize(gpu.get(), q_gpu.get(), o_gpu.get()));
        EXPECT_EQ(download<uint8_t>(o_gpu.get()), download<uint8_t>(o_cpu.get()))
            << fp8_dtype_name(q_dt) << " -> " << fp8_dtype_name(dt) << " n=" << n;
      }
    }
  }
}

TEST_F(GpuVsCpu, AmaxIsBitExactIncludingNanAndInfPropagation) {
  uint32_t seed = 900;
  for (fp8_dtype_t dt : kWide) {
    for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{4096}, int64_t{1000003}}) {
      for (bool specials : {false, true}) {
        const auto bytes = random_bytes(dt, static_cast<size_t>(n), seed++, specials);
        Tensor x_cpu = make_tensor(cpu.get(), dt, {n}), x_gpu = make_tensor(gpu.get(), dt, {n});
        Tensor a_cpu = make_tensor(cpu.get(), FP8_DTYPE_F32, {1}), a_gpu = make_tensor(gpu.get(), FP8_DTYPE_F32, {1});
        upload(x_cpu.get(), bytes);
        upload(x_gpu.get(), bytes);
        upload<float>(a_gpu.get(), {-1.0f});
        FP8_ASSERT_OK(fp8_amax(cpu.get(), x_cpu.get(), a_cpu.get(), nullptr));
        FP8_ASSERT_OK(fp8_amax(gpu.get(), x_gpu.get(), a_gpu.get(), nullptr));
        EXPECT_EQ(bits_of(download<float>(a_gpu.get())[0]), bits_of(download<float>(a_cpu.get())[0]))
            << fp8_dtype_name(dt) << " n=" << n << " specials " << specials;
      }
    }
  }
}

TEST_F(GpuVsCpu, BatchedScalingUpdateIsBitExactOverManySteps) {
  for (const char* text : {"amax_history_len=16, amax_compute_algo=max, margin=2",
                           "amax_history_len=1024, amax_compute_algo=most_recent", "amax_history_len=3000, interval=2, amax_compute_algo=max",
                           "amax_history_len=16, margin=3, power_2_scales=on"}) {
    SCOPED_TRACE(text);
    Recipe r = make_recipe(text);
    const int kStates = 1500;  // more than one launch's batch
    std::vector<Scaling> sc, sg;
    std::vector<fp8_scaling_t*> hc, hg;
    for (int i = 0; i < kStates; ++i) {
      const fp8_role_t role = i % 3 ? FP8_ROLE_FORWARD : FP8_ROLE_BACKWARD;
      sc.push_back(make_scaling(cpu.get(), r.get(), role));
      sg.push_back(make_scaling(gpu.get(), r.get(), role));
      hc.push_back(sc.back().get());
      hg.push_back(sg.back().get());
    }
    Tensor a_cpu = make_tensor(cpu.get(), FP8_DTYPE_F32, {1}), a_gpu = make_tensor(gpu.get(), FP8_DTYPE_F32, {1});
    std::mt19937 rng(5);
    for (int step = 0; step < 4; ++step) {
      for (int i = 0; i < kStates; i += 7) {  // some states see no amax in a step
        const float v = rng() % 97 == 0 ? NAN : std::ldexp(static_cast<float>(rng() % 1000 + 1), static_cast<int>(rng() % 30) - 15);
        Tensor x_cpu = make_tensor(cpu.get(), FP8_DTYPE_F32, {1}), x_gpu = make_tensor(gpu.get(), FP8_DTYPE_F32, {1});
        upload<float>(x_cpu.get(), {v});
        upload<float>(x_gpu.get(), {v});
        FP8_ASSERT_OK(fp8_amax(cpu.get(), x_cpu.get(), a_cpu.get(), hc[static_cast<size_t>(i)]));
        FP8_ASSERT_OK(fp8_amax(gpu.get(), x_gpu.get(), a_gpu.get(), hg[static_cast<size_t>(i)]));
      }
      FP8_ASSERT_OK(fp8_scaling_update(cpu.get(), hc.data(), kStates, r.get()));
      FP8_ASSERT_OK(fp8_scaling_update(gpu.get(), hg.data(), kStates, r.get()));
    }
    for (int i = 0; i < kStates; ++i) {
      const auto c = info_of(hc[static_cast<size_t>(i)]), g = info_of(hg[static_cast<size_t>(i)]);
      ASSERT_EQ(bits_of(g.scale), bits_of(c.scale)) << "state " << i;
      ASSERT_EQ(bits_of(g.scale_inv), bits_of(c.scale_inv)) << "state " << i;
      ASSERT_EQ(g.nonfinite_count, c.nonfinite_count) << "state " << i;
      std::vector<float> hist_c(static_cast<size_t>(c.amax_history_len)), hist_g(hist_c.size());
      fp8_scaling_get_history(hc[static_cast<size_t>(i)], hist_c.data(), c.amax_history_len);
      fp8_scaling_get_history(hg[static_cast<size_t>(i)], hist_g.data(), g.amax_history_len);
      ASSERT_EQ(hist_g, hist_c) << "state " << i;
    }
  }
}

TEST_F(GpuVsCpu, AStepOfCastsAndUpdatesCanBeCapturedInACudaGraph) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  FP8_ASSERT_OK(fp8_context_set_stream(gpu.get(), stream));
  const std::vector<int64_t> shape = {256, 512};
  const auto bytes = random_bytes(FP8_DTYPE_BF16, 256 * 512, 77, false);
  Tensor in = make_tensor(gpu.get(), FP8_DTYPE_BF16, shape), out = make_tensor(gpu.get(), FP8_DTYPE_E4M3, shape);
  Tensor out_t = make_tensor(gpu.get(), FP8_DTYPE_E4M3, {512, 256}), back = make_tensor(gpu.get(), FP8_DTYPE_BF16, shape);
  Tensor amax = make_tensor(gpu.get(), FP8_DTYPE_F32, {1});
  Scaling s = make_scaling(gpu.get(), recipe.get(), FP8_ROLE_FORWARD);
  upload(in.get(), bytes);
  fp8_scaling_t* list[1] = {s.get()};
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(fp8_quantize(gpu.get(), in.get(), out.get(), out_t.get(), s.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_amax(gpu.get(), in.get(), amax.get(), nullptr), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_scaling_update(gpu.get(), list, 1, recipe.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_dequantize(gpu.get(), out.get(), back.get()), FP8_OK) << fp8_last_error_message();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // step 1: scale 1 -> 448/amax
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // step 2 quantizes with the new scale
  FP8_ASSERT_OK(fp8_context_synchronize(gpu.get()));
  const float a = download<float>(amax.get())[0];
  EXPECT_GT(a, 0.0f);
  EXPECT_EQ(info_of(s.get()).scale, 448.0f / a);
  float si = 0;
  FP8_ASSERT_OK(fp8_tensor_get_scale_inv(out.get(), &si));
  EXPECT_EQ(si, 1.0f / (448.0f / a));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  FP8_ASSERT_OK(fp8_context_set_stream(gpu.get(), nullptr));
  cudaStreamDestroy(stream);
}

TEST_F(GpuVsCpu, ACapturedScalingUpdateReplaysTheIntervalRuleOnTheDevice) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  FP8_ASSERT_OK(fp8_context_set_stream(gpu.get(), stream));
  Recipe r = make_recipe("interval=2, amax_history_len=4");
  Scaling s = make_scaling(gpu.get(), r.get(), FP8_ROLE_FORWARD);
  Tensor x = make_tensor(gpu.get(), FP8_DTYPE_F32, {4}), amax = make_tensor(gpu.get(), FP8_DTYPE_F32, {1});
  fp8_scaling_t* list[1] = {s.get()};
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(fp8_amax(gpu.get(), x.get(), amax.get(), s.get()), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(fp8_scaling_update(gpu.get(), list, 1, r.get()), FP8_OK) << fp8_last_error_message();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Replays 0..3 see amaxes 1, 2, 4, 8; the scale is recomputed on updates 0 and 2 only.
  const float expected_scale[] = {448.0f / 1, 448.0f / 1, 448.0f / 4, 448.0f / 4};
  for (int i = 0; i < 4; ++i) {
    const float v = static_cast<float>(1 << i);
    upload<float>(x.get(), {v, -v / 2, 0.0f, v / 4});
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    FP8_ASSERT_OK(fp8_context_synchronize(gpu.get()));
    const fp8_scaling_info_t info = info_of(s.get());
    EXPECT_EQ(info.scale, expected_scale[i]) << "replay " << i;
    EXPECT_EQ(info.update_count, i + 1);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  FP8_ASSERT_OK(fp8_context_set_stream(gpu.get(), nullptr));
  cudaStreamDestroy(stream);
}

// More than 2^31 elements: 64-bit indexing in every kernel. The CPU reference would take minutes,
// so the check samples positions (including the very last ones) against the scalar encoder.
TEST_F(GpuVsCpu, QuantizeHandlesTensorsLargerThan2To31Elements) {
  const int64_t rows = 65544, cols = 32768, n = rows * cols;  // 2,147,745,792 elements
  ASSERT_GT(n, int64_t{1} << 31);
  std::vector<uint16_t> host(static_cast<size_t>(n));
  uint64_t state = 88172645463325252ull;
  uint32_t amax_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    const uint16_t h = static_cast<uint16_t>(0x3000u + (state & 0x0FFFu)) | static_cast<uint16_t>((state >> 20) & 0x8000u);
    host[static_cast<size_t>(i)] = h;
    amax_bits = std::max(amax_bits, static_cast<uint32_t>(h & 0x7FFFu));
  }
  host.back() = 0x4700;  // 32768.0, the largest, in the last element
  Tensor in = make_tensor(gpu.get(), FP8_DTYPE_BF16, {rows, cols});
  Tensor out = make_tensor(gpu.get(), FP8_DTYPE_E4M3, {rows, cols}), out_t = make_tensor(gpu.get(), FP8_DTYPE_E4M3, {cols, rows});
  Scaling s = make_scaling(gpu.get(), recipe.get(), FP8_ROLE_FORWARD);
  upload(in.get(), host);
  FP8_ASSERT_OK(fp8_scaling_set_scale(s.get(), 0.01f));
  FP8_ASSERT_OK(fp8_quantize(gpu.get(), in.get(), out.get(), out_t.get(), s.get()));
  EXPECT_EQ(info_of(s.get()).amax, 32768.0f);
  const auto q = download<uint8_t>(out.get());
  const auto qt = download<uint8_t>(out_t.get());
  std::mt19937_64 rng(3);
  for (int k = 0; k < 2000000; ++k) {
    const int64_t i = k < 1000 ? n - 1 - k : static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
    const int64_t r = i / cols, c = i % cols;
    const uint8_t want = fp8::encode_fp8(fp8::bf16_to_float(host[static_cast<size_t>(i)]) * 0.01f, false);
    ASSERT_EQ(q[static_cast<size_t>(i)], want) << "element " << i;
    ASSERT_EQ(qt[static_cast<size_t>(c * rows + r)], want) << "transposed element (" << c << ", " << r << ")";
  }
  // The same data as one flat vector, without the transposed copy.
  // (flat_out reuses out_t's memory, already checked above.)
  Tensor flat_in = wrap(gpu.get(), FP8_DTYPE_BF16, {n}, data_of(in.get()));
  Tensor flat_out = wrap(gpu.get(), FP8_DTYPE_E4M3, {n}, data_of(out_t.get()));
  FP8_ASSERT_OK(fp8_quantize(gpu.get(), flat_in.get(), flat_out.get(), nullptr, s.get()));
  EXPECT_EQ(download<uint8_t>(flat_out.get()), q);
}

// The bias gradient of more than 65535 row tiles of kBiasGradRows (128) rows: more tiles than a
// grid's y dimension holds. Three paths: the column-sum kernel alone (high precision), fused into
// the dy cast with its transpose (FP8 wgrad), and after the cast without transpose (FP8 dgrad with
// override_wgrad). The values are multiples of 1/4 whose running sums stay small, so every order of
// summation is exact and the GPU's float sums equal the CPU's double ones bit for bit; the rows past
// the 65535th tile hold +1 so that losing them shows.
TEST_F(GpuVsCpu, BiasGradientOfMoreThan65535RowTilesIsBitExact) {
  const int64_t rows = int64_t{65535} * 128 + 256, cols = 16;
  std::vector<uint16_t> dy_host(static_cast<size_t>(rows * cols)), x_host(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float dy = r >= int64_t{65535} * 128 ? 1.0f : static_cast<float>((r + 3 * c) % 9 - 4) * 0.25f;
      dy_host[static_cast<size_t>(r * cols + c)] = fp8::float_to_bf16(dy);
      x_host[static_cast<size_t>(r * cols + c)] = fp8::float_to_bf16(static_cast<float>((r + c) % 5 - 2) * 0.5f);
    }
  }
  std::vector<float> want(static_cast<size_t>(cols), 0.0f);
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += fp8::bf16_to_float(dy_host[static_cast<size_t>(r * cols + c)]);
    want[static_cast<size_t>(c)] = static_cast<float>(sum);
  }
  const std::vector<float> weight = normal_floats(static_cast<size_t>(cols * cols), 5, 0.0f, 0.1f);
  struct Side {
    fp8_context_t* ctx;
    Tensor x, dy, dx, y;
  };
  Side sides[2] = {{cpu.get(), {}, {}, {}, {}}, {gpu.get(), {}, {}, {}, {}}};
  for (Side& side : sides) {
    side.x = make_tensor(side.ctx, FP8_DTYPE_BF16, {rows, cols});
    side.dy = make_tensor(side.ctx, FP8_DTYPE_BF16, {rows, cols});
    side.dx = make_tensor(side.ctx, FP8_DTYPE_BF16, {rows, cols});
    side.y = make_tensor(side.ctx, FP8_DTYPE_BF16, {rows, cols});
    upload(side.x.get(), x_host);
    upload(side.dy.get(), dy_host);
  }
  const struct {
    const char* recipe;  // nullptr: not converted
    bool dx;
    int dgrad, wgrad;  // the precisions the layer's report must show (1 FP8)
  } cases[] = {{nullptr, false, 0, 0},
               {"small_layer_fallback=0", false, 1, 1},
               {"small_layer_fallback=0, override_wgrad=on", true, 1, 0}};
  for (const auto& k : cases) {
    SCOPED_TRACE(k.recipe ? k.recipe : "high precision");
    std::vector<uint32_t> got[2];
    for (int i = 0; i < 2; ++i) {
      Side& side = sides[i];
      Model m = make_model(side.ctx);
      FP8_ASSERT_OK(fp8_model_add_linear(m.get(), "fc", cols, cols, 1, nullptr));
      set_param(m.get(), "fc.weight", weight);
      if (k.recipe) {
        Recipe r = make_recipe(k.recipe);
        FP8_ASSERT_OK(fp8_convert_model(m.get(), r.get(), nullptr));
        FP8_ASSERT_OK(fp8_model_set_autowrap(m.get(), 1));
      }
      FP8_ASSERT_OK(fp8_layer_forward(m.get(), 0, side.x.get(), side.y.get()));
      FP8_ASSERT_OK(fp8_layer_backward(m.get(), 0, side.dy.get(), k.dx ? side.dx.get() : nullptr));
      fp8_layer_report_t report;
      fp8_layer_report_init(&report);
      FP8_ASSERT_OK(fp8_layer_get_report(m.get(), 0, &report));
      EXPECT_EQ(report.dgrad, k.dgrad);
      EXPECT_EQ(report.wgrad, k.wgrad);
      for (float v : download<float>(param_tensor(m.get(), "fc.bias", true))) got[i].push_back(bits_of(v));
    }
    ASSERT_EQ(got[0].size(), static_cast<size_t>(cols));
    EXPECT_EQ(got[1], got[0]) << "GPU bias gradient differs from the CPU reference";
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(got[0][static_cast<size_t>(c)], bits_of(want[static_cast<size_t>(c)])) << c;
  }
}

}  // namespace
