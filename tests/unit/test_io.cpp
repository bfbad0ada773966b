// The file formats under checkpoints and model import/export (src/io): the byte reader, the
// checkpoint container (magic, version, zlib sections, CRCs, atomic writes) and safetensors. The
// readers must refuse every damaged or foreign input with the right status and never crash.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "io/bytes.hpp"
#include "io/container.hpp"
#include "io/safetensors.hpp"

namespace {

using fp8::io::ByteReader;
using fp8::io::ByteWriter;
using fp8::io::SafeTensor;
using fp8::io::Section;
using Bytes = std::vector<uint8_t>;

// The status a call throws (FP8_OK when it returns), and its message.
template <typename F>
fp8_status_t status_of(F&& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const fp8::Error& e) {
    if (message) *message = e.what();
    return e.status();
  }
  return FP8_OK;
}

#define EXPECT_STATUS(expected, expr, ...)                                                           \
  do {                                                                                               \
    std::string msg_;                                                                                \
    const fp8_status_t st_ = status_of([&] { (void)(expr); }, &msg_);                                \
    EXPECT_EQ(st_, expected) << #expr << ": " << msg_;                                               \
    for (const char* part_ : std::initializer_list<const char*>{__VA_ARGS__}) {                      \
      EXPECT_NE(msg_.find(part_), std::string::npos) << "message lacks '" << part_ << "': " << msg_; \
    }                                                                                                \
  } while (0)

