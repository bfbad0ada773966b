// Data parallelism on CPU contexts joined by the in-process transport (fp8.h, "Data parallelism"):
// every rank runs on its own thread, as ranks of one process do. What is checked: the ranks start from
// rank 0's model; scales agree (and equal one rank seeing the whole batch); weights stay bit-identical
// at te and O1..O3; the FP32 exchange equals micro-batch accumulation; the FP8 exchange against
// float64 and against summing in FP8; the skip; collective checkpoints across group sizes; refused
// mismatches; abort, a rank that leaves and one that stalls (the timeout); argument errors.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <thread>

#include "dist_cases.hpp"

using namespace fp8test;
using namespace fp8test::dist_cases;

namespace {
struct LevelCase {
  const char* name;
  const char* recipe;  // nullptr: not converted (FP32 everything)
  fp8_optimizer_kind_t kind;
  float max_grad_norm;
};
void PrintTo(const LevelCase& c, std::ostream* os) {
  *os << c.name;
}

const LevelCase kLevels[] = {
    {"unconverted_sgd", nullptr, FP8_OPTIMIZER_SGD, 0.0f},
    {"te_adam", "backend=te, small_layer_fallback=0", FP8_OPTIMIZER_ADAM, 0.0f},
    {"o1_adamw_clipped", "backend=msamp, opt_level=O1, small_layer_fallback=0", FP8_OPTIMIZER_ADAMW, 0.05f},
    {"o2_adam", "backend=msamp, opt_level=O2, small_layer_fallback=0", FP8_OPTIMIZER_ADAM, 0.0f},
    {"o2_e4m3_adam_clipped", "backend=msamp, opt_level=O2, fp8_format=E4M3, small_layer_fallback=0", FP8_OPTIMIZER_ADAM,
     0.05f},
    {"o3_adam", "backend=msamp, opt_level=O3, small_layer_fallback=0", FP8_OPTIMIZER_ADAM, 0.0f},
};

class DataParallelLevels : public ::testing::TestWithParam<std::tuple<LevelCase, int>> {};

TEST_P(DataParallelLevels, EveryRankHoldsTheSameBitsAfterEveryStep) {
  const LevelCase& c = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  Group g(n, c.recipe, c.kind, c.max_grad_norm);
  // set_comm started every rank from rank 0's model (each was built from its own seed).
  for (int k = 1; k < n; ++k) ASSERT_EQ(state_bytes(g.ranks[k], true), state_bytes(g.ranks[0], true)) << "rank " << k;
  const std::vector<unsigned char> initial = state_bytes(g.ranks[0], false);
  for (int step = 0; step < 3; ++step) {
    on_ranks(n, [&](int k) {
      Rank& r = g.ranks[k];
      forward_backward(r.ctx.get(), r.model.get(), batch_x(step, k), batch_dy(step, k));
    });
    // Each rank's own data gave it its own gradients (so the exchange has work to do) ...
    EXPECT_NE(state_bytes(g.ranks[1], true), state_bytes(g.ranks[0], true));
    on_ranks(n, [&](int k) {
      EXPECT_OK(fp8_optimizer_step(g.ranks[k].opt.get()));
      EXPECT_OK(fp8_optimizer_zero_grad(g.ranks[k].opt.get()));
    });
    // ... and after the step every rank holds the same weights, masters and scales.
    const std::vector<unsigned char> want = state_bytes(g.ranks[0], true);
    for (int k = 1; k < n; ++k)
      ASSERT_EQ(state_bytes(g.ranks[k], true), want) << c.name << ", rank " << k << ", step " << step;
    const fp8_optimizer_stats_t s0 = stats_of(g.ranks[0].opt.get());
    EXPECT_EQ(s0.steps, step + 1);
    for (int k = 1; k < n; ++k) EXPECT_EQ(stats_of(g.ranks[k].opt.get()).last_grad_norm, s0.last_grad_norm);
  }
  EXPECT_NE(state_bytes(g.ranks[0], false), initial) << "the steps changed nothing";
}

INSTANTIATE_TEST_SUITE_P(Levels, DataParallelLevels,
                         ::testing::Combine(::testing::ValuesIn(kLevels), ::testing::Values(2, 3, 4)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "ranks";
                         });

// One rank seeing all n ranks' rows in one batch records the amaxes the ranks agree on: its scales
// are bit for bit those of every rank (amax over the union = max over the ranks' amaxes).
TEST(DataParallelScaling, RanksAgreeOnTheScalesOfOneRankSeeingTheWholeBatch) {
  const char* recipe = "backend=msamp, opt_level=O2, small_layer_fallback=0, amax_history_len=4";
  for (int n : {2, 4}) {
    Group g(n, recipe);
    Rank whole;
    whole.model = build_model(whole.ctx.get(), recipe, 1);  // rank 0's weights
    for (int step = 0; step < 2; ++step) {
      on_ranks(n, [&](int k) {
        Rank& r = g.ranks[k];
        forward_backward(r.ctx.get(), r.model.get(), batch_x(step, k), batch_dy(step, k));
      });
      std::vector<float> x, dy;
      for (int k = 0; k < n; ++k) {
        const auto xk = batch_x(step, k), dyk = batch_dy(step, k);
        x.insert(x.end(), xk.begin(), xk.end());
        dy.insert(dy.end(), dyk.begin(), dyk.end());
      }
      forward_backward(whole.ctx.get(), whole.model.get(), x, dy);
      for (int32_t layer : {0, 2})
        for (int32_t slot : {FP8_SCALING_INPUT, FP8_SCALING_WEIGHT, FP8_SCALING_GRAD_OUTPUT}) {
          fp8_scaling_t* want = nullptr;
          EXPECT_OK(fp8_layer_get_scaling(whole.model.get(), layer, slot, &want));
          const fp8_scaling_info_t w = info_of(want);
          for (int k = 0; k < n; ++k) {
            fp8_scaling_t* got = nullptr;
            EXPECT_OK(fp8_layer_get_scaling(g.ranks[k].model.get(), layer, slot, &got));
            const fp8_scaling_info_t i = info_of(got);
            EXPECT_EQ(i.scale, w.scale) << "layer " << layer << " slot " << slot << " rank " << k << " step " << step;
            EXPECT_EQ(i.amax, w.amax) << "layer " << layer << " slot " << slot << " rank " << k;
          }
        }
      // Without the agreement the ranks' own amaxes would differ: the data is what makes it matter.
      EXPECT_NE(amax_of(batch_dy(step, 0)), amax_of(batch_dy(step, n - 1)));
      on_ranks(n, [&](int k) { EXPECT_OK(fp8_optimizer_zero_grad(g.ranks[k].opt.get())); });
      EXPECT_OK(fp8_model_zero_grad(whole.model.get()));
    }
  }
}

// FP32 wire: N ranks with B rows each average to what one rank accumulating the same N micro-batches
// holds divided by N, to within FP32 summation order.
TEST(DataParallelFp32, AveragedGradientsEqualMicroBatchAccumulation) {
  for (int n : {2, 3, 4}) {
    Group g(n, nullptr, FP8_OPTIMIZER_SGD);
    Rank one;
    one.model = build_model(one.ctx.get(), nullptr, 1);
    on_ranks(n, [&](int k) {
      Rank& r = g.ranks[k];
      forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
      EXPECT_OK(fp8_model_sync_grads(r.model.get()));
    });
    for (int k = 0; k < n; ++k) forward_backward(one.ctx.get(), one.model.get(), batch_x(0, k), batch_dy(0, k));
    int32_t count = 0;
    EXPECT_OK(fp8_model_parameter_count(one.model.get(), &count));
    for (int32_t i = 0; i < count; ++i) {
      fp8_tensor_t* want_t = nullptr;
      EXPECT_OK(fp8_model_parameter_at(one.model.get(), i, nullptr, nullptr, &want_t));
      const std::vector<float> want = download<float>(want_t);
      for (int k = 0; k < n; ++k) {
        fp8_tensor_t* got_t = nullptr;
        EXPECT_OK(fp8_model_parameter_at(g.ranks[k].model.get(), i, nullptr, nullptr, &got_t));
        const std::vector<float> got = download<float>(got_t);
        // Relative to the tensor's largest value: elements that nearly cancel have no relative bound.
        double worst = 0.0, largest = 0.0;
        for (size_t e = 0; e < got.size(); ++e) {
          const double w = static_cast<double>(want[e]) / n;
          worst = std::max(worst, std::fabs(got[e] - w));
          largest = std::max(largest, std::fabs(w));
        }
        EXPECT_LT(worst, 4 * n * std::ldexp(largest, -24))
            << "parameter " << i << ", rank " << k << ", " << n << " ranks";
      }
    }
  }
}

// ---- the FP8 exchange against float64 ----------------------------------------------------------------

// Round to the E5M2 grid (nearest even, saturating at 57344), exactly, in double.
double round_e5m2(double v) {
  const double a = std::fabs(v);
  if (a == 0.0) return 0.0;
  const int e = std::max(std::ilogb(a), -14);
  const double ulp = std::ldexp(1.0, e - 2);
  const double q = std::min(std::nearbyint(a / ulp) * ulp, 57344.0);
  return v < 0 ? -q : q;
}

TEST(DataParallelFp8, ExchangeMeetsItsBoundAndBeatsSummingInFp8) {
  for (int n : {2, 3, 4}) {
    Group g(n, "backend=msamp, opt_level=O2, small_layer_fallback=0");
    const int32_t index = 0;  // fc1.weight: E5M2 gradient
    const size_t numel = static_cast<size_t>(kIn * kHidden);
    std::vector<std::vector<double>> decoded(static_cast<size_t>(n));
    on_ranks(n, [&](int k) {
      Rank& r = g.ranks[k];
      Tensor add = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kHidden, kIn});
      // Magnitudes differ across ranks, so their scales differ and the sum is not trivially exact.
      upload(add.get(), randn(numel, 300u + static_cast<uint32_t>(k), 0.01f * static_cast<float>(1 << (2 * k))));
      EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), index, add.get()));
      fp8_tensor_t* grad = nullptr;
      EXPECT_OK(fp8_model_parameter_at(r.model.get(), index, nullptr, nullptr, &grad));
      float scale_inv = 0.0f;
      EXPECT_OK(fp8_tensor_get_scale_inv(grad, &scale_inv));
      for (uint8_t c : download<uint8_t>(grad)) decoded[k].push_back(static_cast<double>(decode_e5m2(c)) * scale_inv);
    });
    on_ranks(n, [&](int k) { EXPECT_OK(fp8_model_sync_grads(g.ranks[k].model.get())); });
    fp8_tensor_t* grad = nullptr;
    EXPECT_OK(fp8_model_parameter_at(g.ranks[0].model.get(), index, nullptr, nullptr, &grad));
    float scale_inv = 0.0f;
    EXPECT_OK(fp8_tensor_get_scale_inv(grad, &scale_inv));
    const std::vector<uint8_t> codes = download<uint8_t>(grad);
    for (int k = 1; k < n; ++k) {
      fp8_tensor_t* other = nullptr;
      EXPECT_OK(fp8_model_parameter_at(g.ranks[k].model.get(), index, nullptr, nullptr, &other));
      EXPECT_EQ(download<uint8_t>(other), codes) << "rank " << k;
    }
    // The scale comes from the bound known before the means: the mean of the senders' amaxes (each
    // its largest decoded |value|), summed in float64, rounded to FP32.
    double amax_sum = 0.0;
    for (int k = 0; k < n; ++k) {
      float top = 0.0f;
      for (double v : decoded[k]) top = std::max(top, static_cast<float>(std::fabs(v)));
      amax_sum += top;
    }
    const float bound = static_cast<float>(amax_sum / n);
    EXPECT_EQ(scale_inv, 1.0f / (57344.0f / bound)) << n << " ranks";
    double ours = 0.0, fp8_sums = 0.0;
    for (size_t e = 0; e < numel; ++e) {
      double exact = 0.0, magnitude = 0.0;
      for (int k = 0; k < n; ++k) exact += decoded[k][e], magnitude += std::fabs(decoded[k][e]);
      exact /= n;
      const double got = static_cast<double>(decode_e5m2(codes[e])) * scale_inv;
      // One E5M2 rounding of the FP32 mean (half a unit: 2^-3 relative, or half the smallest
      // subnormal, 2^-17, at the scale), plus the FP32 sum's n roundings.
      const double bound = std::max(std::ldexp(std::fabs(exact), -3), std::ldexp(1.0, -17) * scale_inv) * (1 + 1e-6) +
                           n * std::ldexp(magnitude, -24);
      ASSERT_LE(std::fabs(got - exact), bound) << "element " << e << ", " << n << " ranks";
      ours += std::fabs(got - exact);
      // Summing in FP8 (NCCL's FP8 reduction, MS-AMP's): every partial sum rounds to E5M2 at the
      // common scale of the sum, then the mean.
      const double sum_scale = 1.0 / (scale_inv * n);
      double s = round_e5m2(decoded[0][e] * sum_scale);
      for (int k = 1; k < n; ++k) s = round_e5m2(s + round_e5m2(decoded[k][e] * sum_scale));
      fp8_sums += std::fabs(s / sum_scale / n - exact);
    }
    EXPECT_LT(ours, fp8_sums) << n << " ranks: total error of the exchange " << ours << ", of FP8 partial sums "
                              << fp8_sums;
    std::printf("[ exchange ] %d ranks: mean |error| %.3g (FP32 sums, one FP8 rounding) vs %.3g (FP8 partial sums)\n",
                n, ours / numel, fp8_sums / numel);
  }
}

