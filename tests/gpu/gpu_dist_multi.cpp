// Data parallelism over several GPUs (fp8.h, "Data parallelism"): every GPU of the machine a rank.
// In one process, ranks on threads joined by NCCL (fp8_comm_create_local: ncclCommInitAll): the ranks
// hold the same bits after every step at every level, with backward sync off and on, and with two
// GPUs the bits of two ranks sharing GPU 0 (the in-process transport: the same kernels, and a sum of
// two FP32 values does not depend on its order); O3's shards; checkpoints saved by every GPU, loaded
// by one and back. Across processes, one per GPU (fp8_comm_create from an id in a file): the children
// are this program again (/proc/self/exe), each running one GpuDataParallelChild test; they hold the
// same bits, and a rank that exits early makes the other's wait end in FP8_ERR_NCCL (the
// communicator's timeout), not a hang. Each test needs 2 or more GPUs and skips otherwise.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "dist_cases.hpp"

extern char** environ;

using namespace fp8test;
using namespace fp8test::dist_cases;

namespace {

constexpr const char* kO2 = "backend=msamp, opt_level=O2, small_layer_fallback=0";
constexpr const char* kO3 = "backend=msamp, opt_level=O3, small_layer_fallback=0";

struct Level {
  const char* name;
  const char* recipe;
};
void PrintTo(const Level& l, std::ostream* os) {
  *os << l.name;
}
const Level kLevels[] = {{"te", "backend=te, small_layer_fallback=0"},
                         {"O1", "backend=msamp, opt_level=O1, small_layer_fallback=0"},
                         {"O2", kO2},
                         {"O3", kO3}};

// The CUDA devices 0, 1, ... that run FP8 (the suite's main checked device 0).
int fp8_gpus() {
  int32_t count = 0;
  if (fp8_device_count(&count) != FP8_OK) return 0;
  int usable = 0;
  for (int32_t d = 0; d < count; ++d) {
    fp8_device_info_t info;
    fp8_device_info_init(&info);
    if (fp8_device_query(d, &info) != FP8_OK || !info.fp8_gemm) break;
    ++usable;
  }
  return usable;
}
constexpr const char* kNeedsTwoGpus = "needs 2 or more CUDA devices of compute capability 8.9+; found ";

std::vector<int32_t> first_gpus(int n) {
  std::vector<int32_t> devices;
  for (int32_t d = 0; d < n; ++d) devices.push_back(d);
  return devices;
}

// Every parameter's value as stored (with its scale_inv where it is FP8) and every scaling state:
// what state_bytes compares, per parameter, so that models laid out for different numbers of ranks
// (buckets padded to N pieces) compare too. (O3's F16 masters are not in it: a rank holds its share.)
std::vector<unsigned char> weight_bytes(const Rank& r) {
  fp8_model_t* m = r.model.get();
  std::vector<unsigned char> out;
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t i = 0; i < count; ++i) {
    fp8_tensor_t* v = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, nullptr, &v, nullptr));
    const std::vector<uint8_t> b = tensor_bytes(v);
    out.insert(out.end(), b.begin(), b.end());
    const fp8_dtype_t dt = dtype_of(v);
    if (dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2) {
      float scale_inv = 0.0f;
      EXPECT_OK(fp8_tensor_get_scale_inv(v, &scale_inv));
      const auto* s = reinterpret_cast<const unsigned char*>(&scale_inv);
      out.insert(out.end(), s, s + sizeof scale_inv);
    }
  }
  append_scaling_bytes(m, &out);
  return out;
}

// A fresh directory in the system's temporary directory, removed with its files.
struct TempDir {
  std::string path;
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "fp8_dist_multi_XXXXXX").string();
    if (mkdtemp(t.data()))
      path = t;
    else
      ADD_FAILURE() << "mkdtemp(" << t << "): " << std::strerror(errno);
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path + "/" + name; }
};

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
std::string read_text(const std::string& path) {
  const std::vector<unsigned char> b = read_bytes(path);
  return std::string(b.begin(), b.end());
}
void write_bytes(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  out.close();
  EXPECT_TRUE(out.good()) << "writing " << path;
}

// ---- one process, one GPU per rank (NCCL through ncclCommInitAll) ---------------------------------

class MultiGpuLevels : public ::testing::TestWithParam<std::tuple<Level, bool>> {};

