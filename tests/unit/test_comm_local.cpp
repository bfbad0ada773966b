// The in-process transport (src/dist/local_transport.cpp): the collectives among ranks on threads,
// their rank-order numerics, and the failures it must report instead of hanging or exchanging
// garbage (mismatched calls, abort, a rank leaving). Every wait is bounded: a hang fails the test.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "dist/local_transport.hpp"

namespace {

using fp8::dist::ElemType;
using fp8::dist::make_local_group;
using fp8::dist::ReduceOp;
using fp8::dist::Transport;
using Group = std::vector<std::unique_ptr<Transport>>;
using namespace std::chrono_literals;

constexpr auto kHangLimit = 20s;

// Waits for `done` up to the hang limit; past it, fails the test, aborts the group (which must release
// every rank) and, should even that not do, exits rather than hang the suite.
void wait_or_fail(std::vector<std::future<void>>& done, const Group& group) {
  const auto deadline = std::chrono::steady_clock::now() + kHangLimit;
  for (auto& f : done) {
    if (f.wait_until(deadline) == std::future_status::ready) continue;
    ADD_FAILURE() << "ranks still running after 20 s: a collective hangs";
    for (const auto& t : group) {
      if (t) t->abort();
    }
    if (f.wait_for(5s) != std::future_status::ready) {
      std::fputs("test_comm_local: ranks still hang after abort()\n", stderr);
      std::_Exit(1);
    }
  }
  for (auto& f : done) f.get();  // rethrows a rank's unexpected exception
}

// Runs body(rank, transport) for every rank of `group`, each on its own thread.
void run_ranks(const Group& group, const std::function<void(int32_t, Transport&)>& body) {
  std::vector<std::future<void>> done;
  for (size_t r = 0; r < group.size(); ++r) {
    done.push_back(std::async(std::launch::async, body, static_cast<int32_t>(r), std::ref(*group[r])));
  }
  wait_or_fail(done, group);
}

// The FP8_ERR_NCCL message `call` throws; a test failure (and "") when it throws nothing or another.
std::string nccl_error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const fp8::Error& e) {
    EXPECT_EQ(e.status(), FP8_ERR_NCCL) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected FP8_ERR_NCCL, the call returned";
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <typename T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

float f32_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// Values whose sums round differently in different orders: distinct per rank and element.
float f32_value(int32_t rank, size_t i) {
  return static_cast<float>(rank + 1) * 0.1f + static_cast<float>(i) * 1.37f - static_cast<float>(rank * rank) * 3.3f;
}
double f64_value(int32_t rank, size_t i) {
  return static_cast<double>(rank + 1) * 0.1 + static_cast<double>(i) * 1e-7 - static_cast<double>(rank) * 1e15;
}

TEST(CommLocal, describes_itself) {
  const Group group = make_local_group(3);
  ASSERT_EQ(group.size(), 3u);
  for (int32_t r = 0; r < 3; ++r) {
    EXPECT_EQ(group[r]->rank(), r);
    EXPECT_EQ(group[r]->size(), 3);
    EXPECT_STREQ(group[r]->kind(), "local");
    EXPECT_NO_THROW(group[r]->check());
  }
  try {
    make_local_group(0);
    ADD_FAILURE() << "a group of no ranks was made";
  } catch (const fp8::Error& e) {
    EXPECT_EQ(e.status(), FP8_ERR_INVALID_ARGUMENT);
  }
}

TEST(CommLocal, all_reduce_sum_f32_adds_in_rank_order_with_the_same_bytes_on_every_rank) {
  constexpr size_t kCount = 1000;
  for (int32_t n = 1; n <= 4; ++n) {
    std::vector<float> expected(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      float sum = f32_value(0, i);
      for (int32_t r = 1; r < n; ++r) sum = sum + f32_value(r, i);
      expected[i] = sum;
    }
    const Group group = make_local_group(n);
    std::vector<std::vector<float>> bufs(static_cast<size_t>(n), std::vector<float>(kCount));
    run_ranks(group, [&](int32_t rank, Transport& t) {
      auto& buf = bufs[static_cast<size_t>(rank)];
      for (size_t i = 0; i < kCount; ++i) buf[i] = f32_value(rank, i);
      t.all_reduce(buf.data(), kCount, ElemType::kF32, ReduceOp::kSum);
    });
    for (int32_t r = 0; r < n; ++r)
      EXPECT_TRUE(same_bytes(bufs[static_cast<size_t>(r)], expected)) << n << " ranks, rank " << r;
  }
}

TEST(CommLocal, all_reduce_sum_f32_order_is_rank_zero_first) {
  // Rank order, in float: ((1e8 + 1) + -1e8) + 1 = 1, where any other grouping or order gives 0 or 2;
  // element 1 rotates the values: ((1 + 1e8) + 1) + -1e8 = 0.
  const float kValues[4][2] = {{1e8f, 1.0f}, {1.0f, 1e8f}, {-1e8f, 1.0f}, {1.0f, -1e8f}};
  const Group group = make_local_group(4);
  std::vector<std::vector<float>> bufs(4);
  run_ranks(group, [&](int32_t rank, Transport& t) {
    auto& buf = bufs[static_cast<size_t>(rank)];
    buf = {kValues[rank][0], kValues[rank][1]};
    t.all_reduce(buf.data(), 2, ElemType::kF32, ReduceOp::kSum);
  });
  for (const auto& buf : bufs) {
    EXPECT_EQ(buf[0], 1.0f);
    EXPECT_EQ(buf[1], 0.0f);
  }
}

TEST(CommLocal, all_reduce_sum_f64_adds_in_rank_order) {
  constexpr size_t kCount = 257;
  for (int32_t n = 2; n <= 4; ++n) {
    std::vector<double> expected(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      double sum = f64_value(0, i);
      for (int32_t r = 1; r < n; ++r) sum = sum + f64_value(r, i);
      expected[i] = sum;
    }
    const Group group = make_local_group(n);
    std::vector<std::vector<double>> bufs(static_cast<size_t>(n), std::vector<double>(kCount));
    run_ranks(group, [&](int32_t rank, Transport& t) {
      auto& buf = bufs[static_cast<size_t>(rank)];
      for (size_t i = 0; i < kCount; ++i) buf[i] = f64_value(rank, i);
      t.all_reduce(buf.data(), kCount, ElemType::kF64, ReduceOp::kSum);
    });
    for (const auto& buf : bufs) EXPECT_TRUE(same_bytes(buf, expected)) << n << " ranks";
  }
  // Rank order in double: (1e17 + 1) + -1e17 = 0 (1 is below half an ulp of 1e17), not 1.
  const Group group = make_local_group(3);
  std::vector<double> bufs[3] = {{1e17}, {1.0}, {-1e17}};
  run_ranks(group,
            [&](int32_t rank, Transport& t) { t.all_reduce(bufs[rank].data(), 1, ElemType::kF64, ReduceOp::kSum); });
  for (const auto& buf : bufs) EXPECT_EQ(buf[0], 0.0);
}

TEST(CommLocal, all_reduce_sum_u32_wraps) {
  const Group group = make_local_group(3);
  std::vector<uint32_t> bufs[3] = {{0xFFFFFFF0u, 7u}, {0x20u, 11u}, {0x3u, 13u}};
  run_ranks(group,
            [&](int32_t rank, Transport& t) { t.all_reduce(bufs[rank].data(), 2, ElemType::kU32, ReduceOp::kSum); });
  for (const auto& buf : bufs) EXPECT_EQ(buf, (std::vector<uint32_t>{0x13u, 31u}));
}

TEST(CommLocal, all_reduce_max_u32_compares_unsigned_bits) {
  const Group group = make_local_group(4);
  // Element 0: amaxes as bits, NaN (0x7FC00000) beats infinity (0x7F800000). Element 1: unsigned, so
  // 0x80000001 beats 0x7FFFFFFF. Element 2: the largest is on the last rank.
  std::vector<uint32_t> bufs[4] = {
      {0x7F800000u, 5u, 1u}, {0x7FC00000u, 0x80000001u, 2u}, {0x3F800000u, 0x7FFFFFFFu, 3u}, {0x7F7FFFFFu, 0u, 4u}};
  run_ranks(group,
            [&](int32_t rank, Transport& t) { t.all_reduce(bufs[rank].data(), 3, ElemType::kU32, ReduceOp::kMax); });
  for (const auto& buf : bufs) EXPECT_EQ(buf, (std::vector<uint32_t>{0x7FC00000u, 0x80000001u, 4u}));
}

TEST(CommLocal, all_reduce_max_of_floats_takes_the_larger_and_nan_wins) {
  const float nan_a = f32_from_bits(0x7FC00001u);  // two NaN payloads: the lower rank's wins
  const float nan_b = f32_from_bits(0xFFC00002u);
  const float inf = std::numeric_limits<float>::infinity();
  const Group group = make_local_group(4);
  std::vector<float> bufs[4] = {
      {1.0f, -5.0f, inf, 2.0f}, {nan_a, -2.0f, 3.0f, 7.5f}, {3.0f, -7.0f, nan_b, -1.0f}, {nan_b, -3.0f, 4.0f, 7.25f}};
  run_ranks(group,
            [&](int32_t rank, Transport& t) { t.all_reduce(bufs[rank].data(), 4, ElemType::kF32, ReduceOp::kMax); });
  for (const auto& buf : bufs) {
    EXPECT_EQ(bits_of(buf[0]), 0x7FC00001u);
    EXPECT_EQ(buf[1], -2.0f);
    EXPECT_EQ(bits_of(buf[2]), 0xFFC00002u);  // NaN beats infinity, whatever its sign
    EXPECT_EQ(buf[3], 7.5f);
  }

  const Group pair = make_local_group(2);
  std::vector<double> wide[2] = {{-1.0, 2.5, 1e300}, {std::nan(""), 2.25, -1e300}};
  run_ranks(pair,
            [&](int32_t rank, Transport& t) { t.all_reduce(wide[rank].data(), 3, ElemType::kF64, ReduceOp::kMax); });
  for (const auto& buf : wide) {
    EXPECT_TRUE(std::isnan(buf[0]));
    EXPECT_EQ(buf[1], 2.5);
    EXPECT_EQ(buf[2], 1e300);
  }
}

// Byte j of rank r's contribution (piece p of it for all_to_all): distinct and never zero.
unsigned char gather_byte(int32_t rank, size_t j) {
  return static_cast<unsigned char>(1 + rank * 61 + j);
}
unsigned char piece_byte(int32_t sender, int32_t piece, size_t j) {
  return static_cast<unsigned char>(1 + sender * 64 + piece * 16 + j);
}

TEST(CommLocal, all_gather_concatenates_in_rank_order) {
  constexpr size_t kBytes = 13;
  for (int32_t n = 1; n <= 4; ++n) {
    const Group group = make_local_group(n);
    std::vector<std::vector<unsigned char>> recvs(static_cast<size_t>(n));
    run_ranks(group, [&](int32_t rank, Transport& t) {
      std::vector<unsigned char> send(kBytes);
      for (size_t j = 0; j < kBytes; ++j) send[j] = gather_byte(rank, j);
      auto& recv = recvs[static_cast<size_t>(rank)];
      recv.assign(kBytes * static_cast<size_t>(n), 0xEE);
      t.all_gather(send.data(), recv.data(), kBytes);
    });
    for (const auto& recv : recvs) {
      for (int32_t k = 0; k < n; ++k) {
        for (size_t j = 0; j < kBytes; ++j)
          ASSERT_EQ(recv[static_cast<size_t>(k) * kBytes + j], gather_byte(k, j)) << n << " ranks";
      }
    }
  }
}

TEST(CommLocal, all_gather_in_place) {
  constexpr size_t kBytes = 8;
  for (int32_t n = 1; n <= 4; ++n) {
    const Group group = make_local_group(n);
    std::vector<std::vector<unsigned char>> bufs(static_cast<size_t>(n));
    run_ranks(group, [&](int32_t rank, Transport& t) {
      auto& buf = bufs[static_cast<size_t>(rank)];
      buf.assign(kBytes * static_cast<size_t>(n), 0xEE);  // other ranks' slots hold garbage
      unsigned char* mine = buf.data() + static_cast<size_t>(rank) * kBytes;
      for (size_t j = 0; j < kBytes; ++j) mine[j] = gather_byte(rank, j);
      t.all_gather(mine, buf.data(), kBytes);
    });
    for (const auto& buf : bufs) {
      for (int32_t k = 0; k < n; ++k) {
        for (size_t j = 0; j < kBytes; ++j)
          ASSERT_EQ(buf[static_cast<size_t>(k) * kBytes + j], gather_byte(k, j)) << n << " ranks";
      }
    }
  }
}

TEST(CommLocal, broadcast_gives_every_rank_the_roots_bytes) {
  constexpr size_t kBytes = 11;
  for (int32_t n = 1; n <= 4; ++n) {
    for (int32_t root = 0; root < n; ++root) {
      const Group group = make_local_group(n);
      std::vector<std::vector<unsigned char>> bufs(static_cast<size_t>(n));
      run_ranks(group, [&](int32_t rank, Transport& t) {
        auto& buf = bufs[static_cast<size_t>(rank)];
        for (size_t j = 0; j < kBytes; ++j) buf.push_back(gather_byte(rank, j));
        t.broadcast(buf.data(), kBytes, root);
      });
      for (const auto& buf : bufs)
        for (size_t j = 0; j < kBytes; ++j) ASSERT_EQ(buf[j], gather_byte(root, j)) << n << " ranks, root " << root;
    }
  }
  // A different root on one rank is a mismatch, reported on every rank.
  const Group group = make_local_group(2);
  std::vector<std::string> errors(2);
  run_ranks(group, [&](int32_t rank, Transport& t) {
    unsigned char b[4] = {1, 2, 3, 4};
    errors[static_cast<size_t>(rank)] = nccl_error_of([&] { t.broadcast(b, sizeof b, rank); });
  });
  for (const std::string& e : errors) EXPECT_TRUE(contains(e, "mismatch")) << e;
}

TEST(CommLocal, all_to_all_delivers_piece_rank_of_every_sender) {
  constexpr size_t kBytes = 5;
  for (int32_t n = 1; n <= 4; ++n) {
    const Group group = make_local_group(n);
    std::vector<std::vector<unsigned char>> recvs(static_cast<size_t>(n));
    run_ranks(group, [&](int32_t rank, Transport& t) {
      std::vector<unsigned char> send(kBytes * static_cast<size_t>(n));
      for (int32_t p = 0; p < n; ++p) {
        for (size_t j = 0; j < kBytes; ++j) send[static_cast<size_t>(p) * kBytes + j] = piece_byte(rank, p, j);
      }
      auto& recv = recvs[static_cast<size_t>(rank)];
      recv.assign(send.size(), 0xEE);
      t.all_to_all(send.data(), recv.data(), kBytes);
    });
    for (int32_t r = 0; r < n; ++r) {
      for (int32_t k = 0; k < n; ++k) {
        for (size_t j = 0; j < kBytes; ++j) {
          ASSERT_EQ(recvs[static_cast<size_t>(r)][static_cast<size_t>(k) * kBytes + j], piece_byte(k, r, j))
              << n << " ranks, rank " << r << " from " << k;
        }
      }
    }
  }
}

// The strided forms the exchange's slices use: all_to_all reads piece p at send + p * stride (and
// carries an all_gather along); all_gather writes rank k's bytes at recv + k * stride, the bytes
// between the pieces untouched.
TEST(CommLocal, strided_all_to_all_with_a_gather_and_strided_all_gather) {
  constexpr size_t kBytes = 5, kStride = 9, kScale = 3;
  for (int32_t n = 1; n <= 4; ++n) {
    const Group group = make_local_group(n);
    std::vector<std::vector<unsigned char>> recvs(static_cast<size_t>(n)), scales(recvs), gathered(recvs);
    run_ranks(group, [&](int32_t rank, Transport& t) {
      std::vector<unsigned char> send(kStride * static_cast<size_t>(n), 0xDD);
      for (int32_t p = 0; p < n; ++p)
        for (size_t j = 0; j < kBytes; ++j) send[static_cast<size_t>(p) * kStride + j] = piece_byte(rank, p, j);
      std::vector<unsigned char> mine(kScale);
      for (size_t j = 0; j < kScale; ++j) mine[j] = gather_byte(rank, j);
      auto& recv = recvs[static_cast<size_t>(rank)];
      auto& scale = scales[static_cast<size_t>(rank)];
      recv.assign(kBytes * static_cast<size_t>(n), 0xEE);
      scale.assign(kScale * static_cast<size_t>(n), 0xEE);
      t.all_to_all(send.data(), kStride, recv.data(), kBytes, {mine.data(), scale.data(), kScale});
      // In place: this rank's bytes already sit at its stride.
      auto& buf = gathered[static_cast<size_t>(rank)];
      buf.assign(kStride * static_cast<size_t>(n), 0xEE);
      for (size_t j = 0; j < kBytes; ++j) buf[static_cast<size_t>(rank) * kStride + j] = gather_byte(rank, j);
      t.all_gather(buf.data() + static_cast<size_t>(rank) * kStride, buf.data(), kBytes, kStride);
    });
    for (int32_t r = 0; r < n; ++r) {
      const auto ur = static_cast<size_t>(r);
      for (int32_t k = 0; k < n; ++k) {
        const auto uk = static_cast<size_t>(k);
        for (size_t j = 0; j < kBytes; ++j) {
          ASSERT_EQ(recvs[ur][uk * kBytes + j], piece_byte(k, r, j)) << n << " ranks, rank " << r << " from " << k;
          ASSERT_EQ(gathered[ur][uk * kStride + j], gather_byte(k, j)) << n << " ranks, rank " << r;
        }
        for (size_t j = kBytes; j < kStride; ++j) ASSERT_EQ(gathered[ur][uk * kStride + j], 0xEE) << "between pieces";
        for (size_t j = 0; j < kScale; ++j) ASSERT_EQ(scales[ur][uk * kScale + j], gather_byte(k, j));
      }
    }
  }
  // A stride shorter than the bytes is refused.
  const Group two = make_local_group(2);
  std::vector<std::string> errors(2);
  run_ranks(two, [&](int32_t rank, Transport& t) {
    unsigned char b[16] = {};
    try {
      t.all_gather(b, b, 8, 4);
    } catch (const fp8::Error& e) {
      EXPECT_EQ(e.status(), FP8_ERR_INVALID_ARGUMENT) << e.what();
      errors[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (const std::string& e : errors) EXPECT_TRUE(contains(e, "a stride of 4 bytes; expected at least 8")) << e;
}

TEST(CommLocal, many_collectives_in_a_row_reuse_the_barriers) {
  constexpr int kRounds = 200;
  for (int32_t n = 2; n <= 4; ++n) {
    const Group group = make_local_group(n);
    run_ranks(group, [&](int32_t rank, Transport& t) {
      for (int round = 0; round < kRounds; ++round) {
        switch (round % 4) {
          case 0: {
            float v = static_cast<float>(rank + 1 + round);
            t.all_reduce(&v, 1, ElemType::kF32, ReduceOp::kSum);
            float expected = static_cast<float>(1 + round);
            for (int32_t r = 1; r < n; ++r) expected = expected + static_cast<float>(r + 1 + round);
            ASSERT_EQ(v, expected) << "round " << round;
            break;
          }
          case 1: {
            const uint32_t mine = static_cast<uint32_t>(round * 8 + rank + 1);
            std::vector<uint32_t> all(static_cast<size_t>(n));
            t.all_gather(&mine, all.data(), sizeof mine);
            for (int32_t k = 0; k < n; ++k)
              ASSERT_EQ(all[static_cast<size_t>(k)], static_cast<uint32_t>(round * 8 + k + 1));
            break;
          }
          case 2: {
            std::vector<uint32_t> send(static_cast<size_t>(n));
            std::vector<uint32_t> recv(static_cast<size_t>(n));
            for (int32_t p = 0; p < n; ++p)
              send[static_cast<size_t>(p)] = static_cast<uint32_t>(round * 100 + rank * 10 + p + 1);
            t.all_to_all(send.data(), recv.data(), sizeof(uint32_t));
            for (int32_t k = 0; k < n; ++k) {
              ASSERT_EQ(recv[static_cast<size_t>(k)], static_cast<uint32_t>(round * 100 + k * 10 + rank + 1));
            }
            break;
          }
          default:
            t.barrier();
        }
      }
    });
  }
}

TEST(CommLocal, different_collectives_throw_a_mismatch_on_every_rank) {
  const Group group = make_local_group(2);
  std::string errors[2];
  run_ranks(group, [&](int32_t rank, Transport& t) {
    std::vector<float> buf(16, 1.5f);
    if (rank == 0) {
      errors[0] = nccl_error_of([&] { t.all_reduce(buf.data(), 16, ElemType::kF32, ReduceOp::kSum); });
    } else {
      std::vector<float> recv(32);
      errors[1] = nccl_error_of([&] { t.all_gather(buf.data(), recv.data(), 64); });
    }
  });
  for (const auto& e : errors) {
    EXPECT_TRUE(contains(e, "mismatch")) << e;
    EXPECT_TRUE(contains(e, "rank 1 called all_gather(64 bytes)")) << e;
    EXPECT_TRUE(contains(e, "rank 0 called all_reduce(16 x f32, sum)")) << e;
  }
  // The group stays failed: later collectives and check() throw, on every rank.
  run_ranks(group, [&](int32_t, Transport& t) {
    EXPECT_TRUE(contains(nccl_error_of([&] { t.barrier(); }), "mismatch"));
    EXPECT_TRUE(contains(nccl_error_of([&] { t.check(); }), "mismatch"));
  });
}

TEST(CommLocal, different_sizes_types_or_ops_throw_a_mismatch) {
  using Call = std::function<void(Transport&)>;
  const auto reduce = [](size_t count, ElemType type, ReduceOp op) -> Call {
    return [=](Transport& t) {
      uint64_t buf[5] = {1, 2, 3, 4, 5};  // room for 5 elements of any type
      t.all_reduce(buf, count, type, op);
    };
  };
  const auto gather = [](size_t bytes) -> Call {
    return [=](Transport& t) {
      unsigned char send[8] = {1, 2, 3, 4, 5, 6, 7, 8}, recv[16];
      t.all_gather(send, recv, bytes);
    };
  };
  struct Case {
    Call rank0, rank1;
    const char* named;  // how the message must name rank 1's call
  };
  const std::vector<Case> cases = {
      {reduce(4, ElemType::kF32, ReduceOp::kSum), reduce(5, ElemType::kF32, ReduceOp::kSum),
       "all_reduce(5 x f32, sum)"},
      {reduce(4, ElemType::kF32, ReduceOp::kSum), reduce(4, ElemType::kF32, ReduceOp::kMax),
       "all_reduce(4 x f32, max)"},
      {reduce(4, ElemType::kU32, ReduceOp::kMax), reduce(4, ElemType::kF32, ReduceOp::kMax),
       "all_reduce(4 x f32, max)"},
      {reduce(2, ElemType::kF64, ReduceOp::kSum), reduce(4, ElemType::kF32, ReduceOp::kSum),
       "all_reduce(4 x f32, sum)"},
      {gather(8), gather(4), "all_gather(4 bytes)"},
      {[](Transport& t) {
         unsigned char send[8] = {1, 2, 3, 4, 5, 6, 7, 8}, recv[8];
         t.all_to_all(send, recv, 4);
       },
       [](Transport& t) { t.barrier(); }, "barrier()"},
  };
  for (const auto& c : cases) {
    const Group group = make_local_group(2);
    std::string errors[2];
    run_ranks(group, [&](int32_t rank, Transport& t) {
      errors[rank] = nccl_error_of([&] { rank == 0 ? c.rank0(t) : c.rank1(t); });
    });
    for (const auto& e : errors) {
      EXPECT_TRUE(contains(e, "mismatch")) << e;
      EXPECT_TRUE(contains(e, std::string("rank 1 called ") + c.named)) << e;
    }
  }
}

TEST(CommLocal, abort_from_another_thread_releases_a_waiting_rank) {
  const Group group = make_local_group(2);
  std::vector<std::future<void>> done;
  std::string waited;
  const auto start = std::chrono::steady_clock::now();
  done.push_back(std::async(std::launch::async, [&] {
    float v[3] = {1, 2, 3};
    waited = nccl_error_of([&] { group[0]->all_reduce(v, 3, ElemType::kF32, ReduceOp::kSum); });
  }));
  // Rank 1 never calls; a thread that is no rank aborts.
  done.push_back(std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(100ms);
    EXPECT_NO_THROW(group[0]->check());  // nothing has failed yet
    group[1]->abort();
  }));
  wait_or_fail(done, group);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_TRUE(contains(waited, "the communicator was aborted (fp8_comm_abort)")) << waited;

  // Failed for good, on both ranks.
  for (const auto& t : group) {
    float v = 1;
    EXPECT_TRUE(contains(nccl_error_of([&] { t->all_reduce(&v, 1, ElemType::kF32, ReduceOp::kSum); }), "aborted"));
    EXPECT_TRUE(contains(nccl_error_of([&] { t->barrier(); }), "aborted"));
    EXPECT_TRUE(contains(nccl_error_of([&] { t->check(); }), "aborted"));
    t->abort();  // again: harmless
  }
}

TEST(CommLocal, a_rank_leaving_releases_a_rank_waiting_for_it) {
  Group group = make_local_group(3);
  std::vector<std::future<void>> done;
  std::string waited;
  done.push_back(std::async(std::launch::async, [&] {
    float v[2] = {1, 2};
    waited = nccl_error_of([&] { group[0]->all_reduce(v, 2, ElemType::kF32, ReduceOp::kSum); });
  }));
  std::this_thread::sleep_for(100ms);
  group[1].reset();  // rank 1 leaves without calling
  wait_or_fail(done, group);
  EXPECT_TRUE(contains(waited, "rank 1 left the group (its communicator was destroyed)")) << waited;
  EXPECT_TRUE(contains(waited, "rank 0 waited in all_reduce(2 x f32, sum)") ||
              contains(waited, "rank 0 called all_reduce(2 x f32, sum)"))
      << waited;
  // Rank 2, calling afterwards, is told the same without waiting.
  EXPECT_TRUE(contains(nccl_error_of([&] { group[2]->barrier(); }), "rank 1 left the group"));
  EXPECT_TRUE(contains(nccl_error_of([&] { group[0]->check(); }), "rank 1 left the group"));
}

TEST(CommLocal, calling_after_a_rank_left_throws_instead_of_waiting) {
  Group group = make_local_group(2);
  group[1].reset();
  std::vector<std::future<void>> done;
  std::string error;
  done.push_back(std::async(std::launch::async, [&] {
    unsigned char send[4] = {1, 2, 3, 4}, recv[8] = {};
    error = nccl_error_of([&] { group[0]->all_gather(send, recv, 4); });
  }));
  wait_or_fail(done, group);
  EXPECT_TRUE(contains(error,
                       "rank 1 left the group (its communicator was destroyed) before rank 0 called "
                       "all_gather(4 bytes)"))
      << error;
}

TEST(CommLocal, a_rank_refusing_its_arguments_releases_the_others) {
  const Group group = make_local_group(2);
  std::string errors[2];
  run_ranks(group, [&](int32_t rank, Transport& t) {
    float v[2] = {1, 2};
    if (rank == 0) {
      errors[0] = nccl_error_of([&] { t.all_reduce(v, 2, ElemType::kF32, ReduceOp::kSum); });
      return;
    }
    try {
      t.all_reduce(nullptr, 2, ElemType::kF32, ReduceOp::kSum);
      ADD_FAILURE() << "a NULL buffer was accepted";
    } catch (const fp8::Error& e) {
      EXPECT_EQ(e.status(), FP8_ERR_INVALID_ARGUMENT);
      errors[1] = e.what();
    }
  });
  EXPECT_TRUE(contains(errors[1], "'buf'")) << errors[1];
  EXPECT_TRUE(contains(errors[0], "rank 1 could not take part")) << errors[0];
}

TEST(CommLocal, one_rank_collectives_are_copies) {
  const Group group = make_local_group(1);
  Transport& t = *group[0];
  const float nan = f32_from_bits(0xFFC01234u);
  std::vector<float> f = {1.25f, -3.5f, nan};
  t.all_reduce(f.data(), 3, ElemType::kF32, ReduceOp::kSum);
  EXPECT_EQ(f[0], 1.25f);
  EXPECT_EQ(f[1], -3.5f);
  EXPECT_EQ(bits_of(f[2]), 0xFFC01234u);
  std::vector<uint32_t> u = {7u, 0xFFFFFFFFu};
  t.all_reduce(u.data(), 2, ElemType::kU32, ReduceOp::kMax);
  EXPECT_EQ(u, (std::vector<uint32_t>{7u, 0xFFFFFFFFu}));

  const unsigned char send[6] = {9, 8, 7, 6, 5, 4};
  unsigned char recv[6] = {};
  t.all_gather(send, recv, 6);
  EXPECT_EQ(std::memcmp(send, recv, 6), 0);
  std::memset(recv, 0, 6);
  t.all_to_all(send, recv, 6);
  EXPECT_EQ(std::memcmp(send, recv, 6), 0);
  t.barrier();
  EXPECT_NO_THROW(t.check());
}

}  // namespace
