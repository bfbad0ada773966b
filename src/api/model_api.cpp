// Models, layers, conversion and autocast: handle checks here, the work in src/nn.
#include <algorithm>
#include <cmath>

#include "api/guard.hpp"
#include "core/error.hpp"
#include "dist/data_parallel.hpp"
#include "nn/model.hpp"

using fp8::guard;
using fp8::require_arg;
using fp8::require_tensor;

namespace {

// Adds a layer made by `make` after the name check; reports its id.
template <typename Make>
void add_layer(fp8_model* m, const char* name, int32_t* layer_id, Make&& make) {
  require_arg(m, "model");
  fp8::nn::require_new_layer_name(*m, name);
  if (m->recipe) fp8::fail(FP8_ERR_INVALID_STATE, "the model is converted to FP8; add layers before fp8_convert_model");
  if (!m->optimizer_links.empty())
    fp8::fail(FP8_ERR_INVALID_STATE, "an optimizer of this model holds its parameters' storage; add layers before ",
              "fp8_optimizer_create (or destroy the optimizer first)");
  fp8::nn::add_layer(*m, make());
  if (layer_id) *layer_id = static_cast<int32_t>(m->layers.size() - 1);
}

void require_dim(int64_t v, const char* name) {
  if (v <= 0 || v > (int64_t{1} << 31)) fp8::fail(FP8_ERR_INVALID_ARGUMENT, name, " = ", v, "; expected 1..2^31");
}

// A norm layer's dim: at most what fp8_norm_backward takes, since the layer's backward runs it.
void require_norm_dim(int64_t dim) {
  if (dim <= 0 || dim > fp8::kMaxNormBackwardDim)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "dim = ", dim, "; expected 1..", fp8::kMaxNormBackwardDim,
              " (2^20, the largest d a norm's backward takes: its partial column sums live in the context's scratch)");
}

void require_eps(float eps) {
  if (!(std::isfinite(eps) && eps > 0.0f))
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "eps = ", eps, "; expected a finite value > 0");
}

void require_no_autocast(const fp8_model* m, const char* what) {
  if (m->autocast)
    fp8::fail(FP8_ERR_INVALID_STATE, what, " inside fp8_autocast_begin/end; call fp8_autocast_end first");
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_model_create(fp8_model_t** out, fp8_context_t* ctx) {
  return guard("fp8_model_create", [&] {
    require_arg(out, "out");
    require_arg(ctx, "ctx");
    auto m = std::make_unique<fp8_model>();
    m->backend = ctx->backend;
    *out = m.release();
  });
}

FP8_API void fp8_model_destroy(fp8_model_t* model) {
  delete model;
}

FP8_API fp8_status_t fp8_model_add_linear(fp8_model_t* model, const char* name, int64_t in_features,
                                          int64_t out_features, int32_t with_bias, int32_t* layer_id) {
  return guard("fp8_model_add_linear", [&] {
    require_dim(in_features, "in_features");
    require_dim(out_features, "out_features");
    fp8::require_flag(with_bias, "with_bias");
    add_layer(model, name, layer_id,
              [&] { return fp8::nn::make_linear(model->backend, name, in_features, out_features, with_bias != 0); });
  });
}

FP8_API fp8_status_t fp8_model_add_layernorm(fp8_model_t* model, const char* name, int64_t dim, float eps,
                                             int32_t* layer_id) {
  return guard("fp8_model_add_layernorm", [&] {
    require_norm_dim(dim);
    require_eps(eps);
    add_layer(model, name, layer_id, [&] { return fp8::nn::make_norm(model->backend, name, false, dim, eps); });
  });
}

FP8_API fp8_status_t fp8_model_add_rmsnorm(fp8_model_t* model, const char* name, int64_t dim, float eps,
                                           int32_t* layer_id) {
  return guard("fp8_model_add_rmsnorm", [&] {
    require_norm_dim(dim);
    require_eps(eps);
    add_layer(model, name, layer_id, [&] { return fp8::nn::make_norm(model->backend, name, true, dim, eps); });
  });
}

FP8_API fp8_status_t fp8_model_add_activation(fp8_model_t* model, const char* name, fp8_activation_t activation,
                                              int32_t* layer_id) {
  return guard("fp8_model_add_activation", [&] {
    if (activation < FP8_ACTIVATION_RELU || activation > FP8_ACTIVATION_SWIGLU)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "activation = ", activation,
                "; expected FP8_ACTIVATION_RELU (0), GELU (1) or SWIGLU (2)");
    add_layer(model, name, layer_id, [&] { return fp8::nn::make_activation(model->backend, name, activation); });
  });
}

