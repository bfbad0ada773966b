// Communication buckets and backward sync (fp8.h, "Data parallelism"), on CPU contexts joined by the
// in-process transport: a bucket's exchange starts inside the backward once its gradients are all
// written, and the result is bit for bit the exchange at the step, at every level and bucket size;
// per-layer backward calls start only the buckets they finished; accumulation with backward sync
// off for all micro-batches but the last; the bucketed O3 layout; checkpoints across bucket
// layouts; misuse.
#include <cstdio>
#include <string>

#include "dist_cases.hpp"

using namespace fp8test;
using namespace fp8test::dist_cases;

namespace {

constexpr const char* kTe = "backend=te, small_layer_fallback=0";
constexpr const char* kO1 = "backend=msamp, opt_level=O1, small_layer_fallback=0";
constexpr const char* kO2 = "backend=msamp, opt_level=O2, small_layer_fallback=0";
constexpr const char* kO3 = "backend=msamp, opt_level=O3, small_layer_fallback=0";

// Each parameter's value as stored (with an E4M3 weight's scale_inv) and gradient, in the model's
// order: comparable across bucket layouts, unlike the flat arenas.
std::vector<unsigned char> parameter_bytes(const Rank& r, bool grads) {
  fp8_model_t* m = r.model.get();
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  std::vector<unsigned char> out;
  const auto add = [&](const fp8_tensor_t* t) {
    int64_t n = 0;
    fp8_dtype_t dt = FP8_DTYPE_F32;
    EXPECT_OK(fp8_tensor_numel(t, &n));
    EXPECT_OK(fp8_tensor_dtype(t, &dt));
    const size_t bytes = static_cast<size_t>(n) * (dt == FP8_DTYPE_F32 ? 4 : dt == FP8_DTYPE_F16 ? 2 : 1);
    const size_t at = out.size();
    out.resize(at + bytes);
    EXPECT_OK(fp8_tensor_copy_to_host(t, out.data() + at, bytes));
    if (dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2) {
      float s = 0.0f;
      EXPECT_OK(fp8_tensor_get_scale_inv(t, &s));
      const auto* b = reinterpret_cast<const unsigned char*>(&s);
      out.insert(out.end(), b, b + sizeof s);
    }
  };
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t *value = nullptr, *grad = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, nullptr, &value, &grad));
    add(value);
    if (grads) add(grad);
  }
  return out;
}

std::vector<unsigned char> grad_of(const Rank& r, int32_t index) {
  fp8_tensor_t* grad = nullptr;
  EXPECT_OK(fp8_model_parameter_at(r.model.get(), index, nullptr, nullptr, &grad));
  int64_t n = 0;
  fp8_dtype_t dt = FP8_DTYPE_F32;
  EXPECT_OK(fp8_tensor_numel(grad, &n));
  EXPECT_OK(fp8_tensor_dtype(grad, &dt));
  std::vector<unsigned char> out(static_cast<size_t>(n) * (dt == FP8_DTYPE_F32 ? 4 : 1));
  EXPECT_OK(fp8_tensor_copy_to_host(grad, out.data(), out.size()));
  return out;
}

void step_and_zero(Rank& r) {
  EXPECT_OK(fp8_optimizer_step(r.opt.get()));
  EXPECT_OK(fp8_optimizer_zero_grad(r.opt.get()));
}

struct SyncCase {
  const char* name;
  const char* recipe;
  size_t bucket_bytes;  // 0: the default (the whole model in one bucket)
};
void PrintTo(const SyncCase& c, std::ostream* os) {
  *os << c.name;
}

const SyncCase kSyncCases[] = {
    {"te_one_bucket", kTe, 0},       {"te_bucket_per_parameter", kTe, FP8_MIN_BUCKET_BYTES},
    {"o1_buckets_of_4k", kO1, 4096}, {"o2_bucket_per_parameter", kO2, FP8_MIN_BUCKET_BYTES},
    {"o2_one_bucket", kO2, 0},       {"o3_bucket_per_parameter", kO3, FP8_MIN_BUCKET_BYTES},
    {"o3_buckets_of_4k", kO3, 4096},
};

class BackwardSync : public ::testing::TestWithParam<std::tuple<SyncCase, int>> {};

