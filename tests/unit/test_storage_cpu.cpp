// The flat parameter storage (include/fp8.h, "Flat storage"; src/nn/storage.cpp) on the CPU reference
// backend, whose "device memory" is host memory: the arenas fp8_model_flat_storage hands out are read
// here directly.
//  1. the layout at each storage level (unconverted, te, O1, O2, O2 with E4M3 gradients, O3) of a model
//     fc1 (Linear with bias) -> ln (LayerNorm) -> fc2 (Linear): one arena per (role, dtype), every
//     parameter's slice inside its arena, 256-byte aligned from the arena's start, in parameter order,
//     without overlap, holding the tensor's bytes; the arenas' sizes written out by hand; NULL and 0
//     for the kinds a level does not store;
//  2. handles, data pointers and bytes unchanged by fp8_optimizer_create and (handles, pointers) by
//     optimizer steps; data pointers that move when a layer is added before conversion, with handles
//     and values kept;
//  3. fp8_model_write_parameter into F32, F16 (round to nearest even) and O3 (F16 master + E4M3 copy)
//     storage, and its refusals, which change nothing;
//  4. fp8_model_flat_storage's and fp8_model_storage_level's refusals;
//  5. zero_grad zeroes every gradient arena.
// Expected values come from core/format.hpp's conversions (the numerics contract) and from bit
// patterns written here, never from the storage code.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/format.hpp"
#include "fp8_test_util.hpp"

using namespace fp8test;

namespace {

constexpr size_t kAlign = 256;
size_t aligned(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// ---- the model ----------------------------------------------------------------------------------------
//
// fc1: Linear 36 -> 20 with bias, ln: LayerNorm 20, fc2: Linear 20 -> 12 without bias. No parameter
// is a multiple of 256 bytes in any dtype, so every slice but the last of an arena is followed by
// padding.

struct ParamInfo {
  const char* name;
  int64_t numel;
  bool linear_weight;
};
const ParamInfo kParams[] = {
    {"fc1.weight", 20 * 36, true}, {"fc1.bias", 20, false},       {"ln.weight", 20, false},
    {"ln.bias", 20, false},        {"fc2.weight", 12 * 20, true},
};
constexpr int32_t kCount = 5;

struct Level {
  const char* name;
  const char* recipe;  // nullptr: the model is not converted
  int32_t level;       // fp8_model_storage_level
  fp8_dtype_t grad8;   // the Linear weights' FP8 gradients (level > 0)
};
const Level kUnconverted{"Unconverted", nullptr, 0, FP8_DTYPE_F32};
const Level kTe{"Te", "backend=te", 0, FP8_DTYPE_F32};
const Level kO1{"O1", "backend=msamp, opt_level=O1", 1, FP8_DTYPE_E5M2};
const Level kO2{"O2", "backend=msamp, opt_level=O2", 2, FP8_DTYPE_E5M2};
const Level kO2E4m3{"O2E4M3", "backend=msamp, opt_level=O2, fp8_format=E4M3", 2, FP8_DTYPE_E4M3};
const Level kO3{"O3", "backend=msamp, opt_level=O3", 3, FP8_DTYPE_E5M2};
void PrintTo(const Level& l, std::ostream* os) {
  *os << l.name;
}

fp8_dtype_t value_dtype(const Level& l, const ParamInfo& p) {
  if (!p.linear_weight || l.level == 0) return FP8_DTYPE_F32;
  return l.level == 3 ? FP8_DTYPE_E4M3 : FP8_DTYPE_F16;
}
fp8_dtype_t grad_dtype(const Level& l, const ParamInfo& p) {
  return p.linear_weight && l.level > 0 ? l.grad8 : FP8_DTYPE_F32;
}

// The arenas of a level and their bytes, from the layout rule (each slice rounded up to 256 bytes):
//   F32 fc1.weight 2880 -> 3072, each 20-element vector 80 -> 256, F32 fc2.weight 960 -> 1024;
//   F16 1440 -> 1536 and 480 -> 512; one byte per element 720 -> 768 and 240 -> 256.
struct ArenaWant {
  fp8_storage_role_t role;
  fp8_dtype_t dtype;
  size_t bytes;
};
std::vector<ArenaWant> arenas_of(const Level& l) {
  if (l.level == 0) return {{FP8_STORAGE_VALUES, FP8_DTYPE_F32, 4864}, {FP8_STORAGE_GRADS, FP8_DTYPE_F32, 4864}};
  std::vector<ArenaWant> a = {{FP8_STORAGE_VALUES, FP8_DTYPE_F32, 768},
                              {FP8_STORAGE_GRADS, FP8_DTYPE_F32, 768},
                              {FP8_STORAGE_GRADS, l.grad8, 1024}};
  if (l.level == 3) {
    a.push_back({FP8_STORAGE_VALUES, FP8_DTYPE_E4M3, 1024});
    a.push_back({FP8_STORAGE_MASTERS, FP8_DTYPE_F16, 2048});
  } else {
    a.push_back({FP8_STORAGE_VALUES, FP8_DTYPE_F16, 2048});
  }
  return a;
}
// Where a Linear weight's master starts in O3's masters arena (fc1.weight, then fc2.weight).
size_t master_offset(int32_t index) {
  return index == 0 ? 0 : 1536;
}

struct Net {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  std::vector<std::vector<float>> init;  // the FP32 values written before the conversion

  explicit Net(const Level& l, uint32_t seed = 1) {
    fp8_model_t* m = model.get();
    EXPECT_OK(fp8_model_add_linear(m, "fc1", 36, 20, 1, nullptr));
    EXPECT_OK(fp8_model_add_layernorm(m, "ln", 20, 1e-5f, nullptr));
    EXPECT_OK(fp8_model_add_linear(m, "fc2", 20, 12, 0, nullptr));
    for (int32_t i = 0; i < kCount; ++i) {
      init.push_back(randn(static_cast<size_t>(kParams[i].numel), seed * 100 + static_cast<uint32_t>(i), 0.3f));
      upload(value(i), init.back());
    }
    if (l.recipe) {
      Recipe r = make_recipe((std::string(l.recipe) + ", small_layer_fallback=0").c_str());
      EXPECT_OK(fp8_convert_model(m, r.get(), nullptr));
    }
  }
  fp8_model_t* m() { return model.get(); }
  fp8_tensor_t* value(int32_t i) {
    fp8_tensor_t* v = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m(), i, nullptr, &v, nullptr));
    return v;
  }
  fp8_tensor_t* grad(int32_t i) {
    fp8_tensor_t* g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m(), i, nullptr, nullptr, &g));
    return g;
  }
  // grad[i] += g (fp8_model_accumulate_grad).
  void accumulate(int32_t i, const std::vector<float>& g) {
    Tensor t = make_tensor(ctx.get(), FP8_DTYPE_F32, {static_cast<int64_t>(g.size())});
    upload(t.get(), g);
    EXPECT_OK(fp8_model_accumulate_grad(m(), i, t.get()));
  }
  void accumulate_all(uint32_t seed) {
    for (int32_t i = 0; i < kCount; ++i)
      accumulate(i, randn(static_cast<size_t>(kParams[i].numel), seed * 1000 + static_cast<uint32_t>(i), 0.05f));
  }
};

