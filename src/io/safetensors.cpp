#include "io/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "core/error.hpp"
#include "io/bytes.hpp"
#include "io/container.hpp"

namespace fp8::io {

namespace {

struct DtypeInfo {
  const char* name;
  size_t size;
};
constexpr DtypeInfo kDtypes[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
                                 {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U8", 1},      {"BOOL", 1}};
constexpr const char* kDtypeList = "F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL";
constexpr const char* kMetadataKey = "__metadata__";

// Bytes of a tensor of `shape` and elements of `elem` bytes; false when a dimension is negative or the
// product overflows (checked dimension by dimension, as the reference implementation does).
bool tensor_bytes(const std::vector<int64_t>& shape, size_t elem, uint64_t* bytes) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (d < 0) return false;
    const uint64_t du = static_cast<uint64_t>(d);
    if (du != 0 && n > std::numeric_limits<uint64_t>::max() / du) return false;
    n *= du;
  }
  *bytes = n;
  return true;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Length of the valid UTF-8 sequence at p (at most n bytes), 0 if there is none: no overlong forms,
// no surrogates, nothing above U+10FFFF (RFC 3629).
size_t utf8_sequence(const unsigned char* p, size_t n) {
  const unsigned char c = p[0];
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xbf;  // bounds of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (n < len || p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < len; ++i) {
    if ((p[i] & 0xc0) != 0x80) return 0;
  }
  return len;
}

bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_sequence(p + i, s.size() - i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string hex_byte(unsigned char c) {
  static const char kHex[] = "0123456789abcdef";
  return std::string("0x") + kHex[c >> 4] + kHex[c & 15];
}

// Names in messages: control characters escaped, the rest (valid UTF-8 by then) as is.
std::string printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

void put_json_string(std::string& out, const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// A strict JSON reader for exactly the header's schema: objects, arrays, strings and non-negative
// integers where the schema puts them, nothing else. Nesting is bounded by the schema (three levels:
// header, tensor entry, shape), so no input can recurse deeper. Errors are FP8_ERR_CORRUPT with the
// byte offset in the header.
class HeaderParser {
 public:
  HeaderParser(const uint8_t* p, size_t n) : p_(p), n_(n) {}

  template <typename... Parts>
  [[noreturn]] void error(Parts&&... parts) const {
    fail(FP8_ERR_CORRUPT, "safetensors header, byte ", pos_, ": ", std::forward<Parts>(parts)...);
  }

  void skip_ws() {
    while (pos_ < n_ && (p_[pos_] == ' ' || p_[pos_] == '\t' || p_[pos_] == '\n' || p_[pos_] == '\r')) ++pos_;
  }
  bool at_end() {
    skip_ws();
    return pos_ == n_;
  }
  // Consumes c if it is the next token.
  bool consume(char c) {
    skip_ws();
    if (pos_ < n_ && p_[pos_] == static_cast<uint8_t>(c)) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c, const char* context) {
    if (!consume(c)) error("expected '", c, "' ", context, ", found ", next_token());
  }
  // What comes next, for messages: "'x'", "a number", "end of header".
  std::string next_token() {
    skip_ws();
    if (pos_ == n_) return "the end of the header";
    const uint8_t c = p_[pos_];
    if (c == '-' || (c >= '0' && c <= '9')) return "a number";
    if (c == '"') return "a string";
    if (c == '{') return "an object";
    if (c == '[') return "an array";
    if (c == 't' || c == 'f') return "a boolean";
    if (c == 'n') return "null";
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    return "byte " + hex_byte(c);
  }

  // Iterates the members of an object: calls member(key) with the parser just after the ':'.
  // Duplicate keys are refused.
  template <typename F>
  void object(const char* context, F&& member) {
    expect('{', context);
    if (consume('}')) return;
    std::unordered_set<std::string> keys;
    do {
      skip_ws();
      const size_t key_pos = pos_;
      std::string key = string(context);
      if (!keys.insert(key).second) {
        pos_ = key_pos;
        error("key \"", printable(key), "\" appears twice ", context);
      }
      expect(':', "after an object key");
      member(key);
    } while (consume(','));
    expect('}', context);
  }

  std::string string(const char* context) {
    skip_ws();
    if (pos_ == n_ || p_[pos_] != '"') error("expected a string ", context, ", found ", next_token());
    ++pos_;
    std::string out;
    for (;;) {
      if (pos_ == n_) error("unterminated string");
      const uint8_t c = p_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) error("control character ", hex_byte(c), " in a string must be escaped");
      if (c == '\\') {
        ++pos_;
        escape(out);
        continue;
      }
      const size_t len = utf8_sequence(p_ + pos_, n_ - pos_);
      if (len == 0) error("invalid UTF-8 in a string");
      out.append(reinterpret_cast<const char*>(p_ + pos_), len);
      pos_ += len;
    }
  }

  uint64_t integer(const char* context) {
    skip_ws();
    if (pos_ == n_ || p_[pos_] < '0' || p_[pos_] > '9') {
      if (pos_ < n_ && p_[pos_] == '-') error("expected a non-negative integer ", context, ", found a negative number");
      error("expected a non-negative integer ", context, ", found ", next_token());
    }
    const size_t start = pos_;
    uint64_t v = 0;
    while (pos_ < n_ && p_[pos_] >= '0' && p_[pos_] <= '9') {
      const uint64_t digit = p_[pos_] - '0';
      if (v > (std::numeric_limits<uint64_t>::max() - digit) / 10) {
        pos_ = start;
        error("integer ", context, " does not fit in 64 bits");
      }
      v = v * 10 + digit;
      ++pos_;
    }
    if (p_[start] == '0' && pos_ - start > 1) {
      pos_ = start;
      error("integer ", context, " has a leading zero");
    }
    if (pos_ < n_ && (p_[pos_] == '.' || p_[pos_] == 'e' || p_[pos_] == 'E')) {
      pos_ = start;
      error("expected an integer ", context, ", found a fraction or exponent");
    }
    return v;
  }

 private:
  uint32_t hex4() {
    if (n_ - pos_ < 4) error("\\u escape needs four hex digits");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const uint8_t c = p_[pos_ + i];
      uint32_t d;
      if (c >= '0' && c <= '9') {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        d = c - 'A' + 10;
      } else {
        error("\\u escape needs four hex digits");
      }
      v = v * 16 + d;
    }
    pos_ += 4;
    return v;
  }

  // After the backslash.
  void escape(std::string& out) {
    if (pos_ == n_) error("unterminated string");
    const uint8_t c = p_[pos_++];
    switch (c) {
      case '"':
        out += '"';
        return;
      case '\\':
        out += '\\';
        return;
      case '/':
        out += '/';
        return;
      case 'b':
        out += '\b';
        return;
      case 'f':
        out += '\f';
        return;
      case 'n':
        out += '\n';
        return;
      case 'r':
        out += '\r';
        return;
      case 't':
        out += '\t';
        return;
      case 'u':
        break;
      default:
        --pos_;
        error("invalid escape '\\", next_token(), "'");
    }
    uint32_t cp = hex4();
    if (cp >= 0xdc00 && cp <= 0xdfff) error("\\u escape is a lone low surrogate");
    if (cp >= 0xd800 && cp <= 0xdbff) {
      if (n_ - pos_ < 2 || p_[pos_] != '\\' || p_[pos_ + 1] != 'u') error("\\u escape is a lone high surrogate");
      pos_ += 2;
      const uint32_t low = hex4();
      if (low < 0xdc00 || low > 0xdfff) error("\\u escape: a high surrogate is not followed by a low one");
      cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
    }
    append_utf8(out, cp);
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

SafeTensorPlace parse_entry(HeaderParser& json, std::string name) {
  SafeTensorPlace e;
  e.name = std::move(name);
  const std::string ctx = "in tensor '" + printable(e.name) + "'";
  bool has_dtype = false, has_shape = false, has_offsets = false;
  json.object(ctx.c_str(), [&](const std::string& key) {
    if (key == "dtype") {
      has_dtype = true;
      e.dtype = json.string(("for the dtype " + ctx).c_str());
    } else if (key == "shape") {
      has_shape = true;
      const std::string dim_ctx = "for a dimension " + ctx;
      json.expect('[', ("for the shape " + ctx).c_str());
      if (!json.consume(']')) {
        do {
          if (e.shape.size() == kMaxSafetensorsRank) {
            fail(FP8_ERR_UNSUPPORTED, "safetensors tensor '", printable(e.name), "' has more than ",
                 kMaxSafetensorsRank, " dimensions");
          }
          const uint64_t d = json.integer(dim_ctx.c_str());
          if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            json.error("dimension ", d, " ", ctx, " does not fit in int64");
          }
          e.shape.push_back(static_cast<int64_t>(d));
        } while (json.consume(','));
        json.expect(']', ("after the shape " + ctx).c_str());
      }
    } else if (key == "data_offsets") {
      has_offsets = true;
      const std::string off_ctx = "for data_offsets " + ctx;
      json.expect('[', off_ctx.c_str());
      e.begin = json.integer(off_ctx.c_str());
      json.expect(',', ("after the first of two data_offsets " + ctx).c_str());
      e.end = json.integer(off_ctx.c_str());
      json.expect(']', ("after the second of two data_offsets " + ctx).c_str());
    } else {
      json.error("unknown key \"", printable(key), "\" ", ctx, " (expected dtype, shape, data_offsets)");
    }
  });
  const char* missing = !has_dtype ? "dtype" : !has_shape ? "shape" : !has_offsets ? "data_offsets" : nullptr;
  if (missing) fail(FP8_ERR_CORRUPT, "safetensors tensor '", printable(e.name), "' has no ", missing);
  return e;
}

}  // namespace

size_t safetensors_dtype_size(const std::string& dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (dtype == d.name) return d.size;
  }
  return 0;
}

std::vector<uint8_t> encode_safetensors(const std::vector<SafeTensor>& tensors, const SafetensorsMetadata& metadata) {
  std::string header = "{";
  if (!metadata.empty()) {
    std::unordered_set<std::string> keys;
    put_json_string(header, kMetadataKey);
    header += ":{";
    for (const auto& [key, value] : metadata) {
      if (!valid_utf8(key) || !valid_utf8(value)) {
        fail(FP8_ERR_INVALID_ARGUMENT, "safetensors metadata '", printable(key), "': key and value must be UTF-8");
      }
      if (!keys.insert(key).second) {
        fail(FP8_ERR_INVALID_ARGUMENT, "safetensors metadata key '", printable(key), "' appears twice");
      }
      if (header.back() != '{') header += ',';
      put_json_string(header, key);
      header += ':';
      put_json_string(header, value);
    }
    header += '}';
  }
  std::unordered_set<std::string> names;
  uint64_t offset = 0;
  for (const SafeTensor& t : tensors) {
    const std::string name = printable(t.name);
    if (!valid_utf8(t.name)) fail(FP8_ERR_INVALID_ARGUMENT, "safetensors tensor name '", name, "' is not UTF-8");
    if (t.name == kMetadataKey) fail(FP8_ERR_INVALID_ARGUMENT, "a safetensors tensor cannot be named '", name, "'");
    if (!names.insert(t.name).second) {
      fail(FP8_ERR_INVALID_ARGUMENT, "safetensors tensor name '", name, "' appears twice");
    }
    const size_t elem = safetensors_dtype_size(t.dtype);
    if (elem == 0) {
      fail(FP8_ERR_INVALID_ARGUMENT, "safetensors tensor '", name, "': dtype '", printable(t.dtype), "' is not one of ",
           kDtypeList);
    }
    if (t.shape.size() > kMaxSafetensorsRank) {
      fail(FP8_ERR_INVALID_ARGUMENT, "safetensors tensor '", name, "' has ", t.shape.size(), " dimensions, more than ",
           kMaxSafetensorsRank);
    }
    uint64_t bytes = 0;
    if (!tensor_bytes(t.shape, elem, &bytes)) {
      fail(FP8_ERR_INVALID_ARGUMENT, "safetensors tensor '", name, "': shape ", shape_text(t.shape),
           " has a negative dimension or too many elements");
    }
    if (bytes != t.data.size()) {
      fail(FP8_ERR_INVALID_ARGUMENT, "safetensors tensor '", name, "' (", t.dtype, " ", shape_text(t.shape), ") needs ",
           bytes, " bytes of data, has ", t.data.size());
    }
    if (header.back() != '{') header += ',';
    put_json_string(header, t.name);
    header += ":{\"dtype\":";
    put_json_string(header, t.dtype);
    header += ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxSafetensorsHeader) {
    fail(FP8_ERR_INVALID_ARGUMENT, "safetensors header would be ", header.size(), " bytes, more than the format's ",
         kMaxSafetensorsHeader);
  }

  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + offset);
  ByteWriter w(out);
  w.put_u64(header.size());
  w.put_bytes(reinterpret_cast<const uint8_t*>(header.data()), header.size());
  for (const SafeTensor& t : tensors) w.put_bytes(t.data);
  return out;
}