FP8_API fp8_status_t fp8_model_layer_count(const fp8_model_t* model, int32_t* count) {
  return guard("fp8_model_layer_count", [&] {
    require_arg(model, "model");
    require_arg(count, "count");
    *count = static_cast<int32_t>(model->layers.size());
  });
}

FP8_API fp8_status_t fp8_model_find_layer(const fp8_model_t* model, const char* name, int32_t* layer_id) {
  return guard("fp8_model_find_layer", [&] {
    require_arg(model, "model");
    require_arg(name, "name");
    require_arg(layer_id, "layer_id");
    for (size_t i = 0; i < model->layers.size(); ++i)
      if (model->layers[i]->name() == name) {
        *layer_id = static_cast<int32_t>(i);
        return;
      }
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "the model has no layer named '", name, "'");
  });
}

FP8_API fp8_status_t fp8_model_layer_name(const fp8_model_t* model, int32_t layer_id, const char** name) {
  return guard("fp8_model_layer_name", [&] {
    require_arg(model, "model");
    require_arg(name, "name");
    *name = fp8::nn::layer_at(*model, layer_id).name().c_str();
  });
}

FP8_API fp8_status_t fp8_model_parameter(fp8_model_t* model, const char* name, fp8_tensor_t** value,
                                         fp8_tensor_t** grad) {
  return guard("fp8_model_parameter", [&] {
    require_arg(model, "model");
    require_arg(name, "name");
    fp8::nn::Parameter* p = fp8::nn::find_parameter(*model, name);
    if (!p)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "the model has no parameter '", name,
                "'; expected '<layer>.<weight|bias>'");
    if (value) *value = p->value.get();
    if (grad) *grad = p->grad.get();
  });
}

FP8_API fp8_status_t fp8_model_parameter_count(const fp8_model_t* model, int32_t* count) {
  return guard("fp8_model_parameter_count", [&] {
    require_arg(model, "model");
    require_arg(count, "count");
    size_t n = 0;
    for (const auto& l : model->layers) n += l->parameters().size();
    *count = static_cast<int32_t>(n);
  });
}

FP8_API fp8_status_t fp8_model_parameter_at(fp8_model_t* model, int32_t index, const char** name, fp8_tensor_t** value,
                                            fp8_tensor_t** grad) {
  return guard("fp8_model_parameter_at", [&] {
    require_arg(model, "model");
    fp8::nn::Parameter& p = fp8::nn::parameter_at(*model, index);
    if (name) *name = p.name.c_str();
    if (value) *value = p.value.get();
    if (grad) *grad = p.grad.get();
  });
}

FP8_API fp8_status_t fp8_model_accumulate_grad(fp8_model_t* model, int32_t index, const fp8_tensor_t* g) {
  return guard("fp8_model_accumulate_grad", [&] {
    require_arg(model, "model");
    require_arg(g, "g");
    fp8::nn::Parameter& p = fp8::nn::parameter_at(*model, index);
    if (g->backend != model->backend)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "g belongs to another context (device ", g->backend->device(),
                "); expected the model's (device ", model->backend->device(), ")");
    if (g->dtype != FP8_DTYPE_F32 && g->dtype != FP8_DTYPE_BF16)
      fp8::fail(FP8_ERR_DTYPE, "g has dtype ", fp8::dtype_name(g->dtype), "; expected f32 or bf16");
    if (g->numel != p.grad->numel)
      fp8::fail(FP8_ERR_SHAPE, "g has ", g->numel, " elements; parameter '", p.name, "' has ", p.grad->numel);
    const bool fp8 = fp8::dtype_is_fp8(p.grad->dtype);
    fp8::dist::before_grad_write(*model, index, 1);
    model->backend->grad_accumulate(
        {fp8 ? static_cast<uint8_t*>(p.grad->data) : nullptr, p.grad->dtype == FP8_DTYPE_E5M2, g->data, g->numel,
         fp8 ? p.grad_scales() : nullptr, fp8 ? nullptr : static_cast<float*>(p.grad->data), g->dtype});
    fp8::dist::after_grad_write(*model, index, 1);
  });
}

