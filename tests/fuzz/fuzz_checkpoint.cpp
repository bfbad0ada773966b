// libFuzzer target: the checkpoint container reader. Any input must either decode or throw
// fp8::Error; anything else (another exception, a crash, a sanitizer report) is a finding. What
// decodes must survive encode + decode unchanged.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "io/container.hpp"

namespace {

void check(const uint8_t* data, size_t size) {
  std::vector<fp8::io::Section> sections;
  try {
    sections = fp8::io::decode_container(data, size);
  } catch (const fp8::Error&) {
    return;
  }
  const std::vector<uint8_t> again = fp8::io::encode_container(sections);
  if (fp8::io::decode_container(again.data(), again.size()) != sections) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
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