// The same training twice: exchanged at the step, and bucket by bucket inside the backward.
TEST_P(BackwardSync, GivesTheBitsOfTheExchangeAtTheStep) {
  const SyncCase& c = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  const bool o3 = c.recipe == kO3;
  Group at_step(n, c.recipe, FP8_OPTIMIZER_ADAMW, 0.05f, FP8_DEVICE_CPU, c.bucket_bytes, false);
  Group in_backward(n, c.recipe, FP8_OPTIMIZER_ADAMW, 0.05f, FP8_DEVICE_CPU, c.bucket_bytes, true);
  for (int step = 0; step < 3; ++step) {
    on_ranks(n, [&](int k) {
      Rank& r = in_backward.ranks[k];
      forward_backward(r.ctx.get(), r.model.get(), batch_x(step, k), batch_dy(step, k));
    });
    // Every bucket was averaged by the backward: the ranks' gradients agree before any step (at O3
    // each rank averaged only its pieces of the FP8 gradients, the step's need; FP32 ones are whole).
    for (int k = 1; k < n && !o3; ++k)
      ASSERT_EQ(parameter_bytes(in_backward.ranks[k], true), parameter_bytes(in_backward.ranks[0], true))
          << "rank " << k << ", step " << step;
    for (int k = 1; k < n && o3; ++k) EXPECT_EQ(grad_of(in_backward.ranks[k], 1), grad_of(in_backward.ranks[0], 1));
    on_ranks(n, [&](int k) {
      train_step(at_step.ranks[k], step, k);
      step_and_zero(in_backward.ranks[k]);
    });
    for (int k = 0; k < n; ++k)
      ASSERT_EQ(state_bytes(in_backward.ranks[k], true), state_bytes(at_step.ranks[k], true))
          << c.name << ", rank " << k << ", step " << step;
  }
  EXPECT_EQ(stats_of(in_backward.ranks[0].opt.get()).steps, 3);
}

INSTANTIATE_TEST_SUITE_P(Cases, BackwardSync,
                         ::testing::Combine(::testing::ValuesIn(kSyncCases), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "ranks";
                         });

// Per-layer forward and backward calls (fc1, act, fc2; one parameter per bucket): the backward of
// fc2 alone starts fc2's buckets and no other; a write to fc2's gradients is then refused; the step
// finishes the rest, with the bits of the exchange at the step.
TEST(BackwardSync, PerLayerCallsStartTheBucketsTheyFinished) {
  constexpr int n = 2;
  Group at_step(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, FP8_MIN_BUCKET_BYTES, false);
  Group in_backward(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, FP8_MIN_BUCKET_BYTES, true);
  struct Acts {
    Tensor x, h, a, y, dy, dh, da;
  };
  std::vector<Acts> acts(n);
  const auto forward = [&](Rank& r, Acts& t, int k) {
    fp8_context_t* ctx = r.ctx.get();
    t.x = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kIn});
    t.h = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kHidden});
    t.a = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kHidden});
    t.y = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kOut});
    t.dy = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kOut});
    t.dh = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kHidden});
    t.da = make_tensor(ctx, FP8_DTYPE_F32, {kRows, kHidden});
    upload(t.x.get(), batch_x(0, k));
    upload(t.dy.get(), batch_dy(0, k));
    EXPECT_OK(fp8_layer_forward(r.model.get(), 0, t.x.get(), t.h.get()));
    EXPECT_OK(fp8_layer_forward(r.model.get(), 1, t.h.get(), t.a.get()));
    EXPECT_OK(fp8_layer_forward(r.model.get(), 2, t.a.get(), t.y.get()));
  };
  on_ranks(n, [&](int k) {
    Acts t;
    forward(at_step.ranks[k], t, k);
    EXPECT_OK(fp8_layer_backward(at_step.ranks[k].model.get(), 2, t.dy.get(), t.da.get()));
    EXPECT_OK(fp8_layer_backward(at_step.ranks[k].model.get(), 1, t.da.get(), t.dh.get()));
    EXPECT_OK(fp8_layer_backward(at_step.ranks[k].model.get(), 0, t.dh.get(), nullptr));
    forward(in_backward.ranks[k], acts[k], k);
    EXPECT_OK(fp8_layer_backward(in_backward.ranks[k].model.get(), 2, acts[k].dy.get(), acts[k].da.get()));
  });
  Rank &r0 = in_backward.ranks[0], &r1 = in_backward.ranks[1];
  EXPECT_EQ(grad_of(r1, 2), grad_of(r0, 2)) << "fc2.weight's bucket was averaged";
  EXPECT_EQ(grad_of(r1, 3), grad_of(r0, 3)) << "fc2.bias's bucket was averaged";
  const std::vector<unsigned char> nothing(grad_of(r0, 0).size(), 0);
  EXPECT_EQ(grad_of(r0, 0), nothing) << "fc1's backward has not run";
  const std::vector<unsigned char> before = parameter_bytes(r1, true);
  Tensor add = make_tensor(r1.ctx.get(), FP8_DTYPE_F32, {kOut, kHidden});
  upload(add.get(), randn(static_cast<size_t>(kOut * kHidden), 3, 0.1f));
  EXPECT_REFUSED_WORDS(fp8_model_accumulate_grad(r1.model.get(), 2, add.get()), FP8_ERR_INVALID_STATE,
                       "fp8_model_accumulate_grad", "parameter 2", "fp8_model_set_backward_sync");
  EXPECT_EQ(parameter_bytes(r1, true), before) << "the refused write changed nothing";
  on_ranks(n, [&](int k) {
    EXPECT_OK(fp8_layer_backward(in_backward.ranks[k].model.get(), 1, acts[k].da.get(), acts[k].dh.get()));
    EXPECT_OK(fp8_layer_backward(in_backward.ranks[k].model.get(), 0, acts[k].dh.get(), nullptr));
  });
  EXPECT_EQ(grad_of(r1, 0), grad_of(r0, 0)) << "fc1's backward started its buckets";
  EXPECT_NE(grad_of(r0, 0), nothing);
  on_ranks(n, [&](int k) {
    step_and_zero(in_backward.ranks[k]);
    step_and_zero(at_step.ranks[k]);
  });
  for (int k = 0; k < n; ++k) EXPECT_EQ(state_bytes(in_backward.ranks[k], true), state_bytes(at_step.ranks[k], true));
  // After the step, writes are allowed again (and start the bucket they complete).
  on_ranks(n, [&](int k) {
    Rank& r = in_backward.ranks[k];
    Tensor g = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kOut, kHidden});
    upload(g.get(), randn(static_cast<size_t>(kOut * kHidden), 5u + k, 0.1f));
    EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), 2, g.get()));
  });
  EXPECT_EQ(grad_of(r1, 2), grad_of(r0, 2)) << "the accumulation completed fc2.weight's bucket";
}

