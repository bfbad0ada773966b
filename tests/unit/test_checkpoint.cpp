// Checkpoints and safetensors (include/fp8.h, "Checkpoints and safetensors"; src/io/checkpoint.cpp) on
// the CPU reference backend:
//  1. exact resume at every optimizer level (te, O1, O2, O3) and kind: train N, save, load into a fresh
//     context + model + optimizer, train M: every stored byte, scaling state and optimizer statistic is
//     that of N + M uninterrupted steps, and a save at N + M is byte-identical;
//  2. FP8_CHECKPOINT_GRADIENTS (mid-accumulation) and the zeroed gradients without it;
//  3. loads that fail (truncated, bit-flipped, foreign, newer, missing, mismatched) leave the model and
//     the optimizer exactly as they were;
//  4. the atomic write;
//  5. loading across levels (te <-> O2, O3 -> te);
//  6. safetensors export / import (the header parsed here, BF16 written here, the refusals);
//  7. fp8_checkpoint_read_recipe;
//  8. argument checks.
// Expected values come from core/format.hpp's conversions (the numerics contract) and from runs of the
// library that were never interrupted, never from the checkpoint code itself.
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/format.hpp"  // float_to_f16, f16_to_float, bf16 and FP8 decoding
#include "fp8_test_util.hpp"
#include "io/container.hpp"  // forging a section (compiled into this test)

using namespace fp8test;

namespace {

using Bytes = std::vector<uint8_t>;

// ---- files -----------------------------------------------------------------------------------------

// A fresh directory under ::testing::TempDir(), removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    std::string base = ::testing::TempDir();
    if (base.empty() || base.back() != '/') base += '/';
    std::string tmpl = base + "fp8_ckpt_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    const char* made = ::mkdtemp(buf.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << tmpl;
    dir_ = made ? made : tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  const std::string& dir() const { return dir_; }
  // Names of the entries in the directory (not . and ..).
  std::vector<std::string> entries() const { return list(dir_); }
  static std::vector<std::string> list(const std::string& d) {
    std::vector<std::string> out;
    if (DIR* dp = ::opendir(d.c_str())) {
      while (const dirent* e = ::readdir(dp))
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.push_back(e->d_name);
      ::closedir(dp);
    }
    return out;
  }

 private:
  std::string dir_;
};

Bytes read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot read " << path;
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}
bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}
bool has_tmp_file(const std::vector<std::string>& names) {
  for (const std::string& n : names)
    if (n.find(".tmp.") != std::string::npos) return true;
  return false;
}

// CRC-32 of zlib / gzip / PNG (reflected 0xEDB88320), written here so the test needs no zlib.
uint32_t crc32_ref(const uint8_t* p, size_t n) {
  static uint32_t table[256];
  static bool ready = false;
  if (!ready) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    ready = true;
  }
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}
void put_u32le(Bytes& b, size_t at, uint32_t v) {
  for (int k = 0; k < 4; ++k) b[at + static_cast<size_t>(k)] = static_cast<uint8_t>(v >> (8 * k));
}

// ---- the model ----------------------------------------------------------------------------------------
//
// fc1 (64 -> 64, bias) -> ln (LayerNorm 64) -> act (GELU) -> fc2 (64 -> 32, bias): every parameter random
// and non-zero, converted with small_layer_fallback=0 (the GEMMs run in FP8), a 16-slot amax history with
// algo max (the whole history matters), autowrap on (the scaling states move at every call).

constexpr int64_t kBatch = 32, kIn = 64, kHidden = 64, kOut = 32;

enum class Variant { Standard, NoNorm, Renamed, SmallerFc2, Unconverted, ShortHistory, OtherMargin, CurrentScaling };

std::string recipe_text(int level, Variant v = Variant::Standard) {
  const char* base = level == 0   ? "backend=te"
                     : level == 1 ? "backend=msamp, opt_level=O1"
                     : level == 2 ? "backend=msamp, opt_level=O2"
                                  : "backend=msamp, opt_level=O3";
  return std::string(base) + ", small_layer_fallback=0, amax_compute_algo=max, amax_history_len=" +
         (v == Variant::ShortHistory ? "8" : "16") + (v == Variant::OtherMargin ? ", margin=2" : "") +
         (v == Variant::CurrentScaling ? ", scaling=current" : "");
}
const char* kind_name(fp8_optimizer_kind_t k) {
  return k == FP8_OPTIMIZER_SGD ? "SGD" : k == FP8_OPTIMIZER_ADAM ? "Adam" : "AdamW";
}

// The values a tensor stands for: F32 as is, F16 widened, FP8 codes times scale_inv.
std::vector<float> decoded(const fp8_tensor_t* t) {
  const fp8_dtype_t dt = dtype_of(t);
  const Bytes b = tensor_bytes(t);
  std::vector<float> out;
  if (dt == FP8_DTYPE_F32) {
    out.resize(b.size() / 4);
    std::memcpy(out.data(), b.data(), b.size());
  } else if (dt == FP8_DTYPE_F16) {
    for (size_t k = 0; k < b.size(); k += 2)
      out.push_back(fp8::f16_to_float(static_cast<uint16_t>(b[k] | (b[k + 1] << 8))));
  } else {
    float si = 0.0f;
    EXPECT_OK(fp8_tensor_get_scale_inv(t, &si));
    for (uint8_t c : b) out.push_back(fp8::dequantize_fp8(c, dt == FP8_DTYPE_E5M2, si));
  }
  return out;
}

std::string recipe_string(const fp8_recipe_t* r) {
  size_t needed = 0;
  EXPECT_EQ(fp8_recipe_to_string(r, nullptr, 0, &needed), FP8_ERR_BUFFER_TOO_SMALL);
  std::string s(needed, '\0');
  EXPECT_OK(fp8_recipe_to_string(r, s.data(), s.size(), nullptr));
  s.resize(needed ? needed - 1 : 0);
  return s;
}

struct Net {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  Optimizer opt;
  int level;
  Variant variant;

  // `seed` picks the initial weights; kind < 0: no optimizer.
  Net(int level_, int kind, uint32_t seed = 1, Variant v = Variant::Standard) : level(level_), variant(v) {
    fp8_model_t* m = model.get();
    const char* first = v == Variant::Renamed ? "inp" : "fc1";
    const int64_t out = v == Variant::SmallerFc2 ? 16 : kOut;
    EXPECT_OK(fp8_model_add_linear(m, first, kIn, kHidden, 1, nullptr));
    if (v != Variant::NoNorm) EXPECT_OK(fp8_model_add_layernorm(m, "ln", kHidden, 1e-5f, nullptr));
    EXPECT_OK(fp8_model_add_activation(m, "act", FP8_ACTIVATION_GELU, nullptr));
    EXPECT_OK(fp8_model_add_linear(m, "fc2", kHidden, out, 1, nullptr));
    int32_t count = 0;
    EXPECT_OK(fp8_model_parameter_count(m, &count));
    for (int32_t i = 0; i < count; ++i) {
      const char* name = nullptr;
      fp8_tensor_t* t = nullptr;
      EXPECT_OK(fp8_model_parameter_at(m, i, &name, &t, nullptr));
      int64_t n = 0;
      EXPECT_OK(fp8_tensor_numel(t, &n));
      const std::string nm = name;
      const uint32_t s = seed * 100 + static_cast<uint32_t>(i);
      if (nm == "ln.weight")
        upload(t, randn(static_cast<size_t>(n), s, 0.1f, 1.0f));  // (a norm's gain)
      else if (nm.find("weight") != std::string::npos)
        upload(t, randn(static_cast<size_t>(n), s, 1.0f / 8.0f));
      else
        upload(t, randn(static_cast<size_t>(n), s, 0.05f));
    }
    if (v != Variant::Unconverted) {
      Recipe r = make_recipe(recipe_text(level, v).c_str());
      EXPECT_OK(fp8_convert_model(m, r.get(), nullptr));
    }
    EXPECT_OK(fp8_model_set_autowrap(m, 1));
    if (kind >= 0) {
      opt = make_optimizer(m, kind);
      if (kind == FP8_OPTIMIZER_SGD) {
        EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_LR, 0.05));
        EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_MOMENTUM, 0.9));
      } else {
        EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_LR, 1e-2));
      }
      EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_WEIGHT_DECAY, 0.01));
      EXPECT_OK(fp8_optimizer_set_float(opt.get(), FP8_OPTIM_MAX_GRAD_NORM, 5.0));
    }
  }
  fp8_model_t* m() { return model.get(); }
  fp8_optimizer_t* o() { return opt.get(); }
  int64_t out_features() const { return variant == Variant::SmallerFc2 ? 16 : kOut; }

  // Forward + host loss gradient (0.5 squared error, mean over rows) + backward on batch `k` (the same
  // k gives the same batch); the loss.
  double accumulate(int k) {
    Tensor x = make_tensor(ctx.get(), FP8_DTYPE_F32, {kBatch, kIn});
    Tensor y = make_tensor(ctx.get(), FP8_DTYPE_F32, {kBatch, out_features()});
    Tensor dy = make_tensor(ctx.get(), FP8_DTYPE_F32, {kBatch, out_features()});
    upload(x.get(), randn(static_cast<size_t>(kBatch * kIn), 5000 + static_cast<uint32_t>(k), 1.0f));
    const std::vector<float> target =
        randn(static_cast<size_t>(kBatch * out_features()), 7000 + static_cast<uint32_t>(k), 0.5f);
    EXPECT_OK(fp8_model_forward(m(), x.get(), y.get()));
    const std::vector<float> yh = download<float>(y.get());
    std::vector<float> g(yh.size());
    double loss = 0.0;
    for (size_t i = 0; i < yh.size(); ++i) {
      const float d = yh[i] - target[i];
      loss += 0.5 * static_cast<double>(d) * d / kBatch;
      g[i] = d / static_cast<float>(kBatch);
    }
    upload(dy.get(), g);
    EXPECT_OK(fp8_model_backward(m(), dy.get(), nullptr));
    return loss;
  }
  double train_step(int k) {
    const double loss = accumulate(k);
    EXPECT_OK(fp8_optimizer_step(o()));
    EXPECT_OK(fp8_optimizer_zero_grad(o()));
    return loss;
  }
  fp8_status_t save(const std::string& path, uint32_t flags = 0, bool with_opt = true) {
    return fp8_checkpoint_save(m(), with_opt ? o() : nullptr, path.c_str(), flags);
  }
  fp8_status_t load(const std::string& path, bool with_opt = true) {
    return fp8_checkpoint_load(m(), with_opt ? o() : nullptr, path.c_str());
  }
};