Bytes bytes_of(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

Bytes random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

std::vector<Section> decode(const Bytes& b) {
  return fp8::io::decode_container(b.data(), b.size());
}
fp8::io::SafetensorsFile decode_st(const Bytes& b) {
  return fp8::io::decode_safetensors(b.data(), b.size());
}

// Rewrites the final file checksum, so a test can damage one field and nothing else.
void fix_file_crc(Bytes& b) {
  const uint32_t crc = fp8::io::crc32_of(b.data(), b.size() - 4);
  for (int i = 0; i < 4; ++i) b[b.size() - 4 + i] = static_cast<uint8_t>(crc >> (8 * i));
}

Bytes zlib(const Bytes& raw) {
  uLongf n = compressBound(raw.size());
  Bytes out(n);
  EXPECT_EQ(compress2(out.data(), &n, raw.data(), raw.size(), 6), Z_OK);
  out.resize(n);
  return out;
}

// A container written field by field, for headers the encoder would never produce.
struct RawSection {
  std::string name;
  uint64_t raw_size;
  Bytes packed;
  uint32_t crc;
};
Bytes handmade_container(uint32_t version, const std::vector<RawSection>& sections) {
  Bytes out;
  ByteWriter w(out);
  w.put_bytes(fp8::io::kContainerMagic, sizeof fp8::io::kContainerMagic);
  w.put_u32(version);
  w.put_u32(static_cast<uint32_t>(sections.size()));
  for (const RawSection& s : sections) {
    w.put_u16(static_cast<uint16_t>(s.name.size()));
    w.put_bytes(reinterpret_cast<const uint8_t*>(s.name.data()), s.name.size());
    w.put_u64(s.raw_size);
    w.put_u64(s.packed.size());
    w.put_u32(s.crc);
    w.put_bytes(s.packed);
  }
  w.put_u32(fp8::io::crc32_of(out.data(), out.size()));
  return out;
}
RawSection honest(const std::string& name, const Bytes& raw) {
  return {name, raw.size(), zlib(raw), fp8::io::crc32_of(raw.data(), raw.size())};
}

std::vector<Section> small_sections() {
  return {{"meta", bytes_of("{\"step\": 12}")}, {"w", random_bytes(40, 1)}, {"empty", {}}};
}

// ---- ByteWriter / ByteReader --------------------------------------------------------------------

TEST(ByteIo, writer_is_little_endian_and_reader_reads_every_type_back) {
  Bytes b;
  ByteWriter w(b);
  w.put_u8(0xab);
  w.put_u16(0x1234);
  w.put_u32(0xdeadbeef);
  w.put_u64(0x0102030405060708ull);
  w.put_i64(-2);
  w.put_f32(-1.5f);
  w.put_f64(3.25);
  w.put_string("hi");
  w.put_bytes(Bytes{9, 8});
  const Bytes head = {0xab, 0x34, 0x12, 0xef, 0xbe, 0xad, 0xde, 8, 7, 6, 5, 4, 3, 2, 1};
  ASSERT_GE(b.size(), head.size());
  EXPECT_EQ(Bytes(b.begin(), b.begin() + head.size()), head);

  ByteReader r(b.data(), b.size());
  EXPECT_EQ(r.get_u8("a"), 0xab);
  EXPECT_EQ(r.get_u16("b"), 0x1234);
  EXPECT_EQ(r.get_u32("c"), 0xdeadbeefu);
  EXPECT_EQ(r.get_u64("d"), 0x0102030405060708ull);
  EXPECT_EQ(r.get_i64("e"), -2);
  EXPECT_EQ(r.get_f32("f"), -1.5f);
  EXPECT_EQ(r.get_f64("g"), 3.25);
  EXPECT_EQ(r.get_string("h"), "hi");
  EXPECT_FALSE(r.done());
  EXPECT_EQ(r.get_bytes(2, "i"), (Bytes{9, 8}));
  EXPECT_TRUE(r.done());
  r.expect_done("all");
}

TEST(ByteIo, overrun_is_corrupt_and_names_what_offset_and_bytes_left) {
  const Bytes b = {1, 2, 3};
  ByteReader r(b.data(), b.size());
  r.get_u16("first");
  EXPECT_STATUS(FP8_ERR_CORRUPT, r.get_u32("tensor count"), "tensor count: needs 4 bytes at offset 2, only 1 left");
  EXPECT_EQ(r.offset(), 2u);  // a failed read consumes nothing
  EXPECT_EQ(r.get_u8("last"), 3);
  EXPECT_STATUS(FP8_ERR_CORRUPT, r.get_u8("past"), "past: needs 1 bytes at offset 3, only 0 left");
}

TEST(ByteIo, length_field_beyond_the_data_is_refused_before_allocating) {
  Bytes b;
  ByteWriter w(b);
  w.put_u32(0xffffffffu);
  w.put_bytes(bytes_of("abc"));
  ByteReader r(b.data(), b.size());
  EXPECT_STATUS(FP8_ERR_CORRUPT, r.get_string("name"), "needs 4294967295 bytes");
  ByteReader r2(b.data(), b.size());
  EXPECT_STATUS(FP8_ERR_CORRUPT, r2.get_bytes(UINT64_MAX, "blob"), "blob");
}

TEST(ByteIo, expect_done_reports_trailing_bytes) {
  const Bytes b = {1, 2, 3};
  ByteReader r(b.data(), b.size());
  r.get_u8("x");
  EXPECT_STATUS(FP8_ERR_CORRUPT, r.expect_done("record"), "record: 2 trailing bytes at offset 1");
  ByteReader empty(nullptr, 0);
  EXPECT_TRUE(empty.done());
  EXPECT_STATUS(FP8_ERR_CORRUPT, empty.get_u8("x"), "only 0 left");
}

TEST(ByteIo, crc32_matches_the_standard_check_value) {
  const Bytes b = bytes_of("123456789");
  EXPECT_EQ(fp8::io::crc32_of(b.data(), b.size()), 0xcbf43926u);
  EXPECT_EQ(fp8::io::crc32_of(nullptr, 0), 0u);
}

// ---- container: round trips ---------------------------------------------------------------------

TEST(Container, round_trips_an_empty_section_list) {
  const Bytes file = fp8::io::encode_container({});
  EXPECT_EQ(file.size(), 8u + 4 + 4 + 4);
  EXPECT_TRUE(decode(file).empty());
}

TEST(Container, round_trips_an_empty_section) {
  const std::vector<Section> in = {{"nothing", {}}};
  EXPECT_EQ(decode(fp8::io::encode_container(in)), in);
}

TEST(Container, round_trips_a_1mib_random_section) {
  const std::vector<Section> in = {{"weights", random_bytes(1 << 20, 7)}};
  EXPECT_EQ(decode(fp8::io::encode_container(in)), in);
}

TEST(Container, round_trips_many_sections_in_order) {
  std::vector<Section> in;
  in.reserve(301);
  for (int i = 0; i < 300; ++i) in.push_back({"layer." + std::to_string(299 - i), random_bytes(i * 7 % 200, i)});
  in.push_back({std::string(255, 'n'), bytes_of("longest name")});
  EXPECT_EQ(decode(fp8::io::encode_container(in)), in);
}

TEST(Container, round_trips_data_that_deflates_at_the_highest_ratio) {
  // Zeros deflate about 1030:1, the most deflate can do: the reader's size limit must allow it.
  const std::vector<Section> in = {{"zeros", Bytes(64u << 20, 0)}};
  const Bytes file = fp8::io::encode_container(in);
  EXPECT_LT(file.size(), (64u << 20) / 1000);
  EXPECT_EQ(decode(file), in);
}

TEST(Container, starts_with_the_magic_and_the_version) {
  const Bytes file = fp8::io::encode_container(small_sections());
  const Bytes head = {0x89, 'F', 'P', '8', '\r', '\n', 0x1a, '\n', 1, 0, 0, 0, 3, 0, 0, 0};
  EXPECT_EQ(Bytes(file.begin(), file.begin() + head.size()), head);
}

TEST(Container, find_section_and_require_section) {
  const std::vector<Section> s = small_sections();
  ASSERT_NE(fp8::io::find_section(s, "w"), nullptr);
  EXPECT_EQ(fp8::io::find_section(s, "w")->data, s[1].data);
  EXPECT_EQ(fp8::io::find_section(s, "missing"), nullptr);
  EXPECT_EQ(&fp8::io::require_section(s, "meta"), &s[0]);
  EXPECT_STATUS(FP8_ERR_CORRUPT, fp8::io::require_section(s, "optimizer"), "checkpoint has no section 'optimizer'");
}

TEST(Container, encoder_refuses_empty_long_and_repeated_names) {
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_container({{"", {}}}), "1 to 255");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_container({{std::string(256, 'x'), {}}}), "256 bytes");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_container({{"a", {}}, {"a", {1}}}), "'a' is used twice");
}

