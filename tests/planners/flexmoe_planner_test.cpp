// SPDX-License-Identifier: Apache-2.0
// FlexMoE's replica placement planner (planners/flexmoe_planner.hpp): hand-worked decisions (below the
// threshold, a hot expert expanded, costs against the interval, full rows and replaces), 600 random
// placements checked against a from-scratch oracle of the model (every move legal, every greedy
// step a strict gain worth its cost, the predictions exact, the same decision twice), and errors
// that name the argument or the move.

#include "../support/test_support.hpp"

#include <moecomm/planners/flexmoe_planner.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace test {

using moecomm::flexmoe_planner_options;
using moecomm::flexmoe_planner_workspace;
using moecomm::placement_decision;
using moecomm::replica_move;
using moecomm::replica_move_kind;
using moecomm::replica_placement;

replica_move expand(std::int32_t e, std::int32_t to) { return {replica_move_kind::expand, e, -1, to}; }
replica_move shrink(std::int32_t e, std::int32_t from) { return {replica_move_kind::shrink, e, from, -1}; }
replica_move migrate(std::int32_t e, std::int32_t from, std::int32_t to) { return {replica_move_kind::migrate, e, from, to}; }

// The model from the slot table alone: replica counts from the slots, L_g summed over the rank's
// slots in ascending local index (the planner's order, so the doubles compare exactly).
std::vector<double> oracle_rank_loads(std::int32_t R, std::int32_t S, std::vector<std::int32_t> const& slots,
                                      std::vector<std::int64_t> const& load) {
  std::vector<std::int32_t> count(load.size(), 0);
  for (std::int32_t e : slots)
    if (e >= 0) ++count[static_cast<std::size_t>(e)];
  std::vector<double> L(static_cast<std::size_t>(R), 0.0);
  for (std::int32_t g = 0; g < R; ++g)
    for (std::int32_t l = 0; l < S; ++l)
      if (std::int32_t const e = slots[static_cast<std::size_t>(g * S + l)]; e >= 0)
        L[static_cast<std::size_t>(g)] += static_cast<double>(load[static_cast<std::size_t>(e)]) / count[static_cast<std::size_t>(e)];
  return L;
}

double busiest(std::vector<double> const& L) { return *std::max_element(L.begin(), L.end()); }

double oracle_imbalance(std::vector<double> const& L, std::vector<std::int64_t> const& load) {
  double total = 0;
  for (std::int64_t x : load) total += static_cast<double>(x);
  return total > 0 ? busiest(L) / (total / static_cast<double>(L.size())) : 1.0;
}