// Each exchange case of the two tests below: `level`, one bucket or one per parameter (slices
// pipelined across buckets), exchanged at the step or during the backward, on 2 and 3 CPU ranks;
// `where` names the case.
void for_each_exchange_case(
    std::initializer_list<const char*> levels,
    const std::function<void(ExchangeCase&, const std::vector<int32_t>&, const std::string& where)>& check) {
  for (const char* level : levels)
    for (size_t bucket_bytes : {size_t{0}, size_t{FP8_MIN_BUCKET_BYTES}})
      for (bool backward_sync : {false, true})
        for (int n : {2, 3}) {
          const std::string recipe = std::string("backend=msamp, opt_level=") + level + ", small_layer_fallback=0";
          ExchangeCase c;
          c.recipe = recipe.c_str();
          c.bucket_bytes = bucket_bytes;
          c.backward_sync = backward_sync;
          const std::vector<int32_t> cpus(static_cast<size_t>(n), FP8_DEVICE_CPU);
          check(c, cpus,
                std::string(level) + ", " + std::to_string(n) + " ranks, bucket bytes " + std::to_string(bucket_bytes) +
                    ", backward sync " + (backward_sync ? "on" : "off"));
        }
}

// However the exchange through the collectives is cut in slices (FP8_EXCHANGE_SLICE_BYTES), every
// rank ends with the same gradients, bit for bit, as with one slice per piece.
TEST(DataParallelFp8, SlicingTheExchangeChangesNoBit) {
  // O2 and O3 (whose backward averages only its own pieces; fp8_model_sync_grads then gathers the
  // rest).
  for_each_exchange_case({"O2", "O3"}, [](ExchangeCase& c, const std::vector<int32_t>& cpus, const std::string& where) {
    c.peer_exchange = "off";  // (the path that slices travel on)
    const std::vector<unsigned char> whole = exchanged_grads(cpus, nullptr, c);
    EXPECT_EQ(exchanged_grads(cpus, "256", c), whole) << where << ", 256-byte slices";
    EXPECT_EQ(exchanged_grads(cpus, "1000", c), whole) << where << ", 768-byte slices (1000 rounded down)";
  });
  // Slices of several chunks each, a tensor's chunks split across them (fc1: 32 x 512 elements).
  ExchangeCase wide;
  wide.hidden = 512;
  wide.peer_exchange = "off";
  const std::vector<int32_t> two(2, FP8_DEVICE_CPU);
  EXPECT_EQ(exchanged_grads(two, "8192", wide), exchanged_grads(two, nullptr, wide)) << "8192-byte slices";
}