struct Arena {
  void* data = nullptr;
  size_t bytes = 0;
  bool operator==(const Arena& o) const { return data == o.data && bytes == o.bytes; }
};
Arena flat(fp8_model_t* m, fp8_storage_role_t role, fp8_dtype_t dtype) {
  Arena a;
  EXPECT_OK(fp8_model_flat_storage(m, role, dtype, &a.data, &a.bytes));
  return a;
}
std::vector<uint8_t> arena_bytes(const Arena& a) {
  const uint8_t* p = static_cast<const uint8_t*>(a.data);
  return p ? std::vector<uint8_t>(p, p + a.bytes) : std::vector<uint8_t>{};
}
const char* role_name(fp8_storage_role_t r) {
  return r == FP8_STORAGE_VALUES ? "values" : r == FP8_STORAGE_GRADS ? "grads" : "masters";
}
std::string kind_name(fp8_storage_role_t r, fp8_dtype_t d) {
  return std::string(role_name(r)) + "/" + std::to_string(d);
}

int32_t storage_level_of(const fp8_model_t* m) {
  int32_t level = -1;
  EXPECT_OK(fp8_model_storage_level(m, &level));
  return level;
}
float scale_inv_of(const fp8_tensor_t* t) {
  float s = std::numeric_limits<float>::quiet_NaN();
  EXPECT_OK(fp8_tensor_get_scale_inv(t, &s));
  return s;
}
bool is_fp8(fp8_dtype_t dt) {
  return dt == FP8_DTYPE_E4M3 || dt == FP8_DTYPE_E5M2;
}

// The values a tensor stands for: F32 as is, F16 widened, FP8 codes times scale_inv.
std::vector<float> decoded(const fp8_tensor_t* t) {
  const fp8_dtype_t dt = dtype_of(t);
  const std::vector<uint8_t> b = tensor_bytes(t);
  std::vector<float> out;
  if (dt == FP8_DTYPE_F32) {
    out.resize(b.size() / 4);
    std::memcpy(out.data(), b.data(), b.size());
  } else if (dt == FP8_DTYPE_F16) {
    for (size_t k = 0; k < b.size(); k += 2)
      out.push_back(fp8::f16_to_float(static_cast<uint16_t>(b[k] | (b[k + 1] << 8))));
  } else {
    const float si = scale_inv_of(t);
    for (uint8_t c : b) out.push_back(fp8::dequantize_fp8(c, dt == FP8_DTYPE_E5M2, si));
  }
  return out;
}

std::vector<uint16_t> f16_of(const std::vector<float>& v) {
  std::vector<uint16_t> h;
  for (float f : v) h.push_back(fp8::float_to_f16(f));
  return h;
}
std::vector<uint16_t> masters_of(fp8_model_t* m, int32_t index, int64_t n) {
  const Arena a = flat(m, FP8_STORAGE_MASTERS, FP8_DTYPE_F16);
  std::vector<uint16_t> h(static_cast<size_t>(n));
  EXPECT_NE(a.data, nullptr);
  EXPECT_LE(master_offset(index) + h.size() * 2, a.bytes);
  if (a.data && master_offset(index) + h.size() * 2 <= a.bytes)
    std::memcpy(h.data(), static_cast<const uint8_t*>(a.data) + master_offset(index), h.size() * 2);
  return h;
}

// One E4M3 step at |x| (in the scaled units the codes are in): 2^(e - 3) for normal |x| in
// [2^e, 2^(e+1)), 2^-9 below 2^-6.
double e4m3_step(double x) {
  x = std::fabs(x);
  if (x < 1.0 / 64) return 1.0 / 512;
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(x))) - 3);
}

