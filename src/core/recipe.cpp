#include "core/recipe.hpp"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "core/error.hpp"

namespace fp8 {

namespace {

const char* const kBackendNames[] = {"auto", "te", "msamp"};
const char* const kOptLevelNames[] = {"O1", "O2", "O3"};
const char* const kFormatNames[] = {"E4M3", "HYBRID"};
const char* const kAlgoNames[] = {"max", "most_recent"};
const char* const kBoolNames[] = {"off", "on"};
const char* const kScalingNames[] = {"delayed", "current", "rowwise", "block"};
const char* const kAutoBoolNames[] = {"auto", "off", "on"};  // -1, 0, 1

// Indexed by fp8_recipe_attr_t; the static_assert below keeps it in step with the header.
const AttrSpec kSpecs[] = {
    {"backend", FP8_BACKEND_AUTO, FP8_BACKEND_MSAMP, FP8_BACKEND_AUTO, kBackendNames},
    {"opt_level", FP8_OPT_O1, FP8_OPT_O3, FP8_OPT_O2, kOptLevelNames},
    {"margin", 0, 32, 0, nullptr},
    {"interval", 1, 1000000, 1, nullptr},
    {"fp8_format", FP8_FORMAT_E4M3, FP8_FORMAT_HYBRID, FP8_FORMAT_HYBRID, kFormatNames},
    {"amax_history_len", 1, 16384, 1024, nullptr},
    {"amax_compute_algo", FP8_AMAX_ALGO_MAX, FP8_AMAX_ALGO_MOST_RECENT, FP8_AMAX_ALGO_MOST_RECENT, kAlgoNames},
    {"override_fprop", 0, 1, 0, kBoolNames},
    {"override_dgrad", 0, 1, 0, kBoolNames},
    {"override_wgrad", 0, 1, 0, kBoolNames},
    {"use_autocast_during_eval", 0, 1, 0, kBoolNames},
    {"small_layer_fallback", 0, 1, 1, kBoolNames},
    {"power_2_scales", FP8_POWER_2_SCALES_AUTO, 1, FP8_POWER_2_SCALES_AUTO, kAutoBoolNames},
    {"scaling", FP8_SCALING_DELAYED, FP8_SCALING_BLOCK, FP8_SCALING_DELAYED, kScalingNames},
};
static_assert(sizeof(kSpecs) / sizeof(kSpecs[0]) == FP8_RECIPE_ATTR_COUNT, "one spec per attribute");

const char* const kOverrideKey = "override_linear_precision";

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// "E4M3, HYBRID" or "0..32"
std::string allowed_values(const AttrSpec& s) {
  std::ostringstream os;
  if (s.names == kBoolNames) return "on, off, true, false, 1 or 0";
  if (s.names == kAutoBoolNames) return "auto, on, off, true, false, 1, 0 or -1 (auto)";
  if (s.names) {
    for (int64_t v = s.min; v <= s.max; ++v) os << (v > s.min ? ", " : "") << s.names[v - s.min];
  } else {
    os << "an integer in " << s.min << ".." << s.max;
  }
  return os.str();
}

fp8_recipe_attr_t attr_by_key(const std::string& key) {
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a)
    if (key == kSpecs[a].key) return a;
  return -1;
}

std::string known_keys() {
  std::ostringstream os;
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a) os << kSpecs[a].key << ", ";
  os << kOverrideKey;
  return os.str();
}

// Parses one value for attribute `a`; throws naming the key and the allowed values.
int64_t parse_value(fp8_recipe_attr_t a, const std::string& key, const std::string& raw) {
  const AttrSpec& s = kSpecs[a];
  const std::string v = lower(raw);
  if (s.names == kBoolNames || s.names == kAutoBoolNames) {
    if (v == "on" || v == "true" || v == "1") return 1;
    if (v == "off" || v == "false" || v == "0") return 0;
    if (s.names == kAutoBoolNames && (v == "auto" || v == "-1")) return FP8_POWER_2_SCALES_AUTO;
  } else if (s.names) {
    for (int64_t i = s.min; i <= s.max; ++i)
      if (v == lower(s.names[i - s.min])) return i;
  } else if (!v.empty()) {
    errno = 0;
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (errno == 0 && end && *end == '\0' && n >= s.min && n <= s.max) return n;
  }
  fail(FP8_ERR_INVALID_ARGUMENT, key, "='", raw, "' is not allowed; expected ", allowed_values(s));
}

}  // namespace

const AttrSpec* recipe_attr_spec(fp8_recipe_attr_t attr) {
  if (attr < 0 || attr >= FP8_RECIPE_ATTR_COUNT) return nullptr;
  return &kSpecs[attr];
}