// Everything a decision promises, from scratch: the moves apply (apply_replica_moves validates
// each) to the slot table reported; the predictions are the oracle's; not triggered means nothing
// moves; every greedy step (a replace is a shrink and the expand onto the shrinking rank) lowers
// the predicted step time and gains more over the interval than it costs.
void check_decision(replica_placement const& current, std::vector<std::int64_t> const& load, flexmoe_planner_options const& o,
                    placement_decision const& d) {
  std::int32_t const R = current.num_ranks(), S = current.slots_per_rank();
  replica_placement const after = moecomm::apply_replica_moves(current, d.moves);
  REQUIRE(after.slot_experts() == d.slot_expert_after);

  std::vector<double> const L0 = oracle_rank_loads(R, S, current.slot_experts(), load);
  std::vector<double> const L1 = oracle_rank_loads(R, S, d.slot_expert_after, load);
  CHECK(d.rank_load_before == L0);
  CHECK(d.rank_load_after == L1);
  CHECK(d.step_seconds_before == busiest(L0) * o.seconds_per_row);
  CHECK(d.step_seconds_after == busiest(L1) * o.seconds_per_row);
  CHECK(d.imbalance_before == oracle_imbalance(L0, load));
  CHECK(d.imbalance_after == oracle_imbalance(L1, load));
  CHECK(d.triggered == (d.imbalance_before > o.imbalance_threshold));
  CHECK(d.step_seconds_after <= d.step_seconds_before);
  CHECK(d.moves.size() <= static_cast<std::size_t>(o.max_moves));
  if (!d.triggered) {
    CHECK(d.moves.empty());
    CHECK(d.step_seconds_after == d.step_seconds_before);
  }

  double const per_copy = o.bytes_per_replica / o.move_bytes_per_second;
  std::vector<std::int32_t> slots = current.slot_experts();
  std::int32_t steps = 0;
  for (std::size_t i = 0; i < d.moves.size(); ++i) {
    CAPTURE(i);
    double const before = busiest(oracle_rank_loads(R, S, slots, load)) * o.seconds_per_row;
    // The imbalance before each step was above the threshold.
    CHECK(oracle_imbalance(oracle_rank_loads(R, S, slots, load), load) > o.imbalance_threshold);
    std::size_t const last = d.moves[i].kind == replica_move_kind::shrink ? i + 1 : i;
    REQUIRE(last < d.moves.size());
    if (last > i) {  // a replace: the expand fills the slot the shrink freed
      CHECK(d.moves[last].kind == replica_move_kind::expand);
      CHECK(d.moves[last].to_rank == d.moves[i].from_rank);
    }
    for (; i <= last; ++i) {
      replica_move const& m = d.moves[i];
      std::int32_t const l = current.local_index_of(m.expert);
      if (m.from_rank >= 0) slots[static_cast<std::size_t>(m.from_rank * S + l)] = -1;
      if (m.to_rank >= 0) slots[static_cast<std::size_t>(m.to_rank * S + l)] = m.expert;
    }
    i = last;
    double const after_step = busiest(oracle_rank_loads(R, S, slots, load)) * o.seconds_per_row;
    CHECK(after_step < before);
    CHECK((before - after_step) * o.interval_steps - per_copy > 0);
    ++steps;
  }
  CHECK(slots == d.slot_expert_after);
  CHECK(d.move_seconds == steps * per_copy);
  CHECK(d.bytes_moved == std::llround(steps * o.bytes_per_replica));
}

placement_decision plan(replica_placement const& current, std::vector<std::int64_t> const& load, flexmoe_planner_options const& o = {}) {
  placement_decision d = moecomm::plan_replica_moves(current, load, o);
  check_decision(current, load, o, d);
  return d;
}

// 4 ranks x 2 slots, 6 experts, rank 3 empty: experts 0, 2, 4 in row 0, the others in row 1.
replica_placement skewed_placement() { return replica_placement(6, 4, 2, {0, 1, 2, 3, 4, 5, -1, -1}); }
std::vector<std::int64_t> const skewed_loads{100, 10, 10, 10, 10, 10};

TEST_CASE("flexmoe_planner: below the threshold nothing moves") {
  flexmoe_planner_options o;
  o.imbalance_threshold = 3;  // L = {110, 20, 20, 0}, mean 37.5: imbalance 2.93
  placement_decision const d = plan(skewed_placement(), skewed_loads, o);
  CHECK_FALSE(d.triggered);
  CHECK(d.imbalance_before == doctest::Approx(110 / 37.5));
  CHECK(d.moves.empty());
  CHECK(d.imbalance_after == d.imbalance_before);
  CHECK(d.slot_expert_after == skewed_placement().slot_experts());
  CHECK(d.bytes_moved == 0);

  // Uniform loads on a balanced placement; no tokens at all.
  replica_placement const balanced = replica_placement::contiguous(16, 8);
  placement_decision const uniform = plan(balanced, std::vector<std::int64_t>(16, 10));
  CHECK_FALSE(uniform.triggered);
  CHECK(uniform.imbalance_before == 1);
  CHECK(uniform.moves.empty());
  placement_decision const idle = plan(balanced, std::vector<std::int64_t>(16, 0));
  CHECK_FALSE(idle.triggered);
  CHECK(idle.imbalance_before == 1);
  CHECK(idle.step_seconds_before == 0);
  CHECK(idle.moves.empty());
}

