// The checkpoint container: named, zlib-compressed, CRC-checked sections in one file, written
// atomically. It knows nothing of models or optimizers; src/api builds checkpoints on top of it.
//
// Layout (all integers little-endian):
//   magic       8 bytes  89 'F' 'P' '8' 0D 0A 1A 0A   (like PNG's: catches 7-bit and text-mode damage)
//   version     u32      kContainerVersion
//   count       u32      number of sections
//   per section:
//     name      u16 length (1..255) + bytes, unique within the file
//     raw       u64      size of the data
//     packed    u64      size of the compressed data
//     crc       u32      CRC-32 of the raw data
//     bytes     packed   zlib stream (RFC 1950) of the data
//   file crc    u32      CRC-32 of every byte before it
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fp8::io {

inline constexpr uint32_t kContainerVersion = 1;
inline constexpr unsigned char kContainerMagic[8] = {0x89, 'F', 'P', '8', '\r', '\n', 0x1a, '\n'};
inline constexpr size_t kMaxSectionName = 255;

struct Section {
  std::string name;
  std::vector<uint8_t> data;
};

inline bool operator==(const Section& a, const Section& b) {
  return a.name == b.name && a.data == b.data;
}
inline bool operator!=(const Section& a, const Section& b) {
  return !(a == b);
}

// FP8_ERR_INVALID_ARGUMENT for a name that is empty, longer than 255 bytes or repeated.
std::vector<uint8_t> encode_container(const std::vector<Section>& sections);

// Sections in file order. Strict: FP8_ERR_VERSION for a file from a newer format version,
// FP8_ERR_CORRUPT for anything else wrong (magic, truncation, trailing bytes, checksums, zlib
// stream, sizes, names), with a message naming the section and the check that failed. A section
// may not claim more raw bytes than its compressed size can inflate to, so a hostile file cannot
// make the reader allocate much more than ~1000 times its own size.
std::vector<Section> decode_container(const uint8_t* data, size_t size);

// NULL when there is no section of that name / FP8_ERR_CORRUPT "checkpoint has no section 'x'".
const Section* find_section(const std::vector<Section>& sections, const std::string& name);
const Section& require_section(const std::vector<Section>& sections, const std::string& name);

// Writes `<path>.tmp.<pid>.<serial>` (created exclusively), fsyncs it, renames it over `path` and
// fsyncs the directory: a crash at any point leaves either the old file or the new one under `path`,
// never a partial one. On failure the temporary file is removed and FP8_ERR_IO names the path and
// the system's reason. Concurrent writers of one path each use their own temporary; the last
// rename wins.
void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes);

// The whole file; FP8_ERR_IO naming the path and the reason (a directory included).
std::vector<uint8_t> read_file(const std::string& path);

// A regular file opened for reading parts of it, for readers that need a few ranges of a large file
// (a part of a Hugging Face checkpoint) without holding all of it. FP8_ERR_IO naming the path and
// the reason when it cannot be opened or read, or is no regular file; FP8_ERR_CORRUPT when a range
// runs past the end (the file got shorter after it was opened).
class FileReader {
 public:
  explicit FileReader(const std::string& path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }  // at open
  // `bytes` bytes from `offset` on; `what` names them in the errors.
  std::vector<uint8_t> read_at(uint64_t offset, uint64_t bytes, const std::string& what) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// zlib's CRC-32 (the one of gzip and PNG), for any size.
uint32_t crc32_of(const uint8_t* data, size_t size);

}  // namespace fp8::io
