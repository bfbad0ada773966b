// libFuzzer target: the safetensors reader. Any input must either decode or throw fp8::Error;
// anything else (another exception, a crash, a sanitizer report) is a finding. What decodes must
// survive encode + decode unchanged.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fp8::io::SafetensorsFile file;
  try {
    file = fp8::io::decode_safetensors(data, size);
  } catch (const fp8::Error&) {
    return 0;
  }
  const std::vector<uint8_t> again = fp8::io::encode_safetensors(file.tensors, file.metadata);
  const fp8::io::SafetensorsFile back = fp8::io::decode_safetensors(again.data(), again.size());
  if (back.tensors != file.tensors || back.metadata != file.metadata) std::abort();
  return 0;
}