TEST_CASE("flexmoe_planner: a hot expert expands onto the idle rank") {
  // L = {110, 20, 20, 0}. Expert 0 (100 per replica) goes to rank 3's free row-0 slot: {60, 20, 20, 50}.
  // Expert 0 then has no target (row 0 full, nothing else replicated there); the next hottest, expert 1,
  // fills rank 3's row-1 slot: {55, 20, 20, 55}. Both rows are now full and only experts 0 and 1 have a
  // second replica: no replace or migration lowers the top.
  placement_decision const d = plan(skewed_placement(), skewed_loads);
  CHECK(d.triggered);
  CHECK(d.moves == std::vector<replica_move>{expand(0, 3), expand(1, 3)});
  CHECK(d.rank_load_after == std::vector<double>{55, 20, 20, 55});
  CHECK(d.imbalance_after < d.imbalance_before);
  CHECK(d.imbalance_after == doctest::Approx(55 / 37.5));
  CHECK(d.step_seconds_before == doctest::Approx(110e-6));
  CHECK(d.step_seconds_after == doctest::Approx(55e-6));
  replica_placement const after = moecomm::apply_replica_moves(skewed_placement(), d.moves);
  CHECK(after.replica_count(0) == 2);
  CHECK(after.replica_count(1) == 2);
  CHECK(after.local_index_of(1) == 1);

  // max_moves caps the decision.
  flexmoe_planner_options one;
  one.max_moves = 1;
  CHECK(plan(skewed_placement(), skewed_loads, one).moves == std::vector<replica_move>{expand(0, 3)});
  one.max_moves = 0;
  placement_decision const none = plan(skewed_placement(), skewed_loads, one);
  CHECK(none.triggered);
  CHECK(none.moves.empty());
}

TEST_CASE("flexmoe_planner: a migration when no expansion helps") {
  // Rank 0 holds two warm experts, rank 1 nothing. Expanding the hottest (expert 0, the lower of a
  // tie) onto rank 1 gives {75, 25}; migrating either gives {50, 50}, the better step (expert 0 again
  // the lower of a tie).
  replica_placement const p(2, 2, 2, {0, 1, -1, -1});
  placement_decision const d = plan(p, {50, 50});
  CHECK(d.moves.front() == migrate(0, 0, 1));
  CHECK(d.moves.size() == 1);
  CHECK(d.rank_load_after == std::vector<double>{50, 50});
  CHECK(d.imbalance_after == 1);
}

TEST_CASE("flexmoe_planner: a move whose cost exceeds its gain over the interval is not made") {
  // Gains: the first expansion 50 rows (50 µs), the second 5 rows (5 µs); a copy costs 1 ms.
  flexmoe_planner_options o;
  o.bytes_per_replica = 1e6;
  o.move_bytes_per_second = 1e9;
  o.interval_steps = 1;  // 50 µs < 1 ms
  placement_decision const short_interval = plan(skewed_placement(), skewed_loads, o);
  CHECK(short_interval.triggered);
  CHECK(short_interval.moves.empty());
  CHECK(short_interval.step_seconds_after == short_interval.step_seconds_before);
  o.interval_steps = 50;  // 2.5 ms > 1 ms, then 0.25 ms < 1 ms
  placement_decision const fifty = plan(skewed_placement(), skewed_loads, o);
  CHECK(fifty.moves == std::vector<replica_move>{expand(0, 3)});
  CHECK(fifty.bytes_moved == 1000000);
  CHECK(fifty.move_seconds == doctest::Approx(1e-3));
  o.interval_steps = 1000;  // both pay
  CHECK(plan(skewed_placement(), skewed_loads, o).moves == std::vector<replica_move>{expand(0, 3), expand(1, 3)});
  // A huge replica over a slow link: no interval of 1000 steps pays for it.
  o.bytes_per_replica = 1e12;
  o.move_bytes_per_second = 1e6;
  placement_decision const dear = plan(skewed_placement(), skewed_loads, o);
  CHECK(dear.triggered);
  CHECK(dear.moves.empty());
}