// The peer exchange (each rank reads the others' codes where they are and writes the means into
// every rank's storage) gives every rank the bits of the exchange through the collectives, at every
// level with FP8 gradients, whole or sliced, exchanged at the step or during the backward.
TEST(DataParallelFp8, ThePeerExchangeGivesTheBitsOfTheCollectives) {
  for_each_exchange_case(
      {"O1", "O2", "O3"}, [](ExchangeCase& c, const std::vector<int32_t>& cpus, const std::string& where) {
        c.peer_exchange = "off";
        const std::vector<unsigned char> collectives = exchanged_grads(cpus, nullptr, c);
        c.peer_exchange = "on";
        EXPECT_EQ(exchanged_grads(cpus, nullptr, c), collectives) << where << ", peer exchange on";
        EXPECT_EQ(exchanged_grads(cpus, "256", c), collectives) << where << ", peer exchange on, 256-byte slices";
        c.peer_exchange = nullptr;
        EXPECT_EQ(exchanged_grads(cpus, nullptr, c), collectives) << where << ", peer exchange unset (auto)";
      });
}

// Steps after the peer exchange: every rank holds the bits of the same group trained through the
// collectives, after every step (O3: the exchange of its own pieces, then the weights gathered).
TEST(DataParallelFp8, ThePeerExchangeTrainsBitForBitAsTheCollectives) {
  for (const char* level : {"O1", "O2", "O3"}) {
    const std::string recipe = std::string("backend=msamp, opt_level=") + level + ", small_layer_fallback=0";
    constexpr int n = 3, steps = 3;
    std::vector<std::vector<unsigned char>> states[2];
    for (int peers = 0; peers < 2; ++peers) {
      const ScopedEnv env("FP8_PEER_EXCHANGE", peers ? "on" : "off");
      Group g(n, recipe.c_str(), FP8_OPTIMIZER_ADAMW, 0.05f);
      for (int step = 0; step < steps; ++step) {
        on_ranks(n, [&](int k) { train_step(g.ranks[k], step, k); });
        for (int k = 0; k < n; ++k) states[peers].push_back(state_bytes(g.ranks[k], false));
      }
    }
    ASSERT_EQ(states[1].size(), states[0].size());
    for (size_t i = 0; i < states[0].size(); ++i)
      EXPECT_EQ(states[1][i], states[0][i]) << level << ", step " << i / n << ", rank " << i % n;
  }
}

TEST(DataParallelFp8, ABadPeerExchangeValueIsRefusedOnEveryRank) {
  for (const char* bad : {"yes", "ON", "", "1"}) {
    const ScopedEnv env("FP8_PEER_EXCHANGE", bad);
    Group g(2, "backend=msamp, opt_level=O2, small_layer_fallback=0");
    const std::vector<Outcome> got = sync_outcomes(g);
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].status, FP8_ERR_INVALID_ARGUMENT) << "'" << bad << "', rank " << k;
      EXPECT_NE(got[k].message.find(std::string("FP8_PEER_EXCHANGE is '") + bad + "'; expected auto, on or off"),
                std::string::npos)
          << got[k].message;
    }
  }
}

TEST(DataParallelFp8, ABadSliceSizeIsRefusedOnEveryRank) {
  for (const char* bad : {"16MiB", "-1", "+4096", " 4096", "", "255", "18446744073709551616", "4611686018427387905"}) {
    const ScopedEnv env("FP8_EXCHANGE_SLICE_BYTES", bad);
    Group g(2, "backend=msamp, opt_level=O2, small_layer_fallback=0");
    const std::vector<Outcome> got = sync_outcomes(g);
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].status, FP8_ERR_INVALID_ARGUMENT) << "'" << bad << "', rank " << k;
      EXPECT_NE(got[k].message.find(std::string("FP8_EXCHANGE_SLICE_BYTES is '") + bad + "'"), std::string::npos)
          << got[k].message;
    }
  }
  // The largest value takes one slice per piece.
  const std::vector<int32_t> two(2, FP8_DEVICE_CPU);
  const std::vector<unsigned char> one_slice = exchanged_grads(two, "4611686018427387904");
  EXPECT_EQ(one_slice, exchanged_grads(two, nullptr));
}

// ---- the skip, checkpoints --------------------------------------------------------------------------

TEST(DataParallelSkip, ANonFiniteGradientOnOneRankSkipsTheStepOnEveryRank) {
  for (const char* recipe :
       {static_cast<const char*>(nullptr), "backend=msamp, opt_level=O2, small_layer_fallback=0"}) {
    Group g(3, recipe);
    on_ranks(3, [&](int k) { train_step(g.ranks[k], 0, k); });
    // (The forward and backward update the scaling states; the skipped step changes no parameter.)
    const std::vector<unsigned char> before = state_bytes(g.ranks[0], false, false);
    on_ranks(3, [&](int k) {
      Rank& r = g.ranks[k];
      forward_backward(r.ctx.get(), r.model.get(), batch_x(1, k), batch_dy(1, k));
      if (k == 1) {
        Tensor bad = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kHidden, kIn});
        std::vector<float> v(static_cast<size_t>(kHidden * kIn), 0.5f);
        v[17] = NAN;
        upload(bad.get(), v);
        EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), 0, bad.get()));
      }
      EXPECT_OK(fp8_optimizer_step(r.opt.get()));
    });
    for (int k = 0; k < 3; ++k) {
      const fp8_optimizer_stats_t s = stats_of(g.ranks[k].opt.get());
      EXPECT_EQ(s.last_skipped, 1) << "rank " << k;
      EXPECT_EQ(s.steps, 1) << "rank " << k;
      EXPECT_EQ(state_bytes(g.ranks[k], false, false), before) << "rank " << k;
    }
  }
}

// Saved by 4 ranks (rank 0 writes), loaded by 4, 2 and 1: the weights are those saved, and a group
// of 4 that loads trains on bit-identically with the group that saved. At O3 the masters, m and v
// are sharded: the file holds them whole, and each loading rank takes its share.
class DataParallelCheckpoint : public ::testing::TestWithParam<const char*> {};

