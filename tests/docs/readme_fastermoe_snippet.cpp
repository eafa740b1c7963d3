// SPDX-License-Identifier: Apache-2.0
// README's FasterMoE snippet (between the markers), run on 8 in-process ranks and checked against
// plain expert parallelism on the same inputs (tests/patterns/shadow_cases.hpp).

#include "../patterns/shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>

namespace test {

TEST_CASE("README FasterMoE snippet runs") {
  std::int64_t const H = 16;
  shadow_case const c{8, 4, 16, 2, H, {64, 64, 0, 17, 64, 3, 64, 40}, 1.2, true};
  auto const in = make_shadow_inputs<float>(c);
  moecomm::fastermoe_cost_params const model = small_model();  // a slow GEMM: hot experts are worth shadowing
  std::vector<layer_result<float>> got(8), want(8);
  std::vector<std::vector<std::int32_t>> shadowed(8);
  // example-begin readme-fastermoe
  using fastermoe = moecomm::fastermoe_shadowing<>;  // Algorithm 1 every step; replicas point to point
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H,
                                                            moecomm::smart_schedule{/*group_size=*/4}, fastermoe{model});
    got[comm.rank()] = run_step(layer, comm.rank(), c, in);  // forward + backward with parametric experts
    shadowed[comm.rank()] = layer.shadow_state().decision().shadowed;  // this step's hot experts
  });
  // example-end readme-fastermoe
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator> plain(
        moecomm::host_backend{}, groups, 16, H);
    want[comm.rank()] = run_step(plain, comm.rank(), c, in);
  });
  CHECK_FALSE(shadowed[0].empty());
  for (std::int32_t r = 0; r < 8; ++r) check_same_result(got[r], want[r], r, c);
}

}  // namespace test