// ---- a snapshot of everything the API shows --------------------------------------------------------

using Snapshot = std::vector<std::pair<std::string, Bytes>>;

template <class T>
Bytes bytes_of(const T& v) {
  Bytes b(sizeof v);
  std::memcpy(b.data(), &v, sizeof v);
  return b;
}

// Every parameter's value and gradient bytes (and scale_inv of FP8 ones), every scaling state's info and
// history, and the optimizer's statistics.
Snapshot snapshot(fp8_model_t* m, const fp8_optimizer_t* o) {
  Snapshot s;
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t i = 0; i < count; ++i) {
    const char* name = nullptr;
    fp8_tensor_t *v = nullptr, *g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, &name, &v, &g));
    for (auto [what, t] : {std::pair<const char*, fp8_tensor_t*>{"value", v}, {"grad", g}}) {
      const std::string label = std::string(name) + " " + what;
      s.emplace_back(label + " dtype", bytes_of(dtype_of(t)));
      s.emplace_back(label, tensor_bytes(t));
      const fp8_dtype_t dt = dtype_of(t);
      if (dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2) {
        float si = 0.0f;
        EXPECT_OK(fp8_tensor_get_scale_inv(t, &si));
        s.emplace_back(label + " scale_inv", bytes_of(si));
      }
    }
  }
  int32_t layers = 0;
  EXPECT_OK(fp8_model_layer_count(m, &layers));
  for (int32_t id = 0; id < layers; ++id)
    for (int32_t slot = 0; slot < 4; ++slot) {
      fp8_scaling_t* sc = nullptr;
      EXPECT_OK(fp8_layer_get_scaling(m, id, slot, &sc));
      if (!sc) continue;
      const std::string label = "layer " + std::to_string(id) + " slot " + std::to_string(slot);
      const fp8_scaling_info_t info = info_of(sc);
      s.emplace_back(label + " scale", bytes_of(info.scale));
      s.emplace_back(label + " scale_inv", bytes_of(info.scale_inv));
      s.emplace_back(label + " amax", bytes_of(info.amax));
      s.emplace_back(label + " history length", bytes_of(info.amax_history_len));
      s.emplace_back(label + " update_count", bytes_of(info.update_count));
      s.emplace_back(label + " nonfinite_count", bytes_of(info.nonfinite_count));
      std::vector<float> h(static_cast<size_t>(info.amax_history_len));
      EXPECT_OK(fp8_scaling_get_history(sc, h.data(), info.amax_history_len));
      Bytes hb(h.size() * 4);
      std::memcpy(hb.data(), h.data(), hb.size());
      s.emplace_back(label + " history", hb);
    }
  if (o) {
    const fp8_optimizer_stats_t st = stats_of(o);
    s.emplace_back("optimizer steps", bytes_of(st.steps));
    s.emplace_back("optimizer skipped_steps", bytes_of(st.skipped_steps));
    s.emplace_back("optimizer last_skipped", bytes_of(st.last_skipped));
    s.emplace_back("optimizer last_grad_norm", bytes_of(bits_of(st.last_grad_norm)));
    s.emplace_back("optimizer parameters", bytes_of(st.parameters));
    s.emplace_back("optimizer state_bytes", bytes_of(st.state_bytes));
    s.emplace_back("optimizer opt_level", bytes_of(st.opt_level));
    s.emplace_back("optimizer training_bytes", bytes_of(st.training_bytes));
    for (int a = 0; a < FP8_OPTIM_ATTR_COUNT; ++a) {
      double v = 0.0;
      if (fp8_optimizer_get_float(o, a, &v) == FP8_OK)
        s.emplace_back("optimizer attr " + std::to_string(a), bytes_of(v));
    }
  }
  return s;
}
Snapshot snapshot(Net& n) {
  return snapshot(n.m(), n.o());
}

// "" when equal, else the first entry that differs.
std::string first_difference(const Snapshot& got, const Snapshot& want) {
  if (got.size() != want.size())
    return "different entry counts: " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].first != want[i].first)
      return "entry " + std::to_string(i) + ": " + got[i].first + " vs " + want[i].first;
    if (got[i].second != want[i].second) {
      const Bytes &a = got[i].second, &b = want[i].second;
      size_t k = 0;
      while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
      return got[i].first + " differs at byte " + std::to_string(k) + " of " + std::to_string(a.size());
    }
  }
  return "";
}

// The first differing byte of two files' contents, or "".
std::string file_difference(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (size_t k = 0; k < a.size(); ++k)
    if (a[k] != b[k]) return "byte " + std::to_string(k) + " of " + std::to_string(a.size());
  return "";
}

// =================================================================================================
// 1. Exact resume
// =================================================================================================

struct ResumeCase {
  int level;
  fp8_optimizer_kind_t kind;
};
class CheckpointResume : public ::testing::TestWithParam<ResumeCase> {};

constexpr int kN = 3, kM = 3;

TEST_P(CheckpointResume, TrainSaveLoadTrainIsBitIdenticalToUninterruptedTraining) {
  const ResumeCase c = GetParam();
  TempDir dir;
  const std::string at_n = dir.path("at_n.ckpt");

  // (a) N steps, save, M more.
  Net a(c.level, c.kind);
  for (int k = 0; k < kN; ++k) a.train_step(k);
  FP8_ASSERT_OK(a.save(at_n));
  const Snapshot snap_n = snapshot(a);
  std::vector<double> losses_a;
  for (int k = kN; k < kN + kM; ++k) losses_a.push_back(a.train_step(k));
  const Snapshot snap_a = snapshot(a);
  FP8_ASSERT_OK(a.save(dir.path("a_end.ckpt")));

  // The run really used FP8 and moved its scaling states; the level is the one asked for.
  EXPECT_EQ(stats_of(a.o()).opt_level, c.level);
  EXPECT_EQ(stats_of(a.o()).steps, kN + kM);
  for (int32_t id : {0, 3}) {
    fp8_layer_report_t rep;
    fp8_layer_report_init(&rep);
    EXPECT_OK(fp8_layer_get_report(a.m(), id, &rep));
    EXPECT_EQ(rep.fprop, 1) << "layer " << id << ": " << rep.reason;
    EXPECT_EQ(rep.wgrad, 1) << "layer " << id << ": " << rep.reason;
  }
  fp8_scaling_t* input_state = nullptr;
  EXPECT_OK(fp8_layer_get_scaling(a.m(), 0, FP8_SCALING_INPUT, &input_state));
  ASSERT_NE(input_state, nullptr);
  EXPECT_EQ(info_of(input_state).update_count, kN + kM);
  EXPECT_NE(info_of(input_state).scale, 1.0f);
  EXPECT_NE(first_difference(snap_n, snap_a), "") << "training changed nothing";

  // (b) a fresh context, model and optimizer built the same way, loaded, M steps.
  Net b(c.level, c.kind);
  EXPECT_NE(first_difference(snapshot(b), snap_n), "");
  FP8_ASSERT_OK(b.load(at_n));
  EXPECT_EQ(first_difference(snapshot(b), snap_n), "") << "right after the load";
  std::vector<double> losses_b;
  for (int k = kN; k < kN + kM; ++k) losses_b.push_back(b.train_step(k));
  EXPECT_EQ(first_difference(snapshot(b), snap_a), "") << "after " << kM << " more steps";
  for (int k = 0; k < kM; ++k)
    EXPECT_EQ(bits_of(static_cast<float>(losses_b[k])), bits_of(static_cast<float>(losses_a[k])));
  EXPECT_EQ(stats_of(b.o()).steps, kN + kM);

  // The format stores nothing that depends on time or the process: the two saves at N + M agree byte
  // for byte.
  FP8_ASSERT_OK(b.save(dir.path("b_end.ckpt")));
  EXPECT_EQ(file_difference(read_bytes(dir.path("b_end.ckpt")), read_bytes(dir.path("a_end.ckpt"))), "");
}

INSTANTIATE_TEST_SUITE_P(LevelsAndKinds, CheckpointResume,
                         ::testing::Values(ResumeCase{0, FP8_OPTIMIZER_ADAM}, ResumeCase{0, FP8_OPTIMIZER_ADAMW},
                                           ResumeCase{0, FP8_OPTIMIZER_SGD}, ResumeCase{1, FP8_OPTIMIZER_ADAM},
                                           ResumeCase{1, FP8_OPTIMIZER_ADAMW}, ResumeCase{1, FP8_OPTIMIZER_SGD},
                                           ResumeCase{2, FP8_OPTIMIZER_ADAM}, ResumeCase{2, FP8_OPTIMIZER_ADAMW},
                                           ResumeCase{3, FP8_OPTIMIZER_ADAM}, ResumeCase{3, FP8_OPTIMIZER_ADAMW}),
                         [](const ::testing::TestParamInfo<ResumeCase>& info) {
                           return std::string(level_name(info.param.level)) + "_" + kind_name(info.param.kind);
                         });

// =================================================================================================
// 2. Gradients
// =================================================================================================