TEST_P(MultiGpuLevels, NcclRanksOnTheirOwnGpusHoldTheSameBitsAfterEveryStep) {
  const Level& level = std::get<0>(GetParam());
  const bool backward_sync = std::get<1>(GetParam());
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  // The smallest buckets: one per parameter, so that there are several exchanges (and, with
  // backward sync, several on the communication stream while the backward goes on).
  Group g(first_gpus(n), level.recipe, FP8_OPTIMIZER_ADAM, 0.05f, FP8_MIN_BUCKET_BYTES, backward_sync);
  for (int k = 0; k < n; ++k) {
    int32_t device = -1;
    EXPECT_OK(fp8_context_device(g.ranks[k].ctx.get(), &device));
    ASSERT_EQ(device, k) << "rank " << k;
  }
  // Two GPUs: two ranks sharing GPU 0 (the in-process transport) train alike, step for step. Each
  // FP32 sum then has two terms (commutative), the amaxes and the O3 norm partials travel as maxima,
  // the FP8 exchange sums in rank order in the same kernel, and the rest are copies: every byte
  // state_bytes reads must be the same. (O3's masters differ by rank, not by transport: not read.)
  std::optional<Group> shared;
  if (n == 2) shared.emplace(2, level.recipe, FP8_OPTIMIZER_ADAM, 0.05f, 0, FP8_MIN_BUCKET_BYTES, backward_sync);
  // fp8_model_set_comm started every rank from rank 0's model (each was built from its own seed).
  const std::vector<unsigned char> initial = state_bytes(g.ranks[0], true);
  for (int k = 1; k < n; ++k) ASSERT_EQ(state_bytes(g.ranks[k], true), initial) << "rank " << k << " before training";
  for (int step = 0; step < 3; ++step) {
    on_ranks(n, [&](int k) { train_step(g.ranks[k], step, k); });
    if (shared) on_ranks(2, [&](int k) { train_step(shared->ranks[k], step, k); });
    const std::vector<unsigned char> want = state_bytes(g.ranks[0], true);
    for (int k = 1; k < n; ++k)
      ASSERT_EQ(state_bytes(g.ranks[k], true), want) << level.name << ", rank " << k << ", step " << step;
    if (shared) {
      for (int k = 0; k < 2; ++k)
        ASSERT_EQ(state_bytes(shared->ranks[k], true), want)
            << level.name << ": rank " << k << " of 2 sharing GPU 0 differs from the NCCL ranks at step " << step;
    }
  }
  EXPECT_NE(state_bytes(g.ranks[0], true), initial) << "the steps changed nothing";
  const fp8_optimizer_stats_t s0 = stats_of(g.ranks[0].opt.get());
  EXPECT_EQ(s0.steps, 3);
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(stats_of(g.ranks[k].opt.get()).last_grad_norm, s0.last_grad_norm) << "rank " << k;
    EXPECT_OK(fp8_context_synchronize(g.ranks[k].ctx.get()));
  }
  std::printf("[ multi-GPU ] %s, backward sync %s: %d NCCL ranks, one per GPU, hold the same bits after 3 steps%s\n",
              level.name, backward_sync ? "on" : "off", n,
              n == 2 ? "; so do 2 ranks sharing GPU 0" : " (no comparison with ranks sharing a GPU: not 2 GPUs)");
}

INSTANTIATE_TEST_SUITE_P(Levels, MultiGpuLevels, ::testing::Combine(::testing::ValuesIn(kLevels), ::testing::Bool()),
                         [](const auto& p) {
                           return std::string(std::get<0>(p.param).name) +
                                  (std::get<1>(p.param) ? "_backward_sync" : "_sync_at_step");
                         });