FP8_API fp8_status_t fp8_model_storage_level(const fp8_model_t* model, int32_t* level) {
  return guard("fp8_model_storage_level", [&] {
    require_arg(model, "model");
    require_arg(level, "level");
    *level = model->store ? model->store->level() : 0;
  });
}

FP8_API fp8_status_t fp8_model_flat_storage(fp8_model_t* model, fp8_storage_role_t role, fp8_dtype_t dtype, void** data,
                                            size_t* bytes) {
  return guard("fp8_model_flat_storage", [&] {
    require_arg(model, "model");
    require_arg(data, "data");
    require_arg(bytes, "bytes");
    if (role < FP8_STORAGE_VALUES || role > FP8_STORAGE_MASTERS)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "role = ", role,
                "; expected FP8_STORAGE_VALUES (0), FP8_STORAGE_GRADS (1) or FP8_STORAGE_MASTERS (2)");
    if (!fp8::dtype_valid(dtype))
      fp8::fail(FP8_ERR_DTYPE, "dtype = ", dtype, "; expected FP8_DTYPE_F32 (0) .. FP8_DTYPE_E5M2 (4)");
    void* d = nullptr;
    size_t b = 0;
    if (model->store) model->store->flat(role, dtype, &d, &b);
    *data = d;
    *bytes = b;
  });
}

FP8_API fp8_status_t fp8_model_weights_changed(fp8_model_t* model) {
  return guard("fp8_model_weights_changed", [&] {
    require_arg(model, "model");
    ++model->weights_version;
  });
}

FP8_API fp8_status_t fp8_model_zero_grad(fp8_model_t* model) {
  return guard("fp8_model_zero_grad", [&] {
    require_arg(model, "model");
    fp8::nn::zero_grad(*model);
  });
}

FP8_API fp8_status_t fp8_model_set_training(fp8_model_t* model, int32_t training) {
  return guard("fp8_model_set_training", [&] {
    require_arg(model, "model");
    fp8::require_flag(training, "training");
    if (model->training != (training != 0)) fp8::nn::drop_kept_states(*model);  // a real mode change
    model->training = training != 0;
  });
}

FP8_API void fp8_convert_options_init(fp8_convert_options_t* options) {
  if (!options) return;
  *options = fp8_convert_options_t{sizeof *options, 1, 1, 1, 1};
}

FP8_API fp8_status_t fp8_convert_model(fp8_model_t* model, const fp8_recipe_t* recipe,
                                       const fp8_convert_options_t* options) {
  return guard("fp8_convert_model", [&] {
    require_arg(model, "model");
    fp8_convert_options_t opts;
    fp8_convert_options_init(&opts);
    if (options) fp8::read_versioned(opts, options, fp8::kConvertOptionsV1Size, "options", "fp8_convert_options_init");
    for (auto [v, name] : {std::pair<int32_t, const char*>{opts.to_fp8, "options->to_fp8"},
                           {opts.linear, "options->linear"},
                           {opts.norm, "options->norm"},
                           {opts.activation, "options->activation"}})
      fp8::require_flag(v, name);
    if (opts.to_fp8) require_arg(recipe, "recipe");
    if (opts.to_fp8 && opts.linear) {
      const int64_t scaling = recipe->recipe.get(FP8_RECIPE_SCALING);
      if ((scaling == FP8_SCALING_ROWWISE || scaling == FP8_SCALING_BLOCK) && !model->backend->scaled_gemms())
        fp8::fail(FP8_ERR_UNSUPPORTED, "recipe scaling=", scaling == FP8_SCALING_BLOCK ? "block" : "rowwise",
                  " needs GEMMs with per-row or block scales, which ", model->backend->describe(),
                  " cannot run (cuBLASLt has them on sm_90 from 12.9 on: fp8_device_query's fp8_block_scaling)");
    }
    require_no_autocast(model, "converting the model");
    fp8::nn::convert_model(*model, opts.to_fp8 ? &recipe->recipe : nullptr,
                           {opts.to_fp8 != 0, opts.linear != 0, opts.norm != 0, opts.activation != 0});
    fp8::nn::drop_kept_states(*model);
    if (opts.to_fp8)
      model->recipe = recipe->recipe;
    else
      model->recipe.reset();
  });
}

