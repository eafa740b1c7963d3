// SPDX-License-Identifier: Apache-2.0
// Moving replicas (collectives/replica_migration.hpp, replicated_expert_layer::move_replicas) over 8
// in-process ranks: a layer whose replicas move between training steps (to a load-aware placement,
// to one replica per expert with empty slots, back to cyclic) trains exactly like one that never
// moved: the same outputs and gradients every step, and in the end every replica holds its
// expert's parameters and optimizer state (SGD with momentum), bit for bit (dyadic payloads, exact
// sums). A move that fails on one rank (a null optimizer state, ranks that disagree on the
// placement) leaves every rank's placement and slots as they were, and the layer goes on.

#include "replicated_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/collectives/replica_migration.hpp>
#include <moecomm/patterns/layer_policies.hpp>

#include <stdexcept>

namespace test {
namespace {

// SGD with momentum: state m per slot, m = m / 2 + g, p -= m / 8 (exact on dyadic values).
struct momentum_state {
  std::int64_t count;
  std::vector<float> m;
  momentum_state(std::int32_t slots, std::int64_t per_slot) : count(per_slot), m(static_cast<std::size_t>(slots * per_slot), 0.0f) {}
  [[nodiscard]] std::int64_t state_count() const { return count; }
  float* state(std::int32_t l) { return m.data() + l * count; }
};

void sgd_step(scale_bias_experts<float>& experts, momentum_state& state) {
  for (std::size_t i = 0; i < experts.params.size(); ++i) {
    state.m[i] = state.m[i] / 2 + experts.grads[i];
    experts.params[i] -= state.m[i] / 8;
    experts.grads[i] = 0;
  }
}

// A state whose slot pointers are missing: a failing move.
struct broken_state {
  [[nodiscard]] std::int64_t state_count() const { return 4; }
  [[nodiscard]] float* state(std::int32_t) const { return nullptr; }
};

// Optimizer state whose `state(l)` throws at its `throw_at`-th call (counted from 1): a caller's
// object that fails while the move reads it.
struct throwing_state : momentum_state {
  int throw_at, calls = 0;
  throwing_state(momentum_state const& s, int at) : momentum_state(s), throw_at(at) {}
  float* state(std::int32_t l) {
    if (++calls == throw_at) throw std::runtime_error("optimizer state unavailable");
    return momentum_state::state(l);
  }
};

// One replica per expert (expert e on rank e / 2, slot e % 2), slots 2 and 3 empty.
moecomm::replica_placement single_replicas() {
  std::vector<std::int32_t> slots(32, -1);
  for (std::int32_t e = 0; e < 16; ++e) slots[static_cast<std::size_t>((e / 2) * 4 + e % 2)] = e;
  return {16, 8, 4, std::move(slots)};
}

shadow_case const skewed{8, 4, 16, 2, 8, {80, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};

std::vector<double> zipf_loads(std::int32_t experts) {
  std::vector<double> loads;
  for (std::int32_t e = 0; e < experts; ++e) loads.push_back(1.0 / std::pow(e + 1.0, 1.2));
  return loads;
}

// The slot (rank, local) values of expert e in `placement`, from every rank's gathered slots.
std::vector<float> of_expert(std::vector<float> const& all, moecomm::replica_placement const& placement, std::int32_t e,
                             std::int64_t per_slot) {
  std::int32_t const rank = placement.replica_ranks()[static_cast<std::size_t>(placement.replica_offsets()[static_cast<std::size_t>(e)])];
  auto const first = all.begin() + (rank * placement.slots_per_rank() + placement.local_index_of(e)) * per_slot;
  return {first, first + per_slot};
}

}  // namespace

TEST_CASE("replica migration: the copies fill each new slot from the old replicas in turn, or from the rank itself") {
  // Before: expert 0 on ranks 0 and 1, expert 1 on rank 2, expert 2 on rank 3, all in slot 0.
  moecomm::replica_placement const from(3, 4, 2, {0, -1, 0, -1, 1, -1, 2, -1});
  // After: expert 0 in slot 0 everywhere, expert 1 in slot 1 of ranks 0-2, expert 2 in slot 1 of rank 3.
  moecomm::replica_placement const to(3, 4, 2, {0, 1, 0, 1, 0, 1, 0, 2});
  auto const copies = moecomm::replica_copies(from, to);
  REQUIRE(copies.size() == 6);
  auto check = [&](std::size_t i, std::int32_t e, std::int32_t from_rank, std::int32_t from_local, std::int32_t to_rank,
                   std::int32_t to_local) {
    CAPTURE(i);
    CHECK(copies[i].expert == e);
    CHECK(copies[i].from_rank == from_rank);
    CHECK(copies[i].from_local == from_local);
    CHECK(copies[i].to_rank == to_rank);
    CHECK(copies[i].to_local == to_local);
  };
  check(0, 1, 2, 0, 0, 1);  // expert 1's only old replica
  check(1, 1, 2, 0, 1, 1);
  check(2, 0, 0, 0, 2, 0);  // expert 0 from its old replicas, ranks 0 and 1, in turn
  check(3, 1, 2, 0, 2, 1);  // rank 2 held expert 1 itself (slot 0): a local copy
  check(4, 0, 1, 0, 3, 0);
  check(5, 2, 3, 0, 3, 1);  // rank 3 held expert 2 in slot 0
}

TEST_CASE("replica migration: a layer whose replicas move between steps trains exactly like one that never moved") {
  shadow_case const& c = skewed;
  auto const in = make_shadow_inputs<float>(c);
  moecomm::replica_placement const start = moecomm::replica_placement::cyclic(8, 4, 2);
  std::vector<moecomm::replica_placement> const moves = {moecomm::replica_placement::from_loads(8, 4, zipf_loads(16), 7),
                                                         single_replicas(), moecomm::replica_placement::cyclic(8, 4, 2)};
  using comm_t = moecomm::inproc_communicator;
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t, moecomm::even_split> still(
        moecomm::host_backend{}, groups, start, c.hidden);
    moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t, moecomm::finemoe_split> moving(
        moecomm::host_backend{}, groups, start, c.hidden);
    auto still_experts = slot_experts(start, me, c.hidden), moving_experts = still_experts;
    momentum_state still_state(4, 2 * c.hidden), moving_state(4, 2 * c.hidden);
    rank_io still_io(c, in), moving_io(c, in);
    for (std::size_t step = 0; step <= moves.size(); ++step) {
      CAPTURE(step);
      if (step > 0) {
        moecomm::replica_migration_stats const& moved = moving.move_replicas(moves[step - 1], moving_experts, moving_state);
        CHECK(moving.placement().expert_at(me, 0) == moves[step - 1].expert_at(me, 0));
        std::int32_t gained = 0;
        for (std::int32_t l = 0; l < 4; ++l) {
          std::int32_t const e = moves[step - 1].expert_at(me, l);
          gained += e >= 0 && (step == 1 ? start : moves[step - 2]).expert_at(me, l) != e;
        }
        CHECK(moved.slots_filled == gained);
        CHECK(moved.bytes_received <= gained * 2 * c.hidden * std::int64_t(2 * sizeof(float)));
      }
      for (auto* run : {&still_io, &moving_io}) {
        bool const is_still = run == &still_io;
        auto& experts = is_still ? still_experts : moving_experts;
        if (is_still) {
          still.forward(run->routing(me), run->x(me), run->out(me), experts);
          still.backward(run->d_out(me), run->d_x(me), run->d_w(me), experts);
        } else {
          moving.forward(run->routing(me), run->x(me), run->out(me), experts);
          moving.backward(run->d_out(me), run->d_x(me), run->d_w(me), experts);
        }
        sgd_step(experts, is_still ? still_state : moving_state);
      }
      auto const& a = still_io.got[static_cast<std::size_t>(me)];
      auto const& b = moving_io.got[static_cast<std::size_t>(me)];
      check_bitwise(b.out, a.out, c.hidden, "moved layer's output vs the unmoved one");
      check_bitwise(b.d_x, a.d_x, c.hidden, "moved layer's input gradient vs the unmoved one");
      check_bitwise(b.d_w, a.d_w, 1, "moved layer's routing-weight gradient vs the unmoved one");
    }
    // Every replica of the moved layer holds its expert's parameters and momentum, as the unmoved one.
    std::int64_t const per_slot = 2 * c.hidden, n = 4 * per_slot;
    std::vector<float> params(static_cast<std::size_t>(n * c.ranks)), state(params.size());
    groups.world().allgather(still_experts.params.data(), params.data(), n * std::int64_t(sizeof(float)));
    groups.world().allgather(still_state.m.data(), state.data(), n * std::int64_t(sizeof(float)));
    for (std::int32_t l = 0; l < 4; ++l) {
      std::int32_t const e = moving.placement().expert_at(me, l);
      if (e < 0) continue;
      CAPTURE(l);
      CAPTURE(e);
      std::vector<float> const p(moving_experts.params.begin() + l * per_slot, moving_experts.params.begin() + (l + 1) * per_slot);
      std::vector<float> const m(moving_state.m.begin() + l * per_slot, moving_state.m.begin() + (l + 1) * per_slot);
      check_bitwise(p, of_expert(params, start, e, per_slot), per_slot, "moved replica's parameters vs the unmoved expert's");
      check_bitwise(m, of_expert(state, start, e, per_slot), per_slot, "moved replica's momentum vs the unmoved expert's");
    }
  });
}