// Every slice of every parameter, checked against the arena fp8_model_flat_storage gives for its
// (role, dtype): inside it, 256-byte aligned from its start, after the previous slice of that arena
// (parameter order, no overlap); and every arena ends at the last slice's end rounded up to 256 (no
// gaps between slices, given the alignment).
void expect_slices(fp8_model_t* m) {
  std::map<std::pair<int32_t, int32_t>, size_t> end;  // (role, dtype) -> end of the last slice so far
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t i = 0; i < count; ++i) {
    const char* name = nullptr;
    fp8_tensor_t *v = nullptr, *g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, &name, &v, &g));
    for (auto [role, t] :
         {std::pair<fp8_storage_role_t, fp8_tensor_t*>{FP8_STORAGE_VALUES, v}, {FP8_STORAGE_GRADS, g}}) {
      SCOPED_TRACE(std::string(name) + " " + role_name(role));
      const fp8_dtype_t dt = dtype_of(t);
      int64_t n = 0;
      EXPECT_OK(fp8_tensor_numel(t, &n));
      const size_t nbytes = static_cast<size_t>(n) * fp8_dtype_size(dt);
      const Arena a = flat(m, role, dt);
      ASSERT_NE(a.data, nullptr) << "no arena for " << kind_name(role, dt);
      const char* base = static_cast<const char*>(a.data);
      const char* at = static_cast<const char*>(data_of(t));
      ASSERT_GE(at, base) << "the slice starts before its arena";
      const size_t off = static_cast<size_t>(at - base);
      EXPECT_EQ(off % kAlign, 0u) << "offset " << off;
      EXPECT_LE(off + nbytes, a.bytes) << "the slice ends after its arena";
      size_t& e = end[{role, dt}];
      EXPECT_GE(off, e) << "the slice overlaps the one before it, or is out of parameter order";
      e = off + nbytes;
    }
  }
  for (const auto& [kind, e] : end) {
    const Arena a = flat(m, kind.first, kind.second);
    EXPECT_EQ(a.bytes, aligned(e)) << kind_name(kind.first, kind.second) << ": gaps between slices or slack";
  }
}

// Everything the storage holds: every arena's place and bytes, every tensor handle, pointer, bytes
// and (FP8) scale_inv.
struct State {
  std::vector<Arena> arenas;
  std::vector<std::vector<uint8_t>> arena_contents;
  std::vector<const fp8_tensor_t*> handles;
  std::vector<void*> data;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<float> scale_invs;
};
State state_of(fp8_model_t* m) {
  State s;
  for (fp8_storage_role_t r = FP8_STORAGE_VALUES; r <= FP8_STORAGE_MASTERS; ++r)
    for (fp8_dtype_t d = FP8_DTYPE_F32; d <= FP8_DTYPE_E5M2; ++d) {
      s.arenas.push_back(flat(m, r, d));
      s.arena_contents.push_back(arena_bytes(s.arenas.back()));
    }
  int32_t count = 0;
  EXPECT_OK(fp8_model_parameter_count(m, &count));
  for (int32_t i = 0; i < count; ++i) {
    const char* name = nullptr;
    fp8_tensor_t *v = nullptr, *g = nullptr;
    EXPECT_OK(fp8_model_parameter_at(m, i, &name, &v, &g));
    fp8_tensor_t *v2 = nullptr, *g2 = nullptr;
    EXPECT_OK(fp8_model_parameter(m, name, &v2, &g2));
    EXPECT_EQ(v2, v);
    EXPECT_EQ(g2, g);
    for (fp8_tensor_t* t : {v, g}) {
      s.handles.push_back(t);
      s.data.push_back(data_of(t));
      s.bytes.push_back(tensor_bytes(t));
      s.scale_invs.push_back(is_fp8(dtype_of(t)) ? scale_inv_of(t) : 0.0f);
    }
  }
  return s;
}
void expect_same_places(const State& got, const State& want, const char* what) {
  EXPECT_EQ(got.handles, want.handles) << what << ": other handles";
  EXPECT_EQ(got.data, want.data) << what << ": a data pointer moved";
  EXPECT_TRUE(got.arenas == want.arenas) << what << ": an arena moved or changed size";
}
void expect_same_state(const State& got, const State& want, const char* what) {
  expect_same_places(got, want, what);
  EXPECT_TRUE(got.arena_contents == want.arena_contents) << what << ": the bytes of an arena changed";
  EXPECT_TRUE(got.bytes == want.bytes) << what << ": the bytes of a tensor changed";
  ASSERT_EQ(got.scale_invs.size(), want.scale_invs.size());
  for (size_t i = 0; i < got.scale_invs.size(); ++i)
    EXPECT_EQ(bits_of(got.scale_invs[i]), bits_of(want.scale_invs[i])) << what << ": scale_inv of tensor " << i;
}

// =================================================================================================
// 1. The layout at each level
// =================================================================================================

class StorageLevel : public ::testing::TestWithParam<Level> {};