TEST_CASE("flexmoe_planner: full rows replace a cold replica; the last replica stays") {
  // One slot per rank, all full: expert 2 holds ranks 2 and 3. L = {100, 10, 5, 5}. Expert 0 has no
  // free slot, so expert 2 (the coldest replicated, 5 per replica) shrinks on its least-loaded holder
  // (rank 2, the lower of a tie) and expert 0 expands there: {50, 10, 50, 10}.
  replica_placement const p(3, 4, 1, {0, 1, 2, 2});
  placement_decision const d = plan(p, {100, 10, 10});
  CHECK(d.moves == std::vector<replica_move>{shrink(2, 2), expand(0, 2)});
  CHECK(d.rank_load_after == std::vector<double>{50, 10, 50, 10});
  CHECK(d.bytes_moved == 0);  // bytes_per_replica defaults to 0
  replica_placement const after = moecomm::apply_replica_moves(p, d.moves);
  CHECK(after.replica_count(0) == 2);
  CHECK(after.replica_count(1) == 1);
  CHECK(after.replica_count(2) == 1);

  // No expert has a second replica to give up: nothing moves, however imbalanced.
  replica_placement const single(4, 4, 1, {0, 1, 2, 3});
  placement_decision const stuck = plan(single, {100, 1, 1, 1});
  CHECK(stuck.triggered);
  CHECK(stuck.moves.empty());

  // A replace takes two moves: with one left it is not made.
  flexmoe_planner_options one;
  one.max_moves = 1;
  CHECK(plan(p, {100, 10, 10}, one).moves.empty());
}

// ---- random instances ------------------------------------------------------------------------

struct instance {
  replica_placement placement;
  std::vector<std::int64_t> load;
  flexmoe_planner_options options;
};

// R in 2..16, S in 1..4; row by row, experts of 1..4 replicas on distinct shuffled ranks, some
// slots left empty; Zipf-like loads over a shuffled popularity order, some experts without tokens.
instance random_instance(std::mt19937& rng) {
  auto const uniform = [&](std::int32_t lo, std::int32_t hi) { return std::uniform_int_distribution<std::int32_t>(lo, hi)(rng); };
  std::int32_t const R = uniform(2, 16), S = uniform(1, 4);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(R * S), -1), ranks(static_cast<std::size_t>(R));
  std::iota(ranks.begin(), ranks.end(), 0);
  std::int32_t E = 0;
  double const empty = std::uniform_real_distribution<double>(0, 0.4)(rng);
  for (std::int32_t l = 0; l < S; ++l) {
    std::shuffle(ranks.begin(), ranks.end(), rng);
    for (std::int32_t next = 0; next < R;) {
      if (E > 0 && std::bernoulli_distribution(empty)(rng)) {
        ++next;
        continue;
      }
      std::int32_t const count = std::min(uniform(1, 4), R - next);
      for (std::int32_t j = 0; j < count; ++j) slots[static_cast<std::size_t>(ranks[static_cast<std::size_t>(next++)] * S + l)] = E;
      ++E;
    }
  }
  std::vector<std::int32_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  double const s = std::uniform_real_distribution<double>(0.0, 2.5)(rng);
  double const scale = std::uniform_int_distribution<std::int32_t>(10, 100000)(rng);
  std::vector<std::int64_t> load(static_cast<std::size_t>(E));
  for (std::size_t i = 0; i < order.size(); ++i)
    load[static_cast<std::size_t>(order[i])] = rng() % 8 == 0 ? 0 : std::llround(scale / std::pow(static_cast<double>(i + 1), s));

  flexmoe_planner_options o;
  o.imbalance_threshold = std::vector<double>{1.0, 1.05, 1.1, 1.5}[rng() % 4];
  o.interval_steps = std::vector<std::int32_t>{1, 10, 50, 1000}[rng() % 4];
  o.bytes_per_replica = std::vector<double>{0, 1e4, 1e6, 1e8}[rng() % 4];
  o.max_moves = std::vector<std::int32_t>{0, 1, 2, 5, 64}[rng() % 5];
  return {replica_placement(E, R, S, std::move(slots)), std::move(load), o};
}