TEST_CASE("replica migration: a move that fails on one rank leaves every rank's placement and slots as they were") {
  shadow_case const& c = skewed;
  auto const in = make_shadow_inputs<float>(c);
  moecomm::replica_placement const start = moecomm::replica_placement::cyclic(8, 4, 2);
  moecomm::replica_placement const target = moecomm::replica_placement::from_loads(8, 4, zipf_loads(16), 7);
  using comm_t = moecomm::inproc_communicator;
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t> layer(moecomm::host_backend{}, groups, start,
                                                                                c.hidden);
    auto experts = slot_experts(start, me, c.hidden);
    momentum_state state(4, 2 * c.hidden);
    for (float& m : state.m) m = static_cast<float>(me) + 0.5f;
    auto const params_before = experts.params;
    auto const state_before = state.m;
    auto const unchanged = [&](char const* what) {
      CAPTURE(what);
      for (std::int32_t l = 0; l < 4; ++l) CHECK(layer.placement().expert_at(me, l) == start.expert_at(me, l));
      CHECK(experts.params == params_before);
      CHECK(state.m == state_before);
    };
    // Rank 3's optimizer state has no slots: it names the argument; the others learn that rank 3 refused.
    try {
      if (me == 3) {
        broken_state broken;
        (void)layer.move_replicas(target, experts, broken);
      } else {
        momentum_state wide(4, 4);  // same state_count as rank 3's claim, so only rank 3's check fails
        (void)layer.move_replicas(target, experts, wide);
      }
      FAIL("the move did not fail");
    } catch (moecomm::error const& e) {
      std::string const what = e.what();
      CAPTURE(what);
      CHECK(e.code() == (me == 3 ? moecomm::status::invalid_argument : moecomm::status::invalid_usage));
      CHECK(what.find(me == 3 ? "state.state(" : "rank 3 rejected") != std::string::npos);
    }
    unchanged("after a rejected argument");
    // Rank 2's state throws at its n-th call, for every n the move makes: every rank refuses, no
    // slot changes (the move reads the caller's objects once, before anything moves).
    for (int n = 1;; ++n) {
      CAPTURE(n);
      throwing_state flaky(state, me == 2 ? n : 0);
      bool moved = false;
      try {
        (void)layer.move_replicas(target, experts, flaky);
        moved = true;
      } catch (moecomm::error const& e) {
        std::string const what = e.what();
        CAPTURE(what);
        CHECK(what.find(me == 2 ? "optimizer state unavailable" : "rank 2 rejected") != std::string::npos);
      }
      int any_moved = moved ? 1 : 0, moves = 0;
      groups.world().allreduce(&any_moved, &moves, 1, moecomm::reduce_op::sum);
      if (moves > 0) {  // n is past the last call: every rank moved; move back for the next checks
        CHECK(moves == c.ranks);
        (void)layer.move_replicas(start, experts, state);
        state.m = state_before;  // the round trip moved peers' state into the slots; the checks below compare with the start
        break;
      }
      unchanged("after a throw while the move read the state");
    }
    // Ranks that disagree on the target: every rank refuses.
    moecomm::replica_placement const mine = me == 5 ? start : target;
    CHECK_THROWS_AS(layer.move_replicas(mine, experts, state), moecomm::error);
    unchanged("after a disagreement");
    // The layer and the world are still usable: a step equals plain expert parallelism.
    rank_io io(c, in);
    layer.forward(io.routing(me), io.x(me), io.out(me), experts);
    layer.backward(io.d_out(me), io.d_x(me), io.d_w(me), experts);
    moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t> plain(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto const want = run_step(plain, me, c, in);
    check_bitwise(io.got[static_cast<std::size_t>(me)].out, want.out, c.hidden, "output after the failed moves vs plain");
  });
}

