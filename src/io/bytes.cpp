#include "io/bytes.hpp"

#include <cstring>

#include "core/error.hpp"

namespace fp8::io {

namespace {

uint64_t load_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

void ByteWriter::put_u16(uint16_t v) {
  for (int i = 0; i < 2; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void ByteWriter::put_u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void ByteWriter::put_u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void ByteWriter::put_i64(int64_t v) {
  put_u64(static_cast<uint64_t>(v));
}
void ByteWriter::put_f32(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_u32(bits);
}
void ByteWriter::put_f64(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_u64(bits);
}
void ByteWriter::put_bytes(const uint8_t* data, size_t size) {
  if (size == 0) return;
  out_.insert(out_.end(), data, data + size);
}
void ByteWriter::put_string(const std::string& s) {
  if (s.size() > UINT32_MAX)
    fail(FP8_ERR_INVALID_ARGUMENT, "string of ", s.size(), " bytes is too long for a u32 length");
  put_u32(static_cast<uint32_t>(s.size()));
  put_bytes(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

ByteReader::ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {
  if (data == nullptr && size != 0) fail(FP8_ERR_INVALID_ARGUMENT, "ByteReader: NULL data with size ", size);
}

const uint8_t* ByteReader::take(uint64_t size, const char* what) {
  if (size > remaining()) {
    fail(FP8_ERR_CORRUPT, what, ": needs ", size, " bytes at offset ", pos_, ", only ", remaining(), " left");
  }
  const uint8_t* p = data_ + pos_;
  pos_ += static_cast<size_t>(size);
  return p;
}

uint8_t ByteReader::get_u8(const char* what) {
  return *take(1, what);
}
uint16_t ByteReader::get_u16(const char* what) {
  return static_cast<uint16_t>(load_le(take(2, what), 2));
}
uint32_t ByteReader::get_u32(const char* what) {
  return static_cast<uint32_t>(load_le(take(4, what), 4));
}
uint64_t ByteReader::get_u64(const char* what) {
  return load_le(take(8, what), 8);
}
int64_t ByteReader::get_i64(const char* what) {
  return static_cast<int64_t>(get_u64(what));
}
float ByteReader::get_f32(const char* what) {
  const uint32_t bits = get_u32(what);
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
double ByteReader::get_f64(const char* what) {
  const uint64_t bits = get_u64(what);
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
std::vector<uint8_t> ByteReader::get_bytes(uint64_t size, const char* what) {
  const uint8_t* p = take(size, what);  // checked before the allocation
  return std::vector<uint8_t>(p, p + size);
}
const uint8_t* ByteReader::get_span(uint64_t size, const char* what) {
  return take(size, what);
}
std::string ByteReader::get_string(const char* what) {
  const uint32_t size = get_u32(what);
  const uint8_t* p = take(size, what);
  if (size == 0) return std::string();
  return std::string(reinterpret_cast<const char*>(p), size);
}

void ByteReader::expect_done(const char* what) const {
  if (!done()) fail(FP8_ERR_CORRUPT, what, ": ", remaining(), " trailing bytes at offset ", pos_);
}

}  // namespace fp8::io
