// SPDX-License-Identifier: Apache-2.0
// Replicated experts (patterns/replicated_experts.hpp) over 8 and 16 in-process ranks: for contiguous,
// cyclic and load-aware placements, with FineMoE's exact split and FlexMoE's even one, on uniform,
// Zipf 1.2 and Zipf 8 routing and a rank without tokens, the layer's output, input gradient and
// routing-weight gradient equal plain expert parallelism's bit for bit, and every replica's
// gradient equals the plain owner's (dyadic payloads: exact sums); FineMoE's split reaches the
// min-max bound, and no rank computes more rows than it.

#include "replicated_cases.hpp"

#include <moecomm/comm/inproc.hpp>

namespace test {

template <class Split, class Algorithm = moecomm::flat>
void check_replicated_equals_plain(shadow_case const& c, moecomm::replica_placement const& placement, Algorithm const& algorithm = {},
                                   std::int32_t nodes_per_domain = 0) {
  CAPTURE(Split::name);
  CAPTURE(c.zipf);
  auto const in = make_shadow_inputs<float>(c);
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) {
    check_replicated_on_rank<Split>(comm, c, in, placement, moecomm::host_backend{}, algorithm, nodes_per_domain);
  });
}

shadow_case const uniform{8, 4, 16, 2, 8, {64, 64, 64, 64, 64, 64, 64, 64}, 0.0, true};
shadow_case const zipf{8, 4, 16, 2, 8, {80, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};  // rank 2 has no tokens
shadow_case const extreme{8, 4, 16, 1, 8, {50, 50, 50, 50, 50, 50, 50, 50}, 8.0, true};

TEST_CASE("replicated experts: every placement and split equals plain expert parallelism bit for bit (8 ranks)") {
  std::vector<double> hot;
  for (std::int32_t e = 0; e < 16; ++e) hot.push_back(1.0 / std::pow(e + 1.0, 1.2));
  moecomm::replica_placement const placements[] = {
      moecomm::replica_placement::contiguous(16, 8),
      moecomm::replica_placement::cyclic(8, 4, 2),  // 16 experts, 2 replicas each
      moecomm::replica_placement::from_loads(8, 4, hot, 5),
  };
  for (moecomm::replica_placement const& p : placements)
    for (shadow_case const& c : {uniform, zipf, extreme}) {
      check_replicated_equals_plain<moecomm::finemoe_split>(c, p);
      check_replicated_equals_plain<moecomm::even_split>(c, p);
    }
}

// Several slots per rank: a token routed to two slots of one rank crosses once with dedup_per_rank
// (and to two ranks of one node, once between nodes with dedup_per_node)
// (semantics §10a); on dyadic payloads the regrouped sums are exact, so the bits stay plain EP's.
TEST_CASE("replicated experts with a deduplicated exchange equal plain expert parallelism (8 ranks, 4 slots each)") {
  moecomm::replica_placement const cyclic = moecomm::replica_placement::cyclic(8, 4, 2);
  for (shadow_case const& c : {uniform, zipf}) {
    check_replicated_equals_plain<moecomm::finemoe_split>(c, cyclic, moecomm::dedup_per_rank<moecomm::flat>{});
    check_replicated_equals_plain<moecomm::even_split>(c, cyclic, moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
    check_replicated_equals_plain<moecomm::finemoe_split>(c, cyclic, moecomm::dedup_per_node{});
  }
}

// Expert parallelism inside each domain, expert data parallelism across them: 8 ranks in 2 domains of
// 2 nodes of 2, every domain holding all 8 experts (2 slots a rank). Plain EP's results bit for bit,
// each replica with its expert's whole gradient (summed over the domains), and no token crossing a
// domain; with a placement that leaves a domain without an expert, its ranks share the others evenly.
TEST_CASE("replicated experts: domain_split on per_domain placement is EP inside each domain, DP across, with plain EP's results") {
  moecomm::replica_placement const per_domain = moecomm::replica_placement::per_domain(8, 2, 4);
  CHECK(per_domain.num_experts() == 8);
  CHECK(per_domain.replica_count(5) == 2);
  shadow_case const eight{8, 2, 8, 2, 8, {64, 64, 64, 64, 64, 64, 64, 64}, 1.2, true};
  shadow_case const skewed{8, 2, 8, 2, 8, {80, 33, 0, 7, 64, 1, 12, 50}, 1.2, true};
  for (shadow_case const& c : {eight, skewed}) {
    check_replicated_equals_plain<moecomm::domain_split>(c, per_domain, moecomm::flat{}, /*nodes_per_domain=*/2);
    check_replicated_equals_plain<moecomm::domain_split>(c, per_domain, moecomm::dedup_per_rank<moecomm::flat>{}, 2);
  }
  static_assert(std::is_same_v<moecomm::expert_parallel_layer_of<float, moecomm::host_backend, moecomm::inproc_communicator,
                                                                moecomm::expert_data_parallel>,
                               moecomm::replicated_expert_layer<float, moecomm::host_backend, moecomm::inproc_communicator,
                                                                moecomm::domain_split>>);
  check_error([] { (void)moecomm::replica_placement::per_domain(8, 2, 3); }, moecomm::status::invalid_argument,
              {"replica_placement::per_domain", "ranks_per_domain = 3 must divide num_ranks = 8"});
}

TEST_CASE("assign_tokens_in_domain: a domain's replicas take its ranks' tokens evenly; without one there, all replicas do") {
  // 4 ranks in 2 domains {0, 1}, {2, 3}; expert 0 on ranks 0 and 2, expert 1 on rank 1 only.
  moecomm::replica_placement const p(2, 4, 1, {0, 1, 0, -1});
  moecomm::replica_sets const sets = moecomm::replica_sets_of(p);
  std::vector<std::int64_t> const counts = {5, 3, 4, 2, 7, 1, 6, 0};  // [rank][expert]
  moecomm::replica_assignment out;
  moecomm::assign_tokens_in_domain(sets, {counts.data(), 8}, [](std::int32_t r) { return r / 2; }, out);
  auto take = [&](std::int32_t s, std::int32_t k) { return out.take[static_cast<std::size_t>(s) * sets.ranks.size() + static_cast<std::size_t>(k)]; };
  // replica lists: expert 0 -> ranks {0, 2} (k = 0, 1), expert 1 -> rank {1} (k = 2)
  CHECK(take(0, 0) == 5);
  CHECK(take(0, 1) == 0);
  CHECK(take(1, 0) == 4);
  CHECK(take(2, 1) == 7);
  CHECK(take(3, 0) == 0);
  CHECK(take(3, 1) == 6);
  CHECK(take(0, 2) == 3);  // expert 1 has no replica in domain 1: its one replica takes everything
  CHECK(take(2, 2) == 1);
}

}  // namespace test

#include <moecomm/patterns/layer_policies.hpp>

namespace test {

TEST_CASE("replicated experts: 16 ranks, 4 replicas per expert or load-aware, both splits, equal plain expert parallelism") {
  shadow_case const c{16, 4, 32, 2, 8, {90, 12, 0, 40, 64, 3, 77, 20, 5, 60, 31, 0, 48, 9, 70, 15}, 1.2, true};
  std::vector<double> hot;
  for (std::int32_t e = 0; e < 32; ++e) hot.push_back(1.0 / std::pow(e + 1.0, 1.2));
  for (moecomm::replica_placement const& p :
       {moecomm::replica_placement::cyclic(16, 8, 4), moecomm::replica_placement::from_loads(16, 4, hot, 3)}) {
    check_replicated_equals_plain<moecomm::finemoe_split>(c, p);
    check_replicated_equals_plain<moecomm::even_split>(c, p);
  }
}

// The short form: one policy value, `replicated<Split>{placement}`, makes the layer replicated.
TEST_CASE("replicated experts: one policy value in make_expert_parallel_layer makes the layer replicated") {
  shadow_case const c = zipf;
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  moecomm::replica_placement const placement = moecomm::replica_placement::cyclic(8, 4, 2);
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    auto plain = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto replicas = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                               moecomm::replicated<moecomm::even_split>{placement});
    static_assert(std::is_same_v<decltype(replicas),
                                 moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t, moecomm::even_split>>);
    auto const want = run_step(plain, me, c, in);
    auto experts = slot_experts(placement, me, c.hidden);
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden));
    replicas.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[me].data(), r.tokens, c.hidden},
                     {out.data(), r.tokens, c.hidden}, experts);
    check_bitwise(out, want.out, c.hidden, "short form's replicated output vs plain");
    check_error([&] {
      auto wrong = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 32, c.hidden,
                                                              moecomm::replicated<>{placement});
    }, moecomm::status::invalid_argument, {"replicated.placement holds 16 experts, num_experts = 32"});
  });
}