// ---- container: damage --------------------------------------------------------------------------

TEST(Container, every_truncation_is_corrupt) {
  const Bytes file = fp8::io::encode_container(small_sections());
  for (size_t n = 0; n < file.size(); ++n) {
    const Bytes cut(file.begin(), file.begin() + n);
    EXPECT_EQ(status_of([&] { decode(cut); }), FP8_ERR_CORRUPT) << "truncated to " << n << " bytes";
  }
}

TEST(Container, every_single_bit_flip_is_detected) {
  const Bytes file = fp8::io::encode_container(small_sections());
  for (size_t bit = 0; bit < file.size() * 8; ++bit) {
    Bytes damaged = file;
    damaged[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    const fp8_status_t st = status_of([&] { decode(damaged); });
    EXPECT_TRUE(st == FP8_ERR_CORRUPT || st == FP8_ERR_VERSION) << "bit " << bit << " gave status " << st;
  }
}

TEST(Container, trailing_garbage_is_corrupt) {
  Bytes file = fp8::io::encode_container(small_sections());
  file.push_back(0);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(file), "1 trailing bytes");
  file.insert(file.end(), file.begin(), file.end());  // two checkpoints back to back
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(file), "trailing bytes");
}

TEST(Container, newer_version_is_refused_naming_both_versions) {
  Bytes file = fp8::io::encode_container(small_sections());
  file[8] = 2;
  fix_file_crc(file);
  EXPECT_STATUS(FP8_ERR_VERSION, decode(file), "version 2", "version 1");
  // Refused on the version alone: a newer layout need not end in a checksum this reader knows.
  file[8] = 0xff;
  file.resize(13);
  EXPECT_STATUS(FP8_ERR_VERSION, decode(file), "version 255");
}

TEST(Container, version_zero_is_corrupt) {
  Bytes file = fp8::io::encode_container({});
  file[8] = 0;
  fix_file_crc(file);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(file), "version 0");
}

TEST(Container, foreign_files_are_corrupt_not_a_checkpoint) {
  const Bytes png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(png), "not a libfp8 checkpoint", "89 50 4e 47");
  const Bytes st = fp8::io::encode_safetensors({{"x", "F32", {1}, Bytes(4, 0)}}, {});
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(st), "not a libfp8 checkpoint");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode({}), "not a libfp8 checkpoint", "empty");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(bytes_of("hello")), "not a libfp8 checkpoint");
  // Text-mode damage: \r\n turned into \n.
  Bytes text = fp8::io::encode_container({});
  text.erase(text.begin() + 4);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(text), "not a libfp8 checkpoint");
}

TEST(Container, damaged_file_checksum_is_corrupt) {
  Bytes file = fp8::io::encode_container(small_sections());
  file.back() ^= 1;
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(file), "checksum mismatch");
}

TEST(Container, section_checksum_mismatch_names_the_section) {
  const Bytes raw = bytes_of("payload");
  RawSection s = honest("optimizer.m", raw);
  s.crc ^= 1;
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {s})), "'optimizer.m'", "checksum mismatch");
}

TEST(Container, raw_size_that_disagrees_with_the_stream_is_corrupt) {
  const Bytes raw = random_bytes(100, 3);
  RawSection more = honest("s", raw), fewer = honest("s", raw);
  more.raw_size = 101;
  fewer.raw_size = 99;
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {more})), "section 's'", "inflates to 100 bytes");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {fewer})), "section 's'", "more than the 99 bytes");
}

TEST(Container, raw_size_beyond_what_deflate_can_produce_is_refused_before_allocating) {
  RawSection s = honest("huge", bytes_of("x"));
  s.raw_size = uint64_t{1} << 39;  // 512 GiB from a dozen bytes
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {s})), "section 'huge'", "impossible");
  s.raw_size = UINT64_MAX;
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {s})), "impossible");
}

TEST(Container, damaged_zlib_stream_is_corrupt) {
  RawSection s = honest("w", random_bytes(64, 5));
  s.packed[0] ^= 0x0f;  // zlib header
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {s})), "section 'w'", "zlib");
  RawSection cut = honest("w", random_bytes(64, 5));
  cut.packed.resize(cut.packed.size() - 6);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {cut})), "section 'w'", "ends before");
  RawSection extra = honest("w", random_bytes(64, 5));
  extra.packed.push_back(0);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {extra})), "section 'w'", "follow the end");
}

