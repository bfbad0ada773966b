// The recipe through the public C ABI only: Accelerate's defaults, attribute ranges, the text form
// (parse is all or nothing, to_string round-trips), the buffer contract of to_string, clone and the
// role-to-dtype mapping. Every expectation here comes from the comments of include/fp8.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fp8.h"

namespace {

struct RecipeDeleter {
  void operator()(fp8_recipe_t* r) const { fp8_recipe_destroy(r); }
};
using RecipePtr = std::unique_ptr<fp8_recipe_t, RecipeDeleter>;

RecipePtr make_recipe() {
  fp8_recipe_t* r = nullptr;
  EXPECT_EQ(fp8_recipe_create(&r), FP8_OK) << fp8_last_error_message();
  EXPECT_NE(r, nullptr);
  return RecipePtr(r);
}

int64_t get(const fp8_recipe_t* r, fp8_recipe_attr_t a) {
  int64_t v = -777;
  EXPECT_EQ(fp8_recipe_get_int(r, a, &v), FP8_OK) << "attr " << a << ": " << fp8_last_error_message();
  return v;
}

using Values = std::array<int64_t, FP8_RECIPE_ATTR_COUNT>;

Values snapshot(const fp8_recipe_t* r) {
  Values v{};
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a) v[static_cast<size_t>(a)] = get(r, a);
  return v;
}

std::string to_string(const fp8_recipe_t* r) {
  size_t needed = 0;
  EXPECT_EQ(fp8_recipe_to_string(r, nullptr, 0, &needed), FP8_ERR_BUFFER_TOO_SMALL);
  std::vector<char> buf(needed + 1, '\x7f');
  EXPECT_EQ(fp8_recipe_to_string(r, buf.data(), buf.size(), nullptr), FP8_OK) << fp8_last_error_message();
  return std::string(buf.data());
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Case-insensitive substring test for message checks (the text form is case-insensitive).
bool icontains(const std::string& haystack, const std::string& needle) {
  return lower(haystack).find(lower(needle)) != std::string::npos;
}

std::string last_error() { return fp8_last_error_message(); }

// The documented range and default of every attribute (fp8.h, next to each FP8_RECIPE_* id).
struct Expected {
  fp8_recipe_attr_t attr;
  int64_t min, max, def;
};
const Expected kExpected[FP8_RECIPE_ATTR_COUNT] = {
    {FP8_RECIPE_BACKEND, FP8_BACKEND_AUTO, FP8_BACKEND_MSAMP, FP8_BACKEND_AUTO},
    {FP8_RECIPE_OPT_LEVEL, FP8_OPT_O1, FP8_OPT_O3, FP8_OPT_O2},
    {FP8_RECIPE_MARGIN, 0, 32, 0},
    {FP8_RECIPE_INTERVAL, 1, 1000000, 1},
    {FP8_RECIPE_FP8_FORMAT, FP8_FORMAT_E4M3, FP8_FORMAT_HYBRID, FP8_FORMAT_HYBRID},
    {FP8_RECIPE_AMAX_HISTORY_LEN, 1, 16384, 1024},
    {FP8_RECIPE_AMAX_COMPUTE_ALGO, FP8_AMAX_ALGO_MAX, FP8_AMAX_ALGO_MOST_RECENT, FP8_AMAX_ALGO_MOST_RECENT},
    {FP8_RECIPE_OVERRIDE_FPROP, 0, 1, 0},
    {FP8_RECIPE_OVERRIDE_DGRAD, 0, 1, 0},
    {FP8_RECIPE_OVERRIDE_WGRAD, 0, 1, 0},
    {FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 0, 1, 0},
    {FP8_RECIPE_SMALL_LAYER_FALLBACK, 0, 1, 1},
    {FP8_RECIPE_POWER_2_SCALES, FP8_POWER_2_SCALES_AUTO, 1, FP8_POWER_2_SCALES_AUTO},
    {FP8_RECIPE_SCALING, FP8_SCALING_DELAYED, FP8_SCALING_BLOCK, FP8_SCALING_DELAYED},
};

std::string key_of(fp8_recipe_attr_t a) {
  const char* key = nullptr;
  EXPECT_EQ(fp8_recipe_attr_bounds(a, nullptr, nullptr, nullptr, &key), FP8_OK) << fp8_last_error_message();
  return key ? key : "";
}

// A recipe with every attribute away from its default, to detect any change.
RecipePtr make_nondefault_recipe() {
  RecipePtr r = make_recipe();
  const int64_t values[FP8_RECIPE_ATTR_COUNT] = {FP8_BACKEND_TE, FP8_OPT_O3, 7, 25, FP8_FORMAT_E4M3, 48,
                                                 FP8_AMAX_ALGO_MAX, 1, 0, 1, 1, 0, 1, FP8_SCALING_CURRENT};
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a)
    EXPECT_EQ(fp8_recipe_set_int(r.get(), a, values[a]), FP8_OK) << fp8_last_error_message();
  return r;
}

// ---- defaults and bounds ------------------------------------------------------------------------