// NCCL ranks on their own GPUs, the exchange cut in 256-byte slices (several per piece, the lane
// stream computing one while the next travels, strided all-gathers): the same bytes as one slice
// per piece; and on two GPUs, as two ranks sharing one GPU (with more ranks NCCL's FP32 sums of
// the biases' gradients add in another order than the in-process transport's).
TEST(MultiGpuSlices, SlicedExchangeOverNcclGivesTheBitsOfOneSlice) {
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  const std::vector<int32_t> devices = first_gpus(n);
  ExchangeCase nccl;  // (the path that slices travel on: not the peer exchange)
  nccl.peer_exchange = "off";
  const std::vector<unsigned char> sliced = exchanged_grads(devices, "256", nccl);
  EXPECT_EQ(sliced, exchanged_grads(devices, nullptr, nccl)) << n << " GPUs";
  EXPECT_EQ(exchanged_grads(first_gpus(2), "256", nccl), exchanged_grads({devices[0], devices[0]}, "256", nccl))
      << "2 GPUs against 2 ranks sharing one";
  // Larger slices of several chunks, one bucket per parameter (slices pipelined across buckets),
  // exchanged during the backward, at O2 and at O3 (own pieces first, the rest at sync_grads):
  // the lane's pass overlaps the next transfer for real here, unlike under the in-process
  // transport, which waits for each collective.
  for (const char* recipe : {"backend=msamp, opt_level=O2, small_layer_fallback=0",
                             "backend=msamp, opt_level=O3, small_layer_fallback=0"}) {
    ExchangeCase c;
    c.recipe = recipe;
    c.bucket_bytes = FP8_MIN_BUCKET_BYTES;
    c.backward_sync = true;
    c.hidden = 4096;
    c.peer_exchange = "off";
    EXPECT_EQ(exchanged_grads(devices, "16384", c), exchanged_grads(devices, nullptr, c)) << recipe;
  }
  std::printf("[ slices ] %d NCCL ranks, 256-byte slices: one slice's bytes; on 2 GPUs those of 2 ranks sharing one\n",
              n);
}

// The peer exchange (FP8_PEER_EXCHANGE=on, so refused if the GPUs cannot reach each other): each
// rank reads its piece of every GPU's codes over NVLink and writes the means into every GPU's
// storage. The same bytes as the exchange over NCCL's collectives, at O1, O2 and O3, one bucket or
// one per parameter, exchanged at the step or during the backward, whole or in slices.
TEST(MultiGpuPeers, ThePeerExchangeGivesTheBitsOfNcclsCollectives) {
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  const std::vector<int32_t> devices = first_gpus(n);
  int cases = 0;
  for (const Level& level : kLevels) {
    if (std::string(level.name) == "te") continue;  // (no FP8 gradients)
    for (size_t bucket_bytes : {size_t{0}, size_t{FP8_MIN_BUCKET_BYTES}})
      for (bool backward_sync : {false, true}) {
        ExchangeCase c;
        c.recipe = level.recipe;
        c.bucket_bytes = bucket_bytes;
        c.backward_sync = backward_sync;
        c.hidden = 4096;
        c.peer_exchange = "off";
        const std::vector<unsigned char> collectives = exchanged_grads(devices, nullptr, c);
        c.peer_exchange = "on";
        const std::string where = std::string(level.name) + ", bucket bytes " + std::to_string(bucket_bytes) +
                                  ", backward sync " + (backward_sync ? "on" : "off");
        EXPECT_EQ(exchanged_grads(devices, nullptr, c), collectives) << where;
        EXPECT_EQ(exchanged_grads(devices, "16384", c), collectives) << where << ", 16384-byte slices";
        cases += 2;
      }
  }
  std::printf("[ peers ] %d GPUs: the peer exchange gave the bytes of NCCL's collectives in %d cases\n", n, cases);
}

// ZeRO at O3 over the GPUs: each rank keeps the F16 masters and Adam's m and v of its share of the
// Linear weights, so the training state is 2 + 5/N bytes per weight (E4M3 weight and FP8 gradient
// whole), as on CPU ranks.
TEST(MultiGpuZero, O3OnEveryGpuKeepsTwoPlusFiveOverNBytesPerWeight) {
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  ZeroO3Footprint f;
  ASSERT_NO_FATAL_FAILURE(zero_o3_footprint(first_gpus(n), &f));
  double worst = 0.0;
  for (int k = 0; k < n; ++k) {
    ASSERT_GT(f.parameters[k], 0) << "rank " << k;
    const double per = f.bytes_per_weight[k];
    EXPECT_LE(per, 2.0 + 5.0 / n + 0.01) << n << " GPUs, rank " << k;
    EXPECT_GE(per, 2.0 + 5.0 / n - 0.01) << n << " GPUs, rank " << k;
    worst = std::max(worst, std::fabs(per - (2.0 + 5.0 / n)));
  }
  EXPECT_EQ(f.masters_total, size_t{1024 * 1024 * 2}) << "the ranks' master shares add up to the whole";
  std::printf(
      "[ ZeRO O3 ] %d GPUs: every rank keeps 2 + 5/%d = %.3f bytes of training state per weight (within "
      "%.4f); the master shares add up to %zu bytes\n",
      n, n, 2.0 + 5.0 / n, worst, f.masters_total);
}

