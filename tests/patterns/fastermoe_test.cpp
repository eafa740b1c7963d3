// SPDX-License-Identifier: Apache-2.0
// FasterMoE shadowing over in-process ranks (4 as 2 x 2, 8 as 2 x 4): the shadowed layer equals
// plain expert parallelism (shadow_cases.hpp) for the sets Algorithm 1 picks on random and very
// skewed routing, for fixed sets (none, one, every expert) and for Pro-Prophet's planner's choice,
// across capacity policies, all-to-all algorithms, both replica paths, float and bf16 rows.

#include "shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/plan/proprophet_planner.hpp>

namespace test {

// Shadowed (with `algorithm`) against plain expert parallelism (with `plain_algorithm`) on every
// rank; returns the shadow set, checked to be the same on every rank.
template <class T, class Shadowing, class Capacity, class Algorithm, class PlainAlgorithm>
std::vector<std::int32_t> run_equivalence(shadow_case const& c, Shadowing const& shadowing, Capacity const& capacity,
                                          Algorithm const& algorithm, PlainAlgorithm const& plain_algorithm) {
  CAPTURE(c.ranks);
  CAPTURE(c.zipf);
  CAPTURE(c.exact);
  CAPTURE(Algorithm::name);
  CAPTURE(Capacity::name);
  auto const in = make_shadow_inputs<T>(c);
  std::vector<std::vector<std::int32_t>> home(static_cast<std::size_t>(c.ranks));
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    home[static_cast<std::size_t>(comm.rank())] =
        check_shadowed_equals_plain(comm, c, in, shadowing, capacity, algorithm, plain_algorithm);
  });
  for (auto const& h : home) CHECK(h == home[0]);  // every rank reached the same decision
  return home[0];
}

template <class T, class Shadowing, class Capacity, class Algorithm>
std::vector<std::int32_t> run_equivalence(shadow_case const& c, Shadowing const& shadowing, Capacity const& capacity,
                                          Algorithm const& algorithm) {
  return run_equivalence<T>(c, shadowing, capacity, algorithm, algorithm);
}

shadow_case const skewed4{4, 2, 8, 2, 16, {60, 45, 0, 70}, 1.2, true};
shadow_case const skewed8{8, 4, 16, 2, 16, {40, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};
shadow_case const extreme8{8, 4, 16, 1, 8, {50, 50, 50, 50, 50, 50, 50, 50}, 8.0, true};  // almost all to expert 0
shadow_case const uniform8{8, 4, 16, 2, 16, {64, 64, 64, 64, 64, 64, 64, 64}, 0.0, true};

TEST_CASE("FasterMoE: the layer with Algorithm 1's shadows equals plain expert parallelism") {
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  for (shadow_case const& c : {skewed4, skewed8, extreme8}) {
    auto const shadowed = run_equivalence<float>(c, shadowing, moecomm::dropless{}, moecomm::pairwise{1});
    CHECK_MESSAGE(!shadowed.empty(), "Algorithm 1 shadowed nothing on skewed routing; the test would prove little");
    run_equivalence<float>(c, shadowing, moecomm::dropless{}, moecomm::hierarchical_2d{});
    run_equivalence<float>(c, shadowing, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}}, moecomm::flat{});
    run_equivalence<float>(c, shadowing, moecomm::capacity<moecomm::drop_by_probability>{0.5, 0, true, {}},
                           moecomm::pairwise{2});
  }
  auto const extreme = run_equivalence<float>(extreme8, shadowing, moecomm::dropless{}, moecomm::flat{});
  CHECK(std::find(extreme.begin(), extreme.end(), 0) != extreme.end());  // the hot expert
}

TEST_CASE("FasterMoE: full-mantissa payloads and bf16 rows (parameter gradients within tolerance)") {
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  for (shadow_case c : {skewed4, skewed8, extreme8}) {
    c.exact = false;
    run_equivalence<float>(c, shadowing, moecomm::dropless{}, moecomm::flat{});
    run_equivalence<__nv_bfloat16>(c, shadowing, moecomm::dropless{}, moecomm::pairwise{1});
  }
}