TEST(Container, repeated_and_empty_names_are_corrupt) {
  const Bytes raw = bytes_of("x");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {honest("a", raw), honest("a", raw)})),
                "'a' appears twice");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {honest("", raw)})), "name length 0");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(handmade_container(1, {honest(std::string(300, 'a'), raw)})),
                "name length 300");
}

TEST(Container, absurd_section_count_is_corrupt) {
  Bytes file = handmade_container(1, {});
  file[12] = 0xff;
  file[13] = 0xff;
  file[14] = 0xff;
  file[15] = 0xff;
  fix_file_crc(file);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode(file), "section count 4294967295");
}

// ---- files --------------------------------------------------------------------------------------

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fp8_test_io.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    DIR* d = opendir(dir_.c_str());
    while (dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    return names;
  }
  std::string dir_;
};

TEST_F(Files, write_file_atomic_replaces_the_file_and_leaves_no_temporary) {
  const std::string path = dir_ + "/model.fp8ckpt";
  fp8::io::write_file_atomic(path, bytes_of("old contents"));
  EXPECT_EQ(fp8::io::read_file(path), bytes_of("old contents"));
  const Bytes big = random_bytes(3 << 20, 11);
  fp8::io::write_file_atomic(path, big);
  EXPECT_EQ(fp8::io::read_file(path), big);
  fp8::io::write_file_atomic(path, {});
  EXPECT_TRUE(fp8::io::read_file(path).empty());
  EXPECT_EQ(entries(), std::vector<std::string>{"model.fp8ckpt"});
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777 & ~0022u, 0644u & ~0022u);
}