TEST(Recipe, CreateHoldsAccelerateDefaults) {
  RecipePtr r = make_recipe();
  EXPECT_EQ(get(r.get(), FP8_RECIPE_BACKEND), FP8_BACKEND_AUTO);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OPT_LEVEL), FP8_OPT_O2);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_MARGIN), 0);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_INTERVAL), 1);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_FP8_FORMAT), FP8_FORMAT_HYBRID);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_AMAX_HISTORY_LEN), 1024);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_AMAX_COMPUTE_ALGO), FP8_AMAX_ALGO_MOST_RECENT);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OVERRIDE_FPROP), 0);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OVERRIDE_DGRAD), 0);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OVERRIDE_WGRAD), 0);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_USE_AUTOCAST_DURING_EVAL), 0);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_SMALL_LAYER_FALLBACK), 1);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_POWER_2_SCALES), FP8_POWER_2_SCALES_AUTO);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_SCALING), FP8_SCALING_DELAYED);
}

TEST(Recipe, AttrBoundsReportDocumentedRangesAndDefaults) {
  RecipePtr r = make_recipe();
  for (const Expected& e : kExpected) {
    int64_t mn = -777, mx = -777, def = -777;
    const char* key = nullptr;
    ASSERT_EQ(fp8_recipe_attr_bounds(e.attr, &mn, &mx, &def, &key), FP8_OK) << fp8_last_error_message();
    EXPECT_EQ(mn, e.min) << "attr " << e.attr;
    EXPECT_EQ(mx, e.max) << "attr " << e.attr;
    EXPECT_EQ(def, e.def) << "attr " << e.attr;
    // The default reported by attr_bounds is what a new recipe holds.
    EXPECT_EQ(get(r.get(), e.attr), def) << "attr " << e.attr;
    ASSERT_NE(key, nullptr) << "attr " << e.attr;
    EXPECT_GT(std::strlen(key), 0u) << "attr " << e.attr;
  }
}

TEST(Recipe, AttrBoundsKeysAreTheTextFormNames) {
  EXPECT_EQ(key_of(FP8_RECIPE_BACKEND), "backend");
  EXPECT_EQ(key_of(FP8_RECIPE_OPT_LEVEL), "opt_level");
  EXPECT_EQ(key_of(FP8_RECIPE_MARGIN), "margin");
  EXPECT_EQ(key_of(FP8_RECIPE_INTERVAL), "interval");
  EXPECT_EQ(key_of(FP8_RECIPE_FP8_FORMAT), "fp8_format");
  EXPECT_EQ(key_of(FP8_RECIPE_AMAX_HISTORY_LEN), "amax_history_len");
  EXPECT_EQ(key_of(FP8_RECIPE_AMAX_COMPUTE_ALGO), "amax_compute_algo");
  EXPECT_EQ(key_of(FP8_RECIPE_USE_AUTOCAST_DURING_EVAL), "use_autocast_during_eval");
  EXPECT_EQ(key_of(FP8_RECIPE_SMALL_LAYER_FALLBACK), "small_layer_fallback");
  EXPECT_EQ(key_of(FP8_RECIPE_POWER_2_SCALES), "power_2_scales");
  EXPECT_EQ(key_of(FP8_RECIPE_SCALING), "scaling");
  // The three override flags share one text-form key; each still has its own, distinct name.
  std::vector<std::string> keys;
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a) keys.push_back(key_of(a));
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "two attributes share a key";
  for (fp8_recipe_attr_t a : {FP8_RECIPE_OVERRIDE_FPROP, FP8_RECIPE_OVERRIDE_DGRAD, FP8_RECIPE_OVERRIDE_WGRAD})
    EXPECT_TRUE(icontains(keys[static_cast<size_t>(a)], "override")) << keys[static_cast<size_t>(a)];
}

TEST(Recipe, AttrBoundsAcceptsNullOutputs) {
  EXPECT_EQ(fp8_recipe_attr_bounds(FP8_RECIPE_MARGIN, nullptr, nullptr, nullptr, nullptr), FP8_OK);
  int64_t mx = -777;
  EXPECT_EQ(fp8_recipe_attr_bounds(FP8_RECIPE_MARGIN, nullptr, &mx, nullptr, nullptr), FP8_OK);
  EXPECT_EQ(mx, 32);
}

// ---- set / get ------------------------------------------------------------------------------------

TEST(Recipe, SetGetEveryAttributeAtMinAndMax) {
  RecipePtr r = make_recipe();
  for (const Expected& e : kExpected) {
    for (int64_t v : {e.min, e.max}) {
      const Values before = snapshot(r.get());
      ASSERT_EQ(fp8_recipe_set_int(r.get(), e.attr, v), FP8_OK) << "attr " << e.attr << " = " << v << ": "
                                                                 << fp8_last_error_message();
      EXPECT_EQ(get(r.get(), e.attr), v) << "attr " << e.attr;
      // Only that attribute changed.
      Values expect = before;
      expect[static_cast<size_t>(e.attr)] = v;
      EXPECT_EQ(snapshot(r.get()), expect) << "attr " << e.attr;
    }
  }
}

TEST(Recipe, SetOutOfRangeIsRefusedNamingKeyAndRangeAndLeavesRecipeUnchanged) {
  RecipePtr r = make_nondefault_recipe();
  const Values before = snapshot(r.get());
  const std::string text_before = to_string(r.get());
  for (const Expected& e : kExpected) {
    const std::string key = key_of(e.attr);
    const std::string range = std::to_string(e.min) + ".." + std::to_string(e.max);
    for (int64_t v : {e.min - 1, e.max + 1, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}) {
      EXPECT_EQ(fp8_recipe_set_int(r.get(), e.attr, v), FP8_ERR_INVALID_ARGUMENT) << key << " = " << v;
      const std::string msg = last_error();
      EXPECT_TRUE(icontains(msg, "fp8_recipe_set_int")) << msg;
      EXPECT_TRUE(icontains(msg, key)) << "message does not name '" << key << "': " << msg;
      EXPECT_TRUE(icontains(msg, range)) << "message does not give the range " << range << ": " << msg;
      EXPECT_EQ(snapshot(r.get()), before) << key << " = " << v;
    }
  }
  EXPECT_EQ(to_string(r.get()), text_before);
}

