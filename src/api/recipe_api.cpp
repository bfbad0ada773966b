// Recipes: creation with Accelerate's defaults, attributes, text form.
#include <cstring>

#include "api/guard.hpp"

using fp8::guard;
using fp8::require_arg;

extern "C" {

FP8_API fp8_status_t fp8_recipe_create(fp8_recipe_t** out) {
  return guard("fp8_recipe_create", [&] {
    require_arg(out, "out");
    *out = new fp8_recipe();
  });
}

FP8_API fp8_status_t fp8_recipe_clone(fp8_recipe_t** out, const fp8_recipe_t* src) {
  return guard("fp8_recipe_clone", [&] {
    require_arg(out, "out");
    require_arg(src, "src");
    *out = new fp8_recipe(*src);
  });
}

FP8_API void fp8_recipe_destroy(fp8_recipe_t* recipe) { delete recipe; }

FP8_API fp8_status_t fp8_recipe_set_int(fp8_recipe_t* recipe, fp8_recipe_attr_t attr, int64_t value) {
  return guard("fp8_recipe_set_int", [&] {
    require_arg(recipe, "recipe");
    recipe->recipe.set(attr, value);
  });
}

FP8_API fp8_status_t fp8_recipe_get_int(const fp8_recipe_t* recipe, fp8_recipe_attr_t attr, int64_t* value) {
  return guard("fp8_recipe_get_int", [&] {
    require_arg(recipe, "recipe");
    require_arg(value, "value");
    if (!fp8::recipe_attr_spec(attr))
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "attr ", attr, " is not a recipe attribute; expected 0..", FP8_RECIPE_ATTR_COUNT - 1);
    *value = recipe->recipe.get(attr);
  });
}

FP8_API fp8_status_t fp8_recipe_attr_bounds(fp8_recipe_attr_t attr, int64_t* min_value, int64_t* max_value,
                                            int64_t* default_value, const char** key) {
  return guard("fp8_recipe_attr_bounds", [&] {
    const fp8::AttrSpec* s = fp8::recipe_attr_spec(attr);
    if (!s) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "attr ", attr, " is not a recipe attribute; expected 0..", FP8_RECIPE_ATTR_COUNT - 1);
    if (min_value) *min_value = s->min;
    if (max_value) *max_value = s->max;
    if (default_value) *default_value = s->def;
    if (key) *key = s->key;
  });
}

FP8_API fp8_status_t fp8_recipe_parse(fp8_recipe_t* recipe, const char* text) {
  return guard("fp8_recipe_parse", [&] {
    require_arg(recipe, "recipe");
    require_arg(text, "text");
    recipe->recipe.parse(text);
  });
}

FP8_API fp8_status_t fp8_recipe_to_string(const fp8_recipe_t* recipe, char* buf, size_t cap, size_t* needed) {
  return guard("fp8_recipe_to_string", [&] {
    require_arg(recipe, "recipe");
    fp8::write_text(recipe->recipe.to_string(), buf, cap, needed);
  });
}

FP8_API fp8_status_t fp8_recipe_dtype_for(const fp8_recipe_t* recipe, fp8_role_t role, fp8_dtype_t* dtype) {
  return guard("fp8_recipe_dtype_for", [&] {
    require_arg(recipe, "recipe");
    require_arg(dtype, "dtype");
    *dtype = recipe->recipe.dtype_for(role);
  });
}

}  // extern "C"
