// Data parallelism on the GPU (fp8.h, "Data parallelism"). One GPU: NCCL with one rank (made by
// fp8_comm_create_local, fp8_comm_create and fp8_comm_wrap_nccl), and 2..4 ranks sharing the GPU
// through the in-process transport, which runs the FP8 exchange kernels with several senders. The
// exchange kernels give the CPU reference's bits; ranks hold identical bits after every step.
#include <nccl.h>

#include "dist_cases.hpp"

using namespace fp8test;
using namespace fp8test::dist_cases;

namespace {

constexpr const char* kO2 = "backend=msamp, opt_level=O2, small_layer_fallback=0";

// Each rank adds its own values to fc1.weight's FP8 gradient (bit-exact on both backends), then
// the ranks exchange: the codes and scale of the result.
struct Exchanged {
  std::vector<uint8_t> codes;
  float scale_inv = 0.0f;
};
std::vector<Exchanged> exchange(Group& g) {
  const int n = g.size();
  std::vector<Exchanged> out(static_cast<size_t>(n));
  on_ranks(n, [&](int k) {
    Rank& r = g.ranks[k];
    Tensor add = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kHidden, kIn});
    upload(add.get(), randn(static_cast<size_t>(kHidden * kIn), 300u + k, 0.01f * static_cast<float>(1 << (2 * k))));
    EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), 0, add.get()));
    // A second parameter with an FP32 gradient (fc1.bias) travels the FP32 way.
    Tensor bias = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kHidden});
    upload(bias.get(), randn(static_cast<size_t>(kHidden), 500u + k, 1.0f));
    EXPECT_OK(fp8_model_accumulate_grad(r.model.get(), 1, bias.get()));
    EXPECT_OK(fp8_model_sync_grads(r.model.get()));
    fp8_tensor_t* grad = nullptr;
    EXPECT_OK(fp8_model_parameter_at(r.model.get(), 0, nullptr, nullptr, &grad));
    out[k].codes = download<uint8_t>(grad);
    EXPECT_OK(fp8_tensor_get_scale_inv(grad, &out[k].scale_inv));
  });
  return out;
}

TEST(GpuDataParallel, ExchangeKernelsGiveTheCpuReferencesBits) {
  for (int n : {1, 2, 3, 4}) {
    Group gpu(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
    Group cpu(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU);
    const std::vector<Exchanged> got = exchange(gpu), want = exchange(cpu);
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(got[k].codes, want[0].codes) << n << " ranks, rank " << k;
      EXPECT_EQ(got[k].scale_inv, want[0].scale_inv) << n << " ranks, rank " << k;
    }
    // The FP32 gradients too (an all-reduce and a division, both exact to the same order).
    for (int k = 0; k < n; ++k) {
      fp8_tensor_t *g = nullptr, *c = nullptr;
      EXPECT_OK(fp8_model_parameter_at(gpu.ranks[k].model.get(), 1, nullptr, nullptr, &g));
      EXPECT_OK(fp8_model_parameter_at(cpu.ranks[0].model.get(), 1, nullptr, nullptr, &c));
      EXPECT_EQ(download<float>(g), download<float>(c)) << n << " ranks, rank " << k;
    }
    std::printf("[ exchange ] %d rank(s) on one GPU: FP8 codes and scales equal the CPU reference's\n", n);
  }
}

