// SPDX-License-Identifier: Apache-2.0
// FasterMoE shadowing over in-process ranks (4 as 2 x 2, 8 as 2 x 4): the shadowed layer equals
// plain expert parallelism (shadow_cases.hpp) for the sets Algorithm 1 picks on random and very
// skewed routing, for fixed sets (none, one, every expert) and for Pro-Prophet's planner's choice,
// across capacity policies, all-to-all algorithms, both replica paths, float and bf16 rows.

#include "shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/planners/proprophet_planner.hpp>

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

// With dyadic payloads and weights every product and partial sum is exact, so the per-rank sums of a
// deduplicated exchange (semantics §10a) give plain expert parallelism's bits: home slots, subsets
// and capacity compose with dedup (subsets: in the next test). Padding with home experts is refused by name.
TEST_CASE("FasterMoE: with a deduplicated exchange, shadowed equals plain on exact payloads, and padding with home experts is refused") {
  using dedup_flat = moecomm::dedup_per_rank<moecomm::flat>;
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  for (shadow_case const& c : {skewed4, skewed8, extreme8}) {
    CHECK(!run_equivalence<float>(c, shadowing, moecomm::dropless{}, dedup_flat{}, moecomm::flat{}).empty());
    run_equivalence<float>(c, shadowing, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}},
                           moecomm::dedup_per_rank<moecomm::hierarchical_2d>{}, moecomm::hierarchical_2d{});
    run_equivalence<float>(c, shadowing, moecomm::receiver_budget{60}, dedup_flat{}, moecomm::pairwise{1});
    run_equivalence<float>(c, shadowing, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}},
                           moecomm::dedup_per_node{4}, moecomm::flat{});
  }
  std::vector<std::int32_t> odd;
  for (std::int32_t e = 1; e < 16; e += 2) odd.push_back(e);
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_planner> const p2p{small_model(), {64}, {odd}};
  CHECK(run_equivalence<float>(skewed8, p2p, moecomm::dropless{}, dedup_flat{}, moecomm::flat{}) == odd);
  CHECK(run_equivalence<float>(skewed8, p2p, moecomm::dropless{}, moecomm::dedup_per_node{4}, moecomm::flat{}) == odd);
  for (bool per_node : {false, true}) {
    moecomm::capacity<moecomm::drop_by_position> const padded{1.0, 0, true, {}};
    auto run = [&] {
      if (per_node) run_equivalence<float>(skewed8, p2p, padded, moecomm::dedup_per_node{4}, moecomm::flat{});
      else run_equivalence<float>(skewed8, p2p, padded, dedup_flat{}, moecomm::flat{});
    };
    CHECK_THROWS_WITH(run(), doctest::Contains("a deduplicated exchange with pad_to_capacity and home experts is not supported"));
  }
}