TEST(Recipe, UnknownAttributeIdIsRefusedEverywhere) {
  RecipePtr r = make_nondefault_recipe();
  const Values before = snapshot(r.get());
  for (fp8_recipe_attr_t a : {int32_t{-1}, int32_t{FP8_RECIPE_ATTR_COUNT}, int32_t{FP8_RECIPE_ATTR_COUNT + 1},
                              std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    EXPECT_EQ(fp8_recipe_set_int(r.get(), a, 0), FP8_ERR_INVALID_ARGUMENT) << "attr " << a;
    EXPECT_TRUE(icontains(last_error(), "fp8_recipe_set_int")) << last_error();
    EXPECT_TRUE(icontains(last_error(), std::to_string(a))) << last_error();
    EXPECT_EQ(fp8_recipe_set_int(r.get(), a, 1), FP8_ERR_INVALID_ARGUMENT) << "attr " << a;
    EXPECT_EQ(snapshot(r.get()), before);

    int64_t value = -777;
    EXPECT_EQ(fp8_recipe_get_int(r.get(), a, &value), FP8_ERR_INVALID_ARGUMENT) << "attr " << a;
    EXPECT_EQ(value, -777);
    EXPECT_TRUE(icontains(last_error(), "fp8_recipe_get_int")) << last_error();

    int64_t mn = -777, mx = -778, def = -779;
    const char* key = "sentinel";
    EXPECT_EQ(fp8_recipe_attr_bounds(a, &mn, &mx, &def, &key), FP8_ERR_INVALID_ARGUMENT) << "attr " << a;
    EXPECT_EQ(mn, -777);
    EXPECT_EQ(mx, -778);
    EXPECT_EQ(def, -779);
    EXPECT_STREQ(key, "sentinel");
    EXPECT_TRUE(icontains(last_error(), "fp8_recipe_attr_bounds")) << last_error();
  }
}

// ---- parse --------------------------------------------------------------------------------------

TEST(Recipe, ParseSetsTheNamedAttributesOnly) {
  RecipePtr r = make_recipe();
  Values expect = snapshot(r.get());
  ASSERT_EQ(fp8_recipe_parse(r.get(), "fp8_format=E4M3, margin=1"), FP8_OK) << fp8_last_error_message();
  expect[FP8_RECIPE_FP8_FORMAT] = FP8_FORMAT_E4M3;
  expect[FP8_RECIPE_MARGIN] = 1;
  EXPECT_EQ(snapshot(r.get()), expect);
}

TEST(Recipe, ParseIgnoresCaseAndSpaces) {
  const char* variants[] = {
      "fp8_format=E4M3,margin=1",
      "fp8_format=e4m3, margin=1",
      "FP8_FORMAT=E4M3, MARGIN=1",
      "Fp8_Format=e4M3 , Margin=1",
      "  fp8_format = E4M3 ,   margin =  1  ",
      " \tfp8_format\t=\tE4M3\t,\tmargin\t=\t1\t",
      "margin=1, fp8_format=E4M3",
  };
  for (const char* text : variants) {
    RecipePtr r = make_recipe();
    Values expect = snapshot(r.get());
    expect[FP8_RECIPE_FP8_FORMAT] = FP8_FORMAT_E4M3;
    expect[FP8_RECIPE_MARGIN] = 1;
    ASSERT_EQ(fp8_recipe_parse(r.get(), text), FP8_OK) << "'" << text << "': " << fp8_last_error_message();
    EXPECT_EQ(snapshot(r.get()), expect) << "'" << text << "'";
  }
}

TEST(Recipe, ParseEmptyTextChangesNothing) {
  for (const char* text : {"", " ", "   \t  "}) {
    RecipePtr r = make_nondefault_recipe();
    const Values before = snapshot(r.get());
    EXPECT_EQ(fp8_recipe_parse(r.get(), text), FP8_OK) << "'" << text << "': " << fp8_last_error_message();
    EXPECT_EQ(snapshot(r.get()), before) << "'" << text << "'";
  }
}

// fp8.h: a key given twice takes its last value; power_2_scales=-1 is auto (FP8_POWER_2_SCALES_AUTO).
TEST(Recipe, ParseTakesARepeatedKeysLastValueAndMinusOneForAuto) {
  RecipePtr r = make_recipe();
  ASSERT_EQ(fp8_recipe_parse(r.get(), "scaling=rowwise, margin=1, scaling=block, margin=2"), FP8_OK)
      << fp8_last_error_message();
  int64_t v = 0;
  ASSERT_EQ(fp8_recipe_get_int(r.get(), FP8_RECIPE_SCALING, &v), FP8_OK);
  EXPECT_EQ(v, FP8_SCALING_BLOCK);
  ASSERT_EQ(fp8_recipe_get_int(r.get(), FP8_RECIPE_MARGIN, &v), FP8_OK);
  EXPECT_EQ(v, 2);
  ASSERT_EQ(fp8_recipe_parse(r.get(), "power_2_scales=on"), FP8_OK);
  ASSERT_EQ(fp8_recipe_parse(r.get(), "power_2_scales=-1"), FP8_OK) << fp8_last_error_message();
  ASSERT_EQ(fp8_recipe_get_int(r.get(), FP8_RECIPE_POWER_2_SCALES, &v), FP8_OK);
  EXPECT_EQ(v, FP8_POWER_2_SCALES_AUTO);
}

TEST(Recipe, ParseOverrideLinearPrecisionSetsFpropDgradWgrad) {
  RecipePtr r = make_recipe();
  ASSERT_EQ(fp8_recipe_parse(r.get(), "override_linear_precision=off/on/off"), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OVERRIDE_FPROP), 0);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OVERRIDE_DGRAD), 1);
  EXPECT_EQ(get(r.get(), FP8_RECIPE_OVERRIDE_WGRAD), 0);

  struct Case {
    const char* text;
    int64_t f, d, w;
  };
  const Case cases[] = {
      {"override_linear_precision=on/off/on", 1, 0, 1},
      {"override_linear_precision=true/false/true", 1, 0, 1},
      {"override_linear_precision=0/1/1", 0, 1, 1},
      {"override_linear_precision=1/1/0", 1, 1, 0},
      {"OVERRIDE_LINEAR_PRECISION=ON/Off/TRUE", 1, 0, 1},
      {"override_linear_precision = off / off / on", 0, 0, 1},
      {"override_linear_precision=off/off/off", 0, 0, 0},
      {"override_linear_precision=on/on/on", 1, 1, 1},
  };
  for (const Case& c : cases) {
    RecipePtr fresh = make_recipe();
    // Start from the opposite of each expected flag, so every flag must be written.
    ASSERT_EQ(fp8_recipe_set_int(fresh.get(), FP8_RECIPE_OVERRIDE_FPROP, 1 - c.f), FP8_OK);
    ASSERT_EQ(fp8_recipe_set_int(fresh.get(), FP8_RECIPE_OVERRIDE_DGRAD, 1 - c.d), FP8_OK);
    ASSERT_EQ(fp8_recipe_set_int(fresh.get(), FP8_RECIPE_OVERRIDE_WGRAD, 1 - c.w), FP8_OK);
    ASSERT_EQ(fp8_recipe_parse(fresh.get(), c.text), FP8_OK) << c.text << ": " << fp8_last_error_message();
    EXPECT_EQ(get(fresh.get(), FP8_RECIPE_OVERRIDE_FPROP), c.f) << c.text;
    EXPECT_EQ(get(fresh.get(), FP8_RECIPE_OVERRIDE_DGRAD), c.d) << c.text;
    EXPECT_EQ(get(fresh.get(), FP8_RECIPE_OVERRIDE_WGRAD), c.w) << c.text;
  }
}

