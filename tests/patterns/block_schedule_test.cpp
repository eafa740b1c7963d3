// SPDX-License-Identifier: Apache-2.0
// Pro-Prophet's block-wise scheduler (patterns/block_schedule.hpp) over a stack of 4 MoE blocks on
// 8 in-process ranks, each block's output the next block's input: over three iterations the
// scheduled stack (transfers begun a block ahead, aggregation left running until the end of the
// backward) gives the unscheduled shadowed stack's outputs, input gradients and expert gradients
// bit for bit, and plain expert parallelism's outputs and input gradients.

#include "shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/block_schedule.hpp>

namespace test {
namespace {

constexpr std::int32_t blocks = 4;
shadow_case const stack_case{8, 4, 16, 2, 16, {40, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};

// One iteration of a stack of `layers` on rank `me`: forward through the blocks, backward in reverse.
// `before_forward(i)` and `after_backward()` are the schedule's hooks (or nothing).
template <class Layer, class Before, class After>
std::vector<layer_result<float>> iterate(std::vector<Layer*> const& layers, std::vector<scale_bias_experts<float>*> const& experts,
                                         std::int32_t me, shadow_inputs<float> const& in, Before&& before_forward,
                                         After&& after_backward) {
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  std::int64_t const T = r.tokens, H = stack_case.hidden;
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), T, r.top_k};
  std::vector<std::vector<float>> x(blocks + 1);
  x[0] = in.x[static_cast<std::size_t>(me)];
  std::vector<layer_result<float>> got(blocks);
  for (std::int32_t i = 0; i < blocks; ++i) {
    before_forward(i);
    x[static_cast<std::size_t>(i) + 1] = poisoned<float>(T * H);
    layers[static_cast<std::size_t>(i)]->forward(routing, {x[static_cast<std::size_t>(i)].data(), T, H},
                                                 {x[static_cast<std::size_t>(i) + 1].data(), T, H}, *experts[static_cast<std::size_t>(i)]);
    got[static_cast<std::size_t>(i)].out = x[static_cast<std::size_t>(i) + 1];
  }
  std::vector<float> d = in.d_out[static_cast<std::size_t>(me)];
  for (std::int32_t i = blocks - 1; i >= 0; --i) {
    auto& g = got[static_cast<std::size_t>(i)];
    g.d_x = poisoned<float>(T * H);
    g.d_w = poisoned<float>(T * r.top_k);
    layers[static_cast<std::size_t>(i)]->backward({d.data(), T, H}, {g.d_x.data(), T, H}, g.d_w, *experts[static_cast<std::size_t>(i)]);
    d = g.d_x;
  }
  after_backward();
  for (std::int32_t i = 0; i < blocks; ++i) {
    auto& e = *experts[static_cast<std::size_t>(i)];
    got[static_cast<std::size_t>(i)].grads = e.grads;
    std::fill(e.grads.begin(), e.grads.end(), 0.0f);
  }
  return got;
}

}  // namespace

TEST_CASE("block schedule: a scheduled stack of MoE blocks equals the unscheduled one bit for bit") {
  auto const in = make_shadow_inputs<float>(stack_case);
  using comm_t = moecomm::inproc_communicator;
  using shadowed_t = moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t, moecomm::dropless, moecomm::flat,
                                                    moecomm::weighted, moecomm::fastermoe_shadowing<>>;
  using plain_t = moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t>;
  moecomm::inproc_world const world(8, std::chrono::seconds(30));
  world.run([&](comm_t comm) {
    std::int32_t const me = comm.rank();
    CAPTURE(me);
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(8, 4));
    moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
    std::vector<std::unique_ptr<shadowed_t>> scheduled, unscheduled;
    std::vector<std::unique_ptr<plain_t>> plain;
    std::vector<scale_bias_experts<float>> experts(3 * blocks, scale_bias_experts<float>(me, 2, stack_case.hidden, true));
    std::vector<shadowed_t*> s_layers, u_layers;
    std::vector<plain_t*> p_layers;
    std::vector<scale_bias_experts<float>*> s_experts, u_experts, p_experts;
    for (std::int32_t i = 0; i < blocks; ++i) {
      scheduled.push_back(std::make_unique<shadowed_t>(moecomm::host_backend{}, groups, 16, stack_case.hidden, moecomm::dropless{},
                                                       moecomm::flat{}, moecomm::routing_checks{}, shadowing));
      unscheduled.push_back(std::make_unique<shadowed_t>(moecomm::host_backend{}, groups, 16, stack_case.hidden, moecomm::dropless{},
                                                         moecomm::flat{}, moecomm::routing_checks{}, shadowing));
      plain.push_back(std::make_unique<plain_t>(moecomm::host_backend{}, groups, 16, stack_case.hidden));
      s_layers.push_back(scheduled.back().get());
      u_layers.push_back(unscheduled.back().get());
      p_layers.push_back(plain.back().get());
      s_experts.push_back(&experts[static_cast<std::size_t>(i)]);
      u_experts.push_back(&experts[static_cast<std::size_t>(blocks + i)]);
      p_experts.push_back(&experts[static_cast<std::size_t>(2 * blocks + i)]);
    }
    moecomm::block_schedule<shadowed_t, scale_bias_experts<float>> schedule(s_layers, s_experts);
    auto const nothing = [](auto...) {};
    for (int iteration = 0; iteration < 3; ++iteration) {
      CAPTURE(iteration);
      auto const a = iterate(s_layers, s_experts, me, in, [&](std::int32_t i) { schedule.before_forward(i); },
                             [&] { schedule.finish_backward(); });
      auto const b = iterate(u_layers, u_experts, me, in, nothing, nothing);
      auto const p = iterate(p_layers, p_experts, me, in, nothing, nothing);
      for (std::int32_t i = 0; i < blocks; ++i) {
        CAPTURE(i);
        auto const& s = a[static_cast<std::size_t>(i)];
        auto const& u = b[static_cast<std::size_t>(i)];
        check_bitwise(s.out, u.out, stack_case.hidden, "scheduled block output vs unscheduled");
        check_bitwise(s.d_x, u.d_x, stack_case.hidden, "scheduled block input gradient vs unscheduled");
        check_bitwise(s.d_w, u.d_w, 1, "scheduled routing-weight gradient vs unscheduled");
        check_bitwise(s.grads, u.grads, 2 * stack_case.hidden, "scheduled expert gradients vs unscheduled");
        check_bitwise(s.out, p[static_cast<std::size_t>(i)].out, stack_case.hidden, "scheduled block output vs plain EP");
        check_bitwise(s.d_x, p[static_cast<std::size_t>(i)].d_x, stack_case.hidden, "scheduled input gradient vs plain EP");
      }
      CHECK(!scheduled[1]->shadow_state().decision().shadowed.empty());  // something was replicated
    }
  });
  CHECK_THROWS_AS((moecomm::block_schedule<shadowed_t, scale_bias_experts<float>>({}, {})), moecomm::error);
}

}  // namespace test