TEST(CheckpointGradients, SavedMidAccumulationTheStepAfterLoadingIsTheOriginalsStep) {
  for (int level : {0, 1, 2, 3}) {
    SCOPED_TRACE(level_name(level));
    TempDir dir;
    Net a(level, FP8_OPTIMIZER_ADAM);
    for (int k = 0; k < 2; ++k) a.train_step(k);
    a.accumulate(10);  // a backward, no step yet
    FP8_ASSERT_OK(a.save(dir.path("grads.ckpt"), FP8_CHECKPOINT_GRADIENTS));
    const Snapshot mid = snapshot(a);
    EXPECT_OK(fp8_optimizer_step(a.o()));
    const Snapshot want = snapshot(a);
    EXPECT_NE(first_difference(want, mid), "");

    Net b(level, FP8_OPTIMIZER_ADAM, 2);
    FP8_ASSERT_OK(b.load(dir.path("grads.ckpt")));
    EXPECT_EQ(first_difference(snapshot(b), mid), "") << "the gradients (and all else) as saved";
    EXPECT_OK(fp8_optimizer_step(b.o()));
    EXPECT_EQ(first_difference(snapshot(b), want), "");
  }
}

// Saved after the first micro-batch of a step, loaded, then the second micro-batch and the step: the
// bits of the uninterrupted run (fp8.h: "train M more: the bits are those of N + M steps"; the flag is
// for "e.g. mid-accumulation").
TEST(CheckpointGradients, ASecondMicroBatchAfterLoadingMatchesTheUninterruptedAccumulation) {
  for (int level : {0, 1, 2, 3}) {
    SCOPED_TRACE(level_name(level));
    TempDir dir;
    Net a(level, FP8_OPTIMIZER_ADAM);
    for (int k = 0; k < 2; ++k) a.train_step(k);
    a.accumulate(10);  // first micro-batch of step 3
    FP8_ASSERT_OK(a.save(dir.path("grads.ckpt"), FP8_CHECKPOINT_GRADIENTS));
    a.accumulate(11);  // second micro-batch: added to the saved gradient
    const Snapshot want_grads = snapshot(a);
    EXPECT_OK(fp8_optimizer_step(a.o()));
    const Snapshot want = snapshot(a);

    Net b(level, FP8_OPTIMIZER_ADAM, 2);
    FP8_ASSERT_OK(b.load(dir.path("grads.ckpt")));
    b.accumulate(11);
    // A Linear quantises its weight once per weights version with the scale of that moment and
    // reuses the copy for every micro-batch, while the first micro-batch's forward already moved the
    // weight state: the checkpoint keeps the copy's scale ("weight_copies") and the load remakes the
    // copy with it, so the second micro-batch is the uninterrupted one's.
    EXPECT_EQ(first_difference(snapshot(b), want_grads), "") << "after the second micro-batch";
    EXPECT_OK(fp8_optimizer_step(b.o()));
    EXPECT_EQ(first_difference(snapshot(b), want), "") << "after the step";
  }
}

TEST(CheckpointGradients, WithoutTheFlagLoadingZeroesTheGradients) {
  for (int level : {0, 2, 3}) {
    SCOPED_TRACE(level_name(level));
    TempDir dir;
    Net a(level, FP8_OPTIMIZER_ADAMW);
    a.train_step(0);
    a.accumulate(1);  // non-zero gradients, not saved
    FP8_ASSERT_OK(a.save(dir.path("nograds.ckpt")));

    Net b(level, FP8_OPTIMIZER_ADAMW, 2);
    b.accumulate(5);
    int32_t count = 0;
    EXPECT_OK(fp8_model_parameter_count(b.m(), &count));
    auto all_zero = [&](Net& n) {
      bool zero = true;
      for (int32_t i = 0; i < count; ++i) {
        fp8_tensor_t* g = nullptr;
        EXPECT_OK(fp8_model_parameter_at(n.m(), i, nullptr, nullptr, &g));
        for (uint8_t byte : tensor_bytes(g)) zero = zero && byte == 0;
      }
      return zero;
    };
    EXPECT_FALSE(all_zero(b)) << "the backward made no gradient";
    FP8_ASSERT_OK(b.load(dir.path("nograds.ckpt")));
    EXPECT_TRUE(all_zero(b));
    // A step on a zero gradient after the load is the original's step on a zero gradient.
    EXPECT_OK(fp8_optimizer_zero_grad(a.o()));
    EXPECT_OK(fp8_optimizer_step(a.o()));
    EXPECT_OK(fp8_optimizer_step(b.o()));
    EXPECT_EQ(first_difference(snapshot(b), snapshot(a)), "");
  }
}

// =================================================================================================
// 3. A failed load changes nothing
// =================================================================================================

// The target of the failed loads: an O3 Adam run in another state than the valid file's (other data,
// more steps, a pending gradient), and its state saved before any load.
struct FailureFixture {
  TempDir dir;
  std::string valid = dir.path("valid.ckpt");
  Net target{3, FP8_OPTIMIZER_ADAM, 2};
  Bytes before_file;
  Snapshot before;

  FailureFixture() {
    Net src(3, FP8_OPTIMIZER_ADAM);
    for (int k = 0; k < 2; ++k) src.train_step(k);
    src.accumulate(2);
    EXPECT_OK(src.save(valid, FP8_CHECKPOINT_GRADIENTS));
    for (int k = 20; k < 23; ++k) target.train_step(k);
    target.accumulate(23);
    EXPECT_OK(target.save(dir.path("A.ckpt"), FP8_CHECKPOINT_GRADIENTS));
    before_file = read_bytes(dir.path("A.ckpt"));
    before = snapshot(target);
  }
  // The target's state is still `before`: its save is byte-identical, its parameters and scales too.
  std::string unchanged(Net& n) {
    if (n.save(dir.path("B.ckpt"), FP8_CHECKPOINT_GRADIENTS) != FP8_OK) return fp8_last_error_message();
    const std::string f = file_difference(read_bytes(dir.path("B.ckpt")), before_file);
    if (!f.empty()) return "saved file differs: " + f;
    return first_difference(snapshot(n), before);
  }
};

TEST(CheckpointLoadFailure, TruncatedFilesAreCorruptAndChangeNothing) {
  FailureFixture fx;
  const Bytes good = read_bytes(fx.valid);
  ASSERT_GT(good.size(), 100u);
  const size_t n = good.size();
  for (size_t len : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{11}, size_t{12}, size_t{16}, size_t{20}, n / 4,
                     n / 2, 3 * n / 4, n - 5, n - 4, n - 1}) {
    SCOPED_TRACE("length " + std::to_string(len) + " of " + std::to_string(n));
    const std::string p = fx.dir.path("truncated.ckpt");
    write_bytes(p, Bytes(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len)));
    EXPECT_REFUSED(fx.target.load(p), FP8_ERR_CORRUPT, "fp8_checkpoint_load", "");
    EXPECT_EQ(fx.unchanged(fx.target), "");
  }
  // One byte too many is refused too.
  Bytes longer = good;
  longer.push_back(0);
  write_bytes(fx.dir.path("longer.ckpt"), longer);
  EXPECT_REFUSED(fx.target.load(fx.dir.path("longer.ckpt")), FP8_ERR_CORRUPT, "fp8_checkpoint_load", "");
  EXPECT_EQ(fx.unchanged(fx.target), "");
  // The checks could fail: the intact file loads and changes the target.
  FP8_ASSERT_OK(fx.target.load(fx.valid));
  EXPECT_NE(fx.unchanged(fx.target), "");
}

TEST(CheckpointLoadFailure, SingleBitFlipsAnywhereAreRefusedAndChangeNothing) {
  FailureFixture fx;
  const Bytes good = read_bytes(fx.valid);
  const size_t n = good.size();
  constexpr int kFlips = 50;
  for (int i = 0; i < kFlips; ++i) {
    const size_t pos = static_cast<size_t>(i) * (n - 1) / (kFlips - 1);
    const int bit = (i * 3) % 8;
    SCOPED_TRACE("byte " + std::to_string(pos) + " bit " + std::to_string(bit) + " of " + std::to_string(n));
    Bytes bad = good;
    bad[pos] ^= static_cast<uint8_t>(1u << bit);
    const std::string p = fx.dir.path("flipped.ckpt");
    write_bytes(p, bad);
    const fp8_status_t st = fx.target.load(p);
    if (pos >= 8 && pos < 12 && !(pos == 8 && bit == 0))  // the format version went up
      EXPECT_EQ(st, FP8_ERR_VERSION) << fp8_last_error_message();
    else
      EXPECT_EQ(st, FP8_ERR_CORRUPT) << fp8_status_string(st) << ": " << fp8_last_error_message();
    EXPECT_EQ(std::string(fp8_last_error_message()).rfind("fp8_checkpoint_load:", 0), 0u) << fp8_last_error_message();
    EXPECT_EQ(fx.unchanged(fx.target), "");
  }
}

TEST(CheckpointLoadFailure, ForeignFilesAreCorruptAndChangeNothing) {
  FailureFixture fx;
  const std::string text = fx.dir.path("notes.txt");
  const std::string s = "this is not a checkpoint, just some text that is long enough to read a header from\n";
  write_bytes(text, Bytes(s.begin(), s.end()));
  EXPECT_REFUSED(fx.target.load(text), FP8_ERR_CORRUPT, "fp8_checkpoint_load", "not a libfp8 checkpoint");
  EXPECT_EQ(fx.unchanged(fx.target), "");
  const std::string st = fx.dir.path("model.safetensors");
  FP8_ASSERT_OK(fp8_model_export_safetensors(fx.target.m(), st.c_str()));
  EXPECT_REFUSED(fx.target.load(st), FP8_ERR_CORRUPT, "fp8_checkpoint_load", "not a libfp8 checkpoint");
  EXPECT_EQ(fx.unchanged(fx.target), "");
  const std::string empty = fx.dir.path("empty.ckpt");
  write_bytes(empty, {});
  EXPECT_REFUSED(fx.target.load(empty), FP8_ERR_CORRUPT, "fp8_checkpoint_load", "empty");
  EXPECT_EQ(fx.unchanged(fx.target), "");
}

