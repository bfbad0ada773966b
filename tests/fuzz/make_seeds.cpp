// Writes the fuzzers' seed corpus: small valid checkpoints into <dir>/checkpoint and small valid
// safetensors files into <dir>/safetensors, made by the encoders under test.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "io/checkpoint_format.hpp"
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

  // A libfp8 checkpoint's sections: a te bias, an O2 weight with its FP8 gradient and moments, an
  // O3 weight with its master, two scaling states, an Adam optimizer.
  {
    using fp8::io::ParamState;
    ParamState bias;
    bias.name = "fc.bias";
    bias.n = 4;
    bias.value = counting(16);
    bias.m = counting(16);
    bias.v = counting(16);
    ParamState o2;
    o2.name = "fc.weight";
    o2.layout = fp8::kLayoutO2;
    o2.value_dtype = FP8_DTYPE_F16;
    o2.n = 16;
    o2.value = counting(32);
    o2.has_grad = true;
    o2.grad_dtype = FP8_DTYPE_E5M2;
    o2.grad = counting(16);
    o2.grad_scales = {0.5f, 3.0f, 0.0f, 0};
    o2.m = counting(16);
    o2.v = counting(32);
    o2.scales.m_scale_inv = o2.scales.v_scale_inv = 0.25f;
    ParamState o3 = o2;
    o3.name = "out.weight";
    o3.layout = fp8::kLayoutO3;
    o3.value_dtype = FP8_DTYPE_E4M3;
    o3.value = counting(16);
    o3.value_scale_inv = 0.125f;
    o3.master = counting(32);
    const std::vector<ParamState> params = {bias, o2, o3};
    fp8::io::ScalingRecord x{"fc", 2, FP8_DTYPE_E4M3, true, {}, {1.5f, 2.0f}};
    fp8::io::ScalingRecord dy{"fc", 1, FP8_DTYPE_E5M2, false, {}, {0.25f}};
    fp8::io::OptimRecord opt;
    opt.level = 2;
    opt.attrs[0] = 1e-3;
    opt.scalars.steps = 3;
    put("checkpoint", fp8::io::encode_container({{"libfp8", counting(9)},
                                                 {"recipe", bytes_of("backend=msamp, opt_level=O2")},
                                                 {"params", fp8::io::encode_params(params)},
                                                 {"scaling", fp8::io::encode_scaling({x, dy})},
                                                 {"optimizer", fp8::io::encode_optimizer(opt, params)}}));
  }

  // A params section whose parameter's byte count wraps around (2^62 F32 elements in 0 bytes): it
  // must be refused as corrupt, not allocated (the fuzzer found it; replayed at every run).
  {
    fp8::io::ParamState huge;
    huge.name = "w";
    huge.n = int64_t{1} << 62;
    put("checkpoint", fp8::io::encode_params({huge}));
  }

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