SafetensorsIndex decode_safetensors_index(const uint8_t* head, size_t head_size, uint64_t file_size) {
  if (head == nullptr && head_size != 0)
    fail(FP8_ERR_INVALID_ARGUMENT, "decode_safetensors_index: NULL head with size ", head_size);
  if (head_size > file_size)
    fail(FP8_ERR_INVALID_ARGUMENT, "decode_safetensors_index: ", head_size, " bytes of a file of ", file_size);
  ByteReader r(head, head_size);
  const uint64_t header_size = r.get_u64("safetensors header length");
  if (header_size > kMaxSafetensorsHeader) {
    fail(FP8_ERR_CORRUPT, "safetensors header length ", header_size, " is above the limit of ", kMaxSafetensorsHeader,
         " bytes (not a safetensors file?)");
  }
  if (header_size > file_size - 8) {
    fail(FP8_ERR_CORRUPT, "safetensors header length ", header_size, " runs past the end of the file (", file_size,
         " bytes)");
  }
  const uint8_t* header = r.get_span(header_size, "safetensors header");
  SafetensorsIndex index;
  index.data_start = 8 + header_size;
  const uint64_t buffer_size = file_size - index.data_start;

  if (header_size == 0 || header[0] != '{') {
    fail(FP8_ERR_CORRUPT, "safetensors header does not start with '{' (not a safetensors file?)");
  }
  HeaderParser json(header, header_size);
  std::vector<SafeTensorPlace>& entries = index.tensors;
  json.object("in the header", [&](const std::string& key) {
    if (key == kMetadataKey) {
      json.object("in __metadata__", [&](const std::string& meta_key) {
        const std::string ctx = "for __metadata__ key '" + printable(meta_key) + "'";
        index.metadata.emplace_back(meta_key, json.string(ctx.c_str()));
      });
    } else {
      entries.push_back(parse_entry(json, key));
    }
  });
  if (!json.at_end()) json.error("unexpected ", json.next_token(), " after the header's JSON object");

  // The tensors must tile the buffer: sorted by offsets (stable, so zero-sized tensors at one offset
  // keep the header's order), each starts where the previous ends, the last ends at the buffer's end.
  for (const SafeTensorPlace& e : entries) {
    if (e.begin > e.end) {
      fail(FP8_ERR_CORRUPT, "safetensors tensor '", printable(e.name), "': data_offsets [", e.begin, ", ", e.end,
           "] end before they begin");
    }
    if (e.end > buffer_size) {
      fail(FP8_ERR_CORRUPT, "safetensors tensor '", printable(e.name), "': data_offsets [", e.begin, ", ", e.end,
           "] run past the data buffer of ", buffer_size, " bytes");
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const SafeTensorPlace& a, const SafeTensorPlace& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafeTensorPlace& e = entries[i];
    if (e.begin > expected) {
      fail(FP8_ERR_CORRUPT, "safetensors data bytes [", expected, ", ", e.begin,
           ") belong to no tensor (a hole before '", printable(e.name), "')");
    }
    if (e.begin < expected) {
      fail(FP8_ERR_CORRUPT, "safetensors tensor '", printable(e.name), "' (bytes [", e.begin, ", ", e.end,
           ")) overlaps '", printable(entries[i - 1].name), "'");
    }
    expected = e.end;
  }
  if (expected != buffer_size) {
    fail(FP8_ERR_CORRUPT, "safetensors data bytes [", expected, ", ", buffer_size,
         ") after the last tensor belong to no tensor");
  }

  for (const SafeTensorPlace& e : entries) {
    const size_t elem = safetensors_dtype_size(e.dtype);
    if (elem == 0) {
      fail(FP8_ERR_UNSUPPORTED, "safetensors tensor '", printable(e.name), "' has dtype '", printable(e.dtype),
           "', which libfp8 does not read (it reads ", kDtypeList, ")");
    }
  }
  for (const SafeTensorPlace& e : entries) {
    uint64_t bytes = 0;
    if (!tensor_bytes(e.shape, safetensors_dtype_size(e.dtype), &bytes)) {
      fail(FP8_ERR_CORRUPT, "safetensors tensor '", printable(e.name), "': shape ", shape_text(e.shape),
           " has too many elements");
    }
    if (bytes != e.end - e.begin) {
      fail(FP8_ERR_CORRUPT, "safetensors tensor '", printable(e.name), "' (", e.dtype, " ", shape_text(e.shape),
           ") needs ", bytes, " bytes, its data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin);
    }
  }
  return index;
}

SafetensorsFile decode_safetensors(const uint8_t* data, size_t size) {
  if (data == nullptr && size != 0) fail(FP8_ERR_INVALID_ARGUMENT, "decode_safetensors: NULL data with size ", size);
  SafetensorsIndex index = decode_safetensors_index(data, size, size);
  SafetensorsFile file;
  file.metadata = std::move(index.metadata);
  file.tensors.reserve(index.tensors.size());
  for (SafeTensorPlace& place : index.tensors) {
    SafeTensor t;
    t.name = std::move(place.name);
    t.dtype = std::move(place.dtype);
    t.shape = std::move(place.shape);
    t.data.assign(data + index.data_start + place.begin, data + index.data_start + place.end);
    file.tensors.push_back(std::move(t));
  }
  return file;
}

SafetensorsIndex read_safetensors_index(const FileReader& file) {
  // The length field (or what there is of it), then the header it announces (or what there is):
  // the decoder reports a short file or an absurd length as it does for a file in memory.
  std::vector<uint8_t> head = file.read_at(0, std::min<uint64_t>(8, file.size()), "the safetensors header length");
  if (head.size() == 8) {
    const uint64_t header_size = ByteReader(head.data(), 8).get_u64("safetensors header length");
    const uint64_t available = header_size > kMaxSafetensorsHeader ? 0 : std::min(header_size, file.size() - 8);
    const std::vector<uint8_t> header = file.read_at(8, available, "the safetensors header");
    head.insert(head.end(), header.begin(), header.end());
  }
  return decode_safetensors_index(head.data(), head.size(), file.size());
}

}  // namespace fp8::io