// Subsets (Pro-Prophet's replicas): an expert replicated on no rank but its owner, on one rank, on
// every rank, or a mix; each rank computes its own tokens of an expert exactly where it holds it.
TEST_CASE("FasterMoE: replicas on subsets of the ranks give plain expert parallelism's result") {
  struct subsets_case {
    char const* name;
    fixed_subset_planner planner;
  };
  subsets_case const cases[] = {
      {"owner only", {{5, 0}, {0, 0, 0}, {}}},  // the decision's order need not ascend
      {"one rank", {{0, 5}, {0, 1, 2}, {3, 0}}},
      {"every rank", {{0}, {0, 7}, {1, 2, 3, 4, 5, 6, 7}}},
      {"mixed", {{0, 5, 9, 14}, {0, 3, 3, 10, 11}, {1, 2, 7, 0, 1, 2, 3, 5, 6, 7, 0}}},
  };
  for (subsets_case const& sc : cases) {
    CAPTURE(sc.name);
    using planner_t = fixed_subset_planner;
    moecomm::fastermoe_shadowing<moecomm::point_to_point_path, planner_t> const p2p{small_model(), {64}, sc.planner};
    auto const in = make_shadow_inputs<float>(skewed8);
    for (int variant = 0; variant < 5; ++variant) {
      CAPTURE(variant);
      std::vector<std::vector<std::int32_t>> home(8);
      moecomm::inproc_world const world(8, std::chrono::seconds(30));
      world.run([&](moecomm::inproc_communicator comm) {
        auto& mine = home[static_cast<std::size_t>(comm.rank())];
        if (variant == 0)
          mine = check_shadowed_equals_plain(comm, skewed8, in, p2p, moecomm::dropless{}, moecomm::pairwise{2}, moecomm::pairwise{2});
        else if (variant == 1)
          mine = check_shadowed_equals_plain(comm, skewed8, in, p2p, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}},
                                             moecomm::hierarchical_2d{}, moecomm::hierarchical_2d{});
        else if (variant == 2)
          mine = check_shadowed_equals_plain(comm, skewed8, in, p2p, moecomm::dropless{}, moecomm::smart_schedule{4}, moecomm::flat{});
        else if (variant == 3)  // exact payloads: the deduplicated exchange's per-rank sums are exact too
          mine = check_shadowed_equals_plain(comm, skewed8, in, p2p, moecomm::dropless{}, moecomm::dedup_per_rank<moecomm::flat>{},
                                             moecomm::flat{});
        else  // and its per-node sums
          mine = check_shadowed_equals_plain(comm, skewed8, in, p2p, moecomm::dropless{}, moecomm::dedup_per_node{4}, moecomm::flat{});
      });
      // Each rank computes at home exactly the experts it owns or holds a replica of.
      for (std::int32_t r = 0; r < 8; ++r) {
        std::vector<std::int32_t> want;
        for (std::size_t i = 0; i < sc.planner.shadowed.size(); ++i) {
          std::int32_t const e = sc.planner.shadowed[i];
          bool held = e / 2 == r;
          for (std::int32_t k = sc.planner.offsets[i]; k < sc.planner.offsets[i + 1]; ++k) held |= sc.planner.ranks[static_cast<std::size_t>(k)] == r;
          if (held) want.push_back(e);
        }
        std::sort(want.begin(), want.end());
        CAPTURE(r);
        CHECK(home[static_cast<std::size_t>(r)] == want);
      }
    }
  }
  // A subset that names a rank outside the group, the owner, or rank order backwards is refused before any exchange.
  for (fixed_subset_planner const& bad : {fixed_subset_planner{{0}, {0, 1}, {9}}, fixed_subset_planner{{0}, {0, 1}, {0}},
                                          fixed_subset_planner{{0}, {0, 2}, {3, 1}}, fixed_subset_planner{{0}, {0, 2}, {1}}}) {
    moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_subset_planner> const policy{small_model(), {}, bad};
    auto const in = make_shadow_inputs<float>(skewed8);
    moecomm::inproc_world const world(8, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4));
      moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::flat,
                                     moecomm::weighted, decltype(policy)>
          layer(moecomm::host_backend{}, groups, 16, skewed8.hidden, {}, {}, {}, policy);
      check_error([&] { (void)run_step(layer, comm.rank(), skewed8, in); }, moecomm::status::invalid_argument, {"subset"});
    });
  }
  // The collective path moves a subset's parameters over every rank (Pro-Prophet's global communicator): the same results.
  for (subsets_case const& sc : cases) {
    CAPTURE(sc.name);
    moecomm::fastermoe_shadowing<moecomm::collective_path, fixed_subset_planner> const collective{small_model(), {}, sc.planner};
    auto const in = make_shadow_inputs<float>(skewed8);
    moecomm::inproc_world const world(8, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      (void)check_shadowed_equals_plain(comm, skewed8, in, collective, moecomm::dropless{}, moecomm::pairwise{2}, moecomm::pairwise{2});
    });
  }
}

// Scheduled steps (Pro-Prophet's scheduler): plans made a step ahead, transfers and aggregation on
// the lane; the results are plain EP's, on every algorithm, with every-rank and subset replicas.
TEST_CASE("FasterMoE: scheduled steps (transfers and aggregation overlapped) equal plain expert parallelism") {
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_subset_planner> const subsets{
      small_model(), {}, {{0, 5, 9}, {0, 3, 3, 5}, {1, 2, 7, 0, 6}}};
  for (shadow_case const& c : {skewed8, extreme8}) {
    auto const in = make_shadow_inputs<float>(c);
    std::vector<std::vector<std::int32_t>> home(8);
    moecomm::inproc_world const world(8, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      home[static_cast<std::size_t>(comm.rank())] = check_scheduled_equals_plain(comm, c, in, shadowing, moecomm::flat{});
      (void)check_scheduled_equals_plain(comm, c, in, shadowing, moecomm::smart_schedule{4});
      (void)check_scheduled_equals_plain(comm, c, in, subsets, moecomm::pairwise{2});
    });
    CHECK_MESSAGE(!home[0].empty(), "nothing shadowed: the schedule would prove little");
  }
  // 4 ranks: Pro-Prophet's planner (its subsets), scheduled, on the smart schedule too.
  moecomm::proprophet_cost_params p;
  p.hidden = skewed4.hidden;
  p.balance_factor = 0;  // search until an expert repeats
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>> prophet{small_model(), {}, {}};
  prophet.planner.model = moecomm::proprophet_cost_model(p);
  auto const in4 = make_shadow_inputs<float>(skewed4);
  moecomm::inproc_world const world4(4, std::chrono::seconds(30));
  world4.run([&](moecomm::inproc_communicator comm) {
    (void)check_scheduled_equals_plain(comm, skewed4, in4, prophet, moecomm::flat{});
    (void)check_scheduled_equals_plain(comm, skewed4, in4, prophet, moecomm::smart_schedule{2});
  });
}