// Gradient accumulation, DDP-style: backward sync off for every micro-batch but the last. The
// result is that of accumulating at the step; a second backward with sync on is refused on every
// rank (each backward is then the step's last), and nothing changes.
TEST(BackwardSync, AccumulationTurnsItOffForAllButTheLastMicroBatch) {
  constexpr int n = 3, micro = 3;
  Group at_step(n, kO1, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 4096, false);
  Group in_backward(n, kO1, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 4096, true);
  on_ranks(n, [&](int k) {
    Rank &a = at_step.ranks[k], &b = in_backward.ranks[k];
    for (int m = 0; m < micro; ++m) {
      forward_backward(a.ctx.get(), a.model.get(), batch_x(m, k), batch_dy(m, k));
      EXPECT_OK(fp8_model_set_backward_sync(b.model.get(), m == micro - 1 ? 1 : 0));
      forward_backward(b.ctx.get(), b.model.get(), batch_x(m, k), batch_dy(m, k));
    }
    step_and_zero(a);
    step_and_zero(b);
  });
  for (int k = 0; k < n; ++k) EXPECT_EQ(state_bytes(in_backward.ranks[k], true), state_bytes(at_step.ranks[k], true));

  // Sync stays on: the second micro-batch's backward is refused on every rank before it writes.
  std::vector<std::vector<unsigned char>> before(n);
  on_ranks(n, [&](int k) {
    Rank& r = in_backward.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(5, k), batch_dy(5, k));
    before[k] = parameter_bytes(r, true);
    Tensor x = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
    Tensor y = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
    Tensor dy = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
    upload(x.get(), batch_x(6, k));
    upload(dy.get(), batch_dy(6, k));
    EXPECT_OK(fp8_model_forward(r.model.get(), x.get(), y.get()));
    EXPECT_REFUSED(fp8_model_backward(r.model.get(), dy.get(), nullptr), FP8_ERR_INVALID_STATE, "fp8_model_backward",
                   "fp8_model_set_backward_sync(model, 0)");
    EXPECT_EQ(parameter_bytes(r, true), before[k]) << "rank " << k;
    step_and_zero(r);
  });
  for (int k = 1; k < n; ++k)
    EXPECT_EQ(state_bytes(in_backward.ranks[k], true), state_bytes(in_backward.ranks[0], true));
}