TEST(Recipe, ParseAcceptsEveryEnumValueByName) {
  struct Case {
    const char* text;
    fp8_recipe_attr_t attr;
    int64_t value;
  };
  const Case cases[] = {
      {"backend=auto", FP8_RECIPE_BACKEND, FP8_BACKEND_AUTO},
      {"backend=te", FP8_RECIPE_BACKEND, FP8_BACKEND_TE},
      {"backend=msamp", FP8_RECIPE_BACKEND, FP8_BACKEND_MSAMP},
      {"backend=MSAMP", FP8_RECIPE_BACKEND, FP8_BACKEND_MSAMP},
      {"opt_level=O1", FP8_RECIPE_OPT_LEVEL, FP8_OPT_O1},
      {"opt_level=O2", FP8_RECIPE_OPT_LEVEL, FP8_OPT_O2},
      {"opt_level=O3", FP8_RECIPE_OPT_LEVEL, FP8_OPT_O3},
      {"opt_level=o3", FP8_RECIPE_OPT_LEVEL, FP8_OPT_O3},
      {"fp8_format=E4M3", FP8_RECIPE_FP8_FORMAT, FP8_FORMAT_E4M3},
      {"fp8_format=HYBRID", FP8_RECIPE_FP8_FORMAT, FP8_FORMAT_HYBRID},
      {"fp8_format=hybrid", FP8_RECIPE_FP8_FORMAT, FP8_FORMAT_HYBRID},
      {"amax_compute_algo=max", FP8_RECIPE_AMAX_COMPUTE_ALGO, FP8_AMAX_ALGO_MAX},
      {"amax_compute_algo=most_recent", FP8_RECIPE_AMAX_COMPUTE_ALGO, FP8_AMAX_ALGO_MOST_RECENT},
      {"amax_compute_algo=MOST_RECENT", FP8_RECIPE_AMAX_COMPUTE_ALGO, FP8_AMAX_ALGO_MOST_RECENT},
      {"use_autocast_during_eval=on", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 1},
      {"use_autocast_during_eval=off", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 0},
      {"use_autocast_during_eval=true", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 1},
      {"use_autocast_during_eval=false", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 0},
      {"use_autocast_during_eval=1", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 1},
      {"use_autocast_during_eval=0", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 0},
      {"use_autocast_during_eval=True", FP8_RECIPE_USE_AUTOCAST_DURING_EVAL, 1},
      {"margin=0", FP8_RECIPE_MARGIN, 0},
      {"margin=32", FP8_RECIPE_MARGIN, 32},
      {"interval=1", FP8_RECIPE_INTERVAL, 1},
      {"interval=1000000", FP8_RECIPE_INTERVAL, 1000000},
      {"amax_history_len=1", FP8_RECIPE_AMAX_HISTORY_LEN, 1},
      {"amax_history_len=16384", FP8_RECIPE_AMAX_HISTORY_LEN, 16384},
      {"scaling=delayed", FP8_RECIPE_SCALING, FP8_SCALING_DELAYED},
      {"scaling=current", FP8_RECIPE_SCALING, FP8_SCALING_CURRENT},
      {"scaling=CURRENT", FP8_RECIPE_SCALING, FP8_SCALING_CURRENT},
      {"scaling=rowwise", FP8_RECIPE_SCALING, FP8_SCALING_ROWWISE},
      {"scaling=block", FP8_RECIPE_SCALING, FP8_SCALING_BLOCK},
      {"power_2_scales=auto", FP8_RECIPE_POWER_2_SCALES, FP8_POWER_2_SCALES_AUTO},
      {"power_2_scales=on", FP8_RECIPE_POWER_2_SCALES, 1},
      {"power_2_scales=false", FP8_RECIPE_POWER_2_SCALES, 0},
  };
  for (const Case& c : cases) {
    int64_t mn = 0, mx = 0;
    ASSERT_EQ(fp8_recipe_attr_bounds(c.attr, &mn, &mx, nullptr, nullptr), FP8_OK);
    // Start from a different value so the parse must write it.
    RecipePtr r = make_recipe();
    ASSERT_EQ(fp8_recipe_set_int(r.get(), c.attr, c.value == mn ? mx : mn), FP8_OK);
    Values expect = snapshot(r.get());
    expect[static_cast<size_t>(c.attr)] = c.value;
    ASSERT_EQ(fp8_recipe_parse(r.get(), c.text), FP8_OK) << c.text << ": " << fp8_last_error_message();
    EXPECT_EQ(snapshot(r.get()), expect) << c.text;
  }
}