// Saved by a rank on every GPU (collective: rank 0 writes), loaded by one rank on GPU 0 (a model
// without a communicator): its weights and scales are rank 0's. Saved again by that rank and loaded
// by a rank on every GPU, the group trains on bit-identically with the group that saved (at O3 the
// masters, m and v go whole into the files and each loading rank takes its share).
class MultiGpuCheckpoint : public ::testing::TestWithParam<Level> {};

TEST_P(MultiGpuCheckpoint, SavedByEveryGpuLoadsIntoOneAndBackAndTrainsOnBitIdentically) {
  const Level& level = GetParam();
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string path = dir.file("gpus.ckpt"), again = dir.file("one.ckpt");
  Group all(first_gpus(n), level.recipe);
  on_ranks(n, [&](int k) { train_step(all.ranks[k], 0, k); });
  on_ranks(n, [&](int k) {
    EXPECT_OK(fp8_checkpoint_save(all.ranks[k].model.get(), all.ranks[k].opt.get(), path.c_str(), 0));
  });
  ASSERT_TRUE(std::filesystem::exists(path));
  const std::vector<unsigned char> saved = weight_bytes(all.ranks[0]);
  for (int k = 1; k < n; ++k) ASSERT_EQ(weight_bytes(all.ranks[k]), saved) << "rank " << k;
  for (int step = 1; step < 3; ++step) on_ranks(n, [&](int k) { train_step(all.ranks[k], step, k); });
  const std::vector<unsigned char> trained = state_bytes(all.ranks[0], false);

  Rank single(0);
  single.model = build_model(single.ctx.get(), level.recipe, 9);
  single.opt = make_optimizer(single.model.get(), FP8_OPTIMIZER_ADAM);
  FP8_ASSERT_OK(fp8_checkpoint_load(single.model.get(), single.opt.get(), path.c_str()));
  EXPECT_EQ(weight_bytes(single), saved) << "1 rank loading what " << n << " GPU ranks saved";
  FP8_ASSERT_OK(fp8_checkpoint_save(single.model.get(), single.opt.get(), again.c_str(), 0));

  Group back(first_gpus(n), level.recipe);
  on_ranks(n, [&](int k) {
    EXPECT_OK(fp8_checkpoint_load(back.ranks[k].model.get(), back.ranks[k].opt.get(), again.c_str()));
  });
  for (int k = 0; k < n; ++k) ASSERT_EQ(weight_bytes(back.ranks[k]), saved) << "rank " << k << " after loading";
  for (int step = 1; step < 3; ++step) {
    on_ranks(n, [&](int k) { train_step(back.ranks[k], step, k); });
    const std::vector<unsigned char> want = state_bytes(back.ranks[0], true);
    for (int k = 1; k < n; ++k) ASSERT_EQ(state_bytes(back.ranks[k], true), want) << "rank " << k << ", step " << step;
  }
  EXPECT_EQ(state_bytes(back.ranks[0], false), trained)
      << n << " GPUs -> 1 -> " << n << " GPUs trains on like the " << n << " that saved";
  std::printf(
      "[ checkpoint ] %s: saved by %d GPU ranks, loaded by 1 rank (rank 0's weights), saved by it and loaded "
      "by %d: trains on bit-identically\n",
      level.name, n, n);
}

INSTANTIATE_TEST_SUITE_P(Levels, MultiGpuCheckpoint, ::testing::Values(Level{"O2", kO2}, Level{"O3", kO3}),
                         [](const auto& p) { return std::string(p.param.name); });

// ---- one process per GPU (fp8_comm_create) --------------------------------------------------------
//
// The parent writes fp8_comm_get_id's ids into a file and runs this program once per rank with
// --gtest_filter naming a GpuDataParallelChild test and the environment below; each child writes
// what it found into its output file. The parent waits at most kChildSeconds, then kills them.

constexpr const char* kEnvRank = "FP8_DIST_CHILD_RANK";
constexpr const char* kEnvWorld = "FP8_DIST_CHILD_WORLD";
constexpr const char* kEnvIds = "FP8_DIST_CHILD_ID_FILE";
constexpr const char* kEnvOut = "FP8_DIST_CHILD_OUT";
constexpr int kChildSeconds = 120;