TEST(CheckpointLoadFailure, ANewerFormatVersionIsRefusedWithErrVersion) {
  FailureFixture fx;
  Bytes b = read_bytes(fx.valid);
  ASSERT_EQ(b[8] | (b[9] << 8) | (b[10] << 16) | (b[11] << 24), 1);
  // The file's own CRC-32 must match the whole file before its last 4 bytes (the reference CRC agrees).
  uint32_t stored = 0;
  for (int k = 0; k < 4; ++k) stored |= static_cast<uint32_t>(b[b.size() - 4 + static_cast<size_t>(k)]) << (8 * k);
  ASSERT_EQ(crc32_ref(reinterpret_cast<const uint8_t*>("123456789"), 9), 0xCBF43926u);
  ASSERT_EQ(crc32_ref(b.data(), b.size() - 4), stored);
  put_u32le(b, 8, 2);
  put_u32le(b, b.size() - 4, crc32_ref(b.data(), b.size() - 4));  // only the version is wrong
  const std::string p = fx.dir.path("v2.ckpt");
  write_bytes(p, b);
  EXPECT_REFUSED(fx.target.load(p), FP8_ERR_VERSION, "fp8_checkpoint_load", "version 2");
  EXPECT_EQ(fx.unchanged(fx.target), "");
  fp8_recipe_t* r = nullptr;
  ASSERT_EQ(fp8_recipe_create(&r), FP8_OK);
  Recipe recipe(r);
  EXPECT_REFUSED(fp8_checkpoint_read_recipe(p.c_str(), r), FP8_ERR_VERSION, "fp8_checkpoint_read_recipe", "version 2");
}

// A recipe section whose text does not parse (a foreign writer's value, an unknown key): the file
// is corrupt for both readers, and neither changes the model or the caller's recipe.
TEST(CheckpointLoadFailure, ARecipeThatDoesNotParseIsCorrupt) {
  FailureFixture fx;
  const Bytes valid = read_bytes(fx.valid);
  std::vector<fp8::io::Section> sections = fp8::io::decode_container(valid.data(), valid.size());
  fp8::io::Section* recipe = nullptr;
  for (auto& s : sections)
    if (s.name == "recipe") recipe = &s;
  ASSERT_NE(recipe, nullptr);
  const std::string text(recipe->data.begin(), recipe->data.end());
  for (const std::string& forged : {std::string("scaling=blockwise"), text + ",block_size=64"}) {
    SCOPED_TRACE(forged);
    recipe->data.assign(forged.begin(), forged.end());
    const std::string p = fx.dir.path("forged.ckpt");
    write_bytes(p, fp8::io::encode_container(sections));
    EXPECT_REFUSED(fx.target.load(p), FP8_ERR_CORRUPT, "fp8_checkpoint_load", "recipe does not parse");
    EXPECT_EQ(fx.unchanged(fx.target), "");
    fp8_recipe_t* r = nullptr;
    ASSERT_EQ(fp8_recipe_create(&r), FP8_OK);
    Recipe mine(r);
    const std::string before = recipe_string(r);
    EXPECT_REFUSED(fp8_checkpoint_read_recipe(p.c_str(), r), FP8_ERR_CORRUPT, "fp8_checkpoint_read_recipe",
                   "recipe does not parse");
    EXPECT_EQ(recipe_string(r), before);
  }
}

TEST(CheckpointLoadFailure, AMissingFileIsAnIoErrorNamingThePath) {
  FailureFixture fx;
  const std::string p = fx.dir.path("does_not_exist.ckpt");
  EXPECT_REFUSED(fx.target.load(p), FP8_ERR_IO, "fp8_checkpoint_load", p);
  EXPECT_EQ(fx.unchanged(fx.target), "");
  EXPECT_REFUSED(fx.target.load(fx.dir.dir()), FP8_ERR_IO, "fp8_checkpoint_load", fx.dir.dir());  // a directory
  EXPECT_EQ(fx.unchanged(fx.target), "");
}

// Models and optimizers that do not match the file: FP8_ERR_INVALID_STATE naming the difference, and
// nothing changed (each target trained a step and holds a gradient, so a partial load would show).
TEST(CheckpointLoadFailure, MismatchedModelsAndOptimizersAreRefusedAndChangeNothing) {
  TempDir dir;
  const std::string with_opt = dir.path("with_opt.ckpt"), model_only = dir.path("model_only.ckpt");
  {
    Net src(3, FP8_OPTIMIZER_ADAM);
    for (int k = 0; k < 2; ++k) src.train_step(k);
    FP8_ASSERT_OK(src.save(with_opt));
    FP8_ASSERT_OK(src.save(model_only, 0, false));
  }
  struct Case {
    const char* what;
    int level;
    int kind;
    Variant variant;
    const char* file;
    bool pass_optimizer;
    const char* word;
  };
  const Case cases[] = {
      {"other layers (no LayerNorm)", 3, FP8_OPTIMIZER_ADAM, Variant::NoNorm, "with_opt", true, "scaling state"},
      {"other names (fc1 is inp)", 3, FP8_OPTIMIZER_ADAM, Variant::Renamed, "with_opt", true, "inp"},
      {"other sizes (fc2 64 -> 16)", 3, FP8_OPTIMIZER_ADAM, Variant::SmallerFc2, "with_opt", true, "fc2.weight"},
      {"other amax history length", 3, FP8_OPTIMIZER_ADAM, Variant::ShortHistory, "with_opt", true, "history"},
      {"other margin (same states, another rule)", 3, FP8_OPTIMIZER_ADAM, Variant::OtherMargin, "with_opt", true,
       "margin: 0 in the file, 2 in the model"},
      {"unconverted model", 0, FP8_OPTIMIZER_ADAM, Variant::Unconverted, "with_opt", true, "converted"},
      {"unconverted model, no optimizer", 0, FP8_OPTIMIZER_ADAM, Variant::Unconverted, "model_only", false,
       "converted"},
      {"optimizer of another kind", 3, FP8_OPTIMIZER_ADAMW, Variant::Standard, "with_opt", true, "kind"},
      {"optimizer but the file has none", 3, FP8_OPTIMIZER_ADAM, Variant::Standard, "model_only", true, "no optimizer"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Net t(c.level, c.kind, 3, c.variant);
    t.train_step(40);
    t.accumulate(41);
    FP8_ASSERT_OK(t.save(dir.path("A.ckpt"), FP8_CHECKPOINT_GRADIENTS));
    const Bytes a = read_bytes(dir.path("A.ckpt"));
    const Snapshot before = snapshot(t);
    EXPECT_REFUSED(t.load(dir.path(std::string(c.file) + ".ckpt"), c.pass_optimizer), FP8_ERR_INVALID_STATE,
                   "fp8_checkpoint_load", c.word);
    FP8_ASSERT_OK(t.save(dir.path("B.ckpt"), FP8_CHECKPOINT_GRADIENTS));
    EXPECT_EQ(file_difference(read_bytes(dir.path("B.ckpt")), a), "");
    EXPECT_EQ(first_difference(snapshot(t), before), "");
  }
}

// =================================================================================================
// 4. The atomic write
// =================================================================================================

TEST(CheckpointAtomicWrite, SavingOverACheckpointLeavesTheNewValidFileAndNoTemporary) {
  TempDir dir;
  const std::string p = dir.path("run.ckpt");
  Net a(2, FP8_OPTIMIZER_ADAM);
  a.train_step(0);
  FP8_ASSERT_OK(a.save(p));
  const Bytes first = read_bytes(p);
  a.train_step(1);
  FP8_ASSERT_OK(a.save(p));
  EXPECT_NE(file_difference(read_bytes(p), first), "");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"run.ckpt"});
  Net b(2, FP8_OPTIMIZER_ADAM);
  FP8_ASSERT_OK(b.load(p));
  EXPECT_EQ(first_difference(snapshot(b), snapshot(a)), "");
  EXPECT_EQ(stats_of(b.o()).steps, 2);
}

TEST(CheckpointAtomicWrite, SavingIntoAMissingDirectoryFailsWithIoAndWritesNothing) {
  TempDir dir;
  Net a(1, FP8_OPTIMIZER_ADAM);
  a.train_step(0);
  const std::string p = dir.path("missing/run.ckpt");
  EXPECT_REFUSED(a.save(p), FP8_ERR_IO, "fp8_checkpoint_save", "missing");
  EXPECT_FALSE(file_exists(p));
  EXPECT_FALSE(file_exists(dir.path("missing")));
  EXPECT_TRUE(dir.entries().empty());
  const std::string st = dir.path("missing/model.safetensors");
  EXPECT_REFUSED(fp8_model_export_safetensors(a.m(), st.c_str()), FP8_ERR_IO, "fp8_model_export_safetensors",
                 "missing");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(CheckpointAtomicWrite, AFailedRenameRemovesTheTemporaryFile) {
  TempDir dir;
  Net a(0, FP8_OPTIMIZER_ADAM);
  a.train_step(0);
  const std::string p = dir.path("adir");
  ASSERT_EQ(::mkdir(p.c_str(), 0755), 0);
  const std::string inside = dir.path("adir/keep");
  write_bytes(inside, Bytes{1, 2, 3});
  EXPECT_REFUSED(a.save(p), FP8_ERR_IO, "fp8_checkpoint_save", "adir");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"adir"});
  EXPECT_FALSE(has_tmp_file(dir.entries()));
  EXPECT_EQ(read_bytes(inside), (Bytes{1, 2, 3}));
}

// =================================================================================================
// 5. Loading across levels
// =================================================================================================

// The loss on one fixed batch, before each of `steps` steps on it.
std::vector<double> losses_on_a_fixed_batch(Net& n, int steps) {
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) out.push_back(n.train_step(99));
  return out;
}

std::map<std::string, std::vector<float>> decoded_params(fp8_model_t* m) {
  std::map<std::string, std::vector<float>> out;
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t i = 0; i < count; ++i) {
    const char* name = nullptr;
    fp8_tensor_t* v = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, &name, &v, nullptr));
    out[name] = decoded(v);
  }
  return out;
}
// (The norm of the model is "ln".)
bool is_linear_weight(const std::string& name) {
  return name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0 && name != "ln.weight";
}

// The tensors of a safetensors file (name -> dtype, shape, bytes) and its metadata, parsed here.
struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  Bytes data;
};
struct StFile {
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> metadata;
  std::string error;
};