TEST_P(DataParallelCheckpoint, SavedByFourRanksLoadsIntoTwoAndOneAndTrainsOnBitIdentically) {
  const char* recipe = GetParam();
  const std::string path = temp_path("four.ckpt");
  std::remove(path.c_str());
  Group four(4, recipe);
  on_ranks(4, [&](int k) { train_step(four.ranks[k], 0, k); });
  on_ranks(4, [&](int k) {
    EXPECT_OK(fp8_checkpoint_save(four.ranks[k].model.get(), four.ranks[k].opt.get(), path.c_str(), 0));
  });
  const std::vector<unsigned char> saved = state_bytes(four.ranks[0], false);
  for (int step = 1; step < 3; ++step) on_ranks(4, [&](int k) { train_step(four.ranks[k], step, k); });
  const std::vector<unsigned char> trained = state_bytes(four.ranks[0], false);

  for (int n : {4, 2, 1}) {
    Group g(n, recipe);
    on_ranks(
        n, [&](int k) { EXPECT_OK(fp8_checkpoint_load(g.ranks[k].model.get(), g.ranks[k].opt.get(), path.c_str())); });
    for (int k = 0; k < n; ++k) EXPECT_EQ(state_bytes(g.ranks[k], false), saved) << n << " ranks, rank " << k;
    // The group trains on from the file as the group that saved did (at 4 ranks: the same data).
    for (int step = 1; step < 3 && n == 4; ++step) on_ranks(4, [&](int k) { train_step(g.ranks[k], step, k); });
    if (n == 4) EXPECT_EQ(state_bytes(g.ranks[0], false), trained);
  }
  // A model without a communicator loads the same file, and trains on as one rank does.
  Rank single;
  single.model = build_model(single.ctx.get(), recipe, 9);
  single.opt = make_optimizer(single.model.get(), FP8_OPTIMIZER_ADAM);
  EXPECT_OK(fp8_checkpoint_load(single.model.get(), single.opt.get(), path.c_str()));
  EXPECT_EQ(state_bytes(single, false), saved);
  // Saved again by the single model, loaded by 4 ranks: the same state, sharded or not.
  const std::string again = temp_path("one.ckpt");
  EXPECT_OK(fp8_checkpoint_save(single.model.get(), single.opt.get(), again.c_str(), 0));
  Group back(4, recipe);
  on_ranks(4, [&](int k) {
    EXPECT_OK(fp8_checkpoint_load(back.ranks[k].model.get(), back.ranks[k].opt.get(), again.c_str()));
  });
  for (int step = 1; step < 3; ++step) on_ranks(4, [&](int k) { train_step(back.ranks[k], step, k); });
  EXPECT_EQ(state_bytes(back.ranks[0], false), trained) << "4 -> 1 -> 4 ranks trains on like the 4 that saved";
  // Gradients mid-accumulation are each rank's own: refused on every rank, nothing written.
  const std::string other = temp_path("grads.ckpt");
  std::remove(other.c_str());
  for (int k = 0; k < 4; ++k)
    EXPECT_REFUSED(fp8_checkpoint_save(four.ranks[k].model.get(), nullptr, other.c_str(), FP8_CHECKPOINT_GRADIENTS),
                   FP8_ERR_INVALID_STATE, "fp8_checkpoint_save", "fp8_optimizer_step");
  EXPECT_FALSE(std::filesystem::exists(other));
  // A file one rank cannot read fails the load on every rank, and no rank changes.
  Group two(2, recipe);
  const std::vector<unsigned char> before = state_bytes(two.ranks[0], false);
  std::vector<fp8_status_t> got(2);
  on_ranks(2, [&](int k) {
    got[k] = fp8_checkpoint_load(two.ranks[k].model.get(), two.ranks[k].opt.get(),
                                 k == 1 ? "/nonexistent/dir/file.ckpt" : path.c_str());
  });
  EXPECT_EQ(got[0], FP8_ERR_INVALID_STATE);
  EXPECT_EQ(got[1], FP8_ERR_IO);
  for (int k = 0; k < 2; ++k) EXPECT_EQ(state_bytes(two.ranks[k], false), before) << "rank " << k;
  std::remove(path.c_str());
  std::remove(again.c_str());
}

INSTANTIATE_TEST_SUITE_P(Levels, DataParallelCheckpoint,
                         ::testing::Values("backend=msamp, opt_level=O2, small_layer_fallback=0",
                                           "backend=msamp, opt_level=O3, small_layer_fallback=0"));

// ZeRO at O3: each rank keeps the F16 masters and Adam's m and v of its share of the Linear weights,
// so the training state is 2 + 5/N bytes per weight (E4M3 weight and FP8 gradient whole).
TEST(DataParallelZero, O3KeepsTwoPlusFiveOverNBytesPerWeight) {
  for (int n : {1, 2, 4}) {
    ZeroO3Footprint f;
    ASSERT_NO_FATAL_FAILURE(zero_o3_footprint(std::vector<int32_t>(static_cast<size_t>(n), FP8_DEVICE_CPU), &f));
    for (int k = 0; k < n; ++k) {
      const double per = f.bytes_per_weight[k];
      EXPECT_LE(per, 2.0 + 5.0 / n + 0.01) << n << " ranks, rank " << k;
      EXPECT_GE(per, 2.0 + 5.0 / n - 0.01) << n << " ranks, rank " << k;
      std::printf("[ ZeRO O3  ] %d rank(s), rank %d: %.3f bytes of training state per weight\n", n, k, per);
    }
    EXPECT_EQ(f.masters_total, size_t{1024 * 1024 * 2}) << "the ranks' master shares add up to the whole";
  }
}

// ---- misuse --------------------------------------------------------------------------------------------

TEST(DataParallelMisuse, DifferentModelsAreRefusedOnEveryRankNamingTheDifference) {
  Rank a, b;
  std::vector<fp8_context_t*> ctxs = {a.ctx.get(), b.ctx.get()};
  fp8_comm_t* comms[2] = {};
  FP8_ASSERT_OK(fp8_comm_create_local(comms, ctxs.data(), 2));
  a.comm.reset(comms[0]);
  b.comm.reset(comms[1]);
  a.model = build_model(a.ctx.get(), nullptr, 1);
  b.model = build_model(b.ctx.get(), nullptr, 1, kHidden + 16);
  Rank* rs[2] = {&a, &b};
  std::vector<fp8_status_t> st(2);
  std::vector<std::string> msg(2);
  on_ranks(2, [&](int k) {
    st[k] = fp8_model_set_comm(rs[k]->model.get(), rs[k]->comm.get());
    msg[k] = fp8_last_error_message();
  });
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(st[k], FP8_ERR_INVALID_STATE) << msg[k];
    EXPECT_NE(msg[k].find("rank 1 has layer 0 'fc1'"), std::string::npos) << msg[k];
    EXPECT_NE(msg[k].find("[80, 32]"), std::string::npos) << msg[k];
  }
  // Same models, different optimizer kinds: refused at fp8_optimizer_create on both.
  b.model = build_model(b.ctx.get(), nullptr, 1);
  on_ranks(2, [&](int k) { EXPECT_OK(fp8_model_set_comm(rs[k]->model.get(), rs[k]->comm.get())); });
  on_ranks(2, [&](int k) {
    fp8_optimizer_t* o = nullptr;
    st[k] = fp8_optimizer_create(&o, rs[k]->model.get(), k == 0 ? FP8_OPTIMIZER_ADAM : FP8_OPTIMIZER_SGD);
    msg[k] = fp8_last_error_message();
    EXPECT_EQ(o, nullptr);
  });
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(st[k], FP8_ERR_INVALID_STATE) << msg[k];
    EXPECT_NE(msg[k].find("optimizer SGD"), std::string::npos) << msg[k];
  }
  // With an optimizer (made on every rank: a collective call), the communicator can no longer change.
  on_ranks(2, [&](int k) { rs[k]->opt = make_optimizer(rs[k]->model.get(), FP8_OPTIMIZER_SGD); });
  EXPECT_REFUSED(fp8_model_set_comm(a.model.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_model_set_comm",
                 "fp8_optimizer_create");
}

TEST(DataParallelMisuse, ARankRefusingSetCommMakesEveryRankRefuseInsteadOfWaiting) {
  Rank a, b;
  std::vector<fp8_context_t*> ctxs = {a.ctx.get(), b.ctx.get()};
  fp8_comm_t* comms[2] = {};
  FP8_ASSERT_OK(fp8_comm_create_local(comms, ctxs.data(), 2));
  a.comm.reset(comms[0]);
  b.comm.reset(comms[1]);
  const char* recipe = "backend=msamp, opt_level=O2, small_layer_fallback=0";
  a.model = build_model(a.ctx.get(), recipe, 1);
  b.model = build_model(b.ctx.get(), recipe, 1);
  EXPECT_OK(fp8_autocast_begin(b.model.get()));  // rank 1 alone is inside a region
  Rank* rs[2] = {&a, &b};
  std::vector<fp8_status_t> st(2);
  std::vector<std::string> msg(2);
  on_ranks(2, [&](int k) {
    st[k] = fp8_model_set_comm(rs[k]->model.get(), rs[k]->comm.get());
    msg[k] = fp8_last_error_message();
  });
  EXPECT_EQ(st[1], FP8_ERR_INVALID_STATE) << msg[1];
  EXPECT_NE(msg[1].find("autocast"), std::string::npos) << msg[1];
  EXPECT_EQ(st[0], FP8_ERR_INVALID_STATE) << msg[0];
  EXPECT_NE(msg[0].find("failed on rank 1"), std::string::npos) << msg[0];
  EXPECT_OK(fp8_autocast_end(b.model.get()));
  on_ranks(2, [&](int k) { EXPECT_OK(fp8_model_set_comm(rs[k]->model.get(), rs[k]->comm.get())); });
}

