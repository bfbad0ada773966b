// The delayed-scaling rule of fp8.h, step by step, on the CPU reference backend. Amaxes enter the
// states the way training feeds them: through fp8_amax / fp8_quantize on real tensors.
#include <cfloat>
#include <cmath>

#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

class ScalingRule : public ::testing::Test {
 protected:
  Context ctx = make_context(FP8_DEVICE_CPU);
  Tensor amax_out = make_tensor(ctx.get(), FP8_DTYPE_F32, {1});

  // Feeds a tensor whose largest magnitude is `amax` into the state's history slot 0.
  void feed(fp8_scaling_t* s, float amax) {
    Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {2});
    upload<float>(x.get(), {0.5f * amax, -amax});
    FP8_ASSERT_OK(fp8_amax(ctx.get(), x.get(), amax_out.get(), s));
  }
  void update(fp8_scaling_t* s, const fp8_recipe_t* r) {
    fp8_scaling_t* list[1] = {s};
    FP8_ASSERT_OK(fp8_scaling_update(ctx.get(), list, 1, r));
  }
  std::vector<float> history(const fp8_scaling_t* s) {
    std::vector<float> h(static_cast<size_t>(info_of(s).amax_history_len));
    EXPECT_EQ(fp8_scaling_get_history(s, h.data(), static_cast<int32_t>(h.size())), FP8_OK);
    return h;
  }
};

TEST_F(ScalingRule, NewStateHasUnitScaleZeroHistoryAndTheRecipeDtypes) {
  auto hybrid = make_recipe();
  auto fwd = make_scaling(ctx.get(), hybrid.get(), FP8_ROLE_FORWARD);
  auto bwd = make_scaling(ctx.get(), hybrid.get(), FP8_ROLE_BACKWARD);
  const fp8_scaling_info_t info = info_of(fwd.get());
  EXPECT_EQ(info.scale, 1.0f);
  EXPECT_EQ(info.scale_inv, 1.0f);
  EXPECT_EQ(info.amax_history_len, 1024);
  EXPECT_EQ(info.update_count, 0);
  EXPECT_EQ(info.nonfinite_count, 0);
  for (float v : history(fwd.get())) ASSERT_EQ(v, 0.0f);
  fp8_dtype_t dt = -1;
  FP8_ASSERT_OK(fp8_scaling_dtype(fwd.get(), &dt));
  EXPECT_EQ(dt, FP8_DTYPE_E4M3);
  FP8_ASSERT_OK(fp8_scaling_dtype(bwd.get(), &dt));
  EXPECT_EQ(dt, FP8_DTYPE_E5M2);
  auto e4m3 = make_recipe("fp8_format=E4M3");
  auto bwd_e4m3 = make_scaling(ctx.get(), e4m3.get(), FP8_ROLE_BACKWARD);
  FP8_ASSERT_OK(fp8_scaling_dtype(bwd_e4m3.get(), &dt));
  EXPECT_EQ(dt, FP8_DTYPE_E4M3);
}

TEST_F(ScalingRule, AmaxIsMaxAccumulatedIntoSlotZeroWithinAStep) {
  auto r = make_recipe("amax_history_len=4");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), 3.0f);
  feed(s.get(), 7.0f);
  feed(s.get(), 5.0f);
  EXPECT_EQ(info_of(s.get()).amax, 7.0f);
}

TEST_F(ScalingRule, MostRecentUsesThisStepsAmaxAndRollsTheHistory) {
  auto r = make_recipe("amax_history_len=4, amax_compute_algo=most_recent");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), 8.0f);
  update(s.get(), r.get());
  fp8_scaling_info_t info = info_of(s.get());
  EXPECT_EQ(info.scale, 448.0f / 8.0f);
  EXPECT_EQ(info.scale_inv, 1.0f / (448.0f / 8.0f));
  EXPECT_EQ(info.update_count, 1);
  EXPECT_EQ(history(s.get()), (std::vector<float>{0.0f, 8.0f, 0.0f, 0.0f}));
  feed(s.get(), 2.0f);
  update(s.get(), r.get());
  EXPECT_EQ(info_of(s.get()).scale, 448.0f / 2.0f) << "most_recent ignores the larger amax of the step before";
  EXPECT_EQ(history(s.get()), (std::vector<float>{0.0f, 2.0f, 8.0f, 0.0f}));
}

