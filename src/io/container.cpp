#include "io/container.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <unordered_set>

#include "core/error.hpp"
#include "io/bytes.hpp"

namespace fp8::io {

namespace {

constexpr int kDeflateLevel = 6;
constexpr uint64_t kMaxRawSize = uint64_t{1} << 40;
// Deflate cannot expand more than 1032:1 (a 258-byte match in 2 bits), so no honest section needs
// more; the slack covers zlib's header and short streams.
constexpr uint64_t kMaxInflateRatio = 1040;
constexpr uint64_t kInflateSlack = uint64_t{1} << 20;
constexpr size_t kSectionHeaderMin = 2 + 1 + 8 + 8 + 4;  // name length, 1-byte name, sizes, crc

// Section names come from the file: show control and non-ASCII bytes as \xHH in messages.
std::string printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

bool raw_size_plausible(uint64_t raw, uint64_t packed) {
  if (raw > kMaxRawSize) return false;
  // packed <= file size, so the product cannot overflow for any file that fits in memory; check anyway.
  if (packed > (UINT64_MAX - kInflateSlack) / kMaxInflateRatio) return true;
  return raw <= packed * kMaxInflateRatio + kInflateSlack;
}

std::vector<uint8_t> deflate_all(const std::vector<uint8_t>& raw, const std::string& name) {
  uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
  std::vector<uint8_t> packed(packed_size);
  const Bytef* src = raw.empty() ? reinterpret_cast<const Bytef*>("") : raw.data();
  const int rc = compress2(packed.data(), &packed_size, src, static_cast<uLong>(raw.size()), kDeflateLevel);
  if (rc == Z_MEM_ERROR) fail(FP8_ERR_OUT_OF_MEMORY, "checkpoint section '", name, "': zlib ran out of memory");
  if (rc != Z_OK) fail(FP8_ERR_INTERNAL, "checkpoint section '", name, "': compress2 failed with ", rc);
  packed.resize(packed_size);
  return packed;
}

// Inflates a zlib stream that must produce exactly `raw_size` bytes and end exactly at the end of
// its input.
std::vector<uint8_t> inflate_exact(const uint8_t* in, uint64_t in_size, uint64_t raw_size, const std::string& where) {
  std::vector<uint8_t> out;
  try {
    out.resize(raw_size);
  } catch (const std::bad_alloc&) {
    fail(FP8_ERR_OUT_OF_MEMORY, where, ": cannot allocate ", raw_size, " bytes to inflate it");
  }
  z_stream zs{};
  if (inflateInit(&zs) != Z_OK) fail(FP8_ERR_OUT_OF_MEMORY, where, ": zlib could not start inflating");
  struct InflateEnd {
    z_stream* zs;
    ~InflateEnd() { inflateEnd(zs); }
  } inflate_end{&zs};

  const uint8_t* in_next = in;
  uint64_t in_left = in_size;
  uint8_t* out_next = out.data();
  uint64_t out_left = raw_size;
  uint8_t probe = 0;
  bool probing = false;  // the output is full: any further byte means the header lied
  for (;;) {
    if (zs.avail_in == 0 && in_left > 0) {
      const uInt chunk = static_cast<uInt>(std::min<uint64_t>(in_left, UINT_MAX));
      zs.next_in = const_cast<Bytef*>(in_next);
      zs.avail_in = chunk;
      in_next += chunk;
      in_left -= chunk;
    }
    if (zs.avail_out == 0) {
      if (out_left > 0) {
        const uInt chunk = static_cast<uInt>(std::min<uint64_t>(out_left, UINT_MAX));
        zs.next_out = out_next;
        zs.avail_out = chunk;
        out_next += chunk;
        out_left -= chunk;
      } else if (!probing) {
        probing = true;
        zs.next_out = &probe;
        zs.avail_out = 1;
      }
    }
    const int rc = inflate(&zs, Z_NO_FLUSH);
    if (probing && zs.avail_out == 0) {
      fail(FP8_ERR_CORRUPT, where, ": inflates to more than the ", raw_size, " bytes its header claims");
    }
    if (rc == Z_STREAM_END) break;
    if (rc == Z_OK) continue;
    if (rc == Z_BUF_ERROR) {  // no progress possible: output space is always offered, so input ran out
      fail(FP8_ERR_CORRUPT, where, ": compressed data ends before its zlib stream does (", zs.total_out, " of ",
           raw_size, " bytes inflated)");
    }
    if (rc == Z_MEM_ERROR) fail(FP8_ERR_OUT_OF_MEMORY, where, ": zlib ran out of memory");
    if (rc == Z_NEED_DICT) fail(FP8_ERR_CORRUPT, where, ": zlib stream asks for a preset dictionary");
    fail(FP8_ERR_CORRUPT, where, ": zlib stream is damaged (", zs.msg ? zs.msg : "inflate error", ")");
  }
  if (!probing && (zs.avail_out != 0 || out_left != 0)) {
    fail(FP8_ERR_CORRUPT, where, ": inflates to ", zs.total_out, " bytes, its header claims ", raw_size);
  }
  if (zs.avail_in != 0 || in_left != 0) {
    fail(FP8_ERR_CORRUPT, where, ": ", zs.avail_in + in_left, " bytes follow the end of its zlib stream");
  }
  return out;
}

struct SectionEntry {
  std::string name;
  uint64_t raw_size;
  uint64_t packed_size;
  uint32_t crc;
  const uint8_t* packed;
};

[[noreturn]] void fail_io(const char* doing, const std::string& path, int err) {
  fail(FP8_ERR_IO, "cannot ", doing, " '", path, "': ", std::strerror(err));
}

std::string parent_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// 0, or the errno of the write that failed. Handles short writes and EINTR.
int write_all(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    const size_t chunk = std::min<size_t>(size, size_t{1} << 30);
    const ssize_t n = ::write(fd, data, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;  // a regular file never accepts nothing; do not spin
    data += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

// The path opened read-only with `flags` added, and its status; FP8_ERR_IO naming the path.
int open_for_reading(const std::string& path, int flags, struct stat* st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | flags);
  if (fd < 0) fail_io("open", path, errno);
  if (::fstat(fd, st) != 0) {
    const int err = errno;
    ::close(fd);
    fail_io("stat", path, err);
  }
  return fd;
}

}  // namespace

uint32_t crc32_of(const uint8_t* data, size_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (size > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(size, size_t{1} << 30));
    crc = crc32(crc, data, chunk);
    data += chunk;
    size -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

std::vector<uint8_t> encode_container(const std::vector<Section>& sections) {
  if (sections.size() > UINT32_MAX)
    fail(FP8_ERR_INVALID_ARGUMENT, "checkpoint: too many sections (", sections.size(), ")");
  std::unordered_set<std::string> names;
  for (const Section& s : sections) {
    if (s.name.empty() || s.name.size() > kMaxSectionName) {
      fail(FP8_ERR_INVALID_ARGUMENT, "checkpoint section name '", printable(s.name), "' has ", s.name.size(),
           " bytes; names have 1 to ", kMaxSectionName);
    }
    if (!names.insert(s.name).second) {
      fail(FP8_ERR_INVALID_ARGUMENT, "checkpoint section name '", printable(s.name), "' is used twice");
    }
    if (s.data.size() > kMaxRawSize) {
      fail(FP8_ERR_INVALID_ARGUMENT, "checkpoint section '", printable(s.name), "' has ", s.data.size(),
           " bytes, more than the format's limit of ", kMaxRawSize);
    }
  }

  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.put_bytes(kContainerMagic, sizeof kContainerMagic);
  w.put_u32(kContainerVersion);
  w.put_u32(static_cast<uint32_t>(sections.size()));
  for (const Section& s : sections) {
    const std::vector<uint8_t> packed = deflate_all(s.data, s.name);
    if (!raw_size_plausible(s.data.size(), packed.size())) {  // the reader would refuse it
      fail(FP8_ERR_INTERNAL, "checkpoint section '", printable(s.name), "': ", s.data.size(), " bytes deflate to ",
           packed.size(), ", beyond the reader's ratio limit");
    }
    w.put_u16(static_cast<uint16_t>(s.name.size()));
    w.put_bytes(reinterpret_cast<const uint8_t*>(s.name.data()), s.name.size());
    w.put_u64(s.data.size());
    w.put_u64(packed.size());
    w.put_u32(crc32_of(s.data.data(), s.data.size()));
    w.put_bytes(packed);
  }
  w.put_u32(crc32_of(out.data(), out.size()));
  return out;
}

std::vector<Section> decode_container(const uint8_t* data, size_t size) {
  if (data == nullptr && size != 0) fail(FP8_ERR_INVALID_ARGUMENT, "decode_container: NULL data with size ", size);
  if (size == 0) fail(FP8_ERR_CORRUPT, "not a libfp8 checkpoint (magic missing: the data is empty)");
  if (size < sizeof kContainerMagic || std::memcmp(data, kContainerMagic, sizeof kContainerMagic) != 0) {
    std::string seen;
    for (size_t i = 0; i < std::min(size, sizeof kContainerMagic); ++i) {
      char byte[4];
      std::snprintf(byte, sizeof byte, "%s%02x", i ? " " : "", data[i]);
      seen += byte;
    }
    fail(FP8_ERR_CORRUPT, "not a libfp8 checkpoint (magic ", seen, ", expected 89 46 50 38 0d 0a 1a 0a)");
  }
  ByteReader r(data, size);
  r.get_span(sizeof kContainerMagic, "checkpoint magic");
  const uint32_t version = r.get_u32("checkpoint header: format version");
  if (version == 0) fail(FP8_ERR_CORRUPT, "checkpoint header: format version 0 is not valid");
  if (version > kContainerVersion) {
    fail(FP8_ERR_VERSION, "checkpoint format version ", version, " is newer than this libfp8 reads (version ",
         kContainerVersion, "); load it with a newer libfp8");
  }
  const uint32_t count = r.get_u32("checkpoint header: section count");
  if (count > r.remaining() / kSectionHeaderMin) {
    fail(FP8_ERR_CORRUPT, "checkpoint header: section count ", count, " cannot fit in a file of ", size, " bytes");
  }

  // Walk the headers first: truncation and trailing bytes are named before the checksum is checked.
  std::vector<SectionEntry> entries;
  entries.reserve(count);
  std::unordered_set<std::string> names;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string nth = "checkpoint section #" + std::to_string(i);
    const uint16_t name_size = r.get_u16((nth + " name length").c_str());
    if (name_size == 0 || name_size > kMaxSectionName) {
      fail(FP8_ERR_CORRUPT, nth, ": name length ", name_size, " is outside 1..", kMaxSectionName);
    }
    const uint8_t* name_bytes = r.get_span(name_size, (nth + " name").c_str());
    SectionEntry e;
    e.name.assign(reinterpret_cast<const char*>(name_bytes), name_size);
    const std::string where = "checkpoint section '" + printable(e.name) + "'";
    if (!names.insert(e.name).second) fail(FP8_ERR_CORRUPT, where, " appears twice");
    e.raw_size = r.get_u64((where + " raw size").c_str());
    e.packed_size = r.get_u64((where + " compressed size").c_str());
    e.crc = r.get_u32((where + " checksum").c_str());
    if (!raw_size_plausible(e.raw_size, e.packed_size)) {
      fail(FP8_ERR_CORRUPT, where, ": raw size ", e.raw_size, " is impossible for ", e.packed_size,
           " compressed bytes");
    }
    e.packed = r.get_span(e.packed_size, (where + " compressed data").c_str());
    entries.push_back(std::move(e));
  }
  const size_t checked_size = r.offset();
  const uint32_t stored_crc = r.get_u32("checkpoint file checksum");
  r.expect_done("checkpoint after its final checksum");
  const uint32_t file_crc = crc32_of(data, checked_size);
  if (file_crc != stored_crc) {
    fail(FP8_ERR_CORRUPT, "checkpoint file checksum mismatch (stored ", hex32(stored_crc), ", computed ",
         hex32(file_crc), "): the file is damaged");
  }

  std::vector<Section> sections;
  sections.reserve(entries.size());
  for (SectionEntry& e : entries) {
    const std::string where = "checkpoint section '" + printable(e.name) + "'";
    Section s;
    s.data = inflate_exact(e.packed, e.packed_size, e.raw_size, where);
    const uint32_t crc = crc32_of(s.data.data(), s.data.size());
    if (crc != e.crc) {
      fail(FP8_ERR_CORRUPT, where, ": checksum mismatch (stored ", hex32(e.crc), ", computed ", hex32(crc), ")");
    }
    s.name = std::move(e.name);
    sections.push_back(std::move(s));
  }
  return sections;
}

const Section* find_section(const std::vector<Section>& sections, const std::string& name) {
  for (const Section& s : sections) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

const Section& require_section(const std::vector<Section>& sections, const std::string& name) {
  const Section* s = find_section(sections, name);
  if (s == nullptr) fail(FP8_ERR_CORRUPT, "checkpoint has no section '", printable(name), "'");
  return *s;
}

void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes) {
  // One name per process and call (two threads saving to one path do not share a temporary), and
  // O_EXCL: never truncate or follow something already there.
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = path + ".tmp." + std::to_string(static_cast<long long>(::getpid())) + "." +
                          std::to_string(static_cast<unsigned long long>(serial++));
  const int fd = ::open(tmp.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("create", tmp, errno);
  if (const int err = write_all(fd, bytes.data(), bytes.size()); err != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail_io("write", tmp, err);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail_io("flush", tmp, err);
  }
  if (::close(fd) != 0) {  // NFS reports deferred write errors here
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_io("close", tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_io("replace", path, err);
  }
  // Make the rename itself durable. Some file systems cannot fsync a directory (EINVAL): the
  // rename is then as durable as they make it.
  const std::string dir = parent_directory(path);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) fail_io("open the directory of", path, errno);
  if (::fsync(dfd) != 0 && errno != EINVAL) {
    const int err = errno;
    ::close(dfd);
    fail_io("flush the directory of", path, err);
  }
  ::close(dfd);
}

std::vector<uint8_t> read_file(const std::string& path) {
  struct stat st {};
  const int fd = open_for_reading(path, 0, &st);
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    fail_io("read", path, EISDIR);
  }
  // st_size is a hint (0 for /proc files; the file may change): read until end of file, straight
  // into the result, with one byte to spare so a file of the expected size ends in one pass.
  std::vector<uint8_t> out;
  size_t used = 0;
  try {
    out.resize(S_ISREG(st.st_mode) && st.st_size > 0 ? static_cast<size_t>(st.st_size) + 1 : size_t{1} << 16);
    for (;;) {
      if (used == out.size()) out.resize(out.size() * 2);
      const ssize_t n = ::read(fd, out.data() + used, out.size() - used);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        fail_io("read", path, err);
      }
      if (n == 0) break;
      used += static_cast<size_t>(n);
    }
  } catch (const std::bad_alloc&) {
    ::close(fd);
    fail(FP8_ERR_OUT_OF_MEMORY, "cannot hold '", path, "' in memory (", st.st_size, " bytes)");
  }
  ::close(fd);
  out.resize(used);
  return out;
}

FileReader::FileReader(const std::string& path) : path_(path) {
  // (O_NONBLOCK: opening a FIFO would otherwise wait for a writer; regular files ignore it.)
  struct stat st {};
  fd_ = open_for_reading(path, O_NONBLOCK, &st);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail_io("read parts of", path, S_ISDIR(st.st_mode) ? EISDIR : ESPIPE);
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

FileReader::~FileReader() {
  ::close(fd_);
}

std::vector<uint8_t> FileReader::read_at(uint64_t offset, uint64_t bytes, const std::string& what) const {
  if (offset > size_ || bytes > size_ - offset)
    fail(FP8_ERR_CORRUPT, what, " (bytes [", offset, ", ", offset + bytes, ")) run past the end of '", path_, "' (",
         size_, " bytes)");
  std::vector<uint8_t> out;
  try {
    out.resize(static_cast<size_t>(bytes));
  } catch (const std::bad_alloc&) {
    fail(FP8_ERR_OUT_OF_MEMORY, "cannot hold ", what, " of '", path_, "' in memory (", bytes, " bytes)");
  }
  uint64_t used = 0;
  while (used < bytes) {
    const ssize_t n =
        ::pread(fd_, out.data() + used, static_cast<size_t>(bytes - used), static_cast<off_t>(offset + used));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_io("read", path_, errno);
    }
    if (n == 0)
      fail(FP8_ERR_CORRUPT, "'", path_, "' ended at byte ", offset + used, " in ", what, " (bytes [", offset, ", ",
           offset + bytes, ")): the file got shorter after it was opened");
    used += static_cast<uint64_t>(n);
  }
  return out;
}

}  // namespace fp8::io
