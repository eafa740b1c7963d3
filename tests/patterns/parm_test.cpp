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

}  // namespace test