TEST_F(ScalingRule, MaxAlgoUsesTheLargestAmaxStillInTheHistory) {
  auto r = make_recipe("amax_history_len=3, amax_compute_algo=max");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  const float amaxes[] = {16.0f, 2.0f, 4.0f, 1.0f};
  // After each update the scale uses the max over the amaxes of the last 3 steps.
  const float expected_max[] = {16.0f, 16.0f, 16.0f, 4.0f};
  for (int i = 0; i < 4; ++i) {
    feed(s.get(), amaxes[i]);
    update(s.get(), r.get());
    EXPECT_EQ(info_of(s.get()).scale, 448.0f / expected_max[i]) << "step " << i;
  }
}

TEST_F(ScalingRule, MarginDividesTheTargetByPowersOfTwo) {
  auto r = make_recipe("margin=3");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), 5.0f);
  update(s.get(), r.get());
  EXPECT_EQ(info_of(s.get()).scale, (448.0f / 8.0f) / 5.0f);
}

// power_2_scales: the quotient rounded down to a power of two, computed here independently in
// double (2^floor(log2 q)); exact powers stay; scale_inv is its exact inverse.
TEST_F(ScalingRule, Power2ScalesRoundTheQuotientDownToAPowerOfTwo) {
  auto r = make_recipe("power_2_scales=on, margin=1");
  auto plain = make_recipe("margin=1");
  for (float amax : {5.0f, 3.5f, 7.0f, 1e-3f, 224.0f, 1e30f, 4e-38f}) {
    auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
    auto p = make_scaling(ctx.get(), plain.get(), FP8_ROLE_FORWARD);
    feed(s.get(), amax);
    feed(p.get(), amax);
    update(s.get(), r.get());
    update(p.get(), plain.get());
    const float q = info_of(p.get()).scale;  // the rule without rounding: min(224 / amax, FLT_MAX)
    const double want = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(static_cast<double>(q)))));
    const fp8_scaling_info_t info = info_of(s.get());
    EXPECT_EQ(static_cast<double>(info.scale), want) << "amax " << amax;
    EXPECT_LE(info.scale, q) << "amax " << amax;
    EXPECT_EQ(static_cast<double>(info.scale_inv), 1.0 / want) << "amax " << amax;
  }
  // 224 / 224 = 1 is a power of two already; the FLT_MAX clamp rounds to 2^127.
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), 1e-45f);
  update(s.get(), r.get());
  EXPECT_EQ(info_of(s.get()).scale, std::ldexp(1.0f, 127));
}

// States made under the rowwise and block recipes are delayed per-tensor ones (fp8.h): the same
// rule as scaling=delayed, with power_2_scales' auto on for block only; fp8_quantize through them
// casts per tensor.
TEST_F(ScalingRule, RowwiseAndBlockRecipesMakeDelayedPerTensorStates) {
  const std::pair<const char*, const char*> cases[] = {
      {"scaling=rowwise", ""}, {"scaling=block", "power_2_scales=on"}, {"scaling=block, power_2_scales=off", ""}};
  for (const auto& [text, same_delayed] : cases) {
    SCOPED_TRACE(text);
    auto r = make_recipe(text), delayed = make_recipe(same_delayed);
    auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
    auto d = make_scaling(ctx.get(), delayed.get(), FP8_ROLE_FORWARD);
    feed(s.get(), 3.5f);
    feed(d.get(), 3.5f);
    update(s.get(), r.get());
    update(d.get(), delayed.get());
    EXPECT_EQ(info_of(s.get()).scale, info_of(d.get()).scale);
    EXPECT_EQ(info_of(s.get()).update_count, 1);
    Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {2, 3}), q = make_tensor(ctx.get(), FP8_DTYPE_E4M3, {2, 3});
    upload<float>(x.get(), {1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 1.5f});
    FP8_ASSERT_OK(fp8_quantize(ctx.get(), x.get(), q.get(), nullptr, s.get()));
    float si = 0.0f;
    FP8_ASSERT_OK(fp8_tensor_get_scale_inv(q.get(), &si));
    EXPECT_EQ(si, info_of(s.get()).scale_inv) << "one scale for the whole tensor";
  }
}

TEST_F(ScalingRule, GradientStateUnderHybridTargetsE5M2Max) {
  auto r = make_recipe();
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_BACKWARD);
  feed(s.get(), 3.0f);
  update(s.get(), r.get());
  EXPECT_EQ(info_of(s.get()).scale, 57344.0f / 3.0f);
}

TEST_F(ScalingRule, IntervalRecomputesTheScaleEveryNthUpdateButRollsEveryStep) {
  auto r = make_recipe("interval=3, amax_history_len=8");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  const float amaxes[] = {2.0f, 4.0f, 8.0f, 16.0f, 32.0f};
  const float expected_scale[] = {448.0f / 2, 448.0f / 2, 448.0f / 2, 448.0f / 16, 448.0f / 16};
  for (int i = 0; i < 5; ++i) {
    feed(s.get(), amaxes[i]);
    update(s.get(), r.get());
    EXPECT_EQ(info_of(s.get()).scale, expected_scale[i]) << "update " << i;
    EXPECT_EQ(history(s.get())[1], amaxes[i]) << "the history rolls on every update";
  }
}