FP8_API fp8_status_t fp8_model_has_fp8_layers(const fp8_model_t* model, int32_t* has) {
  return guard("fp8_model_has_fp8_layers", [&] {
    require_arg(model, "model");
    require_arg(has, "has");
    *has = std::any_of(model->layers.begin(), model->layers.end(), [](const auto& l) { return l->converted(); });
  });
}

FP8_API fp8_status_t fp8_autocast_begin(fp8_model_t* model) {
  return guard("fp8_autocast_begin", [&] {
    require_arg(model, "model");
    if (model->autocast) fp8::fail(FP8_ERR_INVALID_STATE, "autocast is already on; expected fp8_autocast_end first");
    if (!model->recipe)
      fp8::fail(FP8_ERR_INVALID_STATE, "the model has no FP8 layers; call fp8_convert_model before fp8_autocast_begin");
    model->autocast = true;
  });
}

FP8_API fp8_status_t fp8_autocast_end(fp8_model_t* model) {
  return guard("fp8_autocast_end", [&] {
    require_arg(model, "model");
    if (!model->autocast) fp8::fail(FP8_ERR_INVALID_STATE, "fp8_autocast_end without fp8_autocast_begin");
    model->autocast = false;
    fp8::nn::update_model_scaling(*model);
  });
}

FP8_API fp8_status_t fp8_model_set_autowrap(fp8_model_t* model, int32_t on) {
  return guard("fp8_model_set_autowrap", [&] {
    require_arg(model, "model");
    fp8::require_flag(on, "on");
    model->autowrap = on != 0;
  });
}

FP8_API fp8_status_t fp8_model_forward(fp8_model_t* model, const fp8_tensor_t* x, fp8_tensor_t* y) {
  return guard("fp8_model_forward", [&] {
    require_arg(model, "model");
    require_tensor(model, x, "x");
    require_tensor(model, y, "y");
    fp8::require_not_parameter(model, y, "y");
    fp8::nn::AutowrapRegion region(*model);
    fp8::nn::model_forward(*model, x, y);
    region.close();
  });
}

FP8_API fp8_status_t fp8_model_backward(fp8_model_t* model, const fp8_tensor_t* dy, fp8_tensor_t* dx) {
  return guard("fp8_model_backward", [&] {
    require_arg(model, "model");
    require_tensor(model, dy, "dy");
    if (dx) {
      require_tensor(model, dx, "dx");
      fp8::require_not_parameter(model, dx, "dx");
    }
    fp8::nn::model_backward(*model, dy, dx);
  });
}

FP8_API fp8_status_t fp8_layer_forward(fp8_model_t* model, int32_t layer_id, const fp8_tensor_t* x, fp8_tensor_t* y) {
  return guard("fp8_layer_forward", [&] {
    require_arg(model, "model");
    const fp8::nn::Layer& layer = fp8::nn::layer_at(*model, layer_id);
    require_tensor(model, x, "x");
    require_tensor(model, y, "y");
    fp8::require_not_parameter(model, y, "y");
    model->latest.resize(model->layers.size());
    std::unique_ptr<fp8_saved>& kept = model->latest[static_cast<size_t>(layer_id)];
    // (a kept forward whose weights changed since can no longer be differentiated: it is replaced)
    if (model->training && kept && kept->training && layer.saved_current(fp8::nn::make_step(*model), *kept))
      fp8::fail(FP8_ERR_INVALID_STATE, "layer '", layer.name(),
                "' has a training-mode forward awaiting its fp8_layer_backward; a second one would replace it. "
                "Call fp8_layer_backward first, drop it with fp8_model_set_training (a change of mode drops it), or "
                "keep several forwards in flight with fp8_layer_forward_saved");
    fp8::nn::AutowrapRegion region(*model);
    std::unique_ptr<fp8_saved> saved = fp8::nn::layer_forward(*model, layer_id, x, y);
    region.close();
    kept = std::move(saved);
  });
}