// The bucketed O3 layout: one bucket per weight, each padded to N pieces; each rank keeps the
// masters of its pieces (together the whole), and the training state stays 2 + 5/N bytes per
// weight. Training keeps the ranks identical.
TEST(BackwardSync, O3BucketsShardEveryWeightIntoPieces) {
  for (int n : {2, 4}) {
    std::vector<Rank> ranks;
    for (int k = 0; k < n; ++k) ranks.emplace_back(FP8_DEVICE_CPU);
    std::vector<fp8_context_t*> ctxs;
    for (Rank& r : ranks) ctxs.push_back(r.ctx.get());
    std::vector<fp8_comm_t*> comms(static_cast<size_t>(n));
    FP8_ASSERT_OK(fp8_comm_create_local(comms.data(), ctxs.data(), n));
    const int64_t dims[] = {256, 512, 512, 256};
    for (int k = 0; k < n; ++k) {
      Rank& r = ranks[k];
      r.comm.reset(comms[k]);
      r.model = make_model(r.ctx.get());
      for (int l = 0; l < 3; ++l) {
        const std::string name = "fc" + std::to_string(l);
        EXPECT_OK(fp8_model_add_linear(r.model.get(), name.c_str(), dims[l], dims[l + 1], 0, nullptr));
        fp8_tensor_t* w = nullptr;
        EXPECT_OK(fp8_model_parameter_at(r.model.get(), l, nullptr, &w, nullptr));
        upload(w, randn(static_cast<size_t>(dims[l] * dims[l + 1]), 11u + l, 0.03f));
      }
      Recipe rec = make_recipe("backend=msamp, opt_level=O3");
      EXPECT_OK(fp8_convert_model(r.model.get(), rec.get(), nullptr));
      EXPECT_OK(fp8_model_set_bucket_bytes(r.model.get(), 64 * 1024));
    }
    on_ranks(n, [&](int k) {
      EXPECT_OK(fp8_model_set_comm(ranks[k].model.get(), ranks[k].comm.get()));
      EXPECT_OK(fp8_model_set_backward_sync(ranks[k].model.get(), 1));
      ranks[k].opt = make_optimizer(ranks[k].model.get(), FP8_OPTIMIZER_ADAM);
    });
    const int64_t weights = 256 * 512 + 512 * 512 + 512 * 256;
    size_t masters_total = 0;
    for (int k = 0; k < n; ++k) {
      void* data = nullptr;
      size_t bytes = 0;
      EXPECT_OK(fp8_model_flat_storage(ranks[k].model.get(), FP8_STORAGE_GRADS, FP8_DTYPE_E5M2, &data, &bytes));
      EXPECT_EQ(bytes % (static_cast<size_t>(n) * 256), 0u) << "every bucket padded to " << n << " pieces";
      EXPECT_OK(fp8_model_flat_storage(ranks[k].model.get(), FP8_STORAGE_MASTERS, FP8_DTYPE_F16, &data, &bytes));
      masters_total += bytes;
      const fp8_optimizer_stats_t s = stats_of(ranks[k].opt.get());
      const double per = static_cast<double>(s.training_bytes) / static_cast<double>(s.parameters);
      EXPECT_NEAR(per, 2.0 + 5.0 / n, 0.01) << n << " ranks, rank " << k;
      std::printf("[ buckets  ] O3, %d ranks, rank %d: %.3f bytes of training state per weight\n", n, k, per);
    }
    EXPECT_EQ(masters_total, static_cast<size_t>(weights) * 2) << "the ranks' pieces add up to the whole";
    // One step from each rank's own gradient: the ranks stay identical.
    on_ranks(n, [&](int k) {
      Rank& r = ranks[k];
      Tensor x = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {64, 256});
      Tensor y = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {64, 256});
      upload(x.get(), randn(64 * 256, 40u + k, 1.0f));
      EXPECT_OK(fp8_model_set_autowrap(r.model.get(), 1));
      EXPECT_OK(fp8_model_forward(r.model.get(), x.get(), y.get()));
      EXPECT_OK(fp8_model_backward(r.model.get(), x.get(), nullptr));  // (dy: any values of y's shape)
      step_and_zero(r);
    });
    for (int k = 1; k < n; ++k) EXPECT_EQ(parameter_bytes(ranks[k], false), parameter_bytes(ranks[0], false));
  }
}