TEST_F(ScalingRule, ZeroAmaxKeepsTheScaleAndIsNotCountedAsNonFinite) {
  auto r = make_recipe("amax_history_len=2");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), 4.0f);
  update(s.get(), r.get());
  update(s.get(), r.get());  // nothing fed: amax 0
  const fp8_scaling_info_t info = info_of(s.get());
  EXPECT_EQ(info.scale, 448.0f / 4.0f);
  EXPECT_EQ(info.nonfinite_count, 0);
}

TEST_F(ScalingRule, NonFiniteAmaxIsCountedKeepsTheScaleAndNeverEntersTheHistory) {
  auto r = make_recipe("amax_history_len=4, amax_compute_algo=max");
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), 4.0f);
  update(s.get(), r.get());
  for (float bad : {NAN, INFINITY}) {
    feed(s.get(), bad);
    EXPECT_FALSE(std::isfinite(info_of(s.get()).amax));
    update(s.get(), r.get());
  }
  const fp8_scaling_info_t info = info_of(s.get());
  EXPECT_EQ(info.scale, 448.0f / 4.0f);
  EXPECT_EQ(info.nonfinite_count, 2);
  for (float v : history(s.get())) EXPECT_TRUE(std::isfinite(v)) << v;
  EXPECT_EQ(history(s.get()), (std::vector<float>{0.0f, 0.0f, 0.0f, 4.0f}));
}

TEST_F(ScalingRule, TinyAmaxClampsTheScaleToFltMax) {
  auto r = make_recipe();
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  feed(s.get(), std::numeric_limits<float>::denorm_min());
  update(s.get(), r.get());
  const fp8_scaling_info_t info = info_of(s.get());
  EXPECT_EQ(info.scale, FLT_MAX);
  EXPECT_EQ(info.scale_inv, 1.0f / FLT_MAX);
}

TEST_F(ScalingRule, OneBatchedUpdateEqualsUpdatingEachStateAlone) {
  auto r = make_recipe("amax_history_len=5, amax_compute_algo=max, margin=1");
  std::vector<Scaling> batch, alone;
  std::vector<fp8_scaling_t*> handles;
  for (int i = 0; i < 40; ++i) {
    batch.push_back(make_scaling(ctx.get(), r.get(), i % 2 ? FP8_ROLE_BACKWARD : FP8_ROLE_FORWARD));
    alone.push_back(make_scaling(ctx.get(), r.get(), i % 2 ? FP8_ROLE_BACKWARD : FP8_ROLE_FORWARD));
    handles.push_back(batch.back().get());
  }
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < 40; ++i) {
      const float a = (i == 7 && step == 1) ? NAN : 0.37f * static_cast<float>((i * 13 + step * 7) % 23);
      feed(batch[i].get(), a);
      feed(alone[i].get(), a);
      update(alone[i].get(), r.get());
    }
    FP8_ASSERT_OK(fp8_scaling_update(ctx.get(), handles.data(), 40, r.get()));
  }
  for (int i = 0; i < 40; ++i) {
    const fp8_scaling_info_t a = info_of(batch[i].get()), b = info_of(alone[i].get());
    EXPECT_EQ(bits_of(a.scale), bits_of(b.scale)) << i;
    EXPECT_EQ(bits_of(a.scale_inv), bits_of(b.scale_inv)) << i;
    EXPECT_EQ(a.nonfinite_count, b.nonfinite_count) << i;
    EXPECT_EQ(history(batch[i].get()), history(alone[i].get())) << i;
  }
  EXPECT_EQ(info_of(batch[7].get()).nonfinite_count, 1);
}

TEST_F(ScalingRule, SetScaleAlsoSetsItsInverse) {
  auto r = make_recipe();
  auto s = make_scaling(ctx.get(), r.get(), FP8_ROLE_FORWARD);
  FP8_ASSERT_OK(fp8_scaling_set_scale(s.get(), 3.0f));
  EXPECT_EQ(info_of(s.get()).scale, 3.0f);
  EXPECT_EQ(info_of(s.get()).scale_inv, 1.0f / 3.0f);
  EXPECT_EQ(fp8_scaling_set_scale(s.get(), 0.0f), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fp8_scaling_set_scale(s.get(), NAN), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(info_of(s.get()).scale, 3.0f);
}

}  // namespace
