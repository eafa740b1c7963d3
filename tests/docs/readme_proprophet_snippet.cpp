// SPDX-License-Identifier: Apache-2.0
// README's Pro-Prophet snippet (between the markers): a 2-block stack on 8 in-process ranks over
// three iterations, scheduled by block_schedule, each block's output checked against plain expert
// parallelism's bit for bit.

#include "../patterns/shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/block_schedule.hpp>
#include <moecomm/plan/proprophet_planner.hpp>

namespace test {

TEST_CASE("README Pro-Prophet snippet runs") {
  std::int64_t const H = 16;
  shadow_case const c{8, 4, 16, 2, H, {64, 64, 0, 17, 64, 3, 64, 40}, 1.2, true};
  auto const in = make_shadow_inputs<float>(c);
  std::vector<std::vector<float>> got(8), want(8);
  std::vector<std::int64_t> replicated(8);
  // Two blocks of the same routing, the first one's output the second one's input.
  auto const two_blocks = [&](auto& block0, auto& block1, auto& experts0, auto& experts1, std::int32_t me, auto&& before) {
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    moecomm::routing_view const routing{r.idx.data(), r.w.data(), r.tokens, r.top_k};
    std::vector<float> mid(static_cast<std::size_t>(r.tokens * H)), out(mid.size()), d_mid(mid.size()), d_x(mid.size());
    before(0);
    block0.forward(routing, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, H}, {mid.data(), r.tokens, H}, experts0);
    before(1);
    block1.forward(routing, {mid.data(), r.tokens, H}, {out.data(), r.tokens, H}, experts1);
    block1.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, H}, {d_mid.data(), r.tokens, H}, moecomm::not_needed, experts1);
    block0.backward({d_mid.data(), r.tokens, H}, {d_x.data(), r.tokens, H}, moecomm::not_needed, experts0);
    out.insert(out.end(), d_x.begin(), d_x.end());
    return out;
  };
  // example-begin readme-proprophet
  moecomm::proprophet_cost_params costs;  // Pro-Prophet's model: its code's bandwidths and GEMM rate
  costs.hidden = H;
  costs.balance_factor = 0.5;  // plan while max - min rows per rank >= half the mean (the code: 3)
  using prophet = moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>>;
  prophet policy{small_model(), {}, {}};  // (the FasterMoE model is unused by Pro-Prophet's planner)
  policy.planner.model = moecomm::proprophet_cost_model(costs);
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto block0 = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H, policy);
    auto block1 = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H, policy);
    scale_bias_experts<float> experts0(comm.rank(), 2, H, true), experts1 = experts0;
    // Each block's parameter transfers begin a block ahead; its gradient aggregation runs on until finish_backward
    moecomm::block_schedule<decltype(block0), scale_bias_experts<float>> schedule({&block0, &block1}, {&experts0, &experts1});
    for (int iteration = 0; iteration < 3; ++iteration) {
      got[comm.rank()] = two_blocks(block0, block1, experts0, experts1, comm.rank(),
                                    [&](std::int32_t block) { schedule.before_forward(block); });  // then attention, then forward
      schedule.finish_backward();  // the owners' gradients are whole: the optimizer may step
    }
    replicated[comm.rank()] = static_cast<std::int64_t>(block0.shadow_state().decision().subset_ranks.size());
  });
  // example-end readme-proprophet
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator> plain0(moecomm::host_backend{}, groups, 16, H),
        plain1(moecomm::host_backend{}, groups, 16, H);
    scale_bias_experts<float> experts0(comm.rank(), 2, H, true), experts1 = experts0;
    want[comm.rank()] = two_blocks(plain0, plain1, experts0, experts1, comm.rank(), [](std::int32_t) {});
  });
  CHECK(replicated[0] > 0);  // Pro-Prophet replicated something on a subset
  for (std::int32_t r = 0; r < 8; ++r) check_bitwise(got[r], want[r], H, "scheduled Pro-Prophet stack vs plain EP");
}

}  // namespace test