struct ChildEnv {
  int rank = 0, world = 0;
  std::string ids, out;
};
std::optional<ChildEnv> child_env() {
  const char *rank = std::getenv(kEnvRank), *world = std::getenv(kEnvWorld), *ids = std::getenv(kEnvIds),
             *out = std::getenv(kEnvOut);
  if (!rank || !world || !ids || !out) return std::nullopt;
  ChildEnv e;
  e.rank = std::atoi(rank);
  e.world = std::atoi(world);
  e.ids = ids;
  e.out = out;
  return e;
}
std::vector<fp8_comm_id_t> read_ids(const std::string& path) {
  const std::vector<unsigned char> b = read_bytes(path);
  std::vector<fp8_comm_id_t> ids(b.size() / sizeof(fp8_comm_id_t));
  if (!ids.empty()) std::memcpy(ids.data(), b.data(), ids.size() * sizeof(fp8_comm_id_t));
  return ids;
}
void write_ids(const std::string& path, size_t count) {
  std::vector<fp8_comm_id_t> ids(count);
  for (fp8_comm_id_t& id : ids) EXPECT_OK(fp8_comm_get_id(&id));
  write_bytes(path, ids.data(), ids.size() * sizeof(fp8_comm_id_t));
}

struct ChildResult {
  bool spawned = false, reaped = false, timed_out = false;
  int status = 0;   // waitpid's, once reaped
  std::string log;  // its stdout and stderr
};
bool succeeded(const ChildResult& c) {
  return c.reaped && !c.timed_out && WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
}
std::string describe(const ChildResult& c) {
  std::ostringstream os;
  if (!c.spawned)
    os << "not started";
  else if (c.timed_out)
    os << "still running after " << kChildSeconds << " s (killed)";
  else if (!c.reaped)
    os << "lost (waitpid failed)";
  else if (WIFEXITED(c.status))
    os << "exit code " << WEXITSTATUS(c.status);
  else if (WIFSIGNALED(c.status))
    os << "killed by signal " << WTERMSIG(c.status);
  else
    os << "wait status " << c.status;
  os << "; its output:\n" << c.log;
  return os.str();
}

std::string self_exe() {
  std::vector<char> buf(4096);
  const ssize_t len = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  return len > 0 ? std::string(buf.data(), static_cast<size_t>(len)) : std::string("/proc/self/exe");
}