// A failure inside an overlapped transfer (an owner whose parameters are missing) ends every rank
// with an error, within the timeout.
TEST_CASE("FasterMoE: a failure inside a scheduled transfer ends every rank with an error") {
  struct vanishing_experts : scale_bias_experts<float> {
    using scale_bias_experts<float>::scale_bias_experts;
    bool gone = false;
    float* parameters(std::int32_t l) { return gone ? nullptr : scale_bias_experts<float>::parameters(l); }
  };
  moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
  auto const in = make_shadow_inputs<float>(skewed8);
  std::vector<int> failed(8, 0);
  moecomm::inproc_world const world(8, std::chrono::seconds(5));
  try {
    world.run([&](moecomm::inproc_communicator comm) {
      std::int32_t const me = comm.rank();
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(8, 4));
      moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::flat,
                                     moecomm::weighted, moecomm::fastermoe_shadowing<>>
          layer(moecomm::host_backend{}, groups, 16, skewed8.hidden, {}, {}, {}, shadowing);
      vanishing_experts experts(me, 2, skewed8.hidden, true);
      auto const& r = in.routing[static_cast<std::size_t>(me)];
      std::vector<float> out(static_cast<std::size_t>(r.tokens * skewed8.hidden)), d_x(out.size()), d_w(static_cast<std::size_t>(r.tokens * 2));
      try {
        for (int step = 0; step < 2; ++step) {
          if (step == 1) {  // the owner of a shadowed expert loses its parameters: its transfer fails on the lane
            auto const& shadowed = layer.shadow_state().decision().shadowed;
            REQUIRE(!shadowed.empty());
            experts.gone = me == shadowed.front() / 2;
          }
          layer.begin_replica_transfer(experts);
          layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, 16},
                        {out.data(), r.tokens, 16}, experts);
          layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, 16}, {d_x.data(), r.tokens, 16}, d_w, experts);
          layer.finish_replica_gradients();
        }
      } catch (moecomm::error const&) {
        failed[static_cast<std::size_t>(me)] = 1;
        throw;
      }
    });
    FAIL("no rank failed");
  } catch (moecomm::error const& e) {
    CAPTURE(e.what());
  }
  for (std::int32_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(failed[static_cast<std::size_t>(r)] == 1);
  }
}

// Pro-Prophet's planner as the policy's planner: its subsets (every rank but the owner and the one
// sending the fewest tokens) drive the layer, with plain expert parallelism's results.
TEST_CASE("FasterMoE: Pro-Prophet's planner and its subsets give plain expert parallelism's result") {
  moecomm::proprophet_cost_params p;
  p.hidden = skewed8.hidden;
  p.balance_factor = 0;  // search until an expert repeats
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>> policy{small_model(), {}, {}};
  policy.planner.model = moecomm::proprophet_cost_model(p);
  auto const in = make_shadow_inputs<float>(skewed8);
  std::vector<std::vector<std::int32_t>> home(8);
  moecomm::inproc_world const world(8, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    home[static_cast<std::size_t>(comm.rank())] =
        check_shadowed_equals_plain(comm, skewed8, in, policy, moecomm::dropless{}, moecomm::pairwise{4}, moecomm::pairwise{4});
  });
  // Something was replicated, and not everywhere: some rank computes an expert at home that another sends away.
  bool replicated = false, differs = false;
  for (auto const& h : home) {
    replicated |= !h.empty();
    differs |= h != home[0];
  }
  CHECK(replicated);
  CHECK(differs);
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

// Every rank runs the planner on the same counts, so ranks with different cost
// models would shadow different experts; the layer refuses at construction, naming the field. The
// layer's own configuration (experts, hidden) is agreed first.
TEST_CASE("FasterMoE: ranks that pass different cost models or hidden sizes are refused at construction, naming the field") {
  using comm_t = moecomm::inproc_communicator;
  using layer_t = moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t, moecomm::dropless, moecomm::flat,
                                                 moecomm::weighted, moecomm::fastermoe_shadowing<>>;
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](comm_t comm) {
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(4, 2));
    moecomm::fastermoe_shadowing<> shadowing{small_model(), {}, {}};
    if (comm.rank() == 3) shadowing.model.net_bandwidth *= 2;
    CAPTURE(comm.rank());
    check_error([&] { layer_t l(moecomm::host_backend{}, groups, 8, 16, {}, {}, {}, shadowing); }, moecomm::status::invalid_usage,
                {"fastermoe_shadowing: ranks disagree on the shadowing policy's cost model", "they differ in model.net_bandwidth"});
    shadowing.model.net_bandwidth = small_model().net_bandwidth;
    check_error([&] { layer_t l(moecomm::host_backend{}, groups, 8, comm.rank() == 1 ? 32 : 16, {}, {}, {}, shadowing); },
                moecomm::status::invalid_usage,
                {"expert_parallel_layer: ranks disagree on the layer's configuration", "they differ in hidden"});
    layer_t agreed(moecomm::host_backend{}, groups, 8, 16, {}, {}, {}, shadowing);  // the groups are still usable
  });
}

}  // namespace test
