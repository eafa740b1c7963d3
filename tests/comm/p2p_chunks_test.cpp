// SPDX-License-Identifier: Apache-2.0
// The host-side helpers of the device communicators: the chunking of large point-to-point messages
// and the argument checks that run before any NCCL call (each names the bad argument).

#include "../support/test_support.hpp"

#include <moecomm/comm/detail/p2p_chunks.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace test {

using moecomm::recv_block;
using moecomm::send_block;
using moecomm::status;

namespace {

bool contains(std::string const& text, std::string const& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("chunk_count and split_into_chunks cover the message exactly, all chunks full but the last") {
  using moecomm::detail::chunk_count;
  using moecomm::detail::split_into_chunks;
  CHECK(chunk_count(0, 1) == 0);
  CHECK(split_into_chunks(0, 7).empty());
  CHECK(chunk_count(1, 1) == 1);
  CHECK(chunk_count(12, 12) == 1);
  CHECK(chunk_count(13, 12) == 2);
  CHECK(chunk_count(40, 12) == 4);

  auto const c = split_into_chunks(40, 12);
  REQUIRE(c.size() == 4);
  std::vector<std::int64_t> const offsets{c[0].offset, c[1].offset, c[2].offset, c[3].offset};
  std::vector<std::int64_t> const sizes{c[0].bytes, c[1].bytes, c[2].bytes, c[3].bytes};
  CHECK(offsets == std::vector<std::int64_t>{0, 12, 24, 36});
  CHECK(sizes == std::vector<std::int64_t>{12, 12, 12, 4});

  for (std::int64_t bytes : {1, 2, 5, 11, 12, 13, 23, 24, 25, 1000}) {
    for (std::int64_t max_chunk : {1, 2, 3, 12, 999, 1000, 1001}) {
      CAPTURE(bytes);
      CAPTURE(max_chunk);
      auto const chunks = split_into_chunks(bytes, max_chunk);
      REQUIRE(static_cast<std::int64_t>(chunks.size()) == chunk_count(bytes, max_chunk));
      std::int64_t next = 0;
      for (std::size_t i = 0; i < chunks.size(); ++i) {
        CHECK(chunks[i].offset == next);
        CHECK(chunks[i].bytes >= 1);
        CHECK(chunks[i].bytes <= max_chunk);
        if (i + 1 < chunks.size()) CHECK(chunks[i].bytes == max_chunk);
        next += chunks[i].bytes;
      }
      CHECK(next == bytes);
    }
  }
}

TEST_CASE("chunking a message larger than 2^31 bytes needs no 32-bit arithmetic") {
  std::int64_t const bytes = (std::int64_t{5} << 30) + 3;  // 5 GiB + 3
  std::int64_t const max_chunk = std::int64_t{1} << 30;
  auto const chunks = moecomm::detail::split_into_chunks(bytes, max_chunk);
  REQUIRE(chunks.size() == 6);
  CHECK(chunks[5].offset == (std::int64_t{5} << 30));
  CHECK(chunks[5].bytes == 3);
  CHECK(moecomm::detail::chunk_count(std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::max()) == 1);
}

TEST_CASE("chunking rejects negative sizes and non-positive chunk sizes") {
  auto const a = thrown_error([] { (void)moecomm::detail::split_into_chunks(-1, 4); });
  CHECK(a.first == status::invalid_argument);
  CHECK(contains(a.second, "bytes = -1"));
  auto const b = thrown_error([] { (void)moecomm::detail::chunk_count(10, 0); });
  CHECK(b.first == status::invalid_argument);
  CHECK(contains(b.second, "max_chunk = 0"));
}

TEST_CASE("validate_exchange accepts well-formed block lists") {
  char data[16] = {};
  std::vector<send_block> const sends{{0, data, 16}, {2, data, 0}, {1, nullptr, 0}};
  std::vector<recv_block> const recvs{{2, data, 4}, {0, data, 16}};
  CHECK_NOTHROW(moecomm::detail::validate_exchange("op", sends, recvs, 3));
  CHECK_NOTHROW(moecomm::detail::validate_exchange("op", {}, {}, 1));
}

TEST_CASE("validate_exchange names the bad block and what is wrong with it") {
  char data[16] = {};
  using moecomm::detail::validate_exchange;
  struct bad_case {
    std::vector<send_block> sends;
    std::vector<recv_block> recvs;
    char const* expected;
  };
  std::vector<bad_case> const cases{
      {{{0, data, 1}, {3, data, 1}}, {}, "sends[1].peer = 3 is not a rank of this group of 3"},
      {{{-1, data, 1}}, {}, "sends[0].peer = -1"},
      {{}, {{5, data, 1}}, "recvs[0].peer = 5"},
      {{{1, data, -4}}, {}, "sends[0].bytes = -4 must be >= 0"},
      {{}, {{1, data, 2}, {2, data, -1}}, "recvs[1].bytes = -1"},
      {{{1, nullptr, 8}}, {}, "sends[0].data is null"},
      {{}, {{0, nullptr, 1}}, "recvs[0].data is null"},
      {{{1, data, 1}, {0, data, 1}, {1, data, 2}}, {}, "sends[0] and sends[2] both name peer 1"},
      {{}, {{2, data, 0}, {2, data, 0}}, "recvs[0] and recvs[1] both name peer 2"},
  };
  for (auto const& c : cases) {
    CAPTURE(c.expected);
    auto const e = thrown_error([&] { validate_exchange("nccl_communicator::exchange", c.sends, c.recvs, 3); });
    CHECK(e.first == status::invalid_argument);
    CHECK(contains(e.second, "moecomm::nccl_communicator::exchange: "));
    CHECK(contains(e.second, c.expected));
  }
}

TEST_CASE("validate_root, validate_size and validate_buffer name the argument") {
  using namespace moecomm::detail;
  CHECK_NOTHROW(validate_root("op", 0, 1));
  CHECK_NOTHROW(validate_root("op", 3, 4));
  auto const r = thrown_error([] { validate_root("nccl_communicator::broadcast", 4, 4); });
  CHECK(r.first == status::invalid_argument);
  CHECK(contains(r.second, "moecomm::nccl_communicator::broadcast: root = 4 is not a rank of this group of 4"));
  CHECK(thrown_error([] { validate_root("op", -1, 4); }).first == status::invalid_argument);

  CHECK_NOTHROW(validate_size("op", "count", 0));
  auto const s = thrown_error([] { validate_size("op", "count", -2); });
  CHECK(s.first == status::invalid_argument);
  CHECK(contains(s.second, "count = -2 must be >= 0"));

  int x = 0;
  CHECK_NOTHROW(validate_buffer("op", "send", &x, 4));
  CHECK_NOTHROW(validate_buffer("op", "send", nullptr, 0));
  auto const b = thrown_error([] { validate_buffer("op", "recv", nullptr, 8); });
  CHECK(b.first == status::invalid_argument);
  CHECK(contains(b.second, "recv is null but its size is 8"));
}

}  // namespace test