// Whether a step exchanges is decided by the calls: after fp8_model_sync_grads, gradient writes are
// refused until the step (or zero_grad), and the step does not average twice.
TEST(DataParallelMisuse, GradientWritesAfterAnExplicitSyncAreRefused) {
  Group g(2, "backend=msamp, opt_level=O2, small_layer_fallback=0");
  on_ranks(2, [&](int k) {
    Rank& r = g.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    EXPECT_OK(fp8_model_sync_grads(r.model.get()));
    EXPECT_OK(fp8_model_sync_grads(r.model.get()));  // a second call does not average again
  });
  const std::vector<unsigned char> averaged = state_bytes(g.ranks[0], true);
  EXPECT_EQ(state_bytes(g.ranks[1], true), averaged);
  Rank& r = g.ranks[1];
  Tensor add = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kHidden, kIn});
  upload(add.get(), randn(static_cast<size_t>(kHidden * kIn), 3, 0.1f));
  EXPECT_REFUSED(fp8_model_accumulate_grad(r.model.get(), 0, add.get()), FP8_ERR_INVALID_STATE,
                 "fp8_model_accumulate_grad", "fp8_model_sync_grads");
  EXPECT_EQ(state_bytes(g.ranks[1], true), averaged) << "the refused write changed nothing";
  // The steps use the averaged gradients as they are, and afterwards writes are allowed again.
  on_ranks(2, [&](int k) { EXPECT_OK(fp8_optimizer_step(g.ranks[k].opt.get())); });
  EXPECT_EQ(state_bytes(g.ranks[0], false), state_bytes(g.ranks[1], false));
  EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), 0, add.get()));
}

// Layers added and converted after fp8_model_set_comm, each rank with its own initial values: the
// optimizer's creation starts every rank from rank 0's, and the ranks stay identical. (O3, whose
// masters the ranks shard, is refused: convert before fp8_model_set_comm.)
TEST(DataParallelMisuse, LayersAddedAfterSetCommStartFromRankZerosValues) {
  std::vector<Rank> ranks(2);
  std::vector<fp8_context_t*> ctxs = {ranks[0].ctx.get(), ranks[1].ctx.get()};
  fp8_comm_t* comms[2] = {};
  FP8_ASSERT_OK(fp8_comm_create_local(comms, ctxs.data(), 2));
  on_ranks(2, [&](int k) {
    Rank& r = ranks[k];
    r.comm.reset(comms[k]);
    r.model = make_model(r.ctx.get());
    EXPECT_OK(fp8_model_set_comm(r.model.get(), r.comm.get()));
    EXPECT_OK(fp8_model_add_linear(r.model.get(), "fc1", kIn, kHidden, 1, nullptr));
    EXPECT_OK(fp8_model_add_activation(r.model.get(), "act", FP8_ACTIVATION_GELU, nullptr));
    EXPECT_OK(fp8_model_add_linear(r.model.get(), "fc2", kHidden, kOut, 1, nullptr));
    for (int32_t i = 0; i < 4; ++i) {
      fp8_tensor_t* v = nullptr;
      EXPECT_OK(fp8_model_parameter_at(r.model.get(), i, nullptr, &v, nullptr));
      int64_t n = 0;
      fp8_tensor_numel(v, &n);
      upload(v, randn(static_cast<size_t>(n), 40u + 7u * k + i, 0.2f));  // each rank its own
    }
    Recipe o3 = make_recipe("backend=msamp, opt_level=O3");
    EXPECT_REFUSED(fp8_convert_model(r.model.get(), o3.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_convert_model",
                   "fp8_model_set_comm");
    Recipe o2 = make_recipe("backend=msamp, opt_level=O2, small_layer_fallback=0");
    EXPECT_OK(fp8_convert_model(r.model.get(), o2.get(), nullptr));
    EXPECT_OK(fp8_model_set_autowrap(r.model.get(), 1));
    r.opt = make_optimizer(r.model.get(), FP8_OPTIMIZER_ADAM);
  });
  EXPECT_EQ(state_bytes(ranks[0], false), state_bytes(ranks[1], false));
  on_ranks(2, [&](int k) { train_step(ranks[k], 0, k); });
  EXPECT_EQ(state_bytes(ranks[0], false), state_bytes(ranks[1], false));
}

TEST(DataParallelMisuse, AbortUnblocksARankWaitingForAnother) {
  Group g(2, nullptr, FP8_OPTIMIZER_SGD);
  Rank& r0 = g.ranks[0];
  forward_backward(r0.ctx.get(), r0.model.get(), batch_x(0, 0), batch_dy(0, 0));
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_OK(fp8_comm_abort(g.ranks[1].comm.get()));
  });
  // Rank 1 never steps: rank 0 waits in the exchange until the abort.
  EXPECT_REFUSED(fp8_optimizer_step(r0.opt.get()), FP8_ERR_NCCL, "fp8_optimizer_step", "aborted");
  watchdog.join();
  EXPECT_REFUSED(fp8_model_sync_grads(g.ranks[1].model.get()), FP8_ERR_NCCL, "fp8_model_sync_grads", "aborted");
}

// A rank that stalls (alive, but never calling the collective) fails the others once their timeout
// passes, not never, and the group is aborted for every rank.
TEST(DataParallelMisuse, ARankThatStallsMakesTheOthersFailAfterTheirTimeout) {
  Group g(2, nullptr, FP8_OPTIMIZER_SGD);
  double seconds = 0.0;
  EXPECT_OK(fp8_comm_get_timeout(g.ranks[0].comm.get(), &seconds));
  EXPECT_EQ(seconds, FP8_DEFAULT_COMM_TIMEOUT_S);
  EXPECT_OK(fp8_comm_set_timeout(g.ranks[0].comm.get(), 0.3));
  EXPECT_OK(fp8_comm_get_timeout(g.ranks[0].comm.get(), &seconds));
  EXPECT_EQ(seconds, 0.3);
  Rank& r0 = g.ranks[0];
  forward_backward(r0.ctx.get(), r0.model.get(), batch_x(0, 0), batch_dy(0, 0));
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 never steps.
  EXPECT_REFUSED(fp8_optimizer_step(r0.opt.get()), FP8_ERR_NCCL, "fp8_optimizer_step", "fp8_comm_set_timeout");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(took, 0.3);
  EXPECT_LT(took, 10.0);
  EXPECT_NE(std::string(fp8_last_error_message()).find("only 1 of 2 ranks had called it"), std::string::npos)
      << fp8_last_error_message();
  // Rank 1, calling late, is told why without waiting.
  EXPECT_REFUSED(fp8_model_sync_grads(g.ranks[1].model.get()), FP8_ERR_NCCL, "fp8_model_sync_grads",
                 "rank 0 waited over 0.3 s");
}

TEST(DataParallelMisuse, ARankThatLeavesMakesTheOthersFailInsteadOfWaiting) {
  Group g(3, "backend=msamp, opt_level=O2, small_layer_fallback=0");
  on_ranks(3, [&](int k) { train_step(g.ranks[k], 0, k); });
  on_ranks(3, [&](int k) {
    Rank& r = g.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(1, k), batch_dy(1, k));
  });
  std::vector<fp8_status_t> st(2);
  on_ranks(3, [&](int k) {
    Rank& r = g.ranks[k];
    if (k == 2) {  // leaves: its optimizer, model and communicator go
      r.opt.reset();
      r.model.reset();
      r.comm.reset();
      return;
    }
    st[k] = fp8_optimizer_step(r.opt.get());
    EXPECT_NE(std::string(fp8_last_error_message()).find("rank 2 left"), std::string::npos) << fp8_last_error_message();
  });
  EXPECT_EQ(st[0], FP8_ERR_NCCL);
  EXPECT_EQ(st[1], FP8_ERR_NCCL);
}