// FlexMoE as one policy: rebalance() moves replicas when the loads since the last call pay for it,
// and the layer still equals plain expert parallelism; a move that cannot pay is not made.
TEST_CASE("replica migration: flexmoe's rebalance moves replicas that pay off, keeps plain EP's results, and skips the rest") {
  shadow_case const c{8, 4, 16, 2, 8, {64, 64, 64, 64, 64, 64, 64, 64}, 2.0, true};
  auto const in = make_shadow_inputs<float>(c);
  moecomm::replica_placement const start = moecomm::replica_placement::cyclic(8, 4, 2);
  using comm_t = moecomm::inproc_communicator;
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    moecomm::flexmoe_planner_options cheap;  // moves cost little against the gain over 50 steps
    cheap.bytes_per_replica = 1e3;
    moecomm::flexmoe_planner_options dear = cheap;  // each move costs more than 50 steps could gain
    dear.bytes_per_replica = 1e12;
    auto flex = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                           moecomm::flexmoe{start, {}, {cheap}});
    auto stuck = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                            moecomm::flexmoe{start, {}, {dear}});
    stuck.set_training(false);  // forwards only: it counts loads for rebalance
    static_assert(std::is_same_v<decltype(flex), moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t,
                                                                                  moecomm::even_split, moecomm::weighted,
                                                                                  moecomm::dynamic_placement>>);
    moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t> plain(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto const want = run_step(plain, me, c, in);
    auto flex_experts = slot_experts(start, me, c.hidden), stuck_experts = flex_experts;
    momentum_state flex_state(4, 2 * c.hidden), stuck_state(4, 2 * c.hidden);
    std::vector<std::int64_t> busiest;
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      rank_io io(c, in), stuck_io(c, in);
      flex.forward(io.routing(me), io.x(me), io.out(me), flex_experts);
      flex.backward(io.d_out(me), io.d_x(me), io.d_w(me), flex_experts);
      check_bitwise(io.got[static_cast<std::size_t>(me)].out, want.out, c.hidden, "flexmoe output vs plain");
      check_bitwise(io.got[static_cast<std::size_t>(me)].d_x, want.d_x, c.hidden, "flexmoe input gradient vs plain");
      busiest.push_back(flex.report().busiest_rank_rows);
      stuck.forward(stuck_io.routing(me), stuck_io.x(me), stuck_io.out(me), stuck_experts);
      std::fill(flex_experts.grads.begin(), flex_experts.grads.end(), 0.0f);
      moecomm::placement_decision const& moved = flex.rebalance(flex_experts, flex_state);
      moecomm::placement_decision const& kept = stuck.rebalance(stuck_experts, stuck_state);
      if (step == 0) {
        CHECK(moved.triggered);
        CHECK(!moved.moves.empty());
        CHECK(moved.imbalance_after < moved.imbalance_before);
        CHECK(kept.triggered);
        CHECK(kept.moves.empty());  // no gain over the interval pays for a terabyte
      }
      for (std::int32_t l = 0; l < 4; ++l) {
        CHECK(flex.placement().expert_at(me, l) == moved.slot_expert_after[static_cast<std::size_t>(me * 4 + l)]);
        CHECK(stuck.placement().expert_at(me, l) == start.expert_at(me, l));
      }
    }
    CHECK(busiest.back() < busiest.front());  // the moves balanced the rows the ranks compute
    // Every replica holds its expert's parameters (no step updated them here).
    for (std::int32_t l = 0; l < 4; ++l) {
      std::int32_t const e = flex.placement().expert_at(me, l);
      if (e < 0) continue;
      for (std::int64_t i = 0; i < 2 * c.hidden; ++i)
        REQUIRE(flex_experts.params[static_cast<std::size_t>(l * 2 * c.hidden + i)] == parameter_value(e, i, true));
    }
  });
}

}  // namespace test