// A minimal JSON reader for the safetensors header: objects, strings (no escapes needed here, but \"
// and \\ are handled), non-negative integers and arrays of them.
class Json {
 public:
  explicit Json(const std::string& s) : s_(s) {}
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool peek(char c) {
    ws();
    return i_ < s_.size() && s_[i_] == c;
  }
  bool string(std::string& out) {
    if (!eat('"')) return false;
    out.clear();
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\' && i_ + 1 < s_.size()) ++i_;
      out += s_[i_++];
    }
    return eat('"');
  }
  bool integer(int64_t& out) {
    ws();
    if (i_ >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i_]))) return false;
    out = 0;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) out = out * 10 + (s_[i_++] - '0');
    return true;
  }
  bool int_array(std::vector<int64_t>& out) {
    out.clear();
    if (!eat('[')) return false;
    if (eat(']')) return true;
    do {
      int64_t v;
      if (!integer(v)) return false;
      out.push_back(v);
    } while (eat(','));
    return eat(']');
  }
  bool done() {
    ws();
    return i_ == s_.size();
  }

 private:
  const std::string& s_;
  size_t i_ = 0;
};

StFile parse_safetensors(const Bytes& file) {
  StFile out;
  if (file.size() < 8) {
    out.error = "shorter than 8 bytes";
    return out;
  }
  uint64_t len = 0;
  for (int k = 0; k < 8; ++k) len |= static_cast<uint64_t>(file[static_cast<size_t>(k)]) << (8 * k);
  if (len > file.size() - 8) {
    out.error = "header length past the end";
    return out;
  }
  const std::string header(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(len));
  const size_t data_start = 8 + len;
  Json j(header);
  if (!j.eat('{')) {
    out.error = "no {";
    return out;
  }
  uint64_t expected_offset = 0;
  std::vector<std::pair<int64_t, std::string>> by_offset;
  std::map<std::string, std::vector<int64_t>> offsets;
  if (!j.peek('}')) do {
      std::string key;
      if (!j.string(key) || !j.eat(':') || !j.eat('{')) {
        out.error = "bad entry";
        return out;
      }
      if (key == "__metadata__") {
        if (!j.peek('}')) do {
            std::string k, v;
            if (!j.string(k) || !j.eat(':') || !j.string(v)) {
              out.error = "bad metadata";
              return out;
            }
            out.metadata[k] = v;
          } while (j.eat(','));
      } else {
        StTensor t;
        std::vector<int64_t> off;
        do {
          std::string field;
          if (!j.string(field) || !j.eat(':')) {
            out.error = "bad field in " + key;
            return out;
          }
          if (field == "dtype") {
            if (!j.string(t.dtype)) {
              out.error = "bad dtype";
              return out;
            }
          } else if (field == "shape") {
            if (!j.int_array(t.shape)) {
              out.error = "bad shape";
              return out;
            }
          } else if (field == "data_offsets") {
            if (!j.int_array(off) || off.size() != 2) {
              out.error = "bad offsets";
              return out;
            }
          } else {
            out.error = "unknown field " + field;
            return out;
          }
        } while (j.eat(','));
        if (off.size() != 2 || off[0] > off[1] || data_start + static_cast<uint64_t>(off[1]) > file.size()) {
          out.error = "offsets of " + key + " outside the data";
          return out;
        }
        t.data.assign(file.begin() + static_cast<std::ptrdiff_t>(data_start + static_cast<uint64_t>(off[0])),
                      file.begin() + static_cast<std::ptrdiff_t>(data_start + static_cast<uint64_t>(off[1])));
        by_offset.emplace_back(off[0], key);
        offsets[key] = off;
        out.tensors[key] = std::move(t);
      }
      if (!j.eat('}')) {
        out.error = "unclosed object " + key;
        return out;
      }
    } while (j.eat(','));
  if (!j.eat('}') || !j.done()) {
    out.error = "trailing header text";
    return out;
  }
  // The data region is covered exactly, in offset order, with no gaps.
  std::sort(by_offset.begin(), by_offset.end());
  for (const auto& [begin, name] : by_offset) {
    if (static_cast<uint64_t>(begin) != expected_offset) {
      out.error = "gap before " + name;
      return out;
    }
    expected_offset = static_cast<uint64_t>(offsets[name][1]);
  }
  if (data_start + expected_offset != file.size()) out.error = "bytes after the last tensor";
  return out;
}

// Writes a safetensors file: tensors in the given order, contiguous, metadata format=pt. A tensor
// with `unwritten` bytes (the last one) has offsets for that many bytes and none in the result: the
// caller extends the file to its full size (a hole).
struct StOut {
  std::string name, dtype;
  std::vector<int64_t> shape;
  Bytes data;
  uint64_t unwritten = 0;
};
Bytes make_safetensors(const std::vector<StOut>& tensors) {
  std::string h = "{\"__metadata__\":{\"format\":\"pt\"}";
  uint64_t off = 0, written = 0;
  for (const StOut& t : tensors) {
    const uint64_t size = t.unwritten ? t.unwritten : t.data.size();
    h += ",\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t k = 0; k < t.shape.size(); ++k) h += (k ? "," : "") + std::to_string(t.shape[k]);
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + size) + "]}";
    off += size;
    written += t.data.size();
  }
  h += "}";
  while (h.size() % 8) h += ' ';
  Bytes out(8 + h.size() + written);
  for (int k = 0; k < 8; ++k)
    out[static_cast<size_t>(k)] = static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * k));
  std::memcpy(out.data() + 8, h.data(), h.size());
  size_t at = 8 + h.size();
  for (const StOut& t : tensors) {
    if (!t.data.empty()) std::memcpy(out.data() + at, t.data.data(), t.data.size());
    at += t.data.size();
  }
  return out;
}

// The O3 master, as the model's safetensors export gives it (F16 per Linear weight).
std::map<std::string, std::vector<uint16_t>> exported_f16(Net& n, const std::string& path) {
  EXPECT_OK(fp8_model_export_safetensors(n.m(), path.c_str()));
  const StFile f = parse_safetensors(read_bytes(path));
  EXPECT_EQ(f.error, "");
  std::map<std::string, std::vector<uint16_t>> out;
  for (const auto& [name, t] : f.tensors)
    if (t.dtype == "F16") {
      std::vector<uint16_t> h(t.data.size() / 2);
      std::memcpy(h.data(), t.data.data(), t.data.size());
      out[name] = h;
    }
  return out;
}

TEST(CheckpointCrossLevel, TeToO2RoundsTheWeightsToF16AndTrainingContinues) {
  TempDir dir;
  Net te(0, FP8_OPTIMIZER_ADAM);
  for (int k = 0; k < 3; ++k) te.train_step(k);
  FP8_ASSERT_OK(te.save(dir.path("te.ckpt")));
  const auto te_params = decoded_params(te.m());

  for (int level : {1, 2, 3}) {
    SCOPED_TRACE(std::string("te -> ") + level_name(level));
    Net o(level, FP8_OPTIMIZER_ADAM, 7);
    FP8_ASSERT_OK(o.load(dir.path("te.ckpt")));
    EXPECT_EQ(stats_of(o.o()).steps, 3);
    EXPECT_EQ(stats_of(o.o()).opt_level, level);
    const auto got = decoded_params(o.m());
    const auto master =
        level == 3 ? exported_f16(o, dir.path("o3.safetensors")) : std::map<std::string, std::vector<uint16_t>>{};
    for (const auto& [name, want] : te_params) {
      SCOPED_TRACE(name);
      const std::vector<float>& g = got.at(name);
      ASSERT_EQ(g.size(), want.size());
      size_t bad = 0;
      for (size_t k = 0; k < want.size(); ++k) {
        if (!is_linear_weight(name)) {
          bad += bits_of(g[k]) != bits_of(want[k]);
        } else if (level < 3) {
          bad += bits_of(g[k]) != bits_of(fp8::f16_to_float(fp8::float_to_f16(want[k])));
        } else {
          bad += master.at(name)[k] != fp8::float_to_f16(want[k]);
        }
      }
      EXPECT_EQ(bad, 0u);
    }
    const std::vector<double> losses = losses_on_a_fixed_batch(o, 4);
    for (double l : losses) EXPECT_TRUE(std::isfinite(l));
    EXPECT_LT(losses.back(), losses.front());
    EXPECT_EQ(stats_of(o.o()).steps, 7);
    EXPECT_EQ(stats_of(o.o()).skipped_steps, 0);
  }
  // Another kind is refused.
  Net wrong(2, FP8_OPTIMIZER_ADAMW);
  EXPECT_REFUSED(wrong.load(dir.path("te.ckpt")), FP8_ERR_INVALID_STATE, "fp8_checkpoint_load", "kind");
}

TEST(CheckpointCrossLevel, O2AndO3ToTeWidenExactlyAndO3UsesTheMaster) {
  TempDir dir;
  for (int level : {1, 2, 3}) {
    SCOPED_TRACE(std::string(level_name(level)) + " -> te");
    Net src(level, FP8_OPTIMIZER_ADAMW);
    for (int k = 0; k < 3; ++k) src.train_step(k);
    FP8_ASSERT_OK(src.save(dir.path("src.ckpt")));
    const auto src_params = decoded_params(src.m());
    const auto master =
        level == 3 ? exported_f16(src, dir.path("src.safetensors")) : std::map<std::string, std::vector<uint16_t>>{};

    Net te(0, FP8_OPTIMIZER_ADAMW, 7);
    FP8_ASSERT_OK(te.load(dir.path("src.ckpt")));
    EXPECT_EQ(stats_of(te.o()).steps, 3);
    EXPECT_EQ(stats_of(te.o()).opt_level, 0);
    for (const auto& [name, src_values] : src_params) {
      SCOPED_TRACE(name);
      const std::vector<float> got = decoded(param_tensor(te.m(), name));
      EXPECT_EQ(dtype_of(param_tensor(te.m(), name)), FP8_DTYPE_F32);
      size_t bad = 0, differs_from_e4m3 = 0;
      for (size_t k = 0; k < got.size(); ++k) {
        const float want = level == 3 && is_linear_weight(name) ? fp8::f16_to_float(master.at(name)[k]) : src_values[k];
        bad += bits_of(got[k]) != bits_of(want);
        differs_from_e4m3 += bits_of(got[k]) != bits_of(src_values[k]);
      }
      EXPECT_EQ(bad, 0u);
      if (level == 3 && is_linear_weight(name))
        EXPECT_GT(differs_from_e4m3, got.size() / 2) << "the E4M3 copy, not the master";
    }
    const std::vector<double> losses = losses_on_a_fixed_batch(te, 4);
    for (double l : losses) EXPECT_TRUE(std::isfinite(l));
    EXPECT_LT(losses.back(), losses.front());
  }
}

