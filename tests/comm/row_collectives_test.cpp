// SPDX-License-Identifier: Apache-2.0
// Row collectives and parallel groups over in-process ranks (row_collectives_cases.hpp), and their
// argument errors.

#include "pipelined_collectives_cases.hpp"
#include "row_collectives_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>

namespace test {

TEST_CASE("row_allgather and ordered_reduce_scatter equal the oracle bit for bit, 1, 3 and 4 ranks") {
  for (int n : {1, 3, 4}) {
    CAPTURE(n);
    moecomm::inproc_world const world(n, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      check_row_collectives_on_rank<float>(moecomm::host_backend{}, comm);
      check_row_collectives_on_rank<__nv_bfloat16>(moecomm::host_backend{}, comm);
    });
  }
}

TEST_CASE("pipelined all-to-all ∥ all-gather and its mirror equal the two collectives in turn, 1, 2 and 7 pieces (8 ranks)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 4},
                                              moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{2, 4, 1},
                                              moecomm::parallel_sizes{4, 2, 2}}) {
    CAPTURE(sizes.model);
    CAPTURE(sizes.expert);
    CAPTURE(sizes.expert_slicing);
    moecomm::inproc_world const world(8, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      check_pipelined_collectives_on_rank<float>(moecomm::host_backend{}, comm, sizes);
      check_pipelined_collectives_on_rank<__nv_bfloat16>(moecomm::host_backend{}, comm, sizes);
    });
  }
}

TEST_CASE("pipelined collectives name the caller's argument before any message") {
  moecomm::inproc_world const world(2, std::chrono::seconds(20));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::pipeline_workspace<moecomm::host_backend> scratch;
    moecomm::parallel_groups<moecomm::inproc_communicator> groups(comm, {2, 1, 2});
    std::vector<float> in(4 * 2), out(8 * 2);
    std::vector<std::int64_t> send{4}, recv{4, 4}, short_recv{4};
    auto const in_view = moecomm::matrix_view<float const>{in.data(), 4, 2};
    check_error([&] { moecomm::alltoall_allgather(be, groups.ep(), groups.esp(), in_view, moecomm::array_view<std::int64_t const>(send),
                                                  moecomm::array_view<std::int64_t const>(recv),
                                                  moecomm::matrix_view<float>{out.data(), 7, 2}, scratch, 2); },
                moecomm::status::invalid_argument, {"alltoall_allgather", "argument 'out' has 7 rows; needs at least 8"});
    check_error([&] { moecomm::alltoall_allgather(be, groups.ep(), groups.esp(), in_view, moecomm::array_view<std::int64_t const>(send),
                                                  moecomm::array_view<std::int64_t const>(short_recv),
                                                  moecomm::matrix_view<float>{out.data(), 8, 2}, scratch, 2); },
                moecomm::status::invalid_argument, {"argument 'recv_rows' has 1 entries, gather ranks x all-to-all ranks = 2"});
    check_error([&] { moecomm::reduce_scatter_alltoall(be, groups.esp(), groups.ep(), moecomm::matrix_view<float const>{out.data(), 8, 2},
                                                       moecomm::array_view<std::int64_t const>(recv),
                                                       moecomm::array_view<std::int64_t const>(send),
                                                       moecomm::matrix_view<float>{in.data(), 4, 2}, scratch, 0); },
                moecomm::status::invalid_argument, {"reduce_scatter_alltoall", "pieces = 0 must be at least 1"});
  });
}

TEST_CASE("row_slice cuts rows into contiguous slices, the first rows % parts one longer") {
  CHECK(moecomm::row_slice(7, 3, 0).begin == 0);
  CHECK(moecomm::row_slice(7, 3, 0).count == 3);
  CHECK(moecomm::row_slice(7, 3, 1).begin == 3);
  CHECK(moecomm::row_slice(7, 3, 2).begin == 5);
  CHECK(moecomm::row_slice(7, 3, 2).count == 2);
  CHECK(moecomm::row_slice(0, 4, 3).count == 0);
  check_error([] { (void)moecomm::row_slice(5, 2, 2); }, moecomm::status::invalid_argument, {"part = 2 is not in [0, 2)"});
}

TEST_CASE("row collectives name the caller's argument before any message") {
  moecomm::inproc_world const world(2, std::chrono::seconds(20));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::workspace<moecomm::host_backend> scratch;
    std::vector<float> all(10 * 4), mine(5 * 4);
    check_error([&] { moecomm::row_allgather(be, comm, moecomm::matrix_view<float const>{mine.data(), 4, 4},
                                             moecomm::matrix_view<float>{all.data(), 10, 4}, scratch); },
                moecomm::status::invalid_argument, {"row_allgather", "argument 'mine' has 4 rows; needs at least 5"});
    check_error([&] { moecomm::ordered_reduce_scatter(be, comm, moecomm::matrix_view<float const>{all.data(), 10, 4},
                                                      moecomm::matrix_view<float>{mine.data(), 5, 3}, scratch); },
                moecomm::status::invalid_argument, {"ordered_reduce_scatter", "argument 'out' has hidden = 3"});
  });
}

TEST_CASE("parallel_groups: MP, EP, ESP, DP and expert-DP groups follow the layout (8 ranks)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{1, 8, 1}, moecomm::parallel_sizes{2, 4, 1},
                                              moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 4},
                                              moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{4, 1, 2}}) {
    CAPTURE(sizes.model);
    CAPTURE(sizes.expert);
    CAPTURE(sizes.expert_slicing);
    moecomm::inproc_world const world(8, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) { check_parallel_groups_on_rank(comm, sizes); });
  }
}

TEST_CASE("parallel_groups: sizes that do not fit the world are errors naming them, on every rank") {
  moecomm::inproc_world const world(8, std::chrono::seconds(20));
  world.run([&](moecomm::inproc_communicator comm) {
    using groups = moecomm::parallel_groups<moecomm::inproc_communicator>;
    check_error([&] { groups g(comm, {3, 1, 1}); }, moecomm::status::invalid_argument,
                {"sizes.model x sizes.expert = 3 x 1 does not divide the world of 8 ranks"});
    check_error([&] { groups g(comm, {4, 2, 3}); }, moecomm::status::invalid_argument,
                {"sizes.expert_slicing = 3 does not divide sizes.model = 4"});
    check_error([&] { groups g(comm, {0, 2, 1}); }, moecomm::status::invalid_argument, {"sizes.model = 0 must be at least 1"});
    // Ranks that disagree: every rank throws invalid_usage, none waits in a sub-group.
    check_error([&] { groups g(comm, {comm.rank() == 5 ? 4 : 2, 2, 1}); }, moecomm::status::invalid_usage,
                {"parallel_groups", "ranks disagree"});
    groups const fine(comm, {2, 2, 2});  // the world is still usable
    CHECK(fine.data_parallel_size() == 2);
  });
}

}  // namespace test