TEST_CASE("FasterMoE: any shadow set, over either replica path, gives plain expert parallelism's result") {
  std::vector<std::int32_t> odd, all;
  for (std::int32_t e = 0; e < 16; ++e) {
    all.push_back(e);
    if (e % 2 == 1) odd.push_back(e);
  }
  for (auto const& set : {std::vector<std::int32_t>{}, std::vector<std::int32_t>{5}, odd, all}) {
    CAPTURE(set.size());
    moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_planner> const p2p{small_model(), {64}, {set}};
    moecomm::fastermoe_shadowing<moecomm::collective_path, fixed_planner> const collective{small_model(), {}, {set}};
    CHECK(run_equivalence<float>(skewed8, p2p, moecomm::dropless{}, moecomm::pairwise{4}) == set);
    CHECK(run_equivalence<float>(skewed8, collective, moecomm::capacity<moecomm::drop_random>{0.75, 0, true, {7, 0}},
                                 moecomm::hierarchical_2d{}) == set);
    CHECK(run_equivalence<float>(uniform8, p2p, moecomm::receiver_budget{100}, moecomm::flat{}) == set);
  }
}

// Pro-Prophet's planner has the policy's planner signature; the policy reads only the chosen
// experts (not their subsets) and replicates them on every rank, with plain EP's results.
TEST_CASE("FasterMoE: Pro-Prophet's planner as the policy's planner gives plain expert parallelism's result") {
  moecomm::proprophet_cost_params p;
  p.hidden = skewed8.hidden;
  p.balance_factor = 0;  // search until an expert repeats
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>> policy{small_model(), {}, {}};
  policy.planner.model = moecomm::proprophet_cost_model(p);
  CHECK(!run_equivalence<float>(skewed8, policy, moecomm::dropless{}, moecomm::pairwise{4}).empty());
}

TEST_CASE("FasterMoE: shadowing with the smart schedule equals plain pairwise expert parallelism") {
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  for (shadow_case const& c : {skewed4, skewed8, extreme8}) {
    for (std::int32_t group : {1, 2, 4}) {
      CAPTURE(group);
      run_equivalence<float>(c, shadowing, moecomm::dropless{}, moecomm::smart_schedule{group}, moecomm::pairwise{group});
    }
    run_equivalence<float>(c, shadowing, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, true, {}},
                           moecomm::smart_schedule{2}, moecomm::flat{});
  }
  shadow_case inexact = skewed8;
  inexact.exact = false;
  run_equivalence<__nv_bfloat16>(inexact, shadowing, moecomm::dropless{}, moecomm::smart_schedule{4}, moecomm::flat{});
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_planner> const none{small_model(), {}, {{}}};
  run_equivalence<float>(skewed8, none, moecomm::receiver_budget{100}, moecomm::smart_schedule{2}, moecomm::flat{});
}

TEST_CASE("FasterMoE: uniform routing shadows nothing; the planner never predicts a slower layer") {
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  CHECK(run_equivalence<float>(uniform8, shadowing, moecomm::dropless{}, moecomm::flat{}).empty());
  moecomm::inproc_world const world(8, std::chrono::seconds(30));
  auto const in = make_shadow_inputs<float>(skewed8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless,
                                   moecomm::flat, moecomm::weighted, moecomm::fastermoe_shadowing<>>
        layer(moecomm::host_backend{}, groups, 16, 16, {}, {}, {}, shadowing);
    run_step(layer, comm.rank(), skewed8, in);
    auto const& d = layer.shadow_state().decision();
    CHECK(d.latency <= d.latency_unshadowed);
    CHECK(*std::max_element(d.tokens.begin(), d.tokens.end()) <= *std::max_element(d.tokens_unshadowed.begin(), d.tokens_unshadowed.end()));
  });
}

}  // namespace test