// A checkpoint of the model alone (optimizer NULL) at O3 still carries the F16 masters, as the header
// says ("at O3 the masters are still saved through the optimizer that holds them"), and loading one with
// optimizer NULL keeps the optimizer's own state (its step count).
TEST(CheckpointModelOnly, AnO3ModelOnlyCheckpointKeepsTheMastersAndTheOptimizerKeepsItsState) {
  TempDir dir;
  Net src(3, FP8_OPTIMIZER_ADAM);
  for (int k = 0; k < 3; ++k) src.train_step(k);
  FP8_ASSERT_OK(src.save(dir.path("model.ckpt"), 0, false));
  const auto master = exported_f16(src, dir.path("src.safetensors"));
  const Bytes fc1 = tensor_bytes(param_tensor(src.m(), "fc1.weight"));

  Net dst(3, FP8_OPTIMIZER_ADAM, 5);
  dst.train_step(50);
  FP8_ASSERT_OK(dst.load(dir.path("model.ckpt"), false));
  EXPECT_EQ(stats_of(dst.o()).steps, 1) << "the optimizer's own state is kept";
  EXPECT_EQ(tensor_bytes(param_tensor(dst.m(), "fc1.weight")), fc1);
  const auto got = exported_f16(dst, dir.path("dst.safetensors"));
  for (const char* name : {"fc1.weight", "fc2.weight"}) {
    size_t bad = 0;
    for (size_t k = 0; k < master.at(name).size(); ++k) bad += got.at(name)[k] != master.at(name)[k];
    // The masters travel with the parameters, so a checkpoint without the optimizer keeps them.
    EXPECT_EQ(bad, 0u) << name << ": the loaded master is not the saved one";
  }
}

// =================================================================================================
// 6. Safetensors
// =================================================================================================

TEST(Safetensors, ExportAtEachLevelImportsIntoTeBitExactlyWithTheRightHeader) {
  TempDir dir;
  const std::map<std::string, std::vector<int64_t>> shapes = {{"fc1.weight", {kHidden, kIn}},  {"fc1.bias", {kHidden}},
                                                              {"ln.weight", {kHidden}},        {"ln.bias", {kHidden}},
                                                              {"fc2.weight", {kOut, kHidden}}, {"fc2.bias", {kOut}}};
  for (int level : {0, 1, 2, 3}) {
    SCOPED_TRACE(level_name(level));
    Net src(level, FP8_OPTIMIZER_ADAM);
    for (int k = 0; k < 2; ++k) src.train_step(k);
    const std::string p = dir.path(std::string(level_name(level)) + ".safetensors");
    FP8_ASSERT_OK(fp8_model_export_safetensors(src.m(), p.c_str()));
    const StFile f = parse_safetensors(read_bytes(p));
    ASSERT_EQ(f.error, "");
    EXPECT_EQ(f.metadata.at("format"), "pt");
    EXPECT_EQ(f.metadata.count("producer"), 1u);
    EXPECT_EQ(f.metadata.at("producer").rfind("libfp8", 0), 0u);
    ASSERT_EQ(f.tensors.size(), shapes.size());
    for (const auto& [name, shape] : shapes) {
      SCOPED_TRACE(name);
      ASSERT_EQ(f.tensors.count(name), 1u);
      const StTensor& t = f.tensors.at(name);
      EXPECT_EQ(t.shape, shape);
      const char* want_dtype = level > 0 && is_linear_weight(name) ? "F16" : "F32";
      EXPECT_EQ(t.dtype, want_dtype);
      EXPECT_EQ(t.data.size(), static_cast<size_t>(numel_of(shape)) * (t.dtype == "F16" ? 2 : 4));
      // The file's values are the model's: F32 bits, the F16 weight (O1/O2), the master (O3, close to
      // the E4M3 copy).
      const fp8_tensor_t* v = param_tensor(src.m(), name);
      if (level < 3 || !is_linear_weight(name)) {
        EXPECT_EQ(t.data, tensor_bytes(v));
      } else {
        const std::vector<float> e4m3 = decoded(v);
        float si = 0.0f;
        EXPECT_OK(fp8_tensor_get_scale_inv(v, &si));
        for (size_t k = 0; k < e4m3.size(); ++k) {
          const float m = fp8::f16_to_float(static_cast<uint16_t>(t.data[2 * k] | (t.data[2 * k + 1] << 8)));
          ASSERT_LE(std::fabs(m - e4m3[k]), std::fabs(m) / 8 + 16 * si) << k;  // one E4M3 step (+ saturation slack)
        }
      }
    }
    // Imported into a fresh te model (no optimizer): the values widened exactly.
    Net te(0, -1, 9);
    FP8_ASSERT_OK(fp8_model_import_safetensors(te.m(), p.c_str()));
    for (const auto& [name, t] : f.tensors) {
      SCOPED_TRACE(name);
      std::vector<float> want(t.data.size() / (t.dtype == "F16" ? 2 : 4));
      for (size_t k = 0; k < want.size(); ++k) {
        if (t.dtype == "F16")
          want[k] = fp8::f16_to_float(static_cast<uint16_t>(t.data[2 * k] | (t.data[2 * k + 1] << 8)));
        else
          std::memcpy(&want[k], t.data.data() + 4 * k, 4);
      }
      const std::vector<float> got = decoded(param_tensor(te.m(), name));
      ASSERT_EQ(got.size(), want.size());
      size_t bad = 0;
      for (size_t k = 0; k < got.size(); ++k) bad += bits_of(got[k]) != bits_of(want[k]);
      EXPECT_EQ(bad, 0u);
    }
  }
}

// At O3 the F16 master is the model's (made by the conversion), not the optimizer's: with the
// optimizer gone the export still writes it as F16, the same bytes as with the optimizer alive, and
// they are the model's master slices (fp8_model_flat_storage: in parameter order, each at a 256-byte
// boundary; host memory on the CPU backend), of which the E4M3 weight is a copy within one E4M3 step.
TEST(Safetensors, AnO3ExportWithoutItsOptimizerStillWritesTheF16Master) {
  TempDir dir;
  Net src(3, FP8_OPTIMIZER_ADAM);
  for (int k = 0; k < 2; ++k) src.train_step(k);
  const auto with_optimizer = exported_f16(src, dir.path("with.safetensors"));
  src.opt.reset();
  const std::string p = dir.path("o3.safetensors");
  FP8_ASSERT_OK(fp8_model_export_safetensors(src.m(), p.c_str()));
  const StFile f = parse_safetensors(read_bytes(p));
  ASSERT_EQ(f.error, "");
  void* masters = nullptr;
  size_t master_bytes = 0;
  FP8_ASSERT_OK(fp8_model_flat_storage(src.m(), FP8_STORAGE_MASTERS, FP8_DTYPE_F16, &masters, &master_bytes));
  ASSERT_NE(masters, nullptr);
  size_t at = 0;  // the slice of the next master
  for (const char* name : {"fc1.weight", "fc2.weight"}) {
    SCOPED_TRACE(name);
    const StTensor& t = f.tensors.at(name);
    EXPECT_EQ(t.dtype, "F16");
    const fp8_tensor_t* v = param_tensor(src.m(), name);
    EXPECT_EQ(dtype_of(v), FP8_DTYPE_E4M3);
    int64_t n = 0;
    EXPECT_OK(fp8_tensor_numel(v, &n));
    const size_t bytes = static_cast<size_t>(n) * 2;
    ASSERT_EQ(t.data.size(), bytes);
    std::vector<uint16_t> h(static_cast<size_t>(n));
    std::memcpy(h.data(), t.data.data(), bytes);
    EXPECT_EQ(h, with_optimizer.at(name)) << "the export changed when the optimizer went";
    ASSERT_LE(at + bytes, master_bytes);
    EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(masters) + at, t.data.data(), bytes), 0)
        << "the exported F16 weight is not the model's master";
    at += (bytes + 255) / 256 * 256;
    const std::vector<float> e4m3 = decoded(v);
    float si = 0.0f;
    EXPECT_OK(fp8_tensor_get_scale_inv(v, &si));
    for (size_t k = 0; k < e4m3.size(); ++k) {
      const float m = fp8::f16_to_float(h[k]);
      ASSERT_LE(std::fabs(m - e4m3[k]), std::fabs(m) / 8 + 16 * si) << k;  // one E4M3 step (+ saturation slack)
    }
  }
  EXPECT_EQ(at, master_bytes) << "the masters arena holds the two Linear weights' masters and nothing else";
}

