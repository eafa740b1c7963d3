// SPDX-License-Identifier: Apache-2.0
// README's HybridEP snippet (between the markers), run on 8 in-process ranks in 2 data centres and
// checked against plain expert parallelism on the same inputs, bit for bit (shadow_cases.hpp).

#include "../patterns/shadow_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/hybridep.hpp>

namespace test {

TEST_CASE("README HybridEP snippet runs") {
  shadow_case const c{8, 4, 16, 2, 8, std::vector<std::int64_t>(8, 64), 0.0, true};
  auto const in = make_shadow_inputs<float>(c);
  std::vector<layer_result<float>> want(8);
  rank_io io(c, in);
  std::vector<scale_bias_experts<float>> rank_experts;
  for (std::int32_t r = 0; r < 8; ++r) rank_experts.emplace_back(r, 2, c.hidden, c.exact);
  // example-begin readme-hybridep
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    // 2 data centres of one node of 4 ranks: topology(ranks, ranks_per_node, nodes_per_domain)
    moecomm::exchange_groups groups(comm, moecomm::topology(8, 4, /*nodes_per_domain=*/1));
    // expert domains of 2 ranks, one in each data centre: experts cross the slow link, tokens stay home
    moecomm::hybridep_layer<float, moecomm::host_backend, moecomm::inproc_communicator> layer(
        moecomm::host_backend{}, groups, /*num_experts=*/16, /*hidden=*/8, moecomm::hybridep{/*expert_domain=*/2});
    auto& experts = rank_experts[comm.rank()];  // parametric: the layer moves their parameters
    layer.begin_expert_gather(experts);         // in the background, while ...
    /* ... the caller's attention and dense FFN run here ... */
    layer.forward(io.routing(comm.rank()), io.x(comm.rank()), io.out(comm.rank()), experts);
    layer.backward(io.d_out(comm.rank()), io.d_x(comm.rank()), io.d_w(comm.rank()), experts);
  });
  // example-end readme-hybridep
  moecomm::inproc_world const reference(8);
  reference.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4, 1));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator> plain(moecomm::host_backend{},
                                                                                                      groups, 16, c.hidden);
    want[comm.rank()] = run_step(plain, comm.rank(), c, in);
  });
  for (std::int32_t r = 0; r < 8; ++r) {
    io.got[r].grads = rank_experts[r].grads;
    check_same_result(io.got[r], want[r], r, c);
  }
}

}  // namespace test