void check_same(placement_decision const& a, placement_decision const& b) {
  CHECK(a.triggered == b.triggered); CHECK(a.moves == b.moves);
  CHECK(a.slot_expert_after == b.slot_expert_after); CHECK(a.rank_load_after == b.rank_load_after);
  CHECK(a.step_seconds_after == b.step_seconds_after); CHECK(a.imbalance_after == b.imbalance_after);
  CHECK(a.bytes_moved == b.bytes_moved);
}

TEST_CASE("flexmoe_planner: random placements, every decision legal, gainful and reproducible") {
  std::mt19937 rng(20230403);
  placement_decision reused;
  flexmoe_planner_workspace workspace;  // dirty from the instance before
  int triggered = 0, moved = 0, replaced = 0, migrated = 0;
  for (int i = 0; i < 600; ++i) {
    CAPTURE(i);
    instance const c = random_instance(rng);
    placement_decision const d = plan(c.placement, c.load, c.options);
    moecomm::plan_replica_moves(c.placement, c.load, c.options, reused, workspace);
    check_same(d, reused);
    triggered += d.triggered;
    moved += !d.moves.empty();
    for (replica_move const& m : d.moves) {
      replaced += m.kind == replica_move_kind::shrink;
      migrated += m.kind == replica_move_kind::migrate;
    }
  }
  // The instances exercise every kind of move.
  CHECK(triggered > 300);
  CHECK(moved > 150);
  CHECK(replaced > 50);
  CHECK(migrated > 50);
}

// ---- errors ----------------------------------------------------------------------------------

TEST_CASE("flexmoe_planner: errors name the argument") {
  using moecomm::status;
  replica_placement const p = skewed_placement();
  auto const run = [&](std::vector<std::int64_t> const& load, flexmoe_planner_options const& o) {
    return [&p, load, o] { (void)moecomm::plan_replica_moves(p, load, o); };
  };
  flexmoe_planner_options const ok;
  check_error(run({1, 2, 3, 4, 5}, ok), status::invalid_argument,
              {"moecomm::plan_replica_moves: expert_loads has 5 entries, the placement has 6 experts"});
  check_error(run({1, 2, -3, 4, 5, 6}, ok), status::invalid_argument, {"expert_loads[2] = -3 is negative"});
  check_error([&] { (void)moecomm::plan_replica_moves(p, moecomm::array_view<std::int64_t const>(nullptr, 6), ok); },
              status::invalid_argument, {"expert_loads is null"});
  double const nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  auto const with = [&](auto set) {
    flexmoe_planner_options o;
    set(o);
    return run(skewed_loads, o);
  };
  check_error(with([](auto& o) { o.imbalance_threshold = 0.9; }), status::invalid_argument, {"options.imbalance_threshold = 0.9"});
  check_error(with([&](auto& o) { o.imbalance_threshold = nan; }), status::invalid_argument, {"options.imbalance_threshold = nan"});
  check_error(with([](auto& o) { o.interval_steps = 0; }), status::invalid_argument, {"options.interval_steps = 0"});
  check_error(with([](auto& o) { o.seconds_per_row = 0; }), status::invalid_argument, {"options.seconds_per_row = 0"});
  check_error(with([&](auto& o) { o.seconds_per_row = inf; }), status::invalid_argument, {"options.seconds_per_row = inf"});
  check_error(with([](auto& o) { o.bytes_per_replica = -1; }), status::invalid_argument, {"options.bytes_per_replica = -1"});
  check_error(with([&](auto& o) { o.bytes_per_replica = inf; }), status::invalid_argument, {"options.bytes_per_replica = inf"});
  check_error(with([](auto& o) { o.move_bytes_per_second = 0; }), status::invalid_argument, {"options.move_bytes_per_second = 0"});
  check_error(with([&](auto& o) { o.move_bytes_per_second = nan; }), status::invalid_argument,
              {"options.move_bytes_per_second = nan"});
  check_error(with([](auto& o) { o.max_moves = -1; }), status::invalid_argument, {"options.max_moves = -1"});
  check_error(with([](auto& o) { o.bytes_per_replica = 1e18; }), status::invalid_argument,
              {"options.bytes_per_replica = 1e+18 times options.max_moves = 64 exceeds 2^62 bytes"});
  // Free moves are allowed: an infinite bandwidth, or nothing to copy.
  flexmoe_planner_options free_moves;
  free_moves.move_bytes_per_second = inf;
  CHECK(plan(p, skewed_loads, free_moves).move_seconds == 0);
}

