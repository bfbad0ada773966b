// Writes the fuzzers' seed corpus: small valid checkpoints into <dir>/checkpoint and small valid
// safetensors files into <dir>/safetensors, made by the encoders under test.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "io/container.hpp"
#include "io/safetensors.hpp"

namespace {

using Bytes = std::vector<uint8_t>;

Bytes bytes_of(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

Bytes counting(size_t n) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 37 + 11);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <seed dir>\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int n = 0;
  auto put = [&](const std::string& kind, const Bytes& bytes) {
    fp8::io::write_file_atomic(dir + "/" + kind + "/seed" + std::to_string(n++), bytes);
  };

  put("checkpoint", fp8::io::encode_container({}));
  put("checkpoint", fp8::io::encode_container({{"meta", bytes_of("{\"step\":3,\"level\":\"O2\"}")}}));
  put("checkpoint", fp8::io::encode_container({{"a", counting(64)}, {"empty", {}}, {"zeros", Bytes(3000, 0)}}));
  put("checkpoint", fp8::io::encode_container({{"model.fc1.weight", counting(300)},
                                               {"optimizer.m", counting(100)},
                                               {"optimizer.v", bytes_of("vvvvvvvvvvvvvvvvvvvvvvvvvvv")}}));

  put("safetensors", fp8::io::encode_safetensors({}, {}));
  put("safetensors", fp8::io::encode_safetensors({{"w", "F32", {2, 2}, counting(16)}}, {{"format", "pt"}}));
  const char* dtypes[] = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"};
  std::vector<fp8::io::SafeTensor> all;
  for (const char* dt : dtypes) {
    all.push_back({std::string("t.") + dt, dt, {2}, counting(2 * fp8::io::safetensors_dtype_size(dt))});
  }
  put("safetensors", fp8::io::encode_safetensors(all, {}));
  put("safetensors", fp8::io::encode_safetensors({{"scalar", "F64", {}, counting(8)},
                                                  {"empty", "BF16", {0, 4}, {}},
                                                  {"caf\xc3\xa9 \"q\"\n\xf0\x9f\x98\x80", "U8", {3}, counting(3)}},
                                                 {{"k\x01", "v\\/"}, {"note", ""}}));
  // Hand-written: whitespace, any key order, escapes the encoder never writes.
  const std::string header =
      "{ \"b\": {\"data_offsets\": [4, 6], \"shape\": [1], \"dtype\": \"F16\"},\n"
      "  \"__metadata__\": {\"\\u00e9\\ud83d\\ude00\": \"\\/\\b\\f\\t\\r\"},\n"
      "  \"a\": {\"shape\": [], \"dtype\": \"I32\", \"data_offsets\": [0, 4]} }";
  Bytes hand(8);
  for (int i = 0; i < 8; ++i) hand[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  hand.insert(hand.end(), header.begin(), header.end());
  for (int i = 0; i < 6; ++i) hand.push_back(static_cast<uint8_t>(i));
  put("safetensors", hand);
  return 0;
}
