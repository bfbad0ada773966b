// Checkpoints and safetensors files of a model (and its optimizer), on top of the container and
// safetensors codecs. Loading parses and checks everything on the host before it writes a byte of
// device memory, so a file that fails leaves the model and the optimizer as they were.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/recipe.hpp"
#include "fp8.h"

struct fp8_model;
struct fp8_optimizer;

namespace fp8::io {

// Whole device copies of what this rank holds a share of (the O3 masters, m and v of a model whose
// masters are sharded over ranks: dist::gather_whole makes them), by parameter index; nullptr
// where the rank holds the whole tensor itself.
struct WholeState {
  std::vector<const void*> master, m, v;
};

// Writes model (and optimizer, which may be null) to `path` atomically: recipe, parameters in their
// stored types (gradients if `gradients`), every scaling state, the optimizer's hyper-parameters,
// counters, states, masters and scales.
void save_checkpoint(const fp8_model& model, const fp8_optimizer* optimizer, const std::string& path, bool gradients,
                     const WholeState* whole = nullptr);
// Restores what save_checkpoint wrote into a model of the same layers (and conversion), converting
// the storage when the optimizer's level differs from the file's. Throws FP8_ERR_IO, FP8_ERR_CORRUPT,
// FP8_ERR_VERSION or FP8_ERR_INVALID_STATE (naming what does not match) before changing anything;
// `checked` (if set) runs between the checks and the first change, and may throw to stop there. A
// rank that keeps a share of a tensor's master, m and v writes that share alone.
void load_checkpoint(fp8_model& model, fp8_optimizer* optimizer, const std::string& path,
                     const std::function<void()>& checked = {});
// The recipe a checkpoint was saved with (FP8_ERR_INVALID_STATE if its model was not converted,
// FP8_ERR_CORRUPT if the saved text does not parse).
Recipe checkpoint_recipe(const std::string& path);

// Parameters as a Hugging Face safetensors file: FP32 parameters as F32, F16 weights as F16, O3
// weights as their F16 master. Import takes F32, F16 or BF16 tensors named like the parameters; with
// `others_allowed` the file may hold tensors that are no parameter (a larger model's file), left alone.
void export_safetensors(const fp8_model& model, const std::string& path, const WholeState* whole = nullptr);
void import_safetensors(fp8_model& model, const std::string& path, bool others_allowed);
// n host values of `dtype` (F32, F16 or BF16) as floats.
std::vector<float> widen_host(fp8_dtype_t dtype, const void* src, int64_t n);
// Writes the parameter's element count of host values of `dtype` (F32, F16 or BF16) into parameter
// `index` in its stored form (rounded to F16, or at O3 into the master and its E4M3 copy), as
// import_safetensors does for each parameter.
void write_parameter(fp8_model& model, size_t index, fp8_dtype_t dtype, const void* src);

}  // namespace fp8::io