FP8_API fp8_status_t fp8_layer_backward(fp8_model_t* model, int32_t layer_id, const fp8_tensor_t* dy,
                                        fp8_tensor_t* dx) {
  return guard("fp8_layer_backward", [&] {
    require_arg(model, "model");
    const fp8::nn::Layer& layer = fp8::nn::layer_at(*model, layer_id);
    require_tensor(model, dy, "dy");
    if (dx) {
      require_tensor(model, dx, "dx");
      fp8::require_not_parameter(model, dx, "dx");
    }
    model->latest.resize(model->layers.size());
    std::unique_ptr<fp8_saved>& kept = model->latest[static_cast<size_t>(layer_id)];
    if (!kept)
      fp8::fail(FP8_ERR_INVALID_STATE, "layer '", layer.name(), "' has no training-mode forward to differentiate (",
                model->training ? "call fp8_layer_forward first)" : "the model is in eval mode)");
    fp8::nn::AutowrapRegion region(*model);
    fp8::nn::layer_backward(*model, layer_id, *kept, dy, dx, 0);
    region.close();
    kept.reset();
  });
}

FP8_API fp8_status_t fp8_layer_forward_saved(fp8_model_t* model, int32_t layer_id, const fp8_tensor_t* x,
                                             fp8_tensor_t* y, fp8_saved_t** saved) {
  return guard("fp8_layer_forward_saved", [&] {
    require_arg(model, "model");
    require_arg(saved, "saved");
    fp8::nn::layer_at(*model, layer_id);
    require_tensor(model, x, "x");
    require_tensor(model, y, "y");
    fp8::require_not_parameter(model, y, "y");
    fp8::nn::AutowrapRegion region(*model);
    std::unique_ptr<fp8_saved> s = fp8::nn::layer_forward(*model, layer_id, x, y);
    region.close();
    *saved = s.release();
  });
}

namespace {
void require_backward_flags(uint32_t flags) {
  if (flags & ~(FP8_BACKWARD_ACCUMULATE_DX | FP8_BACKWARD_ADD_DY))
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "flags = ", flags,
              "; expected 0, FP8_BACKWARD_ACCUMULATE_DX (1) or FP8_BACKWARD_ADD_DY (2)");
}
}  // namespace

FP8_API fp8_status_t fp8_layer_backward_saved(fp8_model_t* model, int32_t layer_id, fp8_saved_t* saved,
                                              const fp8_tensor_t* dy, fp8_tensor_t* dx, uint32_t flags) {
  return guard("fp8_layer_backward_saved", [&] {
    require_arg(model, "model");
    require_arg(saved, "saved");
    fp8::nn::layer_at(*model, layer_id);
    require_tensor(model, dy, "dy");
    if (dx) {
      require_tensor(model, dx, "dx");
      fp8::require_not_parameter(model, dx, "dx");
    }
    require_backward_flags(flags);
    fp8::nn::AutowrapRegion region(*model);
    fp8::nn::layer_backward(*model, layer_id, *saved, dy, dx, flags);
    region.close();
  });
}

FP8_API fp8_status_t fp8_stack_forward_saved(fp8_model_t* model, int32_t first_layer, int32_t layer_count,
                                             const fp8_tensor_t* x, fp8_tensor_t* y, fp8_saved_t** saved) {
  return guard("fp8_stack_forward_saved", [&] {
    require_arg(model, "model");
    require_arg(saved, "saved");
    require_tensor(model, x, "x");
    require_tensor(model, y, "y");
    fp8::require_not_parameter(model, y, "y");
    fp8::nn::AutowrapRegion region(*model);
    std::unique_ptr<fp8_saved> s = fp8::nn::stack_forward(*model, first_layer, layer_count, x, y);
    region.close();
    *saved = s.release();
  });
}

FP8_API fp8_status_t fp8_stack_forward_residual(fp8_model_t* model, int32_t first_layer, int32_t layer_count,
                                                const fp8_tensor_t* x, const fp8_tensor_t* residual, fp8_tensor_t* y,
                                                fp8_dtype_t act_dtype, fp8_saved_t** saved) {
  return guard("fp8_stack_forward_residual", [&] {
    require_arg(model, "model");
    require_arg(saved, "saved");
    require_tensor(model, x, "x");
    require_tensor(model, residual, "residual");
    require_tensor(model, y, "y");
    fp8::require_not_parameter(model, y, "y");
    fp8::nn::AutowrapRegion region(*model);
    std::unique_ptr<fp8_saved> s = fp8::nn::stack_forward(*model, first_layer, layer_count, x, y, residual, act_dtype);
    region.close();
    *saved = s.release();
  });
}