// Gradients left to the trainer: each replica keeps its rows' share; summed over replica_group(l)
// they are the layer's own sum (and so plain EP's owner's), bit for bit.
TEST_CASE("replicated experts: gradients left to the trainer sum over each replica group to the layer's own sum") {
  shadow_case const c = zipf;
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  moecomm::replica_placement const placement = moecomm::replica_placement::cyclic(8, 4, 2);
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    auto summed = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                             moecomm::finemoe{placement});
    auto left = moecomm::make_expert_parallel_layer<float>(
        moecomm::host_backend{}, groups, c.experts, c.hidden,
        moecomm::finemoe{placement, {}, {}, moecomm::replica_gradients::left_to_trainer});
    auto summed_experts = slot_experts(placement, me, c.hidden), left_experts = summed_experts;
    rank_io a(c, in), b(c, in);
    summed.forward(a.routing(me), a.x(me), a.out(me), summed_experts);
    summed.backward(a.d_out(me), a.d_x(me), a.d_w(me), summed_experts);
    left.forward(b.routing(me), b.x(me), b.out(me), left_experts);
    left.backward(b.d_out(me), b.d_x(me), b.d_w(me), left_experts);
    check_bitwise(b.got[static_cast<std::size_t>(me)].d_x, a.got[static_cast<std::size_t>(me)].d_x, c.hidden,
                  "input gradient, gradients left to the trainer");
    bool some_share_differs = false;
    std::int64_t const n = 2 * c.hidden;
    for (std::int32_t l = 0; l < placement.slots_per_rank(); ++l) {
      float* const share = left_experts.gradients(l);
      some_share_differs |= !std::equal(share, share + n, summed_experts.gradients(l));
      moecomm::workspace<moecomm::host_backend> scratch;
      moecomm::ordered_allreduce(moecomm::host_backend{}, left.replica_group(l), moecomm::array_view<float>{share, n}, scratch);
    }
    check_bitwise(left_experts.grads, summed_experts.grads, n, "trainer's sum over replica_group(l) vs the layer's");
    // Not vacuous: somewhere a replica's own share differs from the whole (8 ranks, 2 replicas each, skewed loads).
    std::int32_t const any = some_share_differs ? 1 : 0;
    std::int32_t anywhere = 0;
    groups.world().allreduce(&any, &anywhere, 1, moecomm::reduce_op::max);
    CHECK(anywhere == 1);
  });
}

}  // namespace test

namespace test {

// A silent-data defect once: ranks that pass different (each valid) placements would
// route to different slots and combine wrong rows; the layer refuses at construction, on every rank.
TEST_CASE("replicated experts: ranks that pass different placements are refused at construction, naming the placement") {
  using comm_t = moecomm::inproc_communicator;
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](comm_t comm) {
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(4, 2));
    moecomm::replica_placement const cyclic = moecomm::replica_placement::cyclic(4, 2, 2);  // 4 experts, 2 replicas each
    moecomm::replica_placement const other(4, 4, 2, {1, 0, 3, 2, 1, 0, 3, 2});             // the same experts, other slots
    moecomm::replica_placement const& mine = comm.rank() == 2 ? other : cyclic;
    CAPTURE(comm.rank());
    check_error([&] { moecomm::replicated_expert_layer<float, moecomm::host_backend, comm_t> l(moecomm::host_backend{}, groups, mine, 4); },
                moecomm::status::invalid_usage, {"replicated_expert_layer: ranks disagree on the layer's configuration", "they differ in placement"});
  });
}

}  // namespace test
