#include "core/objects.hpp"

#include <cstring>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"

fp8_tensor::~fp8_tensor() {
  backend->release(scale_inv_allocation);
}

size_t fp8_tensor::nbytes() const {
  return static_cast<size_t>(numel) * fp8::dtype_size(dtype);
}

namespace fp8 {

std::unique_ptr<fp8_tensor> make_tensor(const std::shared_ptr<Backend>& backend, fp8_dtype_t dtype, int32_t ndim,
                                        const int64_t* shape, bool borrow, void* data, size_t scale_bytes,
                                        float* scale_inv) {
  if (!dtype_valid(dtype))
    fail(FP8_ERR_DTYPE, "dtype ", dtype,
         " is not a dtype; expected FP8_DTYPE_F32 (0), F16 (1), BF16 (2), E4M3 (3) or E5M2 (4)");
  if (ndim < 0 || ndim > FP8_MAX_DIMS) fail(FP8_ERR_SHAPE, "ndim = ", ndim, "; expected 0..", FP8_MAX_DIMS);
  if (ndim > 0) require_arg(shape, "shape");
  auto t = std::make_unique<fp8_tensor>();
  t->backend = backend;
  t->dtype = dtype;
  t->ndim = ndim;
  const int64_t limit = (int64_t{1} << 62) / static_cast<int64_t>(dtype_size(dtype));
  for (int32_t i = 0; i < ndim; ++i) {
    if (shape[i] < 0) fail(FP8_ERR_SHAPE, "shape[", i, "] = ", shape[i], "; sizes must be >= 0");
    // (Also in an empty tensor: the sizes reach the grid and tile arithmetic, which must not overflow.)
    if (shape[i] > limit)
      fail(FP8_ERR_SHAPE, "shape[", i, "] = ", shape[i], "; sizes of a ", dtype_name(dtype), " tensor are at most ",
           limit, " (2^62 bytes)");
    t->shape[i] = shape[i];
    if (shape[i] != 0 && t->numel > limit / shape[i])
      fail(FP8_ERR_SHAPE, "shape ", shape_string(ndim, shape), " has too many elements");
    t->numel *= shape[i];
  }
  const size_t nbytes = t->nbytes();
  const bool fp8 = dtype_is_fp8(dtype);
  if (borrow) {
    if (!data && nbytes != 0)
      fail(FP8_ERR_INVALID_ARGUMENT, "argument 'data' is NULL; only an empty tensor may wrap NULL");
    if (reinterpret_cast<uintptr_t>(data) % dtype_size(dtype) != 0)
      fail(FP8_ERR_INVALID_ARGUMENT, "data is not aligned to ", dtype_size(dtype), " bytes, the size of ",
           dtype_name(dtype));
    if (nbytes) backend->check_device_pointer(data, "data");
    t->data = data;
    if (fp8 && scale_inv) {
      t->scale_inv = scale_inv;
      return t;
    }
    if (fp8) {
      t->scale_inv_allocation = backend->allocate(sizeof(float));
      t->scale_inv = static_cast<float*>(t->scale_inv_allocation);
    }
  } else {
    if (nbytes == 0 && !fp8) return t;
    t->data = backend->allocate(fp8 ? fp8::scale_inv_offset(nbytes) + scale_bytes : nbytes);
    t->keeper = std::shared_ptr<void>(t->data, [backend](void* p) { backend->release(p); });
    t->owns_data = true;
    if (fp8) t->scale_inv = reinterpret_cast<float*>(static_cast<char*>(t->data) + fp8::scale_inv_offset(nbytes));
  }
  if (fp8) {
    const float one = 1.0f;
    backend->copy_from_host(t->scale_inv, &one, sizeof one);
  }
  return t;
}

void update_scaling(Backend& backend, fp8_scaling* const* states, int32_t count, const Recipe& recipe) {
  const int margin = static_cast<int>(recipe.get(FP8_RECIPE_MARGIN));
  std::vector<ScalingUpdateItem> items(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i)
    items[static_cast<size_t>(i)] = {states[i]->state, scaled_fp8_max(states[i]->dtype == FP8_DTYPE_E5M2, margin)};
  backend.scaling_update({items.data(), count, static_cast<int32_t>(recipe.get(FP8_RECIPE_AMAX_HISTORY_LEN)),
                          recipe.get(FP8_RECIPE_INTERVAL),
                          recipe.get(FP8_RECIPE_AMAX_COMPUTE_ALGO) == FP8_AMAX_ALGO_MAX,
                          recipe.power_2_scales()});
}

std::vector<std::unique_ptr<fp8_scaling>> make_scaling_arena(const std::shared_ptr<Backend>& backend,
                                                             const Recipe& recipe, const std::vector<fp8_role_t>& roles,
                                                             float scale) {
  std::vector<std::unique_ptr<fp8_scaling>> out;
  if (roles.empty()) return out;
  const int32_t len = static_cast<int32_t>(recipe.get(FP8_RECIPE_AMAX_HISTORY_LEN));
  const size_t each = (sizeof(ScalingHeader) + sizeof(float) * static_cast<size_t>(len) + 15) / 16 * 16;
  const size_t bytes = each * roles.size();
  std::vector<unsigned char> init(bytes, 0);
  const ScalingHeader header{scale, 1.0f / scale, {0u, 0u}, 0u, 0u};
  for (size_t i = 0; i < roles.size(); ++i) std::memcpy(init.data() + i * each, &header, sizeof header);
  void* memory = backend->allocate(bytes);
  std::shared_ptr<void> arena(memory, [backend](void* p) { backend->release(p); });
  backend->copy_from_host(memory, init.data(), bytes);
  for (size_t i = 0; i < roles.size(); ++i) {
    auto s = std::make_unique<fp8_scaling>();
    s->backend = backend;
    s->arena = arena;
    s->state = reinterpret_cast<ScalingHeader*>(static_cast<char*>(memory) + i * each);
    s->history_len = len;
    s->dtype = recipe.dtype_for(roles[i]);
    s->backward_role = roles[i] == FP8_ROLE_BACKWARD;
    s->current = recipe.get(FP8_RECIPE_SCALING) == FP8_SCALING_CURRENT;
    if (s->current) {
      s->current_fp8_max = scaled_fp8_max(s->dtype == FP8_DTYPE_E5M2, static_cast<int>(recipe.get(FP8_RECIPE_MARGIN)));
      s->current_pow2 = recipe.power_2_scales();
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::unique_ptr<fp8_scaling> make_scaling(const std::shared_ptr<Backend>& backend, const Recipe& recipe,
                                          fp8_role_t role, float scale) {
  return std::move(make_scaling_arena(backend, recipe, {role}, scale).front());
}

}  // namespace fp8