FP8_API fp8_status_t fp8_stack_backward_saved(fp8_model_t* model, fp8_saved_t* saved, const fp8_tensor_t* dy,
                                              fp8_tensor_t* dx, uint32_t flags) {
  return guard("fp8_stack_backward_saved", [&] {
    require_arg(model, "model");
    require_arg(saved, "saved");
    require_tensor(model, dy, "dy");
    if (dx) {
      require_tensor(model, dx, "dx");
      fp8::require_not_parameter(model, dx, "dx");
    }
    require_backward_flags(flags);
    fp8::nn::AutowrapRegion region(*model);
    fp8::nn::stack_backward(*model, *saved, dy, dx, flags);
    region.close();
  });
}

FP8_API fp8_status_t fp8_stack_backward_saved_add(fp8_model_t* model, fp8_saved_t* saved, const fp8_tensor_t* dy,
                                                  const fp8_tensor_t* base, fp8_tensor_t* dx) {
  return guard("fp8_stack_backward_saved_add", [&] {
    require_arg(model, "model");
    require_arg(saved, "saved");
    require_tensor(model, dy, "dy");
    require_tensor(model, base, "base");
    require_tensor(model, dx, "dx");
    fp8::nn::AutowrapRegion region(*model);
    fp8::nn::stack_backward(*model, *saved, dy, dx, 0, base);
    region.close();
  });
}

FP8_API fp8_status_t fp8_saved_needs_input(const fp8_saved_t* saved, int32_t* needs_input) {
  return guard("fp8_saved_needs_input", [&] {
    require_arg(saved, "saved");
    require_arg(needs_input, "needs_input");
    *needs_input = saved->training && !saved->consumed && saved->reads_input;
  });
}

FP8_API void fp8_saved_destroy(fp8_saved_t* saved) {
  delete saved;
}

FP8_API fp8_status_t fp8_layer_get_scaling(fp8_model_t* model, int32_t layer_id, int32_t slot,
                                           fp8_scaling_t** scaling) {
  return guard("fp8_layer_get_scaling", [&] {
    require_arg(model, "model");
    require_arg(scaling, "scaling");
    fp8::nn::Layer& layer = fp8::nn::layer_at(*model, layer_id);
    if (slot < FP8_SCALING_INPUT || slot > FP8_SCALING_OUTPUT)
      fp8::fail(FP8_ERR_INVALID_ARGUMENT, "slot = ", slot,
                "; expected FP8_SCALING_INPUT (0) .. FP8_SCALING_OUTPUT (3)");
    *scaling = layer.scaling(slot);
  });
}

FP8_API void fp8_layer_report_init(fp8_layer_report_t* report) {
  if (!report) return;
  *report = fp8_layer_report_t{};
  report->struct_size = sizeof *report;
}

FP8_API fp8_status_t fp8_layer_get_report(const fp8_model_t* model, int32_t layer_id, fp8_layer_report_t* report) {
  return guard("fp8_layer_get_report", [&] {
    require_arg(model, "model");
    require_arg(report, "report");
    fp8::require_struct_size(report, fp8::kLayerReportV1Size, "report", "fp8_layer_report_init");
    const fp8::nn::Layer& layer = fp8::nn::layer_at(*model, layer_id);
    const fp8::nn::LayerStats& s = layer.stats();
    fp8_layer_report_t r{};
    r.kind = layer.kind();
    r.converted = layer.converted();
    r.fprop = s.fprop;
    r.dgrad = s.dgrad;
    r.wgrad = s.wgrad;
    r.fp8_calls = s.fp8_calls;
    r.fallback_calls = s.fallback_calls;
    std::snprintf(r.reason, sizeof r.reason, "%s", s.reason.c_str());
    r.scaling = layer.converted() && model->recipe ? static_cast<int32_t>(model->recipe->get(FP8_RECIPE_SCALING)) : -1;
    fp8::write_versioned(report, r);
  });
}

FP8_API fp8_status_t fp8_model_report(const fp8_model_t* model, char* buf, size_t cap, size_t* needed) {
  return guard("fp8_model_report", [&] {
    require_arg(model, "model");
    fp8::write_text(fp8::nn::model_report(*model), buf, cap, needed);
  });
}

}  // extern "C"