TEST_F(Files, write_file_atomic_works_with_a_path_in_the_current_directory) {
  char cwd[4096];
  ASSERT_NE(getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(chdir(dir_.c_str()), 0);
  fp8::io::write_file_atomic("plain_name", bytes_of("x"));
  EXPECT_EQ(fp8::io::read_file("plain_name"), bytes_of("x"));
  ASSERT_EQ(chdir(cwd), 0);
}

TEST_F(Files, write_file_atomic_into_a_missing_directory_fails_with_io) {
  const std::string path = dir_ + "/no/such/dir/ckpt";
  EXPECT_STATUS(FP8_ERR_IO, fp8::io::write_file_atomic(path, bytes_of("x")), "no/such/dir/ckpt",
                "No such file or directory");
  EXPECT_TRUE(entries().empty());
}

TEST_F(Files, write_file_atomic_that_fails_while_writing_leaves_the_old_file_intact) {
  const std::string path = dir_ + "/ckpt";
  fp8::io::write_file_atomic(path, bytes_of("the old checkpoint"));
  // A file size limit makes write() stop short after 4 KiB and then fail with EFBIG: the short-write
  // loop runs into a real error halfway through the file.
  struct rlimit old_limit {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  const fp8_status_t st = status_of([&] { fp8::io::write_file_atomic(path, random_bytes(1 << 20, 2)); }, &msg);
  setrlimit(RLIMIT_FSIZE, &old_limit);
  signal(SIGXFSZ, old_handler);
  EXPECT_EQ(st, FP8_ERR_IO) << msg;
  EXPECT_NE(msg.find("ckpt.tmp."), std::string::npos) << msg;
  EXPECT_NE(msg.find("too large"), std::string::npos) << msg;  // strerror(EFBIG)
  EXPECT_EQ(fp8::io::read_file(path), bytes_of("the old checkpoint"));
  EXPECT_EQ(entries(), std::vector<std::string>{"ckpt"});
}

TEST_F(Files, write_file_atomic_over_a_directory_fails_with_io_and_removes_the_temporary) {
  const std::string path = dir_ + "/taken";
  ASSERT_EQ(mkdir(path.c_str(), 0755), 0);
  fp8::io::write_file_atomic(path + "/inside", bytes_of("kept"));
  EXPECT_STATUS(FP8_ERR_IO, fp8::io::write_file_atomic(path, bytes_of("x")), "taken");
  EXPECT_EQ(entries(), std::vector<std::string>{"taken"});
  EXPECT_EQ(fp8::io::read_file(path + "/inside"), bytes_of("kept"));
}

TEST_F(Files, read_file_of_a_missing_file_fails_with_io_naming_the_path) {
  EXPECT_STATUS(FP8_ERR_IO, fp8::io::read_file(dir_ + "/absent.ckpt"), "absent.ckpt", "No such file or directory");
}

TEST_F(Files, read_file_of_a_directory_fails_with_io) {
  EXPECT_STATUS(FP8_ERR_IO, fp8::io::read_file(dir_), dir_.c_str(), "Is a directory");
}

TEST_F(Files, checkpoint_survives_the_trip_through_a_file) {
  const std::string path = dir_ + "/c";
  const std::vector<Section> in = small_sections();
  fp8::io::write_file_atomic(path, fp8::io::encode_container(in));
  const Bytes back = fp8::io::read_file(path);
  EXPECT_EQ(decode(back), in);
}

// ---- safetensors ------------------------------------------------------------------------------

Bytes st_file(const std::string& header, const Bytes& buffer = {}) {
  Bytes out;
  ByteWriter w(out);
  w.put_u64(header.size());
  w.put_bytes(bytes_of(header));
  w.put_bytes(buffer);
  return out;
}

std::string header_of(const Bytes& file) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{file[i]} << (8 * i);
  return std::string(file.begin() + 8, file.begin() + 8 + n);
}

TEST(Safetensors, round_trips_every_dtype) {
  const std::vector<std::pair<const char*, size_t>> dtypes = {{"F64", 8},     {"F32", 4},     {"F16", 2}, {"BF16", 2},
                                                              {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I64", 8}, {"I32", 4},
                                                              {"I16", 2},     {"I8", 1},      {"U8", 1},  {"BOOL", 1}};
  std::vector<SafeTensor> in;
  uint32_t seed = 0;
  for (const auto& [dtype, size] : dtypes) {
    EXPECT_EQ(fp8::io::safetensors_dtype_size(dtype), size) << dtype;
    in.push_back({std::string("t.") + dtype, dtype, {2, 3}, random_bytes(6 * size, ++seed)});
  }
  const Bytes file = fp8::io::encode_safetensors(in, {});
  EXPECT_EQ(header_of(file).size() % 8, 0u);
  const fp8::io::SafetensorsFile out = decode_st(file);
  EXPECT_EQ(out.tensors, in);
  EXPECT_TRUE(out.metadata.empty());
  EXPECT_EQ(fp8::io::safetensors_dtype_size("U16"), 0u);
}

TEST(Safetensors, writes_a_known_file_byte_for_byte) {
  const std::vector<SafeTensor> in = {{"w", "F32", {2}, {0, 0, 0x80, 0x3f, 0, 0, 0, 0x40}},  // 1.0f, 2.0f
                                      {"bias", "U8", {}, {7}}};
  const Bytes file = fp8::io::encode_safetensors(in, {{"format", "pt"}});
  const std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"bias\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[8,9]}}";
  ASSERT_EQ(header.size(), 139u);
  Bytes expected = {144, 0, 0, 0, 0, 0, 0, 0};  // 139 padded to 144
  for (char c : header + "     ") expected.push_back(static_cast<uint8_t>(c));
  for (uint8_t b : {0, 0, 0x80, 0x3f, 0, 0, 0, 0x40, 7}) expected.push_back(b);
  EXPECT_EQ(file, expected);
  EXPECT_EQ(header_of(file), header + "     ");
}

TEST(Safetensors, writes_an_empty_file_as_an_empty_object) {
  EXPECT_EQ(fp8::io::encode_safetensors({}, {}), st_file("{}      "));
  const fp8::io::SafetensorsFile back = decode_st(st_file("{}      "));
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

TEST(Safetensors, reads_a_hand_written_file_with_any_key_order_and_whitespace) {
  const std::string header =
      " {\n \"b\" : {\"data_offsets\": [4, 8], \"shape\": [ 1 ,2 ], \"dtype\": \"BF16\"},\n"
      "\t\"__metadata__\": {\"format\": \"pt\", \"note\": \"\"},\r\n"
      "  \"a\": {\"shape\": [1], \"dtype\": \"I32\", \"data_offsets\": [0, 4]} }  ";
  // Leading whitespace is not allowed: the header must start with '{'.
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(st_file(header, Bytes(8, 1))), "start with '{'");
  const fp8::io::SafetensorsFile f = decode_st(st_file(header.substr(1), {1, 0, 0, 0, 0x80, 0x3f, 0, 0xc0}));
  ASSERT_EQ(f.tensors.size(), 2u);
  // In the order of their bytes, not of the header.
  EXPECT_EQ(f.tensors[0], (SafeTensor{"a", "I32", {1}, {1, 0, 0, 0}}));
  EXPECT_EQ(f.tensors[1], (SafeTensor{"b", "BF16", {1, 2}, {0x80, 0x3f, 0, 0xc0}}));
  const fp8::io::SafetensorsMetadata meta = {{"format", "pt"}, {"note", ""}};
  EXPECT_EQ(f.metadata, meta);
}

TEST(Safetensors, round_trips_metadata_in_order) {
  const fp8::io::SafetensorsMetadata meta = {
      {"z", "last letter"}, {"format", "pt"}, {"empty", ""}, {"json", "{\"a\": [1]}"}};
  const fp8::io::SafetensorsFile f = decode_st(fp8::io::encode_safetensors({{"x", "I8", {0}, {}}}, meta));
  EXPECT_EQ(f.metadata, meta);
}

TEST(Safetensors, unicode_names_and_escapes_are_decoded_to_utf8) {
  const std::string header =
      "{\"caf\\u00e9\\n\\\"q\\\"\\\\\\/\\t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
      "\"\\ud83d\\ude00 \xe6\x97\xa5\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}";
  const fp8::io::SafetensorsFile f = decode_st(st_file(header, {1, 2}));
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].name, "caf\xc3\xa9\n\"q\"\\/\t");
  EXPECT_EQ(f.tensors[1].name, "\xf0\x9f\x98\x80 \xe6\x97\xa5");
  // Written back: quotes, backslashes and control characters escaped, the rest as UTF-8.
  const std::vector<SafeTensor> in = {{"a\"b\\c\n\x01\xc3\xa9", "U8", {1}, {5}}};
  const Bytes file = fp8::io::encode_safetensors(in, {{"k\x1f", "v\xf0\x9f\x98\x80"}});
  EXPECT_NE(header_of(file).find("\"a\\\"b\\\\c\\n\\u0001\xc3\xa9\""), std::string::npos) << header_of(file);
  EXPECT_NE(header_of(file).find("\"k\\u001f\":\"v\xf0\x9f\x98\x80\""), std::string::npos) << header_of(file);
  const fp8::io::SafetensorsFile back = decode_st(file);
  EXPECT_EQ(back.tensors, in);
  EXPECT_EQ(back.metadata, (fp8::io::SafetensorsMetadata{{"k\x1f", "v\xf0\x9f\x98\x80"}}));
}