TEST_P(StorageLevel, EverySliceAlignedInOrderInsideItsArenaWithTheArenasSizes) {
  const Level& l = GetParam();
  Net n(l);
  fp8_model_t* m = n.m();
  EXPECT_EQ(storage_level_of(m), l.level);
  // The arenas there are, with their sizes, and NULL, 0 for every other kind.
  const std::vector<ArenaWant> want = arenas_of(l);
  for (fp8_storage_role_t r = FP8_STORAGE_VALUES; r <= FP8_STORAGE_MASTERS; ++r)
    for (fp8_dtype_t d = FP8_DTYPE_F32; d <= FP8_DTYPE_E5M2; ++d) {
      SCOPED_TRACE(kind_name(r, d));
      size_t bytes = 0;
      for (const ArenaWant& w : want)
        if (w.role == r && w.dtype == d) bytes = w.bytes;
      void* data = reinterpret_cast<void*>(uintptr_t{1});
      size_t got = 12345;
      FP8_ASSERT_OK(fp8_model_flat_storage(m, r, d, &data, &got));
      EXPECT_EQ(got, bytes);
      EXPECT_EQ(data == nullptr, bytes == 0);
    }
  // Each parameter's tensors have the level's dtypes and lie in their arenas as documented.
  for (int32_t i = 0; i < kCount; ++i) {
    SCOPED_TRACE(kParams[i].name);
    EXPECT_EQ(dtype_of(n.value(i)), value_dtype(l, kParams[i]));
    EXPECT_EQ(dtype_of(n.grad(i)), grad_dtype(l, kParams[i]));
  }
  expect_slices(m);
  // The values are those written before the conversion, in the level's storage; the gradients zero.
  for (int32_t i = 0; i < kCount; ++i) {
    SCOPED_TRACE(kParams[i].name);
    const std::vector<float>& w = n.init[static_cast<size_t>(i)];
    const fp8_dtype_t dt = dtype_of(n.value(i));
    if (dt == FP8_DTYPE_F32) {
      EXPECT_EQ(download<float>(n.value(i)), w);
    } else if (dt == FP8_DTYPE_F16) {
      EXPECT_EQ(download<uint16_t>(n.value(i)), f16_of(w));
    } else {  // O3: the F16 master in its slice of the masters arena, the E4M3 copy within a step of it
      const std::vector<uint16_t> master = masters_of(m, i, kParams[i].numel);
      EXPECT_EQ(master, f16_of(w));
      const std::vector<float> e4m3 = decoded(n.value(i));
      const float si = scale_inv_of(n.value(i));
      for (size_t k = 0; k < e4m3.size(); ++k) {
        const double x = fp8::f16_to_float(master[k]);
        ASSERT_LE(std::fabs(e4m3[k] - x), e4m3_step(x / si) * si) << k;
      }
    }
    for (float g : decoded(n.grad(i))) ASSERT_EQ(g, 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, StorageLevel, ::testing::Values(kUnconverted, kTe, kO1, kO2, kO2E4m3, kO3),
                         [](const ::testing::TestParamInfo<Level>& i) { return std::string(i.param.name); });

// An empty model stores nothing: NULL, 0 for every kind, level 0.
TEST(StorageEmpty, AModelWithoutParametersHasNoArenas) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  FP8_ASSERT_OK(fp8_model_add_activation(model.get(), "act", FP8_ACTIVATION_GELU, nullptr));
  EXPECT_EQ(storage_level_of(model.get()), 0);
  for (fp8_storage_role_t r = FP8_STORAGE_VALUES; r <= FP8_STORAGE_MASTERS; ++r)
    for (fp8_dtype_t d = FP8_DTYPE_F32; d <= FP8_DTYPE_E5M2; ++d) {
      void* data = reinterpret_cast<void*>(uintptr_t{1});
      size_t bytes = 1;
      FP8_ASSERT_OK(fp8_model_flat_storage(model.get(), r, d, &data, &bytes));
      EXPECT_EQ(data, nullptr) << kind_name(r, d);
      EXPECT_EQ(bytes, 0u) << kind_name(r, d);
    }
}

// =================================================================================================
// 2. Handles and pointers: kept by the optimizer, moved by an added layer
// =================================================================================================

// fp8_optimizer_create adopts the storage: the same handles, data pointers, arenas and bytes after
// it. Steps write into the same places (handles, pointers and arenas kept, the values changed), and so
// does a second optimizer made after the first is gone.
TEST_P(StorageLevel, OptimizerCreateAndStepsKeepHandlesPointersAndBytes) {
  const Level& l = GetParam();
  for (fp8_optimizer_kind_t kind : {FP8_OPTIMIZER_ADAM, FP8_OPTIMIZER_SGD}) {
    if (kind == FP8_OPTIMIZER_SGD && l.level >= 2) continue;  // (refused: test_optim_levels)
    SCOPED_TRACE(kind == FP8_OPTIMIZER_ADAM ? "Adam" : "SGD");
    Net n(l);
    fp8_model_t* m = n.m();
    n.accumulate_all(1);  // gradients with something in them
    const State before = state_of(m);
    Optimizer o = make_optimizer(m, kind);
    ASSERT_NE(o, nullptr);
    expect_same_state(state_of(m), before, "fp8_optimizer_create");
    EXPECT_EQ(storage_level_of(m), l.level);
    FP8_ASSERT_OK(fp8_optimizer_set_float(o.get(), FP8_OPTIM_LR, 0.05));
    for (uint32_t step = 0; step < 3; ++step) {
      FP8_ASSERT_OK(fp8_optimizer_step(o.get()));
      FP8_ASSERT_OK(fp8_optimizer_zero_grad(o.get()));
      n.accumulate_all(10 + step);
    }
    EXPECT_EQ(stats_of(o.get()).steps, 3);
    const State after = state_of(m);
    expect_same_places(after, before, "the optimizer steps");
    for (int32_t i = 0; i < kCount; ++i)
      EXPECT_NE(after.bytes[static_cast<size_t>(2 * i)], before.bytes[static_cast<size_t>(2 * i)])
          << kParams[i].name << ": the steps did not reach this value";
    if (l.level == 3) {
      EXPECT_NE(masters_of(m, 0, kParams[0].numel), f16_of(n.init[0])) << "the steps did not reach the master";
    }
    expect_slices(m);
    o.reset();
    Optimizer again = make_optimizer(m, kind);
    expect_same_state(state_of(m), after, "a second fp8_optimizer_create");
  }
}

// Before conversion the storage keeps room to append; a layer that does not fit moves every slice to
// new arenas. The handles stay the same objects (fetched again or not) and keep their values and
// gradients; only their data pointers change. Conversion to another level moves them again, with
// the same handles.
TEST(StorageLayers, AddingALayerMovesTheDataButKeepsHandlesAndValues) {
  Context ctx = make_context(FP8_DEVICE_CPU);
  Model model = make_model(ctx.get());
  fp8_model_t* m = model.get();
  FP8_ASSERT_OK(fp8_model_add_linear(m, "a", 4, 4, 1, nullptr));  // 16 + 4 elements: 512 bytes of slices
  fp8_tensor_t *aw = nullptr, *ag = nullptr, *ab = nullptr;
  FP8_ASSERT_OK(fp8_model_parameter(m, "a.weight", &aw, &ag));
  FP8_ASSERT_OK(fp8_model_parameter(m, "a.bias", &ab, nullptr));
  const std::vector<float> w = randn(16, 1, 0.5f), b = randn(4, 2, 0.5f), g = randn(16, 3, 0.5f);
  upload(aw, w);
  upload(ab, b);
  Tensor gt = make_tensor(ctx.get(), FP8_DTYPE_F32, {16});
  upload(gt.get(), g);
  FP8_ASSERT_OK(fp8_model_accumulate_grad(m, 0, gt.get()));
  void* const w_at = data_of(aw);
  void* const g_at = data_of(ag);
  const Arena values_before = flat(m, FP8_STORAGE_VALUES, FP8_DTYPE_F32);
  EXPECT_EQ(values_before.bytes, 512u);

  FP8_ASSERT_OK(fp8_model_add_linear(m, "big", 64, 64, 0, nullptr));  // 16 KiB: cannot fit in the room kept
  fp8_tensor_t *aw2 = nullptr, *ag2 = nullptr;
  FP8_ASSERT_OK(fp8_model_parameter(m, "a.weight", &aw2, &ag2));
  EXPECT_EQ(aw2, aw) << "the handle changed";
  EXPECT_EQ(ag2, ag) << "the gradient's handle changed";
  EXPECT_NE(data_of(aw), w_at) << "the value did not move";
  EXPECT_NE(data_of(ag), g_at) << "the gradient did not move";
  EXPECT_EQ(download<float>(aw), w);
  EXPECT_EQ(download<float>(ab), b);
  EXPECT_EQ(download<float>(ag), g);
  const Arena values_after = flat(m, FP8_STORAGE_VALUES, FP8_DTYPE_F32);
  EXPECT_NE(values_after.data, values_before.data);
  EXPECT_EQ(values_after.bytes, 512u + 64 * 64 * 4);
  expect_slices(m);

  // Converted to O2: the weights move to the F16 arena, same handles, rounded values; the bias stays.
  Recipe r = make_recipe("backend=msamp, opt_level=O2");
  FP8_ASSERT_OK(fp8_convert_model(m, r.get(), nullptr));
  FP8_ASSERT_OK(fp8_model_parameter(m, "a.weight", &aw2, &ag2));
  EXPECT_EQ(aw2, aw);
  EXPECT_EQ(ag2, ag);
  EXPECT_EQ(dtype_of(aw), FP8_DTYPE_F16);
  EXPECT_EQ(download<uint16_t>(aw), f16_of(w));
  EXPECT_EQ(download<float>(ab), b);
  expect_slices(m);
}

// =================================================================================================
// 3. fp8_model_write_parameter
// =================================================================================================

std::vector<uint8_t> as_bytes(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

// Into FP32 storage (te, and the FP32 parameters of every level): F32 exactly, F16 and BF16 widened
// exactly.
TEST(WriteParameter, IntoFp32StorageF32IsExactAndF16Bf16WidenExactly) {
  for (const Level& l : {kUnconverted, kTe, kO2, kO3}) {
    SCOPED_TRACE(l.name);
    Net n(l);
    fp8_model_t* m = n.m();
    for (int32_t i = 0; i < kCount; ++i) {
      if (value_dtype(l, kParams[i]) != FP8_DTYPE_F32) continue;
      SCOPED_TRACE(kParams[i].name);
      const size_t count = static_cast<size_t>(kParams[i].numel);
      std::vector<float> f = randn(count, 50 + static_cast<uint32_t>(i), 2.0f);
      f[0] = 1.0f + std::ldexp(1.0f, -23);  // not representable in F16 or BF16
      f[1] = -0.0f;
      FP8_ASSERT_OK(fp8_model_write_parameter(m, i, FP8_DTYPE_F32, f.data(), count * 4));
      EXPECT_EQ(tensor_bytes(n.value(i)), as_bytes(f.data(), count * 4));
      std::vector<uint16_t> h = f16_of(randn(count, 60 + static_cast<uint32_t>(i), 2.0f));
      FP8_ASSERT_OK(fp8_model_write_parameter(m, i, FP8_DTYPE_F16, h.data(), count * 2));
      std::vector<float> want;
      for (uint16_t x : h) want.push_back(fp8::f16_to_float(x));
      EXPECT_EQ(download<float>(n.value(i)), want);
      std::vector<uint16_t> bf;
      want.clear();
      for (float x : randn(count, 70 + static_cast<uint32_t>(i), 2.0f)) {
        bf.push_back(fp8::float_to_bf16(x));
        want.push_back(fp8::bf16_to_float(bf.back()));
      }
      FP8_ASSERT_OK(fp8_model_write_parameter(m, i, FP8_DTYPE_BF16, bf.data(), count * 2));
      EXPECT_EQ(download<float>(n.value(i)), want);
    }
    expect_slices(m);
  }
}

// Into an F16 weight (O1, O2): rounded to nearest, ties to even (the ties written out by hand); F16
// host values as they are; BF16 ones through float.
TEST(WriteParameter, IntoAnF16WeightRoundsToNearestEven) {
  for (const Level& l : {kO1, kO2}) {
    SCOPED_TRACE(l.name);
    Net n(l);
    fp8_model_t* m = n.m();
    const size_t count = static_cast<size_t>(kParams[4].numel);  // fc2.weight
    std::vector<float> f = randn(count, 80, 0.5f);
    struct Tie {
      float x;
      uint16_t bits;
    };
    const Tie ties[] = {
        {1.0f + std::ldexp(1.0f, -11), 0x3C00},                             // halfway 1 .. 1+2^-10: down to even
        {1.0f + 3 * std::ldexp(1.0f, -11), 0x3C02},                         // halfway 1+2^-10 .. 1+2^-9: up to even
        {-(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0xBC01},  // just above halfway: away
        {2049.0f, 0x6800},                                                  // halfway 2048 .. 2050: 2048
        {2051.0f, 0x6802},                                                  // halfway 2050 .. 2052: 2052
        {std::ldexp(1.0f, -25), 0x0000},                                    // half the smallest subnormal: 0
        {3 * std::ldexp(1.0f, -25), 0x0002},                                // 1.5 subnormal steps: 2 steps
    };
    for (size_t k = 0; k < std::size(ties); ++k) f[k] = ties[k].x;
    FP8_ASSERT_OK(fp8_model_write_parameter(m, 4, FP8_DTYPE_F32, f.data(), count * 4));
    const std::vector<uint16_t> got = download<uint16_t>(n.value(4));
    for (size_t k = 0; k < std::size(ties); ++k) EXPECT_EQ(got[k], ties[k].bits) << "tie " << k;
    EXPECT_EQ(got, f16_of(f));
    // F16 host bits are stored as they are.
    const std::vector<uint16_t> h = f16_of(randn(count, 81, 0.5f));
    FP8_ASSERT_OK(fp8_model_write_parameter(m, 4, FP8_DTYPE_F16, h.data(), count * 2));
    EXPECT_EQ(download<uint16_t>(n.value(4)), h);
    // BF16 (8 mantissa bits) fits F16 but for range: the F16 of the BF16 value.
    std::vector<uint16_t> bf;
    std::vector<float> wide;
    for (float x : randn(count, 82, 0.5f)) {
      bf.push_back(fp8::float_to_bf16(x));
      wide.push_back(fp8::bf16_to_float(bf.back()));
    }
    FP8_ASSERT_OK(fp8_model_write_parameter(m, 4, FP8_DTYPE_BF16, bf.data(), count * 2));
    EXPECT_EQ(download<uint16_t>(n.value(4)), f16_of(wide));
    // The other parameters are as they were.
    EXPECT_EQ(download<uint16_t>(n.value(0)), f16_of(n.init[0]));
    EXPECT_EQ(download<float>(n.value(1)), n.init[1]);
  }
}

// Into an O3 weight: the master is exactly the F16 of the values, the E4M3 copy within one E4M3 step
// of it, scaled so that the master's amax maps to 448; with or without an optimizer.
TEST(WriteParameter, IntoAnO3WeightWritesTheMasterAndItsE4m3Copy) {
  for (bool with_optimizer : {false, true}) {
    SCOPED_TRACE(with_optimizer ? "with an optimizer" : "without optimizer");
    Net n(kO3);
    fp8_model_t* m = n.m();
    Optimizer o;
    if (with_optimizer) o = make_optimizer(m, FP8_OPTIMIZER_ADAM);
    for (int32_t i : {0, 4}) {
      SCOPED_TRACE(kParams[i].name);
      const int64_t count = kParams[i].numel;
      for (int form = 0; form < 2; ++form) {  // F32, then F16 host values
        std::vector<float> f = randn(static_cast<size_t>(count), 90 + static_cast<uint32_t>(i + form), 1.5f);
        const std::vector<uint16_t> h = f16_of(f);
        if (form == 0) {
          FP8_ASSERT_OK(fp8_model_write_parameter(m, i, FP8_DTYPE_F32, f.data(), f.size() * 4));
        } else {
          FP8_ASSERT_OK(fp8_model_write_parameter(m, i, FP8_DTYPE_F16, h.data(), h.size() * 2));
        }
        EXPECT_EQ(masters_of(m, i, count), h) << "the master is not the F16 of the values";
        const float si = scale_inv_of(n.value(i));
        float amax = 0.0f;
        for (uint16_t x : h) amax = std::max(amax, std::fabs(fp8::f16_to_float(x)));
        EXPECT_NEAR(si, amax / 448.0f, 1e-6f * si);
        const std::vector<float> e4m3 = decoded(n.value(i));
        double worst = 0.0;
        for (size_t k = 0; k < e4m3.size(); ++k) {
          const double x = fp8::f16_to_float(h[k]);
          worst = std::max(worst, std::fabs(e4m3[k] - x) / (e4m3_step(x / si) * si));
        }
        EXPECT_LE(worst, 1.0) << "an E4M3 value more than one step from its master";
        EXPECT_GT(worst, 0.0) << "the E4M3 copy is exact: the test cannot tell one step";
      }
    }
    // The other weight's master of the first write is still there when the second is written.
    EXPECT_EQ(masters_of(m, 0, kParams[0].numel), f16_of(randn(static_cast<size_t>(kParams[0].numel), 91, 1.5f)));
    if (o) {  // the optimizer steps from the written master
      const std::vector<uint16_t> written = masters_of(m, 4, kParams[4].numel);
      n.accumulate_all(3);
      FP8_ASSERT_OK(fp8_optimizer_step(o.get()));
      EXPECT_EQ(stats_of(o.get()).last_skipped, 0);
      const std::vector<uint16_t> stepped = masters_of(m, 4, kParams[4].numel);
      size_t close = 0;
      for (size_t k = 0; k < stepped.size(); ++k)
        close += std::fabs(fp8::f16_to_float(stepped[k]) - fp8::f16_to_float(written[k])) < 0.01f;
      EXPECT_EQ(close, stepped.size()) << "the step did not start from the written master";
      EXPECT_NE(stepped, written);
    }
  }
}

// Refusals: a bad index, an FP8 or unknown dtype, bytes that do not match, NULL src or model. Each
// names what is wrong and changes nothing in the storage.
TEST(WriteParameter, RefusalsChangeNothing) {
  for (const Level& l : {kTe, kO2, kO3}) {
    SCOPED_TRACE(l.name);
    Net n(l);
    fp8_model_t* m = n.m();
    n.accumulate_all(1);
    const State before = state_of(m);
    const size_t count = static_cast<size_t>(kParams[0].numel);
    const std::vector<float> f(count, 0.5f);
    const char* fn = "fp8_model_write_parameter";
    EXPECT_REFUSED_WORDS(fp8_model_write_parameter(m, -1, FP8_DTYPE_F32, f.data(), count * 4), FP8_ERR_INVALID_ARGUMENT,
                         fn, "index = -1");
    EXPECT_REFUSED_WORDS(fp8_model_write_parameter(m, kCount, FP8_DTYPE_F32, f.data(), count * 4),
                         FP8_ERR_INVALID_ARGUMENT, fn, "index = 5");
    EXPECT_REFUSED_WORDS(fp8_model_write_parameter(m, 0, FP8_DTYPE_E4M3, f.data(), count), FP8_ERR_DTYPE, fn, "e4m3",
                         "f32, f16 or bf16");
    EXPECT_REFUSED_WORDS(fp8_model_write_parameter(m, 0, FP8_DTYPE_E5M2, f.data(), count), FP8_ERR_DTYPE, fn, "e5m2");
    EXPECT_REFUSED(fp8_model_write_parameter(m, 0, 7, f.data(), count * 4), FP8_ERR_DTYPE, fn, "dtype");
    for (size_t bytes : {count * 4 - 1, count * 2, count * 4 + 4, size_t{0}})
      EXPECT_REFUSED_WORDS(fp8_model_write_parameter(m, 0, FP8_DTYPE_F32, f.data(), bytes), FP8_ERR_SHAPE, fn,
                           "bytes = " + std::to_string(bytes), "fc1.weight", std::to_string(count * 4));
    EXPECT_REFUSED(fp8_model_write_parameter(m, 1, FP8_DTYPE_F16, f.data(), 20 * 4), FP8_ERR_SHAPE, fn, "40");
    EXPECT_REFUSED(fp8_model_write_parameter(m, 0, FP8_DTYPE_F32, nullptr, count * 4), FP8_ERR_INVALID_ARGUMENT, fn,
                   "src");
    EXPECT_REFUSED(fp8_model_write_parameter(nullptr, 0, FP8_DTYPE_F32, f.data(), count * 4), FP8_ERR_INVALID_ARGUMENT,
                   fn, "model");
    expect_same_state(state_of(m), before, "the refused writes");
    // (and the same call with the right arguments does change it)
    FP8_ASSERT_OK(fp8_model_write_parameter(m, 0, FP8_DTYPE_F32, f.data(), count * 4));
    EXPECT_NE(tensor_bytes(n.value(0)), before.bytes[0]);
  }
}

// =================================================================================================
// 4. fp8_model_flat_storage and fp8_model_storage_level refusals
// =================================================================================================

TEST(FlatStorage, RefusesBadRolesDtypesAndNullsAndGivesNullForKindsNotStored) {
  Net n(kO2);
  fp8_model_t* m = n.m();
  void* data = nullptr;
  size_t bytes = 0;
  const char* fn = "fp8_model_flat_storage";
  for (fp8_storage_role_t role : {-1, 3})
    EXPECT_REFUSED_WORDS(fp8_model_flat_storage(m, role, FP8_DTYPE_F32, &data, &bytes), FP8_ERR_INVALID_ARGUMENT, fn,
                         "role = " + std::to_string(role), "FP8_STORAGE_VALUES");
  for (fp8_dtype_t dt : {-1, 5})
    EXPECT_REFUSED_WORDS(fp8_model_flat_storage(m, FP8_STORAGE_VALUES, dt, &data, &bytes), FP8_ERR_DTYPE, fn,
                         "dtype = " + std::to_string(dt));
  EXPECT_REFUSED(fp8_model_flat_storage(m, FP8_STORAGE_VALUES, FP8_DTYPE_F32, nullptr, &bytes),
                 FP8_ERR_INVALID_ARGUMENT, fn, "data");
  EXPECT_REFUSED(fp8_model_flat_storage(m, FP8_STORAGE_VALUES, FP8_DTYPE_F32, &data, nullptr), FP8_ERR_INVALID_ARGUMENT,
                 fn, "bytes");
  EXPECT_REFUSED(fp8_model_flat_storage(nullptr, FP8_STORAGE_VALUES, FP8_DTYPE_F32, &data, &bytes),
                 FP8_ERR_INVALID_ARGUMENT, fn, "model");
  // Kinds an O2 model (HYBRID) does not store: NULL and 0, the outputs overwritten.
  const std::pair<fp8_storage_role_t, fp8_dtype_t> absent[] = {
      {FP8_STORAGE_VALUES, FP8_DTYPE_BF16}, {FP8_STORAGE_VALUES, FP8_DTYPE_E4M3}, {FP8_STORAGE_GRADS, FP8_DTYPE_E4M3},
      {FP8_STORAGE_GRADS, FP8_DTYPE_F16},   {FP8_STORAGE_MASTERS, FP8_DTYPE_F16}, {FP8_STORAGE_MASTERS, FP8_DTYPE_F32},
  };
  for (auto [role, dt] : absent) {
    SCOPED_TRACE(kind_name(role, dt));
    data = reinterpret_cast<void*>(uintptr_t{16});
    bytes = 77;
    FP8_ASSERT_OK(fp8_model_flat_storage(m, role, dt, &data, &bytes));
    EXPECT_EQ(data, nullptr);
    EXPECT_EQ(bytes, 0u);
  }
  // ... and the kinds it stores are there.
  FP8_ASSERT_OK(fp8_model_flat_storage(m, FP8_STORAGE_VALUES, FP8_DTYPE_F16, &data, &bytes));
  EXPECT_NE(data, nullptr);
  EXPECT_EQ(bytes, 2048u);

  int32_t level = -1;
  EXPECT_REFUSED(fp8_model_storage_level(nullptr, &level), FP8_ERR_INVALID_ARGUMENT, "fp8_model_storage_level",
                 "model");
  EXPECT_REFUSED(fp8_model_storage_level(m, nullptr), FP8_ERR_INVALID_ARGUMENT, "fp8_model_storage_level", "level");
  EXPECT_EQ(level, -1);
}

// =================================================================================================
// 5. zero_grad
// =================================================================================================

// fp8_model_zero_grad and fp8_optimizer_zero_grad zero every byte of every gradient arena (padding
// included) and leave the values alone; an FP8 gradient is then "nothing accumulated yet": the next
// addition scales it from its own amax (fp8_max / amax, bit for bit), as on a fresh gradient.
TEST_P(StorageLevel, ZeroGradZeroesEveryGradientArena) {
  const Level& l = GetParam();
  Net n(l);
  fp8_model_t* m = n.m();
  Optimizer o = make_optimizer(m, FP8_OPTIMIZER_ADAM);
  for (int via_optimizer = 0; via_optimizer < 2; ++via_optimizer) {
    SCOPED_TRACE(via_optimizer ? "fp8_optimizer_zero_grad" : "fp8_model_zero_grad");
    n.accumulate_all(5 + static_cast<uint32_t>(via_optimizer));
    n.accumulate_all(7);  // two additions: FP8 ones requantised once more
    std::vector<Arena> grads;
    for (fp8_dtype_t d = FP8_DTYPE_F32; d <= FP8_DTYPE_E5M2; ++d) {
      const Arena a = flat(m, FP8_STORAGE_GRADS, d);
      if (!a.data) continue;
      grads.push_back(a);
      const std::vector<uint8_t> b = arena_bytes(a);
      EXPECT_NE(std::count(b.begin(), b.end(), 0), static_cast<std::ptrdiff_t>(b.size()))
          << "gradient arena " << d << " is zero before zero_grad";
    }
    EXPECT_EQ(grads.size(), l.level == 0 ? 1u : 2u);
    std::vector<std::vector<uint8_t>> values;
    for (fp8_dtype_t d = FP8_DTYPE_F32; d <= FP8_DTYPE_E5M2; ++d)
      values.push_back(arena_bytes(flat(m, FP8_STORAGE_VALUES, d)));
    const std::vector<uint8_t> masters = arena_bytes(flat(m, FP8_STORAGE_MASTERS, FP8_DTYPE_F16));
    if (via_optimizer) {
      FP8_ASSERT_OK(fp8_optimizer_zero_grad(o.get()));
    } else {
      FP8_ASSERT_OK(fp8_model_zero_grad(m));
    }
    for (const Arena& a : grads) {
      const std::vector<uint8_t> b = arena_bytes(a);
      EXPECT_EQ(std::count(b.begin(), b.end(), 0), static_cast<std::ptrdiff_t>(b.size())) << "a byte left non-zero";
    }
    for (int32_t i = 0; i < kCount; ++i)
      for (float g : decoded(n.grad(i))) ASSERT_EQ(g, 0.0f) << kParams[i].name;
    for (fp8_dtype_t d = FP8_DTYPE_F32; d <= FP8_DTYPE_E5M2; ++d)
      EXPECT_EQ(arena_bytes(flat(m, FP8_STORAGE_VALUES, d)), values[static_cast<size_t>(d)]) << "values " << d;
    EXPECT_EQ(arena_bytes(flat(m, FP8_STORAGE_MASTERS, FP8_DTYPE_F16)), masters);
    // The next addition starts afresh.
    const std::vector<float> g = randn(static_cast<size_t>(kParams[0].numel), 99, 0.05f);
    n.accumulate(0, g);
    if (l.level == 0) {
      EXPECT_EQ(download<float>(n.grad(0)), g);
    } else {
      const bool e5m2 = l.grad8 == FP8_DTYPE_E5M2;
      const float scale = (e5m2 ? 57344.0f : 448.0f) / amax_of(g);
      EXPECT_EQ(bits_of(scale_inv_of(n.grad(0))), bits_of(1.0f / scale));
      const std::vector<uint8_t> codes = download<uint8_t>(n.grad(0));
      size_t same = 0;
      for (size_t k = 0; k < codes.size(); ++k) same += codes[k] == fp8::encode_fp8(g[k] * scale, e5m2);
      EXPECT_EQ(same, codes.size());
    }
    FP8_ASSERT_OK(fp8_model_zero_grad(m));
  }
}

}  // namespace