// A rank's F16 master share (O3; empty below O3).
std::vector<unsigned char> master_bytes(const Rank& r) {
  void* data = nullptr;
  size_t bytes = 0;
  EXPECT_OK(fp8_model_flat_storage(r.model.get(), FP8_STORAGE_MASTERS, FP8_DTYPE_F16, &data, &bytes));
  const auto* p = static_cast<const unsigned char*>(data);
  return std::vector<unsigned char>(p, p + bytes);
}

// Every rank's status and message of one collective call, each rank on its own thread.
std::vector<Outcome> outcomes(int n, const std::function<fp8_status_t(int)>& call) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  on_ranks(n, [&](int k) {
    const fp8_status_t st = call(k);
    out[k] = {st, fp8_last_error_message()};
  });
  return out;
}

// A bound on a regression that leaves ranks waiting: they fail after it, not after ten minutes.
void bound_waits(std::vector<Rank>& ranks, double seconds = 20.0) {
  for (Rank& r : ranks) EXPECT_OK(fp8_comm_set_timeout(r.comm.get(), seconds));
}

// n CPU ranks of one in-process group (no models yet), their waits bounded.
std::vector<Rank> bounded_cpu_ranks(int n) {
  std::vector<Rank> ranks;
  EXPECT_OK(join_ranks(ranks, std::vector<int32_t>(static_cast<size_t>(n), FP8_DEVICE_CPU)));
  bound_waits(ranks);
  return ranks;
}

// fp8.h: "if one fails, every rank fails and none changes". A checkpoint refused by one rank alone
// (inside autocast, a bad path) fails on every rank at once instead of leaving the others waiting for
// it; no rank changes, and no file is written.
TEST(DataParallelMisuse, ACheckpointRefusedOnOneRankFailsOnEveryRankInsteadOfWaiting) {
  const char* o3 = "backend=msamp, opt_level=O3, small_layer_fallback=0";
  const std::string path = temp_path("refused_one.ckpt"), unwritten = temp_path("refused_unwritten.ckpt");
  std::remove(path.c_str());
  std::remove(unwritten.c_str());
  Group g(2, o3);
  bound_waits(g.ranks);
  on_ranks(2, [&](int k) { train_step(g.ranks[k], 0, k); });
  on_ranks(
      2, [&](int k) { EXPECT_OK(fp8_checkpoint_save(g.ranks[k].model.get(), g.ranks[k].opt.get(), path.c_str(), 0)); });
  on_ranks(2, [&](int k) { train_step(g.ranks[k], 1, k); });  // the file now differs from the models
  std::vector<std::vector<unsigned char>> before(2), masters(2);
  for (int k = 0; k < 2; ++k) before[k] = state_bytes(g.ranks[k], false), masters[k] = master_bytes(g.ranks[k]);
  const auto unchanged = [&](const char* what) {
    for (int k = 0; k < 2; ++k) {
      EXPECT_EQ(state_bytes(g.ranks[k], false), before[k]) << what << ", rank " << k;
      EXPECT_EQ(master_bytes(g.ranks[k]), masters[k]) << what << ", rank " << k;
    }
  };
  const auto refused_by_rank_1 = [](const std::vector<Outcome>& o, fp8_status_t own, const char* why) {
    EXPECT_EQ(o[1].status, own) << o[1].message;
    EXPECT_NE(o[1].message.find(why), std::string::npos) << o[1].message;
    EXPECT_EQ(o[0].status, FP8_ERR_INVALID_STATE) << o[0].message;
    EXPECT_NE(o[0].message.find("failed on rank 1"), std::string::npos) << o[0].message;
  };
  // Rank 1 alone inside an autocast region: the load and the save.
  EXPECT_OK(fp8_autocast_begin(g.ranks[1].model.get()));
  auto o = outcomes(
      2, [&](int k) { return fp8_checkpoint_load(g.ranks[k].model.get(), g.ranks[k].opt.get(), path.c_str()); });
  refused_by_rank_1(o, FP8_ERR_INVALID_STATE, "autocast");
  EXPECT_NE(o[0].message.find("fp8_checkpoint_load:"), std::string::npos) << o[0].message;
  unchanged("load refused by rank 1 inside autocast");
  o = outcomes(2, [&](int k) {
    return fp8_checkpoint_save(g.ranks[k].model.get(), g.ranks[k].opt.get(), unwritten.c_str(), 0);
  });
  refused_by_rank_1(o, FP8_ERR_INVALID_STATE, "autocast");
  EXPECT_FALSE(std::filesystem::exists(unwritten)) << "rank 0 wrote a file the group refused";
  unchanged("save refused by rank 1 inside autocast");
  on_ranks(2, [&](int k) {  // (the region's end is collective: both ranks end one)
    if (k == 0) EXPECT_OK(fp8_autocast_begin(g.ranks[k].model.get()));
    EXPECT_OK(fp8_autocast_end(g.ranks[k].model.get()));
  });
  for (int k = 0; k < 2; ++k) before[k] = state_bytes(g.ranks[k], false), masters[k] = master_bytes(g.ranks[k]);
  // Rank 1 alone with an empty path, or with the optimizer of another model.
  o = outcomes(2, [&](int k) {
    return fp8_checkpoint_load(g.ranks[k].model.get(), g.ranks[k].opt.get(), k == 1 ? "" : path.c_str());
  });
  refused_by_rank_1(o, FP8_ERR_INVALID_ARGUMENT, "path is empty");
  unchanged("load refused by rank 1's empty path");
  o = outcomes(2, [&](int k) {
    return fp8_checkpoint_load(g.ranks[k].model.get(), g.ranks[k == 1 ? 0 : k].opt.get(), path.c_str());
  });
  refused_by_rank_1(o, FP8_ERR_INVALID_ARGUMENT, "optimizer was made for another model");
  unchanged("load refused by rank 1's optimizer of another model");
  // The optimizer on rank 0 only (O3's save would gather the masters on one rank alone): both calls
  // refused on every rank, each naming what it passed.
  const auto refused_as_unlike = [](const std::vector<Outcome>& o) {
    for (int k = 0; k < 2; ++k) {
      EXPECT_EQ(o[k].status, FP8_ERR_INVALID_ARGUMENT) << o[k].message;
      EXPECT_NE(o[k].message.find(k == 0 ? "optimizer is given on this rank and NULL on another"
                                         : "optimizer is NULL on this rank and given on another"),
                std::string::npos)
          << o[k].message;
    }
  };
  o = outcomes(2, [&](int k) {
    return fp8_checkpoint_save(g.ranks[k].model.get(), k == 0 ? g.ranks[k].opt.get() : nullptr, unwritten.c_str(), 0);
  });
  refused_as_unlike(o);
  EXPECT_FALSE(std::filesystem::exists(unwritten)) << "rank 0 wrote a file the group refused";
  o = outcomes(2, [&](int k) {
    return fp8_checkpoint_load(g.ranks[k].model.get(), k == 0 ? g.ranks[k].opt.get() : nullptr, path.c_str());
  });
  refused_as_unlike(o);
  unchanged("save and load with the optimizer on rank 0 only");
  // The group still works: the file loads on both, and training goes on identically.
  on_ranks(2,
           [&](int k) { EXPECT_OK(fp8_checkpoint_load(g.ranks[k].model.get(), g.ranks[k].opt.get(), path.c_str())); });
  on_ranks(2, [&](int k) { train_step(g.ranks[k], 2, k); });
  EXPECT_EQ(state_bytes(g.ranks[0], false), state_bytes(g.ranks[1], false));
  std::remove(path.c_str());
}