Recipe::Recipe() {
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a) values[static_cast<size_t>(a)] = kSpecs[a].def;
}

void Recipe::set(fp8_recipe_attr_t a, int64_t v) {
  const AttrSpec* s = recipe_attr_spec(a);
  if (!s) fail(FP8_ERR_INVALID_ARGUMENT, "attr ", a, " is not a recipe attribute; expected 0..", FP8_RECIPE_ATTR_COUNT - 1);
  if (v < s->min || v > s->max) {
    std::ostringstream names;
    if (s->names) {
      for (int64_t i = s->min; i <= s->max; ++i) names << (i > s->min ? ", " : " (") << i << " = " << s->names[i - s->min];
      names << ")";
    }
    fail(FP8_ERR_INVALID_ARGUMENT, s->key, " = ", v, " is out of range; expected ", s->min, "..", s->max, names.str());
  }
  values[static_cast<size_t>(a)] = v;
}

void Recipe::parse(const std::string& text) {
  Recipe next = *this;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      fail(FP8_ERR_INVALID_ARGUMENT, "'", item, "' is not a key=value pair; known keys: ", known_keys());
    const std::string key = lower(trim(item.substr(0, eq)));
    const std::string value = trim(item.substr(eq + 1));
    if (key == kOverrideKey) {
      // fprop/dgrad/wgrad, e.g. "off/off/on"
      std::stringstream parts(value);
      std::string part;
      std::vector<std::string> flags;
      while (std::getline(parts, part, '/')) flags.push_back(trim(part));
      if (flags.size() != 3)
        fail(FP8_ERR_INVALID_ARGUMENT, kOverrideKey, "='", value,
             "' is not allowed; expected three flags fprop/dgrad/wgrad, each on, off, true, false, 1 or 0 (e.g. off/off/on)");
      const fp8_recipe_attr_t attrs[3] = {FP8_RECIPE_OVERRIDE_FPROP, FP8_RECIPE_OVERRIDE_DGRAD, FP8_RECIPE_OVERRIDE_WGRAD};
      for (int i = 0; i < 3; ++i) next.values[static_cast<size_t>(attrs[i])] = parse_value(attrs[i], kOverrideKey, flags[i]);
      continue;
    }
    const fp8_recipe_attr_t a = attr_by_key(key);
    if (a < 0) fail(FP8_ERR_INVALID_ARGUMENT, "unknown key '", key, "'; known keys: ", known_keys());
    next.values[static_cast<size_t>(a)] = parse_value(a, key, value);
  }
  *this = next;
}

std::string Recipe::to_string() const {
  std::ostringstream os;
  for (int32_t a = 0; a < FP8_RECIPE_ATTR_COUNT; ++a) {
    if (a == FP8_RECIPE_OVERRIDE_DGRAD || a == FP8_RECIPE_OVERRIDE_WGRAD) continue;
    const AttrSpec& s = kSpecs[a];
    if (a) os << ", ";
    if (a == FP8_RECIPE_OVERRIDE_FPROP) {
      os << kOverrideKey << '=' << kBoolNames[get(FP8_RECIPE_OVERRIDE_FPROP)] << '/'
         << kBoolNames[get(FP8_RECIPE_OVERRIDE_DGRAD)] << '/' << kBoolNames[get(FP8_RECIPE_OVERRIDE_WGRAD)];
      continue;
    }
    os << s.key << '=' << value_string(static_cast<fp8_recipe_attr_t>(a), get(a));
  }
  return os.str();
}

std::string value_string(fp8_recipe_attr_t attr, int64_t v) {
  const AttrSpec& s = kSpecs[attr];
  return s.names ? std::string(s.names[v - s.min]) : std::to_string(v);
}

bool Recipe::power_2_scales(bool auto_on) const {
  const int64_t v = get(FP8_RECIPE_POWER_2_SCALES);
  return v == FP8_POWER_2_SCALES_AUTO ? auto_on : v == 1;
}

fp8_dtype_t Recipe::dtype_for(fp8_role_t role) const {
  if (role != FP8_ROLE_FORWARD && role != FP8_ROLE_BACKWARD)
    fail(FP8_ERR_INVALID_ARGUMENT, "role ", role, " is not a tensor role; expected FP8_ROLE_FORWARD (0) or FP8_ROLE_BACKWARD (1)");
  if (role == FP8_ROLE_BACKWARD && get(FP8_RECIPE_FP8_FORMAT) == FP8_FORMAT_HYBRID) return FP8_DTYPE_E5M2;
  return FP8_DTYPE_E4M3;
}

}  // namespace fp8
