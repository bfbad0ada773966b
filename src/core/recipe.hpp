// The recipe: every attribute's key, range and default in one table, and the text form.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "fp8.h"

namespace fp8 {

struct AttrSpec {
  const char* key;           // text-form name
  int64_t min, max, def;     // inclusive range and Accelerate's default
  const char* const* names;  // value names for min..max (enums, booleans), or nullptr for integers
};

// nullptr for an unknown id.
const AttrSpec* recipe_attr_spec(fp8_recipe_attr_t attr);

// Value v of attribute `attr` (a valid id, v in range) as the text form writes it: its name
// ("HYBRID", "on") or its number.
std::string value_string(fp8_recipe_attr_t attr, int64_t v);

struct Recipe {
  std::array<int64_t, FP8_RECIPE_ATTR_COUNT> values;

  Recipe();  // Accelerate's defaults
  int64_t get(fp8_recipe_attr_t a) const { return values[static_cast<size_t>(a)]; }
  // Throws FP8_ERR_INVALID_ARGUMENT naming the attribute and its allowed values.
  void set(fp8_recipe_attr_t a, int64_t v);
  // All or nothing: on error throws and leaves *this unchanged.
  void parse(const std::string& text);
  std::string to_string() const;
  // Whether scales are rounded down to powers of two: power_2_scales, whose default (auto) is on for
  // block scaling and off for the others (as TransformerEngine and DeepSeek-V3 have it). The second
  // form says what auto means for a cast the recipe's scaling does not decide (fp8_quantize_scaled's).
  bool power_2_scales() const { return power_2_scales(get(FP8_RECIPE_SCALING) == FP8_SCALING_BLOCK); }
  bool power_2_scales(bool auto_on) const;
  // FP8 dtype of a tensor role under this recipe's format.
  fp8_dtype_t dtype_for(fp8_role_t role) const;
};

}  // namespace fp8
