// Little-endian byte encoding for libfp8's file formats. The writer appends to a caller's vector;
// the reader is safe on arbitrary input: every overrun throws FP8_ERR_CORRUPT naming what was being
// read, and a length field is checked against the bytes left before anything is allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fp8::io {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>& out) : out_(out) {}

  void put_u8(uint8_t v) { out_.push_back(v); }
  void put_u16(uint16_t v);
  void put_u32(uint32_t v);
  void put_u64(uint64_t v);
  void put_i64(int64_t v);
  void put_f32(float v);  // IEEE-754 bits, NaN payloads kept
  void put_f64(double v);
  void put_bytes(const uint8_t* data, size_t size);
  void put_bytes(const std::vector<uint8_t>& bytes) { put_bytes(bytes.data(), bytes.size()); }
  // u32 length, then the bytes (no terminator). FP8_ERR_INVALID_ARGUMENT above 2^32 - 1 bytes.
  void put_string(const std::string& s);

  size_t size() const { return out_.size(); }

 private:
  std::vector<uint8_t>& out_;
};

// Reads from a borrowed buffer, which must outlive the reader. Each getter takes `what`, a short
// description for the error message: "<what>: needs N bytes at offset O, only M left".
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size);

  uint8_t get_u8(const char* what);
  uint16_t get_u16(const char* what);
  uint32_t get_u32(const char* what);
  uint64_t get_u64(const char* what);
  int64_t get_i64(const char* what);
  float get_f32(const char* what);
  double get_f64(const char* what);
  // `size` bytes copied out / borrowed in place (valid while the buffer is); both advance.
  std::vector<uint8_t> get_bytes(uint64_t size, const char* what);
  const uint8_t* get_span(uint64_t size, const char* what);
  std::string get_string(const char* what);  // u32 length, then the bytes

  size_t offset() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  bool done() const { return pos_ == size_; }
  // FP8_ERR_CORRUPT "<what>: N trailing bytes at offset O" unless everything was read.
  void expect_done(const char* what) const;

 private:
  const uint8_t* take(uint64_t size, const char* what);  // checks, advances, returns the start

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace fp8::io
