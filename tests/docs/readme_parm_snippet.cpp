// SPDX-License-Identifier: Apache-2.0
// README's Parm snippet (between the markers), run on 8 in-process ranks and checked against the
// unsliced single-process oracle (tests/patterns/parm_cases.hpp).

#include "../patterns/parm_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>

namespace test {

TEST_CASE("README Parm snippet runs") {
  parm_case const c{{2, 4, 2}, 64, 8, 2, 0};
  std::vector<parm_result<float>> got(8), want(8);
  // example-begin readme-parm
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    // MP 2 x EP 4, each expert sliced over its MP pair; world rank = (dp * EP + ep) * MP + mp
    moecomm::parallel_groups groups(comm, moecomm::parallel_sizes{/*model=*/2, /*expert=*/4, /*expert_slicing=*/2},
                                    moecomm::topology(8, /*ranks_per_node=*/4));
    // deepspeed_mp, parm_s1 or parm_s2{pieces}: one type changes the schedule
    got[comm.rank()] = run_parm_step<float>(moecomm::host_backend{}, groups, c, moecomm::parm_s2{/*pieces=*/4},
                                            moecomm::dropless{});  // a parm_layer's forward + backward
    want[comm.rank()] = parm_oracle<float>(groups.coordinates(), c);
  });
  // example-end readme-parm
  for (std::int32_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    check_parm_result(got[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)], "parm_s2");
    CHECK(got[static_cast<std::size_t>(r)].report.model_gather.intra_bytes > 0);  // the MP pair shares a node
  }
}

}  // namespace test