TEST(Safetensors, zero_sized_tensors_and_scalars_round_trip_in_order) {
  const std::vector<SafeTensor> in = {
      {"e1", "F32", {0}, {}},  {"s", "F64", {}, random_bytes(8, 1)},     {"e2", "F16", {3, 0, 2}, {}},
      {"e3", "BOOL", {0}, {}}, {"m", "I16", {2, 2}, random_bytes(8, 2)}, {"e4", "U8", {0, 0}, {}}};
  EXPECT_EQ(decode_st(fp8::io::encode_safetensors(in, {})).tensors, in);
}

TEST(Safetensors, encoder_refuses_inconsistent_tensors) {
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_safetensors({{"w", "F32", {2, 2}, Bytes(15)}}, {}), "'w'",
                "needs 16 bytes", "has 15");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_safetensors({{"w", "F4", {2}, Bytes(1)}}, {}), "'F4'");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_safetensors({{"w", "F32", {-1}, {}}}, {}), "negative");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT,
                fp8::io::encode_safetensors({{"w", "U8", {1}, {1}}, {"w", "U8", {1}, {1}}}, {}), "appears twice");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_safetensors({{"__metadata__", "U8", {1}, {1}}}, {}),
                "__metadata__");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_safetensors({{"\xff", "U8", {1}, {1}}}, {}), "UTF-8");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT, fp8::io::encode_safetensors({}, {{"k", "1"}, {"k", "2"}}), "appears twice");
  EXPECT_STATUS(FP8_ERR_INVALID_ARGUMENT,
                fp8::io::encode_safetensors({{"w", "U8", std::vector<int64_t>(65, 1), {1}}}, {}), "65 dimensions");
}

TEST(Safetensors, foreign_and_truncated_files_are_corrupt) {
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st({}), "header length");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(bytes_of("{}")), "header length");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(fp8::io::encode_container(small_sections())), "safetensors header");
  const Bytes good = fp8::io::encode_safetensors({{"w", "F32", {4}, random_bytes(16, 9)}}, {{"a", "b"}});
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(status_of([&] { decode_st(Bytes(good.begin(), good.begin() + n)); }), FP8_ERR_CORRUPT) << n;
  }
  Bytes longer = good;
  longer.push_back(0);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(longer), "belong to no tensor");
}

TEST(Safetensors, header_length_above_100mb_or_beyond_the_file_is_corrupt) {
  auto file_claiming = [](uint64_t header_size) {
    Bytes file;
    ByteWriter(file).put_u64(header_size);
    file.resize(16, ' ');
    file[8] = '{';
    file[9] = '}';
    return file;
  };
  EXPECT_EQ(decode_st(file_claiming(8)).tensors.size(), 0u);
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(file_claiming(100'000'001)), "above the limit");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(file_claiming(UINT64_MAX)), "above the limit");
  EXPECT_STATUS(FP8_ERR_CORRUPT, decode_st(file_claiming(9)), "runs past the end");
}

struct Malformed {
  const char* why;
  std::string header;
  size_t buffer;
  fp8_status_t status;
  const char* message;
};

