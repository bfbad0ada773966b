// Checkpoints and safetensors: handle checks here, the work in src/io/checkpoint.cpp.
#include <cstring>

#include "api/guard.hpp"
#include "dist/data_parallel.hpp"
#include "io/checkpoint.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"

using fp8::guard;
using fp8::require_arg;

namespace {

// A file name: not NULL, not empty, not a directory's ("dir/").
void require_path(const char* path) {
  require_arg(path, "path");
  const size_t n = std::strlen(path);
  if (n == 0) fp8::fail(FP8_ERR_INVALID_ARGUMENT, "path is empty; expected a file name");
  if (path[n - 1] == '/')
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "path = '", path, "' ends in '/'; expected a file name, not a directory");
}

void require_flags(uint32_t flags) {
  if (flags & ~FP8_CHECKPOINT_GRADIENTS)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "flags = ", flags, "; expected 0 or FP8_CHECKPOINT_GRADIENTS (1)");
}

// A file of a data-parallel model (collective): every rank holds the same state, or its share of
// it, gathered whole first; rank 0 writes it, and the ranks agree on the outcome.
template <class Write>
void rank0_writes(const fp8_model* model, const fp8_optimizer* optimizer, const char* what, Write&& write) {
  fp8::dist::Transport& t = *model->comm->transport;
  std::vector<fp8::nn::Arena> keep;
  const bool sharded = model->store && model->store->masters_sharded();
  const fp8::io::WholeState whole = sharded ? fp8::dist::gather_whole(*model, optimizer, keep) : fp8::io::WholeState{};
  fp8::dist::all_or_none(
      t, model->backend, what,
      [&] {
        if (t.rank() == 0) write(whole);
      },
      [] {}, "and the previous file under that name (if any) is kept");
}

// A data-parallel save or load takes the optimizer on every rank or on none (collective): with it on
// some ranks only, they would run different collectives (O3 gathers its masters' shares) or end in
// different states.
void require_optimizer_alike(const fp8_model* model, const fp8_optimizer* optimizer) {
  if (!fp8::dist::same_on_every_rank(*model->comm->transport, model->backend, optimizer != nullptr))
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "optimizer is ", optimizer ? "given" : "NULL", " on this rank and ",
              optimizer ? "NULL" : "given", " on another; a data-parallel model's ranks pass it alike (all or none)");
}

void require_model_optimizer(const fp8_model* model, const fp8_optimizer* optimizer) {
  if (optimizer) fp8::optim::model_of(*optimizer);  // refuses an optimizer whose model is gone
  if (optimizer && optimizer->model != model)
    fp8::fail(FP8_ERR_INVALID_ARGUMENT, "optimizer was made for another model; pass that model's optimizer or NULL");
  if (model->autocast)
    fp8::fail(FP8_ERR_INVALID_STATE, "inside fp8_autocast_begin/end: checkpoints are taken between steps");
}

}  // namespace