// fp8.h: set_comm is refused while an optimizer of the model exists, on every rank, and agreed on:
// an optimizer on one rank only fails every rank at once. Nothing changes.
TEST(DataParallelMisuse, SetCommWithAnOptimizerIsRefusedOnEveryRank) {
  const char* o2 = "backend=msamp, opt_level=O2, small_layer_fallback=0";
  Group g(2, o2);
  bound_waits(g.ranks);
  on_ranks(2, [&](int k) { train_step(g.ranks[k], 0, k); });
  const std::vector<unsigned char> before = state_bytes(g.ranks[0], true);
  auto o = outcomes(2, [&](int k) { return fp8_model_set_comm(g.ranks[k].model.get(), g.ranks[k].comm.get()); });
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(o[k].status, FP8_ERR_INVALID_STATE) << o[k].message;
    EXPECT_EQ(o[k].message.rfind("fp8_model_set_comm:", 0), 0u) << o[k].message;
    EXPECT_NE(o[k].message.find("set the communicator before fp8_optimizer_create"), std::string::npos) << o[k].message;
    EXPECT_EQ(state_bytes(g.ranks[k], true), before) << "rank " << k;
  }
  on_ranks(2, [&](int k) { train_step(g.ranks[k], 1, k); });  // still one group
  EXPECT_EQ(state_bytes(g.ranks[0], true), state_bytes(g.ranks[1], true));

  // An optimizer on rank 1 only (made before any communicator): both refuse, neither joins.
  std::vector<Rank> ranks = bounded_cpu_ranks(2);
  for (int k = 0; k < 2; ++k) ranks[k].model = build_model(ranks[k].ctx.get(), o2, static_cast<uint32_t>(k + 1));
  ranks[1].opt = make_optimizer(ranks[1].model.get(), FP8_OPTIMIZER_ADAM);
  std::vector<std::vector<unsigned char>> own(2);
  for (int k = 0; k < 2; ++k) own[k] = state_bytes(ranks[k], true);
  o = outcomes(2, [&](int k) { return fp8_model_set_comm(ranks[k].model.get(), ranks[k].comm.get()); });
  EXPECT_EQ(o[1].status, FP8_ERR_INVALID_STATE) << o[1].message;
  EXPECT_NE(o[1].message.find("fp8_optimizer_create"), std::string::npos) << o[1].message;
  EXPECT_EQ(o[0].status, FP8_ERR_INVALID_STATE) << o[0].message;
  EXPECT_NE(o[0].message.find("failed on rank 1"), std::string::npos) << o[0].message;
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(state_bytes(ranks[k], true), own[k]) << "rank " << k << " took rank 0's model";
    EXPECT_REFUSED(fp8_model_set_backward_sync(ranks[k].model.get(), 1), FP8_ERR_INVALID_STATE,
                   "fp8_model_set_backward_sync", "not data-parallel");
  }
}

// fp8.h: comm must be made from the model's context. A rank passing another context's communicator
// is refused through that communicator's group (its own context's memory), so the other ranks refuse
// too instead of waiting for it until their timeout; nothing changes on any rank.
TEST(DataParallelMisuse, ACommOfAnotherContextIsRefusedOnEveryRank) {
  std::vector<Rank> rs = bounded_cpu_ranks(2);
  Rank &a = rs[0], &b = rs[1];
  Context other = make_context(FP8_DEVICE_CPU);
  a.model = build_model(a.ctx.get(), nullptr, 1);
  b.model = build_model(other.get(), nullptr, 2);  // rank 1's model: not of its communicator's context
  const auto o = outcomes(2, [&](int k) { return fp8_model_set_comm(rs[k].model.get(), rs[k].comm.get()); });
  EXPECT_EQ(o[1].status, FP8_ERR_INVALID_ARGUMENT) << o[1].message;
  EXPECT_NE(o[1].message.find("comm belongs to another context"), std::string::npos) << o[1].message;
  EXPECT_EQ(o[0].status, FP8_ERR_INVALID_STATE) << o[0].message;
  EXPECT_NE(o[0].message.find("fp8_model_set_comm failed on rank 1"), std::string::npos) << o[0].message;
  for (int k = 0; k < 2; ++k)  // neither model became data-parallel
    EXPECT_REFUSED(fp8_model_set_backward_sync(rs[k].model.get(), 1), FP8_ERR_INVALID_STATE,
                   "fp8_model_set_backward_sync", "not data-parallel");
  b.model = build_model(b.ctx.get(), nullptr, 2);  // the group is still usable
  on_ranks(2, [&](int k) { EXPECT_OK(fp8_model_set_comm(rs[k].model.get(), rs[k].comm.get())); });
  EXPECT_EQ(state_bytes(b, false), state_bytes(a, false));  // rank 0's model on both
}