// Runs this program as ranks 0 .. world - 1 of `test` (a GpuDataParallelChild test), rank k writing
// outs[k]; waits for all of them, killing every one still running after kChildSeconds.
std::vector<ChildResult> run_children(const std::string& test, int world, const std::string& ids,
                                      const std::vector<std::string>& outs, const TempDir& dir) {
  // The device machine sets it (NVLink multicast off) and the children must keep it.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const std::string exe = self_exe();
  std::vector<ChildResult> results(static_cast<size_t>(world));
  std::vector<pid_t> pids(static_cast<size_t>(world), -1);
  std::vector<std::string> logs;
  for (int k = 0; k < world; ++k) logs.push_back(dir.file("rank" + std::to_string(k) + ".log"));
  for (int k = 0; k < world; ++k) {
    // This environment, without GoogleTest's settings (an output file, shards) and earlier ranks'.
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string s(*e);
      if (s.rfind("GTEST_", 0) == 0 || s.rfind("FP8_DIST_CHILD_", 0) == 0) continue;
      env.push_back(s);
    }
    env.push_back(std::string(kEnvRank) + "=" + std::to_string(k));
    env.push_back(std::string(kEnvWorld) + "=" + std::to_string(world));
    env.push_back(std::string(kEnvIds) + "=" + ids);
    env.push_back(std::string(kEnvOut) + "=" + outs[static_cast<size_t>(k)]);
    std::vector<std::string> args = {exe, "--gtest_filter=" + test};
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, logs[static_cast<size_t>(k)].c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int err =
        posix_spawn(&pids[static_cast<size_t>(k)], exe.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (err != 0) {
      ADD_FAILURE() << "posix_spawn(" << exe << ") for rank " << k << ": " << std::strerror(err);
      pids[static_cast<size_t>(k)] = -1;
      break;  // the others would wait for it: killed below
    }
    results[static_cast<size_t>(k)].spawned = true;
  }
  const bool all_spawned = std::all_of(results.begin(), results.end(), [](const ChildResult& c) { return c.spawned; });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(all_spawned ? kChildSeconds : 0);
  std::vector<bool> done(static_cast<size_t>(world), false);
  for (int k = 0; k < world; ++k) done[static_cast<size_t>(k)] = pids[static_cast<size_t>(k)] <= 0;
  for (;;) {
    bool running = false;
    for (int k = 0; k < world; ++k) {
      const size_t i = static_cast<size_t>(k);
      if (done[i]) continue;
      int status = 0;
      const pid_t got = waitpid(pids[i], &status, WNOHANG);
      if (got == pids[i]) {
        results[i].status = status;
        results[i].reaped = true;
        done[i] = true;
      } else if (got < 0) {
        ADD_FAILURE() << "waitpid for rank " << k << ": " << std::strerror(errno);
        done[i] = true;
      } else {
        running = true;
      }
    }
    if (!running) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (int k = 0; k < world; ++k) {
        const size_t i = static_cast<size_t>(k);
        if (done[i]) continue;
        kill(pids[i], SIGKILL);
        int status = 0;
        results[i].reaped = waitpid(pids[i], &status, 0) == pids[i];
        results[i].status = status;
        results[i].timed_out = true;
        done[i] = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (int k = 0; k < world; ++k) results[static_cast<size_t>(k)].log = read_text(logs[static_cast<size_t>(k)]);
  return results;
}

constexpr const char* kChildSkip =
    " unset: a child of the multi-process tests (GpuDataParallelProcesses), which run it with its rank";

// A child of OneProcessPerGpuHoldsTheSameBitsOnEveryRank: rank `rank` of `world` on GPU `rank`, at O2
// then at O3 (one communicator each, from the id file's ids 0 and 1), 3 steps each; writes
// state_bytes after each level into its output file.
TEST(GpuDataParallelChild, TrainsItsRankOnItsGpuAndWritesItsState) {
  const std::optional<ChildEnv> env = child_env();
  if (!env) GTEST_SKIP() << kEnvRank << kChildSkip;
  const std::vector<fp8_comm_id_t> ids = read_ids(env->ids);
  ASSERT_EQ(ids.size(), 2u) << env->ids;
  std::vector<unsigned char> all;
  const char* recipes[] = {kO2, kO3};
  for (size_t level = 0; level < 2; ++level) {
    Rank r(env->rank);
    fp8_comm_t* comm = nullptr;
    FP8_ASSERT_OK(fp8_comm_create(&comm, r.ctx.get(), env->world, env->rank, &ids[level]));
    r.comm.reset(comm);
    int32_t rank = -1, size = -1;
    EXPECT_OK(fp8_comm_rank(comm, &rank));
    EXPECT_OK(fp8_comm_size(comm, &size));
    EXPECT_EQ(rank, env->rank);
    EXPECT_EQ(size, env->world);
    r.model = build_model(r.ctx.get(), recipes[level], static_cast<uint32_t>(env->rank + 1));
    make_data_parallel(r, FP8_OPTIMIZER_ADAM, 0.05f);
    for (int step = 0; step < 3; ++step) train_step(r, step, env->rank);
    const std::vector<unsigned char> b = state_bytes(r, true);
    all.insert(all.end(), b.begin(), b.end());
    EXPECT_EQ(stats_of(r.opt.get()).steps, 3);
    EXPECT_OK(fp8_context_synchronize(r.ctx.get()));
  }
  write_bytes(env->out, all.data(), all.size());
  std::printf("rank %d of %d: wrote %zu bytes of state\n", env->rank, env->world, all.size());
}

TEST(GpuDataParallelProcesses, OneProcessPerGpuHoldsTheSameBitsOnEveryRank) {
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string ids = dir.file("ids");
  write_ids(ids, 2);
  std::vector<std::string> outs;
  for (int k = 0; k < n; ++k) outs.push_back(dir.file("rank" + std::to_string(k) + ".state"));
  // The children exchange through each other's memory (CUDA IPC; refused if they cannot), the
  // ranks in this process below through NCCL's collectives.
  std::vector<ChildResult> children;
  {
    const ScopedEnv peers("FP8_PEER_EXCHANGE", "on");
    children = run_children("GpuDataParallelChild.TrainsItsRankOnItsGpuAndWritesItsState", n, ids, outs, dir);
  }
  for (int k = 0; k < n; ++k)
    EXPECT_TRUE(succeeded(children[static_cast<size_t>(k)]))
        << "the child of rank " << k << ": " << describe(children[static_cast<size_t>(k)]);
  if (HasFailure()) return;
  const std::vector<unsigned char> want = read_bytes(outs[0]);
  ASSERT_FALSE(want.empty()) << "rank 0 wrote no state";
  for (int k = 1; k < n; ++k) EXPECT_EQ(read_bytes(outs[static_cast<size_t>(k)]), want) << "rank " << k;
  // Two GPUs: the bits of two NCCL ranks in one process (every FP32 sum has two terms: commutative).
  if (n == 2) {
    std::vector<unsigned char> in_process;
    const ScopedEnv collectives("FP8_PEER_EXCHANGE", "off");
    for (const char* recipe : {kO2, kO3}) {
      Group g(first_gpus(2), recipe, FP8_OPTIMIZER_ADAM, 0.05f);
      for (int step = 0; step < 3; ++step) on_ranks(2, [&](int k) { train_step(g.ranks[k], step, k); });
      const std::vector<unsigned char> b = state_bytes(g.ranks[0], true);
      in_process.insert(in_process.end(), b.begin(), b.end());
    }
    EXPECT_EQ(in_process, want) << "2 processes against 2 ranks of one process";
  }
  std::printf(
      "[ processes ] %d processes, one GPU each (fp8_comm_create), exchanging through CUDA IPC: O2 and O3 state "
      "identical on every rank after 3 steps%s\n",
      n, n == 2 ? ", and equal to 2 NCCL ranks in one process exchanging through NCCL's collectives" : "");
}

// A child of ARankThatExitsEarlyEndsTheOthersWaitInAnNcclError (2 ranks, O2): rank 1 exits at once
// after fp8_model_set_comm and fp8_optimizer_create (once rank 0 is past them too); rank 0 sets a
// 5 s timeout and trains a step, which must fail with FP8_ERR_NCCL (at the latest at
// fp8_context_synchronize) within 60 s. Rank 0 writes what it got into its output file.
TEST(GpuDataParallelChild, RankOneExitsEarlyAndRankZerosWaitEndsInAnNcclError) {
  const std::optional<ChildEnv> env = child_env();
  if (!env) GTEST_SKIP() << kEnvRank << kChildSkip;
  ASSERT_EQ(env->world, 2);
  const std::vector<fp8_comm_id_t> ids = read_ids(env->ids);
  ASSERT_EQ(ids.size(), 1u) << env->ids;
  const std::string ready = env->ids + ".ready";  // rank 0 is past fp8_optimizer_create
  Rank r(env->rank);
  fp8_comm_t* comm = nullptr;
  FP8_ASSERT_OK(fp8_comm_create(&comm, r.ctx.get(), 2, env->rank, &ids[0]));
  r.comm.reset(comm);
  r.model = build_model(r.ctx.get(), kO2, static_cast<uint32_t>(env->rank + 1));
  FP8_ASSERT_OK(fp8_model_set_comm(r.model.get(), comm));
  fp8_optimizer_t* o = nullptr;
  FP8_ASSERT_OK(fp8_optimizer_create(&o, r.model.get(), FP8_OPTIMIZER_ADAM));
  r.opt.reset(o);
  if (env->rank == 1) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(ready) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::printf("rank 1: fp8_model_set_comm and fp8_optimizer_create done; exiting at once (std::_Exit(0))\n");
    std::fflush(stdout);
    std::_Exit(0);
  }
  FP8_ASSERT_OK(fp8_comm_set_timeout(comm, 5.0));
  double timeout = 0.0;
  EXPECT_OK(fp8_comm_get_timeout(comm, &timeout));
  EXPECT_EQ(timeout, 5.0);
  Tensor x = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kIn});
  Tensor y = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
  Tensor dy = make_tensor(r.ctx.get(), FP8_DTYPE_F32, {kRows, kOut});
  const std::vector<float> hx = batch_x(0, 0), hdy = batch_dy(0, 0);
  // A watchdog: a call that never returns is reported, not waited for until the parent kills us.
  std::mutex mutex;
  std::condition_variable changed;
  bool finished = false;
  std::atomic<const char*> current{"(no call yet)"};
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(mutex);
    if (!changed.wait_for(lock, std::chrono::seconds(60), [&] { return finished; })) {
      std::printf("rank 0: %s still waits 60 s after rank 1 exited: it hangs\n", current.load());
      std::fflush(stdout);
      const std::string text = "result=hang\n";
      write_bytes(env->out, text.data(), text.size());
      std::_Exit(3);
    }
  });
  write_bytes(ready, "1", 1);
  const std::pair<const char*, std::function<fp8_status_t()>> calls[] = {
      {"fp8_tensor_copy_from_host (x)",
       [&] { return fp8_tensor_copy_from_host(x.get(), hx.data(), hx.size() * sizeof(float)); }},
      {"fp8_tensor_copy_from_host (dy)",
       [&] { return fp8_tensor_copy_from_host(dy.get(), hdy.data(), hdy.size() * sizeof(float)); }},
      {"fp8_model_forward", [&] { return fp8_model_forward(r.model.get(), x.get(), y.get()); }},
      {"fp8_model_backward", [&] { return fp8_model_backward(r.model.get(), dy.get(), nullptr); }},
      {"fp8_optimizer_step", [&] { return fp8_optimizer_step(r.opt.get()); }},
      {"fp8_optimizer_zero_grad", [&] { return fp8_optimizer_zero_grad(r.opt.get()); }},
      {"fp8_context_synchronize", [&] { return fp8_context_synchronize(r.ctx.get()); }},
  };
  const auto start = std::chrono::steady_clock::now();
  fp8_status_t status = FP8_OK;
  std::string failed = "(none)", message;
  for (const auto& call : calls) {
    current = call.first;
    std::printf("rank 0: %.1f s: %s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                call.first);
    std::fflush(stdout);
    status = call.second();
    if (status != FP8_OK) {
      failed = call.first;
      message = fp8_last_error_message();
      break;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  {
    std::lock_guard<std::mutex> lock(mutex);
    finished = true;
  }
  changed.notify_all();
  watchdog.join();
  std::ostringstream report;
  report << "result=" << fp8_status_string(status) << "\ncall=" << failed << "\nseconds=" << seconds
         << "\nmessage=" << message << "\n";
  write_bytes(env->out, report.str().data(), report.str().size());
  std::printf("rank 0: %s returned %s after %.1f s: %s\n", failed.c_str(), fp8_status_string(status), seconds,
              message.c_str());
  EXPECT_EQ(status, FP8_ERR_NCCL) << failed << ": " << message;
  EXPECT_LT(seconds, 60.0);
}

TEST(GpuDataParallelProcesses, ARankThatExitsEarlyEndsTheOthersWaitInAnNcclError) {
  const int n = fp8_gpus();
  if (n < 2) GTEST_SKIP() << kNeedsTwoGpus << n;
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string ids = dir.file("ids");
  write_ids(ids, 1);
  const std::vector<std::string> outs = {dir.file("rank0.result"), dir.file("rank1.result")};
  const std::vector<ChildResult> children =
      run_children("GpuDataParallelChild.RankOneExitsEarlyAndRankZerosWaitEndsInAnNcclError", 2, ids, outs, dir);
  EXPECT_TRUE(succeeded(children[1])) << "the child of rank 1 (exits early): " << describe(children[1]);
  EXPECT_TRUE(succeeded(children[0])) << "the child of rank 0: " << describe(children[0]);
  const std::string report = read_text(outs[0]);
  EXPECT_NE(report.find("result=FP8_ERR_NCCL\n"), std::string::npos) << "rank 0 reported:\n"
                                                                     << report << "its output:\n"
                                                                     << children[0].log;
  std::string line;
  std::istringstream lines(report);
  std::string call, seconds, message;
  while (std::getline(lines, line)) {
    if (line.rfind("call=", 0) == 0) call = line.substr(5);
    if (line.rfind("seconds=", 0) == 0) seconds = line.substr(8);
    if (line.rfind("message=", 0) == 0) message = line.substr(8);
  }
  if (!call.empty()) {
    std::printf(
        "[ early exit ] 2 processes, rank 1 exited after fp8_optimizer_create: rank 0's %s failed after %s s "
        "(timeout 5 s): %s\n",
        call.c_str(), seconds.c_str(), message.c_str());
  }
}

}  // namespace