TEST(Safetensors, each_malformed_header_is_refused_with_its_reason) {
  const std::string t = "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
  const std::vector<Malformed> cases = {
      {"not an object", "[]", 0, FP8_ERR_CORRUPT, "start with '{'"},
      {"empty header", "", 0, FP8_ERR_CORRUPT, "start with '{'"},
      {"unterminated object", "{\"a\":" + t, 8, FP8_ERR_CORRUPT, "expected '}'"},
      {"trailing comma", "{\"a\":" + t + ",}", 8, FP8_ERR_CORRUPT, "expected a string"},
      {"missing colon", "{\"a\" " + t + "}", 8, FP8_ERR_CORRUPT, "expected ':'"},
      {"bare key", "{a:" + t + "}", 8, FP8_ERR_CORRUPT, "expected a string"},
      {"unterminated string", "{\"a", 0, FP8_ERR_CORRUPT, "unterminated string"},
      {"text after the object", "{\"a\":" + t + "}x", 8, FP8_ERR_CORRUPT, "after the header's JSON object"},
      {"two objects", "{}{}", 0, FP8_ERR_CORRUPT, "after the header's JSON object"},
      {"null entry", "{\"a\":null}", 0, FP8_ERR_CORRUPT, "found null"},
      {"number entry", "{\"a\":1}", 0, FP8_ERR_CORRUPT, "found a number"},
      {"boolean dtype", "{\"a\":{\"dtype\":true,\"shape\":[],\"data_offsets\":[0,0]}}", 0, FP8_ERR_CORRUPT,
       "found a boolean"},
      {"float dimension", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1.0],\"data_offsets\":[0,1]}}", 1, FP8_ERR_CORRUPT,
       "fraction or exponent"},
      {"exponent offset", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1e0]}}", 1, FP8_ERR_CORRUPT,
       "fraction or exponent"},
      {"negative dimension", "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", 1, FP8_ERR_CORRUPT,
       "negative"},
      {"leading zero", "{\"a\":{\"dtype\":\"U8\",\"shape\":[01],\"data_offsets\":[0,1]}}", 1, FP8_ERR_CORRUPT,
       "leading zero"},
      {"integer above 64 bits", "{\"a\":{\"dtype\":\"U8\",\"shape\":[18446744073709551616],\"data_offsets\":[0,1]}}", 1,
       FP8_ERR_CORRUPT, "64 bits"},
      {"dimension above int64", "{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,1]}}", 1,
       FP8_ERR_CORRUPT, "int64"},
      {"nested array in shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[[[[[1]]]]],\"data_offsets\":[0,1]}}", 1,
       FP8_ERR_CORRUPT, "found an array"},
      {"deep nesting", "{\"a\":" + std::string(10000, '[') + std::string(10000, ']') + "}", 0, FP8_ERR_CORRUPT,
       "found an array"},
      {"duplicate tensor", "{\"a\":" + t + ",\"a\":" + t + "}", 8, FP8_ERR_CORRUPT, "\"a\" appears twice"},
      {"duplicate metadata block", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, FP8_ERR_CORRUPT, "appears twice"},
      {"duplicate metadata key", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, FP8_ERR_CORRUPT,
       "\"k\" appears twice"},
      {"duplicate field", "{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
       FP8_ERR_CORRUPT, "\"dtype\" appears twice"},
      {"unknown field", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", 1, FP8_ERR_CORRUPT,
       "unknown key \"x\""},
      {"missing dtype", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1, FP8_ERR_CORRUPT, "has no dtype"},
      {"missing shape", "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, FP8_ERR_CORRUPT, "has no shape"},
      {"missing offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, FP8_ERR_CORRUPT, "has no data_offsets"},
      {"three offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 1, FP8_ERR_CORRUPT,
       "expected ']'"},
      {"one offset", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1, FP8_ERR_CORRUPT,
       "expected ','"},
      {"metadata value not a string", "{\"__metadata__\":{\"k\":1}}", 0, FP8_ERR_CORRUPT, "expected a string"},
      {"metadata not an object", "{\"__metadata__\":\"x\"}", 0, FP8_ERR_CORRUPT, "expected '{'"},
      {"lone high surrogate", "{\"__metadata__\":{\"k\":\"\\ud800\"}}", 0, FP8_ERR_CORRUPT, "surrogate"},
      {"lone low surrogate", "{\"__metadata__\":{\"k\":\"\\udc00\"}}", 0, FP8_ERR_CORRUPT, "surrogate"},
      {"bad surrogate pair", "{\"__metadata__\":{\"k\":\"\\ud800\\u0041\"}}", 0, FP8_ERR_CORRUPT, "surrogate"},
      {"short \\u escape", "{\"__metadata__\":{\"k\":\"\\u00g1\"}}", 0, FP8_ERR_CORRUPT, "four hex digits"},
      {"unknown escape", "{\"__metadata__\":{\"k\":\"\\x41\"}}", 0, FP8_ERR_CORRUPT, "invalid escape"},
      {"raw control character", "{\"__metadata__\":{\"k\":\"a\nb\"}}", 0, FP8_ERR_CORRUPT, "control character"},
      {"invalid UTF-8", "{\"__metadata__\":{\"k\":\"\xc3\x28\"}}", 0, FP8_ERR_CORRUPT, "UTF-8"},
      {"overlong UTF-8", "{\"__metadata__\":{\"k\":\"\xc0\xaf\"}}", 0, FP8_ERR_CORRUPT, "UTF-8"},
      {"UTF-8 surrogate", "{\"__metadata__\":{\"k\":\"\xed\xa0\x80\"}}", 0, FP8_ERR_CORRUPT, "UTF-8"},
      {"shape product overflow",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}", 0, FP8_ERR_CORRUPT,
       "too many elements"},
      {"offsets disagree with the shape", "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
       FP8_ERR_CORRUPT, "needs 12 bytes"},
      {"offsets past the buffer", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
       FP8_ERR_CORRUPT, "run past the data buffer"},
      {"offsets reversed", "{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4, FP8_ERR_CORRUPT,
       "end before they begin"},
      {"hole at the start", "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 8, FP8_ERR_CORRUPT,
       "[0, 4) belong to no tensor"},
      {"hole in the middle",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}",
       10, FP8_ERR_CORRUPT, "[4, 6) belong to no tensor"},
      {"overlap",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}",
       6, FP8_ERR_CORRUPT, "overlaps"},
      {"same bytes twice",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
       4, FP8_ERR_CORRUPT, "overlaps"},
      {"empty tensor inside another",
       "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,2]}}",
       4, FP8_ERR_CORRUPT, "overlaps"},
      {"bytes after the last tensor", "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 5,
       FP8_ERR_CORRUPT, "[4, 5) after the last tensor"},
      {"unknown dtype", "{\"w.q\":{\"dtype\":\"F4\",\"shape\":[4],\"data_offsets\":[0,2]}}", 2, FP8_ERR_UNSUPPORTED,
       "'w.q' has dtype 'F4'"},
  };
  for (const Malformed& c : cases) {
    std::string msg;
    const fp8_status_t st = status_of([&] { decode_st(st_file(c.header, Bytes(c.buffer, 0))); }, &msg);
    EXPECT_EQ(st, c.status) << c.why << ": " << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.why << ": message lacks '" << c.message << "': " << msg;
  }
}