// Saved by 4 ranks with one bucket per parameter, loaded by 2 ranks with one bucket and by 1 rank:
// the parameters are those saved, whatever the layout.
TEST(BackwardSync, CheckpointsMoveBetweenBucketLayouts) {
  for (const char* recipe : {kO2, kO3}) {
    const std::string path = temp_path("buckets.ckpt");
    std::remove(path.c_str());
    Group four(4, recipe, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, FP8_MIN_BUCKET_BYTES, true);
    on_ranks(4, [&](int k) { train_step(four.ranks[k], 0, k); });
    on_ranks(4, [&](int k) {
      EXPECT_OK(fp8_checkpoint_save(four.ranks[k].model.get(), four.ranks[k].opt.get(), path.c_str(), 0));
    });
    const std::vector<unsigned char> saved = parameter_bytes(four.ranks[0], false);
    Group two(2, recipe);
    on_ranks(2, [&](int k) {
      EXPECT_OK(fp8_checkpoint_load(two.ranks[k].model.get(), two.ranks[k].opt.get(), path.c_str()));
    });
    for (int k = 0; k < 2; ++k) EXPECT_EQ(parameter_bytes(two.ranks[k], false), saved) << recipe << ", rank " << k;
    Rank single;
    single.model = build_model(single.ctx.get(), recipe, 9);
    single.opt = make_optimizer(single.model.get(), FP8_OPTIMIZER_ADAM);
    EXPECT_OK(fp8_checkpoint_load(single.model.get(), single.opt.get(), path.c_str()));
    EXPECT_EQ(parameter_bytes(single, false), saved) << recipe;
    // And one step on: the 2-rank group (one bucket) and a 2-rank group with a bucket per parameter
    // that loads the same file train alike.
    Group two_buckets(2, recipe, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, FP8_MIN_BUCKET_BYTES, true);
    on_ranks(2, [&](int k) {
      EXPECT_OK(fp8_checkpoint_load(two_buckets.ranks[k].model.get(), two_buckets.ranks[k].opt.get(), path.c_str()));
      train_step(two.ranks[k], 1, k);
      train_step(two_buckets.ranks[k], 1, k);
    });
    EXPECT_EQ(parameter_bytes(two_buckets.ranks[0], false), parameter_bytes(two.ranks[0], false)) << recipe;
    std::remove(path.c_str());
  }
}

void accumulate(Rank& r, int32_t index, int64_t rows, int64_t cols, uint32_t seed) {
  Tensor g = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {rows, cols});
  upload(g.get(), randn(static_cast<size_t>(rows * cols), seed, 0.1f));
  EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), index, g.get()));
}

// Gradients of fc1 written (fp8_model_accumulate_grad) before a whole-model backward in one bucket:
// the bucket is complete once fc2's backward has run, but fc1's backward still has to add to it, so
// it starts at the end. Every rank ends with the same averaged gradients, those of the step.
TEST(BackwardSync, AWholeModelBackwardStartsABucketOnlyOnceItHasWrittenIt) {
  constexpr int n = 2;
  Group at_step(n, kTe, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 0, false);
  Group in_backward(n, kTe, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 0, true);
  on_ranks(n, [&](int k) {
    for (Group* g : {&at_step, &in_backward}) {
      Rank& r = g->ranks[k];
      accumulate(r, 0, kHidden, kIn, 100u + k);
      accumulate(r, 1, 1, kHidden, 200u + k);
      forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    }
    EXPECT_OK(fp8_model_sync_grads(at_step.ranks[k].model.get()));
  });
  for (int k = 0; k < n; ++k)
    EXPECT_EQ(parameter_bytes(in_backward.ranks[k], true), parameter_bytes(at_step.ranks[0], true)) << "rank " << k;
}

// Turning backward sync off and on again: only what is written afterwards counts towards a bucket.
TEST(BackwardSync, TurnedOnAgainItCountsOnlyWhatIsWrittenFromThen) {
  constexpr int n = 2;
  Group g(n, kTe, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, 0, true);
  on_ranks(n, [&](int k) {
    Rank& r = g.ranks[k];
    accumulate(r, 0, kHidden, kIn, 100u + k);
    accumulate(r, 1, 1, kHidden, 200u + k);
    accumulate(r, 2, kOut, kHidden, 300u + k);
    EXPECT_OK(fp8_model_set_backward_sync(r.model.get(), 0));
    EXPECT_OK(fp8_model_set_backward_sync(r.model.get(), 1));
    accumulate(r, 0, kHidden, kIn, 400u + k);  // one of four parameters since: nothing starts
    forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    step_and_zero(r);
  });
  EXPECT_EQ(state_bytes(g.ranks[1], true), state_bytes(g.ranks[0], true));
}