// A file written here with BF16 tensors (and one F16, one F32) imports exactly into te, and rounded
// to F16 at O2.
TEST(Safetensors, ImportsBf16TensorsWrittenByHand) {
  TempDir dir;
  Net te(0, -1, 3);
  std::vector<StOut> out;
  std::map<std::string, std::vector<float>> want;
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(te.m(), &count));
  for (int32_t i = 0; i < count; ++i) {
    const char* name = nullptr;
    fp8_tensor_t* v = nullptr;
    EXPECT_OK(fp8_model_parameter_at(te.m(), i, &name, &v, nullptr));
    int32_t ndim = 0;
    int64_t shape[FP8_MAX_DIMS] = {};
    EXPECT_OK(fp8_tensor_shape(v, &ndim, shape));
    StOut t;
    t.name = name;
    t.shape.assign(shape, shape + ndim);
    const std::vector<float> f = randn(static_cast<size_t>(numel_of(t.shape)), 900 + static_cast<uint32_t>(i), 0.3f);
    std::vector<float>& w = want[name];
    t.dtype = std::string(name) == "ln.bias" ? "F16" : std::string(name) == "fc2.bias" ? "F32" : "BF16";
    for (float x : f) {
      if (t.dtype == "BF16") {
        const uint16_t h = fp8::float_to_bf16(x);
        t.data.push_back(static_cast<uint8_t>(h));
        t.data.push_back(static_cast<uint8_t>(h >> 8));
        w.push_back(fp8::bf16_to_float(h));
      } else if (t.dtype == "F16") {
        const uint16_t h = fp8::float_to_f16(x);
        t.data.push_back(static_cast<uint8_t>(h));
        t.data.push_back(static_cast<uint8_t>(h >> 8));
        w.push_back(fp8::f16_to_float(h));
      } else {
        const uint32_t b = bits_of(x);
        for (int k = 0; k < 4; ++k) t.data.push_back(static_cast<uint8_t>(b >> (8 * k)));
        w.push_back(x);
      }
    }
    out.push_back(std::move(t));
  }
  std::reverse(out.begin(), out.end());  // the file's order is not the model's
  const std::string p = dir.path("bf16.safetensors");
  write_bytes(p, make_safetensors(out));
  FP8_ASSERT_OK(fp8_model_import_safetensors(te.m(), p.c_str()));
  for (const auto& [name, values] : want) {
    SCOPED_TRACE(name);
    const std::vector<float> got = decoded(param_tensor(te.m(), name));
    size_t bad = 0;
    for (size_t k = 0; k < got.size(); ++k) bad += bits_of(got[k]) != bits_of(values[k]);
    EXPECT_EQ(bad, 0u);
  }
  Net o2(2, FP8_OPTIMIZER_ADAM, 4);
  FP8_ASSERT_OK(fp8_model_import_safetensors(o2.m(), p.c_str()));
  for (const auto& [name, values] : want) {
    SCOPED_TRACE(name);
    const std::vector<float> got = decoded(param_tensor(o2.m(), name));
    size_t bad = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      const float w = is_linear_weight(name) ? fp8::f16_to_float(fp8::float_to_f16(values[k])) : values[k];
      bad += bits_of(got[k]) != bits_of(w);
    }
    EXPECT_EQ(bad, 0u);
  }
}

TEST(Safetensors, MissingExtraMisshapenOrI32TensorsAreRefusedAllOrNothing) {
  TempDir dir;
  // A valid file from one model, imported into another (different weights) after each bad variant.
  Net src(0, -1, 1);
  const std::string good_path = dir.path("good.safetensors");
  FP8_ASSERT_OK(fp8_model_export_safetensors(src.m(), good_path.c_str()));
  const StFile good = parse_safetensors(read_bytes(good_path));
  ASSERT_EQ(good.error, "");
  // In the model's order, so that a wrong last tensor comes after the others were read.
  const char* order[] = {"fc1.weight", "fc1.bias", "ln.weight", "ln.bias", "fc2.weight", "fc2.bias"};
  auto base = [&] {
    std::vector<StOut> v;
    for (const char* n : order)
      v.push_back({n, good.tensors.at(n).dtype, good.tensors.at(n).shape, good.tensors.at(n).data});
    return v;
  };
  struct Case {
    const char* what;
    fp8_status_t status;
    const char* word;
    std::vector<StOut> tensors;
  };
  std::vector<Case> cases;
  {
    std::vector<StOut> v = base();
    v.pop_back();
    cases.push_back({"a missing tensor", FP8_ERR_INVALID_STATE, "fc2.bias", v});
  }
  {
    std::vector<StOut> v = base();
    v.push_back({"fc3.weight", "F32", {4}, Bytes(16, 0x3f)});
    cases.push_back({"an extra tensor", FP8_ERR_INVALID_STATE, "fc3.weight", v});
  }
  {
    std::vector<StOut> v = base();
    v.back().shape = {16, 2};
    cases.push_back({"a wrong shape", FP8_ERR_SHAPE, "fc2.bias", v});
  }
  {
    std::vector<StOut> v = base();
    v.back().dtype = "I32";
    cases.push_back({"an I32 tensor", FP8_ERR_UNSUPPORTED, "I32", v});
  }
  for (int level : {0, 2}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(level_name(level)) + ": " + c.what);
      Net t(level, level ? FP8_OPTIMIZER_ADAM : -1, 6);
      if (level) t.train_step(0);
      const Snapshot before = snapshot(t);
      const std::string p = dir.path("bad.safetensors");
      write_bytes(p, make_safetensors(c.tensors));
      EXPECT_REFUSED(fp8_model_import_safetensors(t.m(), p.c_str()), c.status, "fp8_model_import_safetensors", c.word);
      EXPECT_EQ(first_difference(snapshot(t), before), "");
    }
  }
  // The checks could fail: the good file imports and changes the weights.
  Net t(0, -1, 6);
  const Snapshot before = snapshot(t);
  FP8_ASSERT_OK(fp8_model_import_safetensors(t.m(), good_path.c_str()));
  EXPECT_NE(first_difference(snapshot(t), before), "");
}

