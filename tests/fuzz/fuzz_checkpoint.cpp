// libFuzzer target: the checkpoint reader, the container and then its sections (parameters,
// scaling states, optimizer) and the conversion of each parameter to every level, as
// fp8_checkpoint_load runs them before it touches a model. Any input must either decode or throw
// fp8::Error; anything else (another exception, a crash, a sanitizer report) is a finding. What
// decodes must survive encode + decode unchanged.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "io/checkpoint_format.hpp"
#include "io/container.hpp"

namespace {

// The sections as load_checkpoint reads them; each decoder's output must re-encode to its input.
void check_sections(const std::vector<fp8::io::Section>& sections) {
  using namespace fp8::io;
  try {
    const Section* params_section = find_section(sections, "params");
    if (!params_section) return;
    std::vector<ParamState> params = decode_params(params_section->data);
    if (encode_params(params) != params_section->data) std::abort();
    if (const Section* s = find_section(sections, "scaling")) {
      const std::vector<ScalingRecord> states = decode_scaling(s->data);
      if (encode_scaling(states) != s->data) std::abort();
    }
    if (const Section* s = find_section(sections, "weight_copies")) {
      if (encode_weight_copies(decode_weight_copies(s->data)) != s->data) std::abort();
    }
    if (const Section* s = find_section(sections, "optimizer")) {
      const OptimRecord o = decode_optimizer(s->data, params);
      if (encode_optimizer(o, params) != s->data) std::abort();
    }
    for (const ParamState& p : params)
      for (int32_t layout = fp8::kLayoutF32; layout <= fp8::kLayoutO3; ++layout) {
        ParamState q = p;
        convert_layout(q, layout);
        for (fp8_dtype_t g : {FP8_DTYPE_F32, FP8_DTYPE_E4M3, FP8_DTYPE_E5M2}) {
          ParamState r = q;
          convert_grad(r, g);
          if (r.has_grad && r.grad.size() != bytes_of(r.n, g == FP8_DTYPE_F32 ? 4 : 1)) std::abort();
        }
      }
  } catch (const fp8::Error&) {
  }
}

void check(const uint8_t* data, size_t size) {
  std::vector<fp8::io::Section> sections;
  try {
    sections = fp8::io::decode_container(data, size);
  } catch (const fp8::Error&) {
    return;
  }
  const std::vector<uint8_t> again = fp8::io::encode_container(sections);
  if (fp8::io::decode_container(again.data(), again.size()) != sections) std::abort();
  check_sections(sections);
}

}  // namespace

// The input as a section's body: the section checksums keep most mutations of a whole file away
// from the section decoders, so they are also fed directly.
void check_raw_section(const uint8_t* data, size_t size) {
  using namespace fp8::io;
  const std::vector<uint8_t> body(data, data + size);
  std::vector<Section> as_params = {{"params", body}}, as_scaling = {{"params", encode_params({})}, {"scaling", body}};
  check_sections(as_params);
  check_sections(as_scaling);
  try {  // an optimizer section over two parameters of the seed's kinds
    std::vector<ParamState> params(2);
    params[0].n = 4;
    params[1].layout = fp8::kLayoutO3;
    params[1].value_dtype = FP8_DTYPE_E4M3;
    params[1].n = 16;
    const OptimRecord o = decode_optimizer(body, params);
    if (encode_optimizer(o, params) != body) std::abort();
  } catch (const fp8::Error&) {
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_raw_section(data, size);
  check(data, size);
  // Mutations almost never keep the file checksum right; a second pass with it recomputed lets
  // the fuzzer reach the section headers, inflate and the section checksums.
  if (size >= 4) {
    std::vector<uint8_t> fixed(data, data + size);
    const uint32_t crc = fp8::io::crc32_of(fixed.data(), size - 4);
    for (int i = 0; i < 4; ++i) fixed[size - 4 + i] = static_cast<uint8_t>(crc >> (8 * i));
    check(fixed.data(), fixed.size());
  }
  return 0;
}
