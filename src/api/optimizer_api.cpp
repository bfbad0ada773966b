// The optimizer: handle checks here, the work in src/optim.
#include <cstddef>

#include "api/guard.hpp"
#include "core/dtype.hpp"
#include "dist/data_parallel.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"

using fp8::guard;
using fp8::require_arg;

extern "C" {

FP8_API fp8_status_t fp8_optimizer_create(fp8_optimizer_t** out, fp8_model_t* model, fp8_optimizer_kind_t kind) {
  return guard("fp8_optimizer_create", [&] {
    require_arg(out, "out");
    require_arg(model, "model");
    if (!model->comm) {
      *out = fp8::optim::make_optimizer(*model, kind).release();
      return;
    }
    // Collective: the same model and optimizer kind on every rank, made on every rank or on none.
    fp8::dist::Transport& t = *model->comm->transport;
    const bool known = kind >= FP8_OPTIMIZER_SGD && kind <= FP8_OPTIMIZER_ADAMW;
    fp8::dist::require_same_model(t, *model, known ? fp8::optim::kind_name(kind) : "(invalid kind)",
                                  "fp8_optimizer_create");
    // Layers added or converted since fp8_model_set_comm start from rank 0's values too.
    fp8::dist::broadcast_model(t, *model);
    std::unique_ptr<fp8_optimizer> o;
    fp8::dist::all_or_none(
        t, model->backend, "fp8_optimizer_create", [&] { o = fp8::optim::make_optimizer(*model, kind); },
        [&] { o.reset(); });
    if (o->sharded) fp8::dist::agree_compact_scales(*o);  // the masters' amaxes, from every share
    *out = o.release();
  });
}

FP8_API void fp8_optimizer_destroy(fp8_optimizer_t* optimizer) { delete optimizer; }

FP8_API fp8_status_t fp8_optimizer_set_float(fp8_optimizer_t* optimizer, fp8_optimizer_attr_t attr, double value) {
  return guard("fp8_optimizer_set_float", [&] {
    require_arg(optimizer, "optimizer");
    fp8::optim::set_attr(*optimizer, attr, value);
  });
}

FP8_API fp8_status_t fp8_optimizer_get_float(const fp8_optimizer_t* optimizer, fp8_optimizer_attr_t attr,
                                             double* value) {
  return guard("fp8_optimizer_get_float", [&] {
    require_arg(optimizer, "optimizer");
    require_arg(value, "value");
    *value = fp8::optim::get_attr(*optimizer, attr);
  });
}

FP8_API fp8_status_t fp8_optimizer_step(fp8_optimizer_t* optimizer) {
  return guard("fp8_optimizer_step", [&] {
    require_arg(optimizer, "optimizer");
    fp8::optim::step(*optimizer);
  });
}

FP8_API fp8_status_t fp8_optimizer_step_joint(fp8_optimizer_t* optimizer, const fp8_tensor_t* other_sumsq,
                                              fp8_tensor_t* clip_coef) {
  return guard("fp8_optimizer_step_joint", [&] {
    require_arg(optimizer, "optimizer");
    const fp8_model& m = fp8::optim::model_of(*optimizer);
    auto require_scalar = [&](const fp8_tensor* t, const char* name) {
      fp8::require_tensor(&m, t, name);
      if (t->dtype != FP8_DTYPE_F32 || t->numel != 1)
        fp8::fail(FP8_ERR_INVALID_ARGUMENT, name, " is ", fp8::dtype_name(t->dtype), " of ", t->numel,
                  " elements; expected f32 of 1 element");
    };
    require_scalar(other_sumsq, "other_sumsq");
    if (clip_coef) {
      require_scalar(clip_coef, "clip_coef");
      fp8::require_not_parameter(&m, clip_coef, "clip_coef");
    }
    fp8::optim::step(*optimizer, static_cast<const float*>(other_sumsq->data),
                     clip_coef ? static_cast<float*>(clip_coef->data) : nullptr);
  });
}

FP8_API fp8_status_t fp8_optimizer_zero_grad(fp8_optimizer_t* optimizer) {
  return guard("fp8_optimizer_zero_grad", [&] {
    require_arg(optimizer, "optimizer");
    fp8::nn::zero_grad(fp8::optim::model_of(*optimizer));
  });
}

FP8_API void fp8_optimizer_stats_init(fp8_optimizer_stats_t* stats) {
  if (!stats) return;
  *stats = fp8_optimizer_stats_t{};
  stats->struct_size = sizeof *stats;
}

FP8_API fp8_status_t fp8_optimizer_get_stats(const fp8_optimizer_t* optimizer, fp8_optimizer_stats_t* stats) {
  return guard("fp8_optimizer_get_stats", [&] {
    require_arg(optimizer, "optimizer");
    require_arg(stats, "stats");
    fp8::require_struct_size(stats, fp8::kOptimizerStatsV1Size, "stats", "fp8_optimizer_stats_init");
    fp8::write_versioned(stats, fp8::optim::stats(*optimizer));
  });
}

}  // extern "C"