// The exchange in slices (FP8_EXCHANGE_SLICE_BYTES = 256: several per piece, chunks cut at their
// edges, the lane stream computing one slice while the next travels) gives the same bits as the CPU
// reference in slices and as the GPU in one slice per piece.
TEST(GpuDataParallel, SlicedExchangeGivesTheCpuReferencesBits) {
  for (int n : {2, 3}) {
    Group whole(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
    const std::vector<Exchanged> unsliced = exchange(whole);
    setenv("FP8_EXCHANGE_SLICE_BYTES", "256", 1);
    Group gpu(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
    Group cpu(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, FP8_DEVICE_CPU);
    const std::vector<Exchanged> got = exchange(gpu), want = exchange(cpu);
    unsetenv("FP8_EXCHANGE_SLICE_BYTES");
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(got[k].codes, want[0].codes) << n << " ranks, rank " << k;
      EXPECT_EQ(got[k].scale_inv, want[0].scale_inv) << n << " ranks, rank " << k;
      EXPECT_EQ(got[k].codes, unsliced[0].codes) << n << " ranks, rank " << k;
      // Every byte besides: fc2's untouched gradient (a zero bound), the biases, the scales.
      EXPECT_EQ(state_bytes(gpu.ranks[k], true), state_bytes(cpu.ranks[0], true)) << n << " ranks, rank " << k;
    }
    std::printf("[ exchange ] %d ranks on one GPU, 256-byte slices: the CPU reference's bits, and one slice's\n", n);
  }
}

class GpuLevels : public ::testing::TestWithParam<const char*> {};

TEST_P(GpuLevels, RanksSharingTheGpuHoldTheSameBitsAfterEveryStep) {
  const char* recipe = GetParam();
  Group g(3, recipe, FP8_OPTIMIZER_ADAM, 0.05f, 0);
  for (int step = 0; step < 3; ++step) {
    on_ranks(3, [&](int k) { train_step(g.ranks[k], step, k); });
    const std::vector<unsigned char> want = state_bytes(g.ranks[0], true);
    for (int k = 1; k < 3; ++k) ASSERT_EQ(state_bytes(g.ranks[k], true), want) << "rank " << k;
  }
  EXPECT_EQ(stats_of(g.ranks[0].opt.get()).steps, 3);
}

INSTANTIATE_TEST_SUITE_P(Levels, GpuLevels,
                         ::testing::Values("backend=te, small_layer_fallback=0",
                                           "backend=msamp, opt_level=O1, small_layer_fallback=0", kO2,
                                           "backend=msamp, opt_level=O3, small_layer_fallback=0"));

// Backward sync on the GPU: each bucket's exchange runs on the context's communication stream while
// the backward goes on (ranks sharing the GPU: the in-process transport, with the exchange kernels on
// that stream). The result is bit for bit the exchange at the step, at every level.
TEST_P(GpuLevels, BackwardSyncOnTheCommunicationStreamGivesTheBitsOfTheExchangeAtTheStep) {
  const char* recipe = GetParam();
  Group at_step(2, recipe, FP8_OPTIMIZER_ADAM, 0.05f, 0, FP8_MIN_BUCKET_BYTES, false);
  Group in_backward(2, recipe, FP8_OPTIMIZER_ADAM, 0.05f, 0, FP8_MIN_BUCKET_BYTES, true);
  for (int step = 0; step < 3; ++step) {
    on_ranks(2, [&](int k) {
      train_step(at_step.ranks[k], step, k);
      train_step(in_backward.ranks[k], step, k);
    });
    for (int k = 0; k < 2; ++k)
      ASSERT_EQ(state_bytes(in_backward.ranks[k], true), state_bytes(at_step.ranks[k], true)) << "rank " << k;
  }
  // And with NCCL's one rank: backward sync changes nothing.
  Group one(1, recipe, FP8_OPTIMIZER_ADAM, 0.05f, 0, FP8_MIN_BUCKET_BYTES, true);
  Group one_at_step(1, recipe, FP8_OPTIMIZER_ADAM, 0.05f, 0, FP8_MIN_BUCKET_BYTES, false);
  for (int step = 0; step < 2; ++step) {
    train_step(one.ranks[0], step, 0);
    train_step(one_at_step.ranks[0], step, 0);
  }
  EXPECT_EQ(state_bytes(one.ranks[0], true), state_bytes(one_at_step.ranks[0], true));
  EXPECT_OK(fp8_context_synchronize(one.ranks[0].ctx.get()));
  std::printf("[ backward sync ] %s: 2 ranks sharing the GPU and 1 NCCL rank give the step-time exchange's bits\n",
              recipe);
}

// FP8_PEER_EXCHANGE=on where the ranks cannot reach each other's memory (two ranks sharing this GPU
// through the in-process transport, which stages through the host): every rank's exchange fails
// with FP8_ERR_UNSUPPORTED saying why; unset, the same group exchanges through the collectives.
TEST(GpuDataParallel, ThePeerExchangeOnIsRefusedWhereTheRanksCannotReachEachOther) {
  const int n = 2;
  {
    const ScopedEnv on("FP8_PEER_EXCHANGE", "on");
    Group g(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
    const std::vector<Outcome> got = sync_outcomes(g);
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(got[k].status, FP8_ERR_UNSUPPORTED) << "rank " << k << ": " << got[k].message;
      EXPECT_NE(got[k].message.find("FP8_PEER_EXCHANGE is 'on', but the in-process transport's ranks on CUDA "
                                    "contexts exchange through host memory"),
                std::string::npos)
          << got[k].message;
    }
    // And again at the next call: a refusal is not remembered as a choice of the collectives.
    std::vector<fp8_status_t> again(n);
    on_ranks(n, [&](int k) { again[k] = fp8_model_sync_grads(g.ranks[k].model.get()); });
    for (int k = 0; k < n; ++k) EXPECT_EQ(again[k], FP8_ERR_UNSUPPORTED) << "rank " << k << ", second call";
  }
  Group g(n, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
  on_ranks(n, [&](int k) { train_step(g.ranks[k], 0, k); });
  EXPECT_EQ(state_bytes(g.ranks[1], true), state_bytes(g.ranks[0], true));
}

// At te the FP32 exchange of one rank (a sum of one, divided by one) changes nothing: NCCL with one
// rank trains bit for bit like no communicator.
TEST(GpuDataParallel, OneNcclRankAtTeTrainsLikeNoCommunicator) {
  const char* recipe = "backend=te, small_layer_fallback=0";
  Group g(1, recipe, FP8_OPTIMIZER_ADAM, 0.0f, 0);
  Rank alone(0);
  alone.model = build_model(alone.ctx.get(), recipe, 1);
  alone.opt = make_optimizer(alone.model.get(), FP8_OPTIMIZER_ADAM);
  EXPECT_OK(fp8_optimizer_set_float(alone.opt.get(), FP8_OPTIM_LR, 0.01));
  for (int step = 0; step < 3; ++step) {
    train_step(g.ranks[0], step, 0);
    train_step(alone, step, 0);
  }
  EXPECT_EQ(state_bytes(g.ranks[0], false), state_bytes(alone, false));
  EXPECT_OK(fp8_context_synchronize(g.ranks[0].ctx.get()));
}

// fp8_comm_create (an id from fp8_comm_get_id) and fp8_comm_wrap_nccl (the application's
// communicator) train like fp8_comm_create_local.
TEST(GpuDataParallel, CreateFromAnIdAndWrapAnApplicationsCommunicator) {
  Group reference(1, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
  for (int step = 0; step < 2; ++step) train_step(reference.ranks[0], step, 0);
  const std::vector<unsigned char> want = state_bytes(reference.ranks[0], false);
  for (bool wrap : {false, true}) {
    SCOPED_TRACE(wrap ? "fp8_comm_wrap_nccl" : "fp8_comm_create");
    Rank r(0);
    ncclComm_t app = nullptr;
    fp8_comm_t* comm = nullptr;
    fp8_comm_id_t id;
    FP8_ASSERT_OK(fp8_comm_get_id(&id));
    if (wrap) {
      ncclUniqueId nid;
      static_assert(sizeof nid == sizeof id.bytes, "fp8_comm_id_t holds an ncclUniqueId");
      std::memcpy(&nid, id.bytes, sizeof nid);
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      ASSERT_EQ(ncclCommInitRank(&app, 1, nid, 0), ncclSuccess);
      FP8_ASSERT_OK(fp8_comm_wrap_nccl(&comm, r.ctx.get(), app));
    } else {
      FP8_ASSERT_OK(fp8_comm_create(&comm, r.ctx.get(), 1, 0, &id));
    }
    r.comm.reset(comm);
    int32_t rank = -1, size = -1;
    EXPECT_OK(fp8_comm_rank(comm, &rank));
    EXPECT_OK(fp8_comm_size(comm, &size));
    EXPECT_EQ(rank, 0);
    EXPECT_EQ(size, 1);
    r.model = build_model(r.ctx.get(), kO2, 1);
    FP8_ASSERT_OK(fp8_model_set_comm(r.model.get(), comm));
    r.opt = make_optimizer(r.model.get(), FP8_OPTIMIZER_ADAM);
    EXPECT_OK(fp8_optimizer_set_float(r.opt.get(), FP8_OPTIM_LR, 0.01));
    for (int step = 0; step < 2; ++step) train_step(r, step, 0);
    EXPECT_EQ(state_bytes(r, false), want);
    EXPECT_OK(fp8_context_synchronize(r.ctx.get()));
    r.opt.reset();
    r.model.reset();
    r.comm.reset();
    if (app) EXPECT_EQ(ncclCommDestroy(app), ncclSuccess);  // the application's, destroyed last
  }
}

TEST(GpuDataParallel, AbortMakesLaterCollectivesFail) {
  Group g(1, kO2, FP8_OPTIMIZER_ADAM, 0.0f, 0);
  train_step(g.ranks[0], 0, 0);
  Rank& r = g.ranks[0];
  EXPECT_OK(fp8_comm_abort(r.comm.get()));
  // Every collective fails from now on: the forward's scaling update, the exchange, the step.
  Tensor x = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  Tensor y = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
  upload(x.get(), batch_x(1, 0));
  EXPECT_REFUSED(fp8_model_forward(r.model.get(), x.get(), y.get()), FP8_ERR_NCCL, "fp8_model_forward", "aborted");
  EXPECT_OK(fp8_optimizer_zero_grad(r.opt.get()));  // local: gradients written, to exchange again
  EXPECT_REFUSED(fp8_model_sync_grads(r.model.get()), FP8_ERR_NCCL, "fp8_model_sync_grads", "aborted");
  EXPECT_REFUSED(fp8_optimizer_step(r.opt.get()), FP8_ERR_NCCL, "fp8_optimizer_step", "aborted");
}

}  // namespace
