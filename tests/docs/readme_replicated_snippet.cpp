// SPDX-License-Identifier: Apache-2.0
// README's replicated-experts snippet (between the markers), run on 8 in-process ranks and checked
// against plain expert parallelism on the same inputs, bit for bit (replicated_cases.hpp).

#include "../patterns/replicated_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/patterns/flexmoe.hpp>
#include <moecomm/patterns/layer_policies.hpp>
#include <moecomm/patterns/replicated_experts.hpp>

namespace test {

TEST_CASE("README replicated experts snippet runs") {
  shadow_case const c{8, 4, 16, 2, 8, {80, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};
  auto const in = make_shadow_inputs<float>(c);
  rank_io io(c, in);
  std::vector<std::int64_t> busiest(8);
  std::vector<double> expected_load;
  for (std::int32_t e = 0; e < 16; ++e) expected_load.push_back(1.0 / std::pow(e + 1.0, 1.2));
  // example-begin readme-replicated
  // 8 ranks x 4 expert slots for 16 experts: hot experts get more replicas, each on one local index
  auto const placement = moecomm::replica_placement::from_loads(/*ranks=*/8, /*slots_per_rank=*/4, expected_load, /*seed=*/1);
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    // finemoe_split: the exact min-max split of every expert's tokens over its replicas (FineMoE);
    // even_split: FlexMoE's
    moecomm::replicated_expert_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::finemoe_split> layer(
        moecomm::host_backend{}, groups, placement, /*hidden=*/8);
    auto experts = slot_experts(placement, comm.rank(), 8);  // slot l holds expert placement.expert_at(rank, l)
    layer.forward(io.routing(comm.rank()), io.x(comm.rank()), io.out(comm.rank()), experts);
    layer.backward(io.d_out(comm.rank()), io.d_x(comm.rank()), io.d_w(comm.rank()), experts);
    busiest[comm.rank()] = layer.report().busiest_rank_rows;  // the min-max bound
  });
  // example-end readme-replicated
  moecomm::inproc_world const reference(8);
  std::vector<layer_result<float>> want(8);
  reference.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator> plain(moecomm::host_backend{},
                                                                                                      groups, 16, c.hidden);
    want[comm.rank()] = run_step(plain, comm.rank(), c, in);
  });
  for (std::int32_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    check_bitwise(io.got[r].out, want[r].out, c.hidden, "out");
    check_bitwise(io.got[r].d_x, want[r].d_x, c.hidden, "d_x");
    check_bitwise(io.got[r].d_w, want[r].d_w, 1, "d_weights");
    CHECK(busiest[r] == busiest[0]);
  }
}

TEST_CASE("README flexmoe snippet runs") {
  shadow_case const c{8, 4, 16, 2, 8, {64, 64, 64, 64, 64, 64, 64, 64}, 2.0, true};
  auto const in = make_shadow_inputs<float>(c);
  rank_io io(c, in);
  std::vector<std::size_t> moves(8);
  // example-begin readme-flexmoe
  // The trainer's optimizer state per expert slot (here SGD's momentum), moved with the parameters
  struct momentum {
    std::vector<float> m = std::vector<float>(4 * 16);
    std::int64_t state_count() const { return 16; }  // elements per slot
    float* state(std::int32_t slot) { return m.data() + slot * 16; }
  };
  moecomm::flexmoe_planner_options planner;  // when a move pays off (plan/flexmoe_planner.hpp)
  planner.interval_steps = 50;               // its gain counts over the rebalancing interval ...
  planner.bytes_per_replica = 1e6;           // ... against parameters + optimizer state / bandwidth
  auto const start = moecomm::replica_placement::cyclic(/*ranks=*/8, /*slots_per_rank=*/4, /*replicas=*/2);
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*experts=*/16, /*hidden=*/8,
                                                            moecomm::flexmoe{start, {}, {planner}});
    auto experts = slot_experts(start, comm.rank(), 8);
    momentum optimizer_state;
    layer.forward(io.routing(comm.rank()), io.x(comm.rank()), io.out(comm.rank()), experts);
    layer.backward(io.d_out(comm.rank()), io.d_x(comm.rank()), io.d_w(comm.rank()), experts);
    // ... the optimizer's step; then, every interval, replicas move where the loads seen since call for them
    moecomm::placement_decision const& plan = layer.rebalance(experts, optimizer_state);
    moves[comm.rank()] = plan.moves.size();  // expand, shrink, migrate: layer.placement() is the new one
  });
  // example-end readme-flexmoe
  CHECK(moves[0] > 0);
  for (std::int32_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(moves[r] == moves[0]);
  }
}

}  // namespace test
