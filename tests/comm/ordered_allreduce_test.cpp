// SPDX-License-Identifier: Apache-2.0
// ordered_allreduce over in-process ranks: bitwise equal to a sequential sum in ascending rank on every
// rank, for values whose sum depends on the order (so a wrong order fails), odd counts, count 0 and
// chunks smaller than the count; bad arguments and disagreements throw on every rank before any write.
// The same test under MPI is in mpi_test.cpp.

#include "inproc_support.hpp"
#include "ordered_values.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>

#include <chrono>
#include <cstring>

namespace test {

using moecomm::inproc_communicator;
using moecomm::status;

TEST_CASE_TEMPLATE("ordered_allreduce equals the sequential sum in ascending rank, bit for bit, on every rank", T, float, double) {
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    moecomm::inproc_world const world(ranks, std::chrono::seconds(60));
    world.run([&](inproc_communicator comm) {
      moecomm::host_backend const be{2, moecomm::host_kernels::tiled};
      moecomm::workspace<moecomm::host_backend> scratch;  // reused by every call below
      for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{2039}})
        for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{3}, std::int64_t{64}, moecomm::ordered_allreduce_chunk}) {
          if (chunk == 1 && count > 5 && ranks > 4) continue;  // 2039 rendezvous of 8 threads on 2 cores: slow, adds nothing
          CAPTURE(count);
          CAPTURE(chunk);
          std::vector<T> data = rank_values<T>(comm.rank(), count);
          moecomm::ordered_allreduce(be, comm, moecomm::array_view<T>(data), scratch, chunk);
          check_bitwise(data, sequential_sum<T>(ranks, count), 1, "ordered_allreduce");
        }
    });
  }
}

TEST_CASE("the order-sensitive values do tell the orders apart") {
  for (int ranks : {3, 4, 8}) {
    auto const forward = sequential_sum<float>(ranks, 2039), backward = sequential_sum<float>(ranks, 2039, true);
    CHECK(std::memcmp(forward.data(), backward.data(), forward.size() * sizeof(float)) != 0);
    auto const forward64 = sequential_sum<double>(ranks, 2039), backward64 = sequential_sum<double>(ranks, 2039, true);
    CHECK(std::memcmp(forward64.data(), backward64.data(), forward64.size() * sizeof(double)) != 0);
  }
}

TEST_CASE("ordered_allreduce: a bad argument or a disagreement throws on every rank, and nothing is written") {
  moecomm::inproc_world const world(3, std::chrono::seconds(20));
  moecomm::host_backend const be;
  struct bad_case {
    char const* name;
    std::int64_t size[3];   // data.size per rank
    bool null_data[3];
    std::int64_t chunk[3];
    status want[3];
    char const* message[3];
  };
  bad_case const cases[] = {
      {"null data with elements on rank 1", {4, 4, 4}, {false, true, false}, {2, 2, 2},
       {status::aborted, status::invalid_argument, status::aborted},
       {"moecomm::ordered_allreduce: rank 1 passed an invalid argument (see its error); nothing was written",
        "moecomm::ordered_allreduce: data.data is null but its size is 4",
        "moecomm::ordered_allreduce: rank 1 passed an invalid argument"}},
      {"negative size on rank 0", {-1, 4, 4}, {false, false, false}, {2, 2, 2},
       {status::invalid_argument, status::aborted, status::aborted},
       {"moecomm::ordered_allreduce: data.size = -1 must be >= 0", "rank 0 passed an invalid argument",
        "rank 0 passed an invalid argument"}},
      {"chunk 0 on every rank", {4, 4, 4}, {false, false, false}, {0, 0, 0},
       {status::invalid_argument, status::invalid_argument, status::invalid_argument},
       {"chunk_elements = 0 is not in [1, ", "chunk_elements = 0 is not in [1, ", "chunk_elements = 0 is not in [1, "}},
      {"sizes that differ", {4, 4, 5}, {false, false, false}, {2, 2, 2},
       {status::invalid_usage, status::invalid_usage, status::invalid_usage},
       {"ranks disagree: rank 0 has data.size 4 and chunk_elements 2, but rank 2 has data.size 5 and chunk_elements 2",
        "ranks disagree: rank 0 has data.size 4", "ranks disagree: rank 0 has data.size 4"}},
      {"chunks that differ", {4, 4, 4}, {false, false, false}, {2, 3, 2},
       {status::invalid_usage, status::invalid_usage, status::invalid_usage},
       {"but rank 1 has data.size 4 and chunk_elements 3", "but rank 1 has data.size 4 and chunk_elements 3",
        "but rank 1 has data.size 4 and chunk_elements 3"}},
  };
  for (bad_case const& c : cases) {
    CAPTURE(c.name);
    std::vector<std::vector<float>> data(3, std::vector<float>(5, 1.5f));
    auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
      auto const r = static_cast<std::size_t>(comm.rank());
      moecomm::workspace<moecomm::host_backend> scratch;
      moecomm::ordered_allreduce(be, comm, moecomm::array_view<float>(c.null_data[r] ? nullptr : data[r].data(), c.size[r]),
                                 scratch, c.chunk[r]);
    });
    for (std::size_t r = 0; r < 3; ++r) {
      CAPTURE(r);
      CHECK(outcomes[r].code == c.want[r]);
      CHECK_MESSAGE(outcomes[r].message.find(c.message[r]) != std::string::npos, outcomes[r].message);
      CHECK(data[r] == std::vector<float>(5, 1.5f));
    }
  }
}

}  // namespace test