// Leaving the group or converting while buckets are averaged: the model goes on from its gradients
// as they are (averaged ones stay averaged), and nothing waits on a group it left.
TEST(BackwardSync, LeavingTheGroupAfterABackwardKeepsTheAveragedGradients) {
  constexpr int n = 2;
  Group g(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU, FP8_MIN_BUCKET_BYTES, true);
  on_ranks(n, [&](int k) {
    Rank& r = g.ranks[k];
    forward_backward(r.ctx.get(), r.model.get(), batch_x(0, k), batch_dy(0, k));
    r.opt.reset();  // (set_comm refuses a model with an optimizer)
  });
  const std::vector<unsigned char> averaged = parameter_bytes(g.ranks[0], true);
  EXPECT_EQ(parameter_bytes(g.ranks[1], true), averaged);
  on_ranks(n, [&](int k) { EXPECT_OK(fp8_model_set_comm(g.ranks[k].model.get(), nullptr)); });
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(parameter_bytes(g.ranks[k], true), averaged) << "rank " << k;
    EXPECT_REFUSED(fp8_model_set_backward_sync(g.ranks[k].model.get(), 1), FP8_ERR_INVALID_STATE,
                   "fp8_model_set_backward_sync", "not data-parallel");
    Optimizer o = make_optimizer(g.ranks[k].model.get(), FP8_OPTIMIZER_ADAM);
    EXPECT_OK(fp8_optimizer_step(o.get()));  // alone now: no collective
  }
  EXPECT_EQ(parameter_bytes(g.ranks[1], false), parameter_bytes(g.ranks[0], false));
}

TEST(BackwardSync, Misuse) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model alone = build_model(ctx.get(), kO2, 1);
  EXPECT_REFUSED(fp8_model_set_backward_sync(alone.get(), 1), FP8_ERR_INVALID_STATE, "fp8_model_set_backward_sync",
                 "fp8_model_set_comm");
  EXPECT_REFUSED(fp8_model_set_backward_sync(nullptr, 1), FP8_ERR_INVALID_ARGUMENT, "fp8_model_set_backward_sync",
                 "model");
  EXPECT_REFUSED_WORDS(fp8_model_set_bucket_bytes(alone.get(), 100), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_model_set_bucket_bytes", "bytes = 100", "FP8_MIN_BUCKET_BYTES");
  EXPECT_REFUSED(fp8_model_set_bucket_bytes(nullptr, 4096), FP8_ERR_INVALID_ARGUMENT, "fp8_model_set_bucket_bytes",
                 "model");
  EXPECT_OK(fp8_model_set_bucket_bytes(alone.get(), 4096));

  Group g(2, kO2);
  EXPECT_REFUSED_WORDS(fp8_model_set_backward_sync(g.ranks[0].model.get(), 2), FP8_ERR_INVALID_ARGUMENT,
                       "fp8_model_set_backward_sync", "on = 2", "0 or 1");
  EXPECT_REFUSED(fp8_model_set_bucket_bytes(g.ranks[0].model.get(), 4096), FP8_ERR_INVALID_STATE,
                 "fp8_model_set_bucket_bytes", "before fp8_model_set_comm");

  // Ranks whose bucket sizes differ are refused on every rank, naming it.
  std::vector<Rank> ranks(2);
  std::vector<fp8_context_t*> ctxs = {ranks[0].ctx.get(), ranks[1].ctx.get()};
  fp8_comm_t* comms[2] = {};
  FP8_ASSERT_OK(fp8_comm_create_local(comms, ctxs.data(), 2));
  on_ranks(2, [&](int k) {
    Rank& r = ranks[k];
    r.comm.reset(comms[k]);
    r.model = build_model(r.ctx.get(), kO2, 1);
    EXPECT_OK(fp8_model_set_bucket_bytes(r.model.get(), k == 0 ? 4096 : 8192));
    EXPECT_REFUSED_WORDS(fp8_model_set_comm(r.model.get(), r.comm.get()), FP8_ERR_INVALID_STATE, "fp8_model_set_comm",
                         "bucket bytes 4096", "bucket bytes 8192");
  });
}

}  // namespace