struct BadText {
  const char* text;
  std::vector<std::string> must_mention;  // case-insensitive: the key, the bad part, the allowed values
};

std::vector<BadText> bad_texts() {
  const std::vector<std::string> all_keys = {"backend",          "opt_level",         "margin",
                                             "interval",         "fp8_format",        "amax_history_len",
                                             "amax_compute_algo", "override_linear_precision",
                                             "use_autocast_during_eval"};
  std::vector<std::string> unknown = all_keys;
  unknown.push_back("bogus_key");
  std::vector<std::string> no_eq = all_keys;
  no_eq.push_back("fp8_format E4M3");
  std::vector<std::string> no_eq_margin = all_keys;
  no_eq_margin.push_back("margin 3");
  const std::vector<std::string> bools = {"on", "off", "true", "false", "1", "0"};
  auto with = [](std::vector<std::string> v, std::initializer_list<std::string> more) {
    v.insert(v.begin(), more);
    return v;
  };
  return {
      // unknown key: name it and list the known keys
      {"bogus_key=1", unknown},
      {"margin=1, bogus_key=1", unknown},
      // missing '=': show the offending item and list the known keys
      {"fp8_format E4M3", no_eq},
      {"margin 3", no_eq_margin},
      // bad enum values: name the key and every allowed name
      {"backend=foo", {"backend", "foo", "auto", "te", "msamp"}},
      {"backend=2", {"backend", "auto", "te", "msamp"}},
      {"opt_level=O4", {"opt_level", "O4", "O1", "O2", "O3"}},
      {"opt_level=2", {"opt_level", "O1", "O2", "O3"}},
      {"fp8_format=E5M2", {"fp8_format", "E5M2", "E4M3", "HYBRID"}},
      {"fp8_format=", {"fp8_format", "E4M3", "HYBRID"}},
      {"amax_compute_algo=min", {"amax_compute_algo", "min", "max", "most_recent"}},
      {"scaling=dynamic", {"scaling", "dynamic", "delayed", "current", "rowwise", "block"}},
      {"scaling=1", {"scaling", "delayed", "current", "rowwise", "block"}},
      {"power_2_scales=maybe", {"power_2_scales", "maybe", "auto", "on", "off", "-1"}},
      {"power_2_scales=2", {"power_2_scales", "auto", "on", "off"}},
      {"power_2_scales=", {"power_2_scales", "auto", "on", "off"}},
      {"scaling=", {"scaling", "delayed", "current", "rowwise", "block"}},
      {"use_autocast_during_eval=yes", with(bools, {"use_autocast_during_eval", "yes"})},
      {"use_autocast_during_eval=2", with(bools, {"use_autocast_during_eval"})},
      // bad integers and out-of-range integers: name the key and give the range
      {"margin=abc", {"margin", "abc", "0..32"}},
      {"margin=1.5", {"margin", "1.5", "0..32"}},
      {"margin=", {"margin", "0..32"}},
      {"margin=-1", {"margin", "-1", "0..32"}},
      {"margin=33", {"margin", "33", "0..32"}},
      {"margin=99999999999999999999999", {"margin", "99999999999999999999999", "0..32"}},
      {"interval=0", {"interval", "1..1000000"}},
      {"interval=1000001", {"interval", "1000001", "1..1000000"}},
      {"amax_history_len=0", {"amax_history_len", "1..16384"}},
      {"amax_history_len=16385", {"amax_history_len", "16385", "1..16384"}},
      // malformed override: name the key and the allowed flags
      {"override_linear_precision=on/off", {"override_linear_precision", "on", "off"}},
      {"override_linear_precision=on/off/on/off", {"override_linear_precision", "on", "off"}},
      {"override_linear_precision=on", {"override_linear_precision", "on", "off"}},
      {"override_linear_precision=", {"override_linear_precision", "on", "off"}},
      {"override_linear_precision=on/maybe/off", {"override_linear_precision", "maybe", "on", "off"}},
      {"override_linear_precision=on//off", {"override_linear_precision", "on", "off"}},
  };
}