// A framework's whole model in one file (embeddings, buffers of other dtypes, layers libfp8 does not
// run) imports into the libfp8 model that runs part of it; a missing or misshapen parameter is
// still refused, all or nothing, and the plain import still refuses the other tensors.
TEST(Safetensors, APartImportsItsParametersFromALargerModelsFileAndLeavesTheRest) {
  TempDir dir;
  Net src(0, -1, 1);
  const std::string exported = dir.path("part.safetensors");
  FP8_ASSERT_OK(fp8_model_export_safetensors(src.m(), exported.c_str()));
  const StFile part = parse_safetensors(read_bytes(exported));
  ASSERT_EQ(part.error, "");
  auto whole = [&] {
    std::vector<StOut> v = {{"wte.weight", "F32", {3, 4}, Bytes(48, 0x3f)},
                            {"position_ids", "I64", {1, 2}, Bytes(16, 0x01)},
                            {"attention_mask", "BOOL", {2}, Bytes(2, 0x01)}};
    for (const auto& [name, t] : part.tensors) v.push_back({name, t.dtype, t.shape, t.data});
    v.push_back({"lm_head.weight", "BF16", {2, 2}, Bytes(8, 0x3f)});
    return v;
  };
  const std::string good_path = dir.path("whole.safetensors");
  write_bytes(good_path, make_safetensors(whole()));
  for (int level : {0, 2}) {
    SCOPED_TRACE(level_name(level));
    Net t(level, level ? FP8_OPTIMIZER_ADAM : -1, 6);
    const Snapshot before = snapshot(t);
    EXPECT_REFUSED(fp8_model_import_safetensors(t.m(), good_path.c_str()), FP8_ERR_INVALID_STATE,
                   "fp8_model_import_safetensors", "wte.weight");
    EXPECT_EQ(first_difference(snapshot(t), before), "");
    FP8_ASSERT_OK(fp8_model_import_safetensors_part(t.m(), good_path.c_str()));
    // The same values as importing the libfp8 model's own file.
    Net own(level, level ? FP8_OPTIMIZER_ADAM : -1, 6);
    FP8_ASSERT_OK(fp8_model_import_safetensors(own.m(), exported.c_str()));
    EXPECT_EQ(first_difference(snapshot(t), snapshot(own)), "");
    EXPECT_NE(first_difference(snapshot(t), before), "");
    // A parameter missing or misshapen: refused naming it, nothing changed.
    for (const char* what : {"missing", "misshapen"}) {
      SCOPED_TRACE(what);
      std::vector<StOut> v = whole();
      auto bias = std::find_if(v.begin(), v.end(), [](const StOut& o) { return o.name == "fc2.bias"; });
      ASSERT_NE(bias, v.end());
      if (std::string(what) == "missing")
        v.erase(bias);
      else
        bias->shape = {static_cast<int64_t>(bias->data.size() / 4), 1};
      const std::string p = dir.path("bad_whole.safetensors");
      write_bytes(p, make_safetensors(v));
      const Snapshot kept = snapshot(t);
      EXPECT_REFUSED(fp8_model_import_safetensors_part(t.m(), p.c_str()),
                     std::string(what) == "missing" ? FP8_ERR_INVALID_STATE : FP8_ERR_SHAPE,
                     "fp8_model_import_safetensors_part", "fc2.bias");
      EXPECT_EQ(first_difference(snapshot(t), kept), "");
    }
  }
  EXPECT_REFUSED(fp8_model_import_safetensors_part(nullptr, good_path.c_str()), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_model_import_safetensors_part", "model");
}

// The import reads the header and its parameters' bytes, not the file: a part import from a file
// with a 64 GiB tensor besides the parameters (a hole in a sparse file, larger than this machine's
// memory) takes the parameters and leaves the rest unread. A file shorter than its header says is
// refused before anything is read; so is a path that is no regular file.
TEST(Safetensors, AnImportReadsOnlyItsParametersBytes) {
  TempDir dir;
  Net src(0, -1, 1);
  const std::string exported = dir.path("part.safetensors");
  FP8_ASSERT_OK(fp8_model_export_safetensors(src.m(), exported.c_str()));
  const StFile part = parse_safetensors(read_bytes(exported));
  ASSERT_EQ(part.error, "");
  constexpr uint64_t kHuge = uint64_t{1} << 36;
  std::vector<StOut> v;
  for (const auto& [name, t] : part.tensors) v.push_back({name, t.dtype, t.shape, t.data});
  v.push_back({"wte.weight", "U8", {static_cast<int64_t>(kHuge)}, {}, kHuge});
  const Bytes head = make_safetensors(v);
  const std::string p = dir.path("huge.safetensors");
  write_bytes(p, head);
  if (::truncate(p.c_str(), static_cast<off_t>(head.size() + kHuge)) != 0)
    GTEST_SKIP() << "this file system cannot hold a sparse file of 64 GiB: " << std::strerror(errno);
  Net t(2, FP8_OPTIMIZER_ADAM, 6), own(2, FP8_OPTIMIZER_ADAM, 6);
  FP8_ASSERT_OK(fp8_model_import_safetensors_part(t.m(), p.c_str()));
  FP8_ASSERT_OK(fp8_model_import_safetensors(own.m(), exported.c_str()));
  EXPECT_EQ(first_difference(snapshot(t), snapshot(own)), "");
  // The same file cut short inside the big tensor: its header runs past the end, refused as corrupt.
  ASSERT_EQ(::truncate(p.c_str(), static_cast<off_t>(head.size() + 4096)), 0);
  const Snapshot kept = snapshot(t);
  EXPECT_REFUSED(fp8_model_import_safetensors_part(t.m(), p.c_str()), FP8_ERR_CORRUPT,
                 "fp8_model_import_safetensors_part", "wte.weight");
  EXPECT_EQ(first_difference(snapshot(t), kept), "");
  // No file, a directory, a FIFO without a writer (refused at once, not waited on): FP8_ERR_IO
  // naming the path.
  const std::string fifo = dir.path("pipe.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  for (const std::string& bad : {dir.path("none.safetensors"), dir.dir(), fifo}) {
    EXPECT_REFUSED(fp8_model_import_safetensors(t.m(), bad.c_str()), FP8_ERR_IO, "fp8_model_import_safetensors", bad);
    EXPECT_EQ(first_difference(snapshot(t), kept), "");
  }
}

// =================================================================================================
// 7. fp8_checkpoint_read_recipe
// =================================================================================================

TEST(CheckpointReadRecipe, ReturnsTheSavedRecipeAndRefusesAnUnconvertedModelsCheckpoint) {
  TempDir dir;
  for (int level : {0, 3}) {
    SCOPED_TRACE(level_name(level));
    Net a(level, FP8_OPTIMIZER_ADAM);
    FP8_ASSERT_OK(a.save(dir.path("a.ckpt")));
    Recipe saved = make_recipe((recipe_text(level) + ", margin=2, fp8_format=E4M3").c_str());
    // The recipe the model was converted with (not the one above: that one differs in margin/format).
    Recipe want = make_recipe(recipe_text(level).c_str());
    FP8_ASSERT_OK(fp8_checkpoint_read_recipe(dir.path("a.ckpt").c_str(), saved.get()));
    EXPECT_EQ(recipe_string(saved.get()), recipe_string(want.get()));
  }
  Net plain(0, FP8_OPTIMIZER_ADAM, 1, Variant::Unconverted);
  FP8_ASSERT_OK(plain.save(dir.path("plain.ckpt")));
  Recipe r = make_recipe("margin=3");
  const std::string before = recipe_string(r.get());
  EXPECT_REFUSED(fp8_checkpoint_read_recipe(dir.path("plain.ckpt").c_str(), r.get()), FP8_ERR_INVALID_STATE,
                 "fp8_checkpoint_read_recipe", "not converted");
  EXPECT_EQ(recipe_string(r.get()), before);
  EXPECT_REFUSED(fp8_checkpoint_read_recipe(dir.path("none.ckpt").c_str(), r.get()), FP8_ERR_IO,
                 "fp8_checkpoint_read_recipe", "none.ckpt");
  EXPECT_EQ(recipe_string(r.get()), before);
}

// Current scaling travels with the checkpoint: a resumed run is bit-identical to the uninterrupted
// one (each cast's scale follows from its tensor, so no pinned weight-copy scale is needed), the file
// reads back as scaling=current, and a model converted with delayed scaling refuses to load it.
TEST(CheckpointCurrentScaling, ResumesBitIdenticallyAndTheRecipeTravels) {
  TempDir dir;
  const std::string at_n = dir.path("current.ckpt");
  for (int level : {0, 2}) {
    SCOPED_TRACE(level_name(level));
    Net a(level, FP8_OPTIMIZER_ADAMW, 1, Variant::CurrentScaling);
    for (int k = 0; k < kN; ++k) a.train_step(k);
    FP8_ASSERT_OK(a.save(at_n));
    for (int k = kN; k < kN + kM; ++k) a.train_step(k);
    Net b(level, FP8_OPTIMIZER_ADAMW, 1, Variant::CurrentScaling);
    FP8_ASSERT_OK(b.load(at_n));
    for (int k = kN; k < kN + kM; ++k) b.train_step(k);
    EXPECT_EQ(first_difference(snapshot(b), snapshot(a)), "");
    fp8_scaling_t* input_state = nullptr;
    EXPECT_OK(fp8_layer_get_scaling(a.m(), 0, FP8_SCALING_INPUT, &input_state));
    ASSERT_NE(input_state, nullptr);
    EXPECT_EQ(info_of(input_state).update_count, kN + kM) << "one cast of x per step";

    Recipe read = make_recipe();
    FP8_ASSERT_OK(fp8_checkpoint_read_recipe(at_n.c_str(), read.get()));
    int64_t scaling = -1;
    FP8_ASSERT_OK(fp8_recipe_get_int(read.get(), FP8_RECIPE_SCALING, &scaling));
    EXPECT_EQ(scaling, FP8_SCALING_CURRENT);
    Net delayed(level, FP8_OPTIMIZER_ADAMW, 1, Variant::Standard);
    const Snapshot before = snapshot(delayed);
    EXPECT_EQ(delayed.load(at_n), FP8_ERR_INVALID_STATE);
    EXPECT_NE(std::string(fp8_last_error_message()).find("scaling=current"), std::string::npos)
        << fp8_last_error_message();
    EXPECT_EQ(first_difference(snapshot(delayed), before), "") << "a refused load changes nothing";
  }
}

// =================================================================================================
// 8. Argument checks
// =================================================================================================

TEST(CheckpointArguments, NullsBadFlagsForeignOptimizersAndAutocastAreRefused) {
  TempDir dir;
  Net a(2, FP8_OPTIMIZER_ADAM);
  a.train_step(0);
  const std::string p = dir.path("a.ckpt");
  FP8_ASSERT_OK(a.save(p));
  const Bytes saved = read_bytes(p);
  const Snapshot before = snapshot(a);
  const std::string q = dir.path("q.ckpt");

  EXPECT_REFUSED(fp8_checkpoint_save(nullptr, nullptr, q.c_str(), 0), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_save",
                 "model");
  EXPECT_REFUSED(fp8_checkpoint_save(a.m(), a.o(), nullptr, 0), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_save",
                 "path");
  EXPECT_REFUSED(fp8_checkpoint_save(a.m(), a.o(), q.c_str(), 2), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_save",
                 "flags");
  EXPECT_REFUSED(fp8_checkpoint_load(nullptr, nullptr, p.c_str()), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_load",
                 "model");
  EXPECT_REFUSED(fp8_checkpoint_load(a.m(), a.o(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_load", "path");
  EXPECT_REFUSED(fp8_checkpoint_read_recipe(nullptr, nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_read_recipe",
                 "path");
  EXPECT_REFUSED(fp8_checkpoint_read_recipe(p.c_str(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_read_recipe",
                 "recipe");
  EXPECT_REFUSED(fp8_model_export_safetensors(nullptr, q.c_str()), FP8_ERR_INVALID_ARGUMENT,
                 "fp8_model_export_safetensors", "model");
  EXPECT_REFUSED(fp8_model_import_safetensors(a.m(), nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_model_import_safetensors",
                 "path");
  // Not a file name: refused as the argument it is, before any temporary file is made.
  const std::string in_dir = dir.path("sub") + "/";
  for (const std::string& bad : {std::string(), in_dir}) {
    SCOPED_TRACE("path '" + bad + "'");
    const char* what = bad.empty() ? "path is empty" : "ends in '/'";
    EXPECT_REFUSED(fp8_checkpoint_save(a.m(), a.o(), bad.c_str(), 0), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_save",
                   what);
    EXPECT_REFUSED(fp8_checkpoint_load(a.m(), a.o(), bad.c_str()), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_load",
                   what);
    EXPECT_REFUSED(fp8_model_export_safetensors(a.m(), bad.c_str()), FP8_ERR_INVALID_ARGUMENT,
                   "fp8_model_export_safetensors", what);
  }

  // An optimizer made for another model.
  Net other(2, FP8_OPTIMIZER_ADAM);
  EXPECT_REFUSED(fp8_checkpoint_save(a.m(), other.o(), q.c_str(), 0), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_save",
                 "another model");
  EXPECT_REFUSED(fp8_checkpoint_load(a.m(), other.o(), p.c_str()), FP8_ERR_INVALID_ARGUMENT, "fp8_checkpoint_load",
                 "another model");

  // Inside an autocast region.
  FP8_ASSERT_OK(fp8_autocast_begin(a.m()));
  EXPECT_REFUSED(fp8_checkpoint_save(a.m(), a.o(), q.c_str(), 0), FP8_ERR_INVALID_STATE, "fp8_checkpoint_save",
                 "autocast");
  EXPECT_REFUSED(fp8_checkpoint_load(a.m(), a.o(), p.c_str()), FP8_ERR_INVALID_STATE, "fp8_checkpoint_load",
                 "autocast");
  EXPECT_REFUSED(fp8_model_import_safetensors(a.m(), dir.path("x.safetensors").c_str()), FP8_ERR_INVALID_STATE,
                 "fp8_model_import_safetensors", "autocast");
  FP8_ASSERT_OK(fp8_autocast_end(a.m()));

  // None of them wrote a file or changed the model, the optimizer or the other model.
  EXPECT_FALSE(file_exists(q));
  EXPECT_EQ(read_bytes(p), saved);
  EXPECT_EQ(first_difference(snapshot(a), before), "");
  // Outside the region both work again.
  FP8_ASSERT_OK(a.save(q));
  FP8_ASSERT_OK(a.load(p));
  EXPECT_EQ(first_difference(snapshot(a), before), "");
}

}  // namespace
