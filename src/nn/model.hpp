// The model behind fp8_model_t: its layers in order, the conversion recipe, the training and
// autocast flags, and the operations over all layers (conversion, the batched scaling update, the
// report).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/layer.hpp"

struct fp8_model {
  std::shared_ptr<fp8::Backend> backend;
  std::vector<std::unique_ptr<fp8::nn::Layer>> layers;
  std::optional<fp8::Recipe> recipe;  // set by fp8_convert_model(to_fp8 = 1)
  bool training = true;
  bool autocast = false;
  uint64_t weights_version = 0;
};

namespace fp8::nn {

// Throws FP8_ERR_INVALID_ARGUMENT unless `name` can name a new layer of `m`.
void require_new_layer_name(const fp8_model& m, const char* name);
Layer& layer_at(fp8_model& m, int32_t id);
const Layer& layer_at(const fp8_model& m, int32_t id);

// The step description for a layer call now.
Step make_step(fp8_model& m);

struct ConvertChoice {
  bool to_fp8, linear, norm, activation;
};
void convert_model(fp8_model& m, const Recipe* recipe, const ConvertChoice& choice);

// One batched update of every scaling state of the model.
void update_model_scaling(fp8_model& m);

// "<layer>.<param>" -> the parameter, or nullptr.
Parameter* find_parameter(fp8_model& m, const std::string& full_name);

std::string model_report(const fp8_model& m);

}  // namespace fp8::nn