TEST(Recipe, ParseErrorsNameTheKeyAndListTheAllowedValues) {
  for (const BadText& bad : bad_texts()) {
    RecipePtr r = make_recipe();
    EXPECT_EQ(fp8_recipe_parse(r.get(), bad.text), FP8_ERR_INVALID_ARGUMENT) << "'" << bad.text << "'";
    const std::string msg = last_error();
    EXPECT_EQ(msg.rfind("fp8_recipe_parse", 0), 0u) << "'" << bad.text << "': " << msg;
    for (const std::string& part : bad.must_mention)
      EXPECT_TRUE(icontains(msg, part)) << "'" << bad.text << "': message does not mention '" << part << "': " << msg;
  }
}

TEST(Recipe, ParseIsAllOrNothing) {
  // Every bad text, alone and after valid pairs that would change the recipe, leaves it unchanged.
  for (const BadText& bad : bad_texts()) {
    for (const std::string& prefix :
         {std::string(), std::string("margin=5, interval=10, backend=msamp, "),
          std::string("override_linear_precision=off/on/off, use_autocast_during_eval=off, amax_history_len=7, ")}) {
      const std::string text = prefix + bad.text;
      RecipePtr r = make_nondefault_recipe();
      const Values before = snapshot(r.get());
      EXPECT_EQ(fp8_recipe_parse(r.get(), text.c_str()), FP8_ERR_INVALID_ARGUMENT) << "'" << text << "'";
      EXPECT_EQ(snapshot(r.get()), before) << "'" << text << "'";
    }
  }
  // Valid pairs after the bad one are not applied either; nor is the first flag of a bad override.
  RecipePtr r = make_nondefault_recipe();
  const Values before = snapshot(r.get());
  ASSERT_EQ(before[FP8_RECIPE_OVERRIDE_FPROP], 1);
  EXPECT_EQ(fp8_recipe_parse(r.get(), "margin=3, override_linear_precision=off/off/maybe, interval=2"),
            FP8_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(snapshot(r.get()), before);
  EXPECT_EQ(fp8_recipe_parse(r.get(), "margin=3, fp8_format=E5M2, interval=2"), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(snapshot(r.get()), before);
}

// ---- to_string ----------------------------------------------------------------------------------

TEST(Recipe, ToStringListsEveryKeyInAttributeOrder) {
  RecipePtr r = make_recipe();
  const std::string text = to_string(r.get());
  const char* keys[] = {"backend=",          "opt_level=",        "margin=",
                        "interval=",         "fp8_format=",       "amax_history_len=",
                        "amax_compute_algo=", "override_linear_precision=", "use_autocast_during_eval="};
  size_t last = 0;
  bool first = true;
  for (const char* key : keys) {
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << "'" << key << "' missing from " << text;
    if (!first) EXPECT_GT(at, last) << "'" << key << "' out of order in " << text;
    last = at;
    first = false;
  }
}

TEST(Recipe, ToStringRoundTripsThroughParse) {
  std::vector<RecipePtr> recipes;
  recipes.push_back(make_recipe());            // the defaults
  recipes.push_back(make_nondefault_recipe());  // every attribute changed
  {
    RecipePtr lo = make_recipe();  // every attribute at its minimum
    RecipePtr hi = make_recipe();  // every attribute at its maximum
    for (const Expected& e : kExpected) {
      EXPECT_EQ(fp8_recipe_set_int(lo.get(), e.attr, e.min), FP8_OK);
      EXPECT_EQ(fp8_recipe_set_int(hi.get(), e.attr, e.max), FP8_OK);
    }
    recipes.push_back(std::move(lo));
    recipes.push_back(std::move(hi));
  }
  {
    RecipePtr mixed = make_recipe();
    ASSERT_EQ(fp8_recipe_parse(mixed.get(),
                               "backend=msamp, opt_level=O1, margin=31, interval=999999, fp8_format=E4M3, "
                               "amax_history_len=16383, amax_compute_algo=max, "
                               "override_linear_precision=off/on/off, use_autocast_during_eval=on"),
              FP8_OK)
        << fp8_last_error_message();
    recipes.push_back(std::move(mixed));
  }
  for (const RecipePtr& src : recipes) {
    const std::string text = to_string(src.get());
    // Parse into a recipe that differs from src wherever possible, so every key must be applied.
    RecipePtr dst = make_recipe();
    const Values want = snapshot(src.get());
    for (const Expected& e : kExpected)
      ASSERT_EQ(fp8_recipe_set_int(dst.get(), e.attr, want[static_cast<size_t>(e.attr)] == e.min ? e.max : e.min),
                FP8_OK);
    ASSERT_EQ(fp8_recipe_parse(dst.get(), text.c_str()), FP8_OK) << text << ": " << fp8_last_error_message();
    EXPECT_EQ(snapshot(dst.get()), want) << text;
    EXPECT_EQ(to_string(dst.get()), text);
  }
}

TEST(Recipe, ToStringTooSmallBufferWritesNothingAndReportsNeeded) {
  RecipePtr r = make_nondefault_recipe();
  size_t needed = 0;
  ASSERT_EQ(fp8_recipe_to_string(r.get(), nullptr, 0, &needed), FP8_ERR_BUFFER_TOO_SMALL);
  ASSERT_GT(needed, 1u);
  const char kSentinel = '\x5a';
  for (size_t cap : {size_t{1}, size_t{2}, needed / 2, needed - 1}) {
    std::vector<char> buf(needed + 8, kSentinel);
    size_t got = 12345;
    EXPECT_EQ(fp8_recipe_to_string(r.get(), buf.data(), cap, &got), FP8_ERR_BUFFER_TOO_SMALL) << "cap " << cap;
    EXPECT_EQ(got, needed) << "cap " << cap;
    EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [&](char c) { return c == kSentinel; })) << "cap " << cap;
    EXPECT_TRUE(icontains(last_error(), "fp8_recipe_to_string")) << last_error();
    // needed may be NULL; still refused, still nothing written.
    EXPECT_EQ(fp8_recipe_to_string(r.get(), buf.data(), cap, nullptr), FP8_ERR_BUFFER_TOO_SMALL) << "cap " << cap;
    EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [&](char c) { return c == kSentinel; })) << "cap " << cap;
  }
  // Exactly `needed` bytes is enough: the text plus its NUL, nothing written beyond.
  std::vector<char> buf(needed + 8, kSentinel);
  size_t got = 12345;
  ASSERT_EQ(fp8_recipe_to_string(r.get(), buf.data(), needed, &got), FP8_OK) << fp8_last_error_message();
  EXPECT_EQ(got, needed);
  EXPECT_EQ(std::strlen(buf.data()), needed - 1);
  EXPECT_TRUE(std::all_of(buf.begin() + static_cast<std::ptrdiff_t>(needed), buf.end(),
                          [&](char c) { return c == kSentinel; }));
}