// fp8.h allows fp8_model_set_comm again on a replicated model (te..O2: rank 0's model again); a
// sharded O3 model keeps its group: refused on every rank, naming the way out, nothing changed.
TEST(DataParallelMisuse, SetCommTwiceReplicatesAgainButAShardedO3ModelKeepsItsGroup) {
  for (const char* recipe :
       {"backend=msamp, opt_level=O2, small_layer_fallback=0", "backend=msamp, opt_level=O3, small_layer_fallback=0"}) {
    SCOPED_TRACE(recipe);
    const bool o3 = std::string(recipe).find("O3") != std::string::npos;
    std::vector<Rank> ranks = bounded_cpu_ranks(2);
    for (int k = 0; k < 2; ++k)
      ranks[k].model = build_model(ranks[k].ctx.get(), recipe, static_cast<uint32_t>(k + 1));
    on_ranks(2, [&](int k) { EXPECT_OK(fp8_model_set_comm(ranks[k].model.get(), ranks[k].comm.get())); });
    std::vector<std::vector<unsigned char>> before(2), masters(2);
    for (int k = 0; k < 2; ++k) before[k] = state_bytes(ranks[k], true), masters[k] = master_bytes(ranks[k]);
    const auto again =
        outcomes(2, [&](int k) { return fp8_model_set_comm(ranks[k].model.get(), ranks[k].comm.get()); });
    for (int k = 0; k < 2; ++k) {
      if (!o3) {
        EXPECT_EQ(again[k].status, FP8_OK) << again[k].message;
      } else {
        EXPECT_EQ(again[k].status, FP8_ERR_INVALID_STATE) << again[k].message;
        EXPECT_EQ(again[k].message.rfind("fp8_model_set_comm:", 0), 0u) << again[k].message;
        EXPECT_NE(again[k].message.find("sharded over its 2 ranks"), std::string::npos) << again[k].message;
        EXPECT_NE(again[k].message.find("Save a checkpoint"), std::string::npos) << again[k].message;
        // Leaving alone is refused too, at once (it is local).
        EXPECT_REFUSED(fp8_model_set_comm(ranks[k].model.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_model_set_comm",
                       "sharded");
      }
      EXPECT_EQ(state_bytes(ranks[k], true), before[k]) << "rank " << k;
      EXPECT_EQ(master_bytes(ranks[k]), masters[k]) << "rank " << k;
    }
    on_ranks(2, [&](int k) {
      ranks[k].opt = make_optimizer(ranks[k].model.get(), FP8_OPTIMIZER_ADAM);
      train_step(ranks[k], 0, k);
    });
    EXPECT_EQ(state_bytes(ranks[0], false), state_bytes(ranks[1], false));
  }
}

// fp8.h: fp8_comm_destroy releases the handle; "the group is left when the models using it are
// destroyed too". Models whose communicator handles are gone train on as one group.
TEST(DataParallelMisuse, DestroyingTheCommunicatorKeepsItsModelsInTheGroup) {
  Group g(2, "backend=msamp, opt_level=O2, small_layer_fallback=0", FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 4096,
          true);
  bound_waits(g.ranks);
  for (Rank& r : g.ranks) r.comm.reset();
  on_ranks(2, [&](int k) {
    train_step(g.ranks[k], 0, k);
    forward_backward(g.ranks[k].ctx.get(), g.ranks[k].model.get(), batch_x(1, k), batch_dy(1, k));
    EXPECT_OK(fp8_model_sync_grads(g.ranks[k].model.get()));
  });
  EXPECT_EQ(state_bytes(g.ranks[0], true), state_bytes(g.ranks[1], true));
  on_ranks(2, [&](int k) {
    EXPECT_OK(fp8_optimizer_step(g.ranks[k].opt.get()));
    EXPECT_OK(fp8_optimizer_zero_grad(g.ranks[k].opt.get()));
  });
  EXPECT_EQ(state_bytes(g.ranks[0], false), state_bytes(g.ranks[1], false));
}

// Backward sync turned off after a backward has exchanged its buckets (mid-accumulation): the next
// backward is still refused before it writes (the exchange happened), with a message that does not
// claim sync is on; sync_grads inside autocast is refused; the step then goes on identically.
TEST(DataParallelMisuse, BackwardSyncTurnedOffMidAccumulationStillRefusesRewritingAnExchangedBucket) {
  Group g(2, "backend=msamp, opt_level=O2, small_layer_fallback=0", FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 4096,
          true);
  bound_waits(g.ranks);
  std::vector<std::vector<unsigned char>> before(2);
  on_ranks(2, [&](int k) {
    Rank& r = g.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    EXPECT_OK(fp8_model_set_backward_sync(r.model.get(), 0));
    Tensor x = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
    Tensor y = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
    Tensor dy = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
    upload(x.get(), batch_x(1, k));
    upload(dy.get(), batch_dy(1, k));
    EXPECT_OK(fp8_model_forward(r.model.get(), x.get(), y.get()));
    before[k] = state_bytes(r, true);  // (what the refused backward must leave as it is)
    EXPECT_REFUSED_WORDS(fp8_model_backward(r.model.get(), dy.get(), nullptr), FP8_ERR_INVALID_STATE,
                         "fp8_model_backward", "already averaged", "backward sync was on", "step (or zero_grad)");
    EXPECT_EQ(std::string(fp8_last_error_message()).find("backward sync is on"), std::string::npos);
  });
  for (int k = 0; k < 2; ++k) EXPECT_EQ(state_bytes(g.ranks[k], true), before[k]) << "rank " << k;
  Rank& r1 = g.ranks[1];
  EXPECT_OK(fp8_autocast_begin(r1.model.get()));
  EXPECT_REFUSED(fp8_model_sync_grads(r1.model.get()), FP8_ERR_INVALID_STATE, "fp8_model_sync_grads", "autocast");
  on_ranks(2, [&](int k) {  // (the region's end is collective)
    if (k == 0) EXPECT_OK(fp8_autocast_begin(g.ranks[k].model.get()));
    EXPECT_OK(fp8_autocast_end(g.ranks[k].model.get()));
    EXPECT_OK(fp8_optimizer_step(g.ranks[k].opt.get()));
    EXPECT_OK(fp8_optimizer_zero_grad(g.ranks[k].opt.get()));
    train_step(g.ranks[k], 2, k);  // sync off: the step exchanges
  });
  EXPECT_EQ(state_bytes(g.ranks[0], true), state_bytes(g.ranks[1], true));
}

// The bucket size's range: below FP8_MIN_BUCKET_BYTES refused naming the value and the minimum, and
// the largest size_t one bucket for the whole model (no overflow).
TEST(DataParallelMisuse, BucketBytesAtTheEndsOfTheirRange) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model m = build_model(ctx.get(), nullptr, 1);
  EXPECT_REFUSED_WORDS(fp8_model_set_bucket_bytes(m.get(), FP8_MIN_BUCKET_BYTES - 1), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_model_set_bucket_bytes", "bytes = 255", "FP8_MIN_BUCKET_BYTES (256)");
  EXPECT_REFUSED_WORDS(fp8_model_set_bucket_bytes(m.get(), 0), FP8_ERR_INVALID_ARGUMENT, "fp8_model_set_bucket_bytes",
                       "bytes = 0");
  Group g(2, "backend=msamp, opt_level=O2, small_layer_fallback=0", FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU,
          std::numeric_limits<size_t>::max(), true);
  bound_waits(g.ranks);
  Group ref(2, "backend=msamp, opt_level=O2, small_layer_fallback=0");
  on_ranks(2, [&](int k) {
    train_step(g.ranks[k], 0, k);
    train_step(ref.ranks[k], 0, k);
  });
  for (int k = 0; k < 2; ++k) EXPECT_EQ(state_bytes(g.ranks[k], false), state_bytes(ref.ranks[0], false)) << k;
}

TEST(DataParallelMisuse, BadArguments) {
  Context c0 = make_context(FP8_DEVICE_CPU), c1 = make_context(FP8_DEVICE_CPU);
  fp8_context_t* ctxs[2] = {c0.get(), c1.get()};
  fp8_comm_t* comms[2] = {};
  EXPECT_REFUSED(fp8_comm_create_local(nullptr, ctxs, 2), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_create_local", "comms");
  EXPECT_REFUSED(fp8_comm_create_local(comms, ctxs, 0), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_create_local", "nranks");
  fp8_context_t* same[2] = {c0.get(), c0.get()};
  EXPECT_REFUSED(fp8_comm_create_local(comms, same, 2), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_create_local",
                 "one context per rank");
  EXPECT_EQ(comms[0], nullptr);
  fp8_context_t* with_null[2] = {c0.get(), nullptr};
  EXPECT_REFUSED(fp8_comm_create_local(comms, with_null, 2), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_create_local",
                 "ctxs[1]");
  fp8_comm_id_t id{};
  fp8_comm_t* one = nullptr;
  EXPECT_REFUSED(fp8_comm_create(&one, c0.get(), 2, 0, &id), FP8_ERR_UNSUPPORTED, "fp8_comm_create",
                 "fp8_comm_create_local");
  EXPECT_REFUSED(fp8_comm_create(&one, c0.get(), 2, 2, &id), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_create", "rank");
  EXPECT_REFUSED(fp8_comm_create(&one, c0.get(), 0, 0, &id), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_create", "nranks");
  EXPECT_REFUSED(fp8_comm_wrap_nccl(&one, c0.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_wrap_nccl", "nccl");
  FP8_ASSERT_OK(fp8_comm_create_local(comms, ctxs, 2));
  Comm a(comms[0]), b(comms[1]);
  int32_t rank = -1, size = -1;
  EXPECT_OK(fp8_comm_rank(b.get(), &rank));
  EXPECT_OK(fp8_comm_size(b.get(), &size));
  EXPECT_EQ(rank, 1);
  EXPECT_EQ(size, 2);
  EXPECT_REFUSED(fp8_comm_rank(nullptr, &rank), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_rank", "comm");
  EXPECT_REFUSED(fp8_comm_size(a.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_size", "size");
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()})
    EXPECT_REFUSED(fp8_comm_set_timeout(a.get(), bad), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_set_timeout", "seconds = ");
  double timeout = 0.0;
  EXPECT_OK(fp8_comm_get_timeout(a.get(), &timeout));
  EXPECT_EQ(timeout, FP8_DEFAULT_COMM_TIMEOUT_S);  // refusals changed nothing
  EXPECT_REFUSED(fp8_comm_set_timeout(nullptr, 1.0), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_set_timeout", "comm");
  EXPECT_REFUSED(fp8_comm_get_timeout(a.get(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_comm_get_timeout", "seconds");
  EXPECT_OK(fp8_comm_set_timeout(a.get(), 0.0));  // forever
  Model m = build_model(c0.get(), nullptr, 1);
  EXPECT_REFUSED(fp8_model_set_comm(nullptr, a.get()), FP8_ERR_INVALID_ARGUMENT, "fp8_model_set_comm", "model");
  // Without a communicator, sync_grads has nothing to do.
  EXPECT_OK(fp8_model_sync_grads(m.get()));
  fp8_comm_destroy(nullptr);
}

}  // namespace
