// SPDX-License-Identifier: Apache-2.0
// The Parm layer over in-process ranks (parm_cases.hpp): every schedule equals the unsliced
// single-process oracle bit for bit, on 8 ranks in every layout of the issue, dropless and with
// capacity; and its argument errors.

#include "parm_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>

namespace test {

TEST_CASE("Parm: deepspeed_mp, parm_s1 and parm_s2 equal the unsliced oracle bit for bit (8 ranks, 5 layouts, T = 0, 1, 37)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{1, 8, 1}, moecomm::parallel_sizes{2, 4, 1},
                                              moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 4},
                                              moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{4, 2, 2}})
    for (std::int64_t tokens : {0, 1, 37}) {
      CAPTURE(sizes.model);
      CAPTURE(sizes.expert);
      CAPTURE(sizes.expert_slicing);
      CAPTURE(tokens);
      parm_case const c{sizes, tokens, 8, 2, 0};
      moecomm::inproc_world const world(8, std::chrono::seconds(60));
      world.run([&](moecomm::inproc_communicator comm) {
        check_parm_schedules_on_rank<float>(moecomm::host_backend{}, comm, c, moecomm::dropless{});
      });
    }
}

TEST_CASE("Parm: with capacity every schedule drops the baseline's slots (8 ranks, factor 0.75, top-4, 16 experts)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 2}}) {
    CAPTURE(sizes.model);
    CAPTURE(sizes.expert_slicing);
    parm_case const c{sizes, 211, 16, 4, 0.75};
    moecomm::inproc_world const world(8, std::chrono::seconds(60));
    world.run([&](moecomm::inproc_communicator comm) {
      check_parm_schedules_on_rank<float>(moecomm::host_backend{}, comm, c,
                                          moecomm::capacity<moecomm::drop_by_position>{0.75});
    });
  }
}

TEST_CASE("Parm: parm_auto runs the schedule its model picks, the same on every rank, with the oracle's results") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{2, 4, 1},
                                              moecomm::parallel_sizes{4, 2, 4}})
    for (std::int64_t tokens : {0, 37}) {
      CAPTURE(sizes.expert_slicing);
      CAPTURE(tokens);
      parm_case const c{sizes, tokens, 8, 2, 0};
      moecomm::inproc_world const world(8, std::chrono::seconds(60));
      world.run([&](moecomm::inproc_communicator comm) {
        check_parm_auto_on_rank(moecomm::host_backend{}, comm, c, moecomm::dropless{});
      });
    }
  parm_case const dropping{{2, 4, 2}, 211, 16, 4, 0.75};
  moecomm::inproc_world const world(8, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) {
    check_parm_auto_on_rank(moecomm::host_backend{}, comm, dropping, moecomm::capacity<moecomm::drop_by_position>{0.75});
  });
}

TEST_CASE("Parm: parm_auto refuses a schedule without the experts' inner width or pieces") {
  moecomm::inproc_world const world(2, std::chrono::seconds(20));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::parallel_groups<moecomm::inproc_communicator> groups(comm, {2, 1, 2});
    using layer = moecomm::parm_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::parm_auto>;
    check_error([&] { layer(moecomm::host_backend{}, groups, 4, 4, moecomm::parm_auto{}); }, moecomm::status::invalid_argument,
                {"moecomm::parm_layer: schedule.ffn = 0 must be the experts' inner width"});
    check_error([&] { layer(moecomm::host_backend{}, groups, 4, 4, moecomm::parm_auto{moecomm::parm_cost_model(), 8, 0}); },
                moecomm::status::invalid_argument, {"moecomm::parm_layer: schedule.pieces = 0 must be at least 1"});
  });
}

}  // namespace test