extern "C" {

FP8_API fp8_status_t fp8_checkpoint_save(const fp8_model_t* model, const fp8_optimizer_t* optimizer, const char* path,
                                         uint32_t flags) {
  return guard("fp8_checkpoint_save", [&] {
    require_arg(model, "model");
    require_path(path);
    require_flags(flags);
    const bool grads = (flags & FP8_CHECKPOINT_GRADIENTS) != 0;
    if (!model->comm) {
      require_model_optimizer(model, optimizer);
      fp8::io::save_checkpoint(*model, optimizer, path, grads);
      return;
    }
    if (grads)
      fp8::fail(FP8_ERR_INVALID_STATE, "FP8_CHECKPOINT_GRADIENTS on a data-parallel model: each rank's gradients ",
                "are its own until the step averages them; save after fp8_optimizer_step (without the flag)");
    // (The arguments above are refused at once, as on every rank; this rank's state is agreed on, so
    // that a rank refusing alone, inside autocast, does not leave the others waiting in the gather.)
    fp8::dist::all_or_none(
        *model->comm->transport, model->backend, "fp8_checkpoint_save",
        [&] { require_model_optimizer(model, optimizer); }, [] {});
    require_optimizer_alike(model, optimizer);
    rank0_writes(model, optimizer, "fp8_checkpoint_save", [&](const fp8::io::WholeState& whole) {
      fp8::io::save_checkpoint(*model, optimizer, path, false, &whole);
    });
  });
}

FP8_API fp8_status_t fp8_checkpoint_load(fp8_model_t* model, fp8_optimizer_t* optimizer, const char* path) {
  return guard("fp8_checkpoint_load", [&] {
    require_arg(model, "model");
    if (!model->comm) {
      require_path(path);
      require_model_optimizer(model, optimizer);
      fp8::io::load_checkpoint(*model, optimizer, path);
      return;
    }
    // Collective: every rank reads and checks the file; they agree before any writes a byte. (This
    // rank's own checks too: one refusing alone must not leave the others waiting in the agreement.)
    require_optimizer_alike(model, optimizer);
    fp8::dist::Transport& t = *model->comm->transport;
    bool checked = false;
    try {
      require_path(path);
      require_model_optimizer(model, optimizer);
      fp8::io::load_checkpoint(*model, optimizer, path, [&] {
        checked = true;
        const fp8::dist::Agreement a = fp8::dist::agree(t, model->backend, FP8_OK);
        if (a.status != FP8_OK)
          fp8::fail(FP8_ERR_INVALID_STATE, "fp8_checkpoint_load failed on rank ", a.rank, " (",
                    fp8_status_string(a.status), "; its message says why), so no rank changed");
      });
    } catch (const fp8::Error& e) {
      if (!checked) fp8::dist::agree(t, model->backend, e.status());
      throw;
    } catch (...) {
      if (!checked) fp8::dist::agree(t, model->backend, FP8_ERR_INTERNAL);
      throw;
    }
    fp8::dist::grads_consumed(*model);  // (the file's gradients, or zeros)
  });
}

FP8_API fp8_status_t fp8_checkpoint_read_recipe(const char* path, fp8_recipe_t* recipe) {
  return guard("fp8_checkpoint_read_recipe", [&] {
    require_path(path);
    require_arg(recipe, "recipe");
    recipe->recipe = fp8::io::checkpoint_recipe(path);
  });
}

FP8_API fp8_status_t fp8_model_export_safetensors(const fp8_model_t* model, const char* path) {
  return guard("fp8_model_export_safetensors", [&] {
    require_arg(model, "model");
    require_path(path);
    if (!model->comm) {
      fp8::io::export_safetensors(*model, path);
      return;
    }
    rank0_writes(model, nullptr, "fp8_model_export_safetensors",
                 [&](const fp8::io::WholeState& whole) { fp8::io::export_safetensors(*model, path, &whole); });
  });
}

namespace {

fp8_status_t import_safetensors(const char* api, fp8_model_t* model, const char* path, bool others_allowed) {
  return guard(api, [&] {
    require_arg(model, "model");
    require_path(path);
    if (model->autocast) fp8::fail(FP8_ERR_INVALID_STATE, "inside fp8_autocast_begin/end; import between steps");
    fp8::io::import_safetensors(*model, path, others_allowed);
  });
}

}  // namespace

FP8_API fp8_status_t fp8_model_import_safetensors(fp8_model_t* model, const char* path) {
  return import_safetensors("fp8_model_import_safetensors", model, path, false);
}

FP8_API fp8_status_t fp8_model_import_safetensors_part(fp8_model_t* model, const char* path) {
  return import_safetensors("fp8_model_import_safetensors_part", model, path, true);
}

}  // extern "C"

extern "C" FP8_API fp8_status_t fp8_model_write_parameter(fp8_model_t* model, int32_t index, fp8_dtype_t dtype,
                                                          const void* src, size_t bytes) {
  return guard("fp8_model_write_parameter", [&] {
    require_arg(model, "model");
    const fp8::nn::Parameter& p = fp8::nn::parameter_at(*model, index);
    if (dtype != FP8_DTYPE_F32 && dtype != FP8_DTYPE_F16 && dtype != FP8_DTYPE_BF16)
      fp8::fail(FP8_ERR_DTYPE, "dtype = ", fp8::dtype_name(dtype), "; expected f32, f16 or bf16 host data");
    const size_t want = static_cast<size_t>(p.value->numel) * fp8::dtype_size(dtype);
    if (bytes != want)
      fp8::fail(FP8_ERR_SHAPE, "bytes = ", bytes, "; parameter '", p.name, "' has ", p.value->numel, " elements, so ",
                want, " bytes of ", fp8::dtype_name(dtype));
    require_arg(src, "src");
    fp8::io::write_parameter(*model, static_cast<size_t>(index), dtype, src);
  });
}