TEST(Safetensors, more_dimensions_than_libfp8_reads_is_unsupported) {
  auto header = [](int rank) {
    std::string dims;
    for (int i = 0; i < rank; ++i) dims += i ? ",1" : "1";
    return "{\"a\":{\"dtype\":\"U8\",\"shape\":[" + dims + "],\"data_offsets\":[0,1]}}";
  };
  EXPECT_EQ(decode_st(st_file(header(64), {7})).tensors[0].shape.size(), 64u);
  EXPECT_STATUS(FP8_ERR_UNSUPPORTED, decode_st(st_file(header(65), {7})), "more than 64 dimensions");
}

TEST(Safetensors, unknown_dtype_is_unsupported_only_in_a_well_formed_file) {
  // The same entry in a file whose tensors do not tile the buffer is corrupt first.
  EXPECT_STATUS(FP8_ERR_CORRUPT,
                decode_st(st_file("{\"q\":{\"dtype\":\"F4\",\"shape\":[4],\"data_offsets\":[0,2]}}", Bytes(3))),
                "belong to no tensor");
  EXPECT_STATUS(FP8_ERR_UNSUPPORTED,
                decode_st(st_file("{\"q\":{\"dtype\":\"U32\",\"shape\":[1],\"data_offsets\":[0,4]}}", Bytes(4))),
                "'q' has dtype 'U32'", "F8_E4M3");
}

TEST(Safetensors, every_bit_flip_is_refused_or_decodes_to_a_file_that_round_trips) {
  // safetensors has no checksum: a flip in the data is invisible, a flip in the header must be
  // caught or yield another well-formed file. Either way no crash, and only fp8::Error.
  const Bytes file = fp8::io::encode_safetensors({{"a", "F32", {2}, random_bytes(8, 4)}, {"bb", "U8", {3}, {1, 2, 3}}},
                                                 {{"format", "pt"}});
  for (size_t bit = 0; bit < file.size() * 8; ++bit) {
    Bytes damaged = file;
    damaged[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    fp8::io::SafetensorsFile f;
    const fp8_status_t st = status_of([&] { f = decode_st(damaged); });
    if (st == FP8_OK) {
      const fp8::io::SafetensorsFile again = decode_st(fp8::io::encode_safetensors(f.tensors, f.metadata));
      EXPECT_EQ(again.tensors, f.tensors) << bit;
      EXPECT_EQ(again.metadata, f.metadata) << bit;
    } else {
      EXPECT_TRUE(st == FP8_ERR_CORRUPT || st == FP8_ERR_UNSUPPORTED) << bit << ": " << st;
    }
  }
}

}  // namespace