TEST(Recipe, ToStringWithNullBufferAndZeroCapQueriesTheSize) {
  RecipePtr r = make_recipe();
  size_t needed = 0;
  EXPECT_EQ(fp8_recipe_to_string(r.get(), nullptr, 0, &needed), FP8_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(needed, to_string(r.get()).size() + 1);
  // A different recipe needs a different size (the value is computed, not a constant).
  RecipePtr r2 = make_recipe();
  ASSERT_EQ(fp8_recipe_set_int(r2.get(), FP8_RECIPE_INTERVAL, 1000000), FP8_OK);
  size_t needed2 = 0;
  EXPECT_EQ(fp8_recipe_to_string(r2.get(), nullptr, 0, &needed2), FP8_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(needed2, to_string(r2.get()).size() + 1);
  EXPECT_NE(needed2, needed);
}

// ---- clone, dtype_for ---------------------------------------------------------------------------

TEST(Recipe, CloneIsAnIndependentCopy) {
  RecipePtr src = make_nondefault_recipe();
  fp8_recipe_t* raw = nullptr;
  ASSERT_EQ(fp8_recipe_clone(&raw, src.get()), FP8_OK) << fp8_last_error_message();
  RecipePtr copy(raw);
  ASSERT_NE(copy.get(), src.get());
  const Values original = snapshot(src.get());
  EXPECT_EQ(snapshot(copy.get()), original);
  EXPECT_EQ(to_string(copy.get()), to_string(src.get()));

  // Changing the copy leaves the source alone, and the other way round.
  ASSERT_EQ(fp8_recipe_set_int(copy.get(), FP8_RECIPE_MARGIN, 20), FP8_OK);
  ASSERT_EQ(fp8_recipe_parse(copy.get(), "fp8_format=HYBRID, backend=auto"), FP8_OK);
  EXPECT_EQ(snapshot(src.get()), original);
  const Values copied = snapshot(copy.get());
  ASSERT_EQ(fp8_recipe_set_int(src.get(), FP8_RECIPE_INTERVAL, 99), FP8_OK);
  EXPECT_EQ(snapshot(copy.get()), copied);

  // The copy outlives its source.
  src.reset();
  EXPECT_EQ(get(copy.get(), FP8_RECIPE_MARGIN), 20);
  EXPECT_EQ(get(copy.get(), FP8_RECIPE_FP8_FORMAT), FP8_FORMAT_HYBRID);
}

TEST(Recipe, DtypeForFollowsTheFormat) {
  RecipePtr r = make_recipe();  // HYBRID
  fp8_dtype_t dt = -1;
  ASSERT_EQ(fp8_recipe_dtype_for(r.get(), FP8_ROLE_FORWARD, &dt), FP8_OK);
  EXPECT_EQ(dt, FP8_DTYPE_E4M3);
  ASSERT_EQ(fp8_recipe_dtype_for(r.get(), FP8_ROLE_BACKWARD, &dt), FP8_OK);
  EXPECT_EQ(dt, FP8_DTYPE_E5M2);

  ASSERT_EQ(fp8_recipe_set_int(r.get(), FP8_RECIPE_FP8_FORMAT, FP8_FORMAT_E4M3), FP8_OK);
  dt = -1;
  ASSERT_EQ(fp8_recipe_dtype_for(r.get(), FP8_ROLE_FORWARD, &dt), FP8_OK);
  EXPECT_EQ(dt, FP8_DTYPE_E4M3);
  dt = -1;
  ASSERT_EQ(fp8_recipe_dtype_for(r.get(), FP8_ROLE_BACKWARD, &dt), FP8_OK);
  EXPECT_EQ(dt, FP8_DTYPE_E4M3);
}

TEST(Recipe, DtypeForRefusesAnUnknownRole) {
  RecipePtr r = make_recipe();
  for (fp8_role_t role : {int32_t{-1}, int32_t{2}, int32_t{100}, std::numeric_limits<int32_t>::min()}) {
    fp8_dtype_t dt = 77;
    EXPECT_EQ(fp8_recipe_dtype_for(r.get(), role, &dt), FP8_ERR_INVALID_ARGUMENT) << "role " << role;
    EXPECT_EQ(dt, 77) << "role " << role;
    const std::string msg = last_error();
    EXPECT_TRUE(icontains(msg, "fp8_recipe_dtype_for")) << msg;
    EXPECT_TRUE(icontains(msg, "role")) << msg;
    EXPECT_TRUE(icontains(msg, std::to_string(role))) << msg;
  }
}

// ---- NULL arguments -----------------------------------------------------------------------------

bool is_ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// `word` occurs in `text` as a whole identifier (not as part of "fp8_recipe_get_int").
bool names_word(const std::string& text, const std::string& word) {
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const bool left_ok = at == 0 || !is_ident(text[at - 1]);
    const bool right_ok = at + word.size() >= text.size() || !is_ident(text[at + word.size()]);
    if (left_ok && right_ok) return true;
  }
  return false;
}

// The message names the function and the NULL argument.
void expect_null_message(const char* fn, const char* arg) {
  const std::string msg = last_error();
  EXPECT_EQ(msg.rfind(fn, 0), 0u) << "message does not start with " << fn << ": " << msg;
  EXPECT_TRUE(names_word(msg, arg)) << "message does not name " << arg << ": " << msg;
}

TEST(Recipe, NullArgumentsAreRefusedWithoutTouchingOutputs) {
  RecipePtr r = make_nondefault_recipe();
  const Values before = snapshot(r.get());
  fp8_recipe_t* const kSentinelRecipe = reinterpret_cast<fp8_recipe_t*>(uintptr_t{0x1234});

  EXPECT_EQ(fp8_recipe_create(nullptr), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_create", "out");

  fp8_recipe_t* out = kSentinelRecipe;
  EXPECT_EQ(fp8_recipe_clone(nullptr, r.get()), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_clone", "out");
  EXPECT_EQ(fp8_recipe_clone(&out, nullptr), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_clone", "src");
  EXPECT_EQ(out, kSentinelRecipe);

  EXPECT_EQ(fp8_recipe_set_int(nullptr, FP8_RECIPE_MARGIN, 1), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_set_int", "recipe");

  int64_t value = -777;
  EXPECT_EQ(fp8_recipe_get_int(nullptr, FP8_RECIPE_MARGIN, &value), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_get_int", "recipe");
  EXPECT_EQ(value, -777);
  EXPECT_EQ(fp8_recipe_get_int(r.get(), FP8_RECIPE_MARGIN, nullptr), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_get_int", "value");

  EXPECT_EQ(fp8_recipe_parse(nullptr, "margin=1"), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_parse", "recipe");
  EXPECT_EQ(fp8_recipe_parse(r.get(), nullptr), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_parse", "text");

  char buf[8];
  std::memset(buf, 'x', sizeof buf);
  size_t needed = 4321;
  EXPECT_EQ(fp8_recipe_to_string(nullptr, buf, sizeof buf, &needed), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_to_string", "recipe");
  EXPECT_EQ(needed, 4321u);
  for (char c : buf) EXPECT_EQ(c, 'x');

  fp8_dtype_t dt = 77;
  EXPECT_EQ(fp8_recipe_dtype_for(nullptr, FP8_ROLE_FORWARD, &dt), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_dtype_for", "recipe");
  EXPECT_EQ(dt, 77);
  EXPECT_EQ(fp8_recipe_dtype_for(r.get(), FP8_ROLE_FORWARD, nullptr), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_dtype_for", "dtype");

  EXPECT_EQ(snapshot(r.get()), before);
  fp8_recipe_destroy(nullptr);  // does nothing
}

TEST(Recipe, ToStringRefusesNullBufferWithNonzeroCap) {
  RecipePtr r = make_recipe();
  EXPECT_EQ(fp8_recipe_to_string(r.get(), nullptr, 4096, nullptr), FP8_ERR_INVALID_ARGUMENT);
  expect_null_message("fp8_recipe_to_string", "buf");
}

// fp8.h: "On failure, out-parameters and user buffers are left exactly as they were"; only
// FP8_ERR_BUFFER_TOO_SMALL is documented to return the needed size. Disabled until
// src/api/recipe_api.cpp checks buf before writing *needed (it writes it first today).
TEST(Recipe, ToStringNullBufferWithNonzeroCapLeavesNeededUntouched) {
  RecipePtr r = make_recipe();
  size_t needed = 4321;
  EXPECT_EQ(fp8_recipe_to_string(r.get(), nullptr, 4096, &needed), FP8_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(needed, 4321u);
}

}  // namespace
