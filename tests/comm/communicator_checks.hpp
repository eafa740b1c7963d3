// SPDX-License-Identifier: Apache-2.0
#pragma once
// Checks that every communicator passes, written once for the transports' tests (in-process, MPI,
// c10d): call them on every rank.

#include "../support/test_support.hpp"

#include <moecomm/comm/communicator.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace test {

// exchange: rank i sends i + 1 values of (i * 100 + j) to every j, itself included.
template <class Comm>
void check_exchange_between_every_pair(Comm& comm) {
  int const me = comm.rank();
  int const ranks = comm.size();
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(ranks)), in(static_cast<std::size_t>(ranks));
  std::vector<moecomm::send_block> sends;
  std::vector<moecomm::recv_block> recvs;
  for (int peer = 0; peer < ranks; ++peer) {
    out[peer].assign(static_cast<std::size_t>(me + 1), me * 100 + peer);
    in[peer].assign(static_cast<std::size_t>(peer + 1), -1);
    sends.push_back({peer, out[peer].data(), static_cast<std::int64_t>((me + 1) * sizeof(std::int32_t))});
    recvs.push_back({peer, in[peer].data(), static_cast<std::int64_t>((peer + 1) * sizeof(std::int32_t))});
  }
  comm.exchange(sends, recvs);
  for (int peer = 0; peer < ranks; ++peer)
    REQUIRE(in[peer] == std::vector<std::int32_t>(static_cast<std::size_t>(peer + 1), peer * 100 + me));
}

// allreduce in place: an int64 sum and a double max.
template <class Comm>
void check_allreduce_in_place(Comm& comm) {
  int const me = comm.rank();
  int const ranks = comm.size();
  std::vector<std::int64_t> v{me, 2 * me, 7};
  comm.allreduce(v.data(), v.data(), 3, moecomm::reduce_op::sum);
  std::int64_t const total = std::int64_t{ranks} * (ranks - 1) / 2;
  REQUIRE(v == std::vector<std::int64_t>{total, 2 * total, 7 * ranks});
  double x = me + 0.5, biggest = 0;
  comm.allreduce(&x, &biggest, 1, moecomm::reduce_op::max);
  REQUIRE(biggest == ranks - 0.5);
}

// On a rank whose peer never calls: `allreduce` throws `timeout` after the communicator's timeout
// (`timeout_ms`) and before `at_most`, naming the communicator (`name`, as "moecomm::mpi_communicator")
// and this world rank, and the communicator is unusable after.
template <class Comm>
void check_allreduce_times_out(Comm& comm, std::string const& name, int world_rank, int timeout_ms,
                               std::chrono::milliseconds at_most) {
  auto const start = std::chrono::steady_clock::now();
  auto const [code, message] = thrown_error([&] {
    std::int64_t v = 1;
    comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  });
  auto const waited = std::chrono::steady_clock::now() - start;
  CHECK(code == moecomm::status::timeout);
  CHECK_MESSAGE(message.find(name + "::allreduce: world rank " + std::to_string(world_rank) + " timed out after " +
                             std::to_string(timeout_ms) + " ms in allreduce") != std::string::npos,
                message);
  CHECK(waited >= std::chrono::milliseconds(timeout_ms));
  CHECK(waited < at_most);
  CHECK_FALSE(comm.usable());
  check_error([&] { comm.barrier(); }, moecomm::status::aborted, {"unusable after an earlier failure", "timed out"});
}

}  // namespace test