TEST_CASE("flexmoe_planner: apply_replica_moves names the illegal move") {
  using moecomm::status;
  replica_placement const p = skewed_placement();  // {0, 1 | 2, 3 | 4, 5 | -, -}
  auto const apply = [&](std::vector<replica_move> const& moves) {
    return [&p, moves] { (void)moecomm::apply_replica_moves(p, moves); };
  };
  check_error(apply({expand(9, 3)}), status::invalid_argument,
              {"moecomm::apply_replica_moves: moves[0] (expand expert 9 to rank 3): expert 9 is not in [0, 6)"});
  check_error(apply({expand(0, 3), expand(2, 3)}), status::invalid_argument,
              {"moves[1] (expand expert 2 to rank 3): slot (rank 3, local 0) holds expert 0, not empty"});
  check_error(apply({expand(0, 0)}), status::invalid_argument, {"moves[0]", "slot (rank 0, local 0) holds expert 0"});
  check_error(apply({expand(0, 4)}), status::invalid_argument, {"moves[0]", "to_rank 4 is not a rank in [0, 4)"});
  check_error(apply({{replica_move_kind::expand, 0, 1, 3}}), status::invalid_argument, {"moves[0]", "from_rank must be -1"});
  check_error(apply({shrink(1, 0)}), status::invalid_argument,
              {"moves[0] (shrink expert 1 on rank 0): it would remove the last replica of expert 1"});
  check_error(apply({expand(0, 3), shrink(0, 0), shrink(0, 3)}), status::invalid_argument,
              {"moves[2] (shrink expert 0 on rank 3): it would remove the last replica of expert 0"});
  check_error(apply({expand(0, 3), shrink(0, 1)}), status::invalid_argument, {"moves[1]", "rank 1 does not hold expert 0"});
  check_error(apply({{replica_move_kind::shrink, 0, 0, 3}}), status::invalid_argument, {"moves[0]", "to_rank must be -1"});
  check_error(apply({migrate(1, 1, 3)}), status::invalid_argument,
              {"moves[0] (migrate expert 1 from rank 1 to rank 3): rank 1 does not hold expert 1"});
  check_error(apply({migrate(1, 0, 2)}), status::invalid_argument, {"slot (rank 2, local 1) holds expert 5, not empty"});
  check_error(apply({migrate(1, -1, 3)}), status::invalid_argument, {"from_rank -1 is not a rank in [0, 4)"});
  check_error(apply({{static_cast<replica_move_kind>(7), 0, -1, 3}}), status::invalid_argument, {"moves[0]", "unknown kind 7"});
  // Legal sequences apply: a migration, then a replace into the slot it freed.
  std::vector<replica_move> const legal{migrate(1, 0, 3), expand(3, 0)};
  replica_placement const q = moecomm::apply_replica_moves(p, legal);
  CHECK(q.slot_experts() == std::vector<std::int32_t>{0, 3, 2, 3, 4, 5, -1, 1});
  CHECK(q.replica_count(3) == 2);
}

}  // namespace test
