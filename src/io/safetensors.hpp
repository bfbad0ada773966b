// Hugging Face safetensors (https://github.com/huggingface/safetensors, "Format"):
//   u64 little-endian N | N bytes of JSON header | byte buffer
// The header is one JSON object: an optional "__metadata__" object of string to string, and per
// tensor {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} with offsets relative to
// the buffer. The tensors tile the buffer exactly, with no hole and no overlap. It knows nothing of
// models; src/api imports and exports models on top of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fp8::io {

struct SafeTensor {
  std::string name;
  std::string dtype;           // "F32", "BF16", "F8_E4M3", ... (safetensors' spelling)
  std::vector<int64_t> shape;  // [] is a scalar
  std::vector<uint8_t> data;   // little-endian elements, row-major
};

using SafetensorsMetadata = std::vector<std::pair<std::string, std::string>>;

// A tensor's header entry: its bytes are [begin, end) of the data buffer (its data_offsets).
struct SafeTensorPlace {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A file's header: its tensors in the order of their bytes, its metadata in the header's order, and
// where the data buffer starts in the file (a tensor's bytes are at data_start + begin).
struct SafetensorsIndex {
  std::vector<SafeTensorPlace> tensors;
  SafetensorsMetadata metadata;
  uint64_t data_start = 0;
};

class FileReader;

struct SafetensorsFile {
  std::vector<SafeTensor> tensors;  // in the order of their bytes in the file
  SafetensorsMetadata metadata;     // in the order of the header
};

inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;  // as the reference implementation
inline constexpr size_t kMaxSafetensorsRank = 64;

// Bytes per element of a dtype libfp8 reads and writes (F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16
// I8 U8 BOOL), or 0 for any other.
size_t safetensors_dtype_size(const std::string& dtype);

// A file whose tensors appear in the given order, "__metadata__" first (left out when empty), the
// header padded with spaces to a multiple of 8 bytes. FP8_ERR_INVALID_ARGUMENT naming the tensor
// for an unknown dtype, a negative dimension, more than kMaxSafetensorsRank dimensions, data whose
// size is not product(shape) * element size, a name that is repeated, is "__metadata__" or is not
// UTF-8, and for repeated or non-UTF-8 metadata keys or values.
std::vector<uint8_t> encode_safetensors(const std::vector<SafeTensor>& tensors, const SafetensorsMetadata& metadata);

// Strict reader. FP8_ERR_CORRUPT for a malformed file: header length beyond the file or above
// kMaxSafetensorsHeader, JSON that is invalid or not of the form above (anything but objects, arrays,
// strings and non-negative integers; duplicate keys; unknown keys in a tensor entry; invalid UTF-8),
// a shape whose size overflows, data_offsets that disagree with shape and dtype, leave holes, overlap
// or run past the buffer. FP8_ERR_UNSUPPORTED naming the tensor for a well-formed entry with a dtype
// this library does not know, or with more than kMaxSafetensorsRank dimensions.
SafetensorsFile decode_safetensors(const uint8_t* data, size_t size);

// The same checks on the header alone, for a file of file_size bytes whose first head_size bytes
// are `head` (the length field and the header, or more): where each tensor's bytes lie, which the
// caller reads itself.
SafetensorsIndex decode_safetensors_index(const uint8_t* head, size_t head_size, uint64_t file_size);

// decode_safetensors_index on a file read through `file`: the length field and the header are read,
// none of the tensors' bytes.
SafetensorsIndex read_safetensors_index(const FileReader& file);

inline bool operator==(const SafeTensor& a, const SafeTensor& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.data == b.data;
}
inline bool operator!=(const SafeTensor& a, const SafeTensor& b) {
  return !(a == b);
}

}  // namespace fp8::io
