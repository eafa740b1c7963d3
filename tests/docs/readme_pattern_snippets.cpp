// SPDX-License-Identifier: Apache-2.0
// The pattern guides' snippets (docs/patterns/: FasterMoE, Parm, HybridEP, FineMoE, FlexMoE, Pro-Prophet), each the
// lines between its markers, run on 8 in-process ranks by the test cases below. The blocks and the
// two types they share (readme_blocks.hpp) come before any test header, so they compile against the
// installed headers alone, as a user's copy must. Every expert scales its rows by e + 1 and every
// value is a small dyadic number, so each output and gradient has an exact closed form
// (test::scaled_step), whichever rank computed which part: the checks are bit for bit.

#include "readme_blocks.hpp"

#include <cstdint>
#include <vector>

namespace readme {

// What one rank left: its batch after the step, and its experts' gradients (per local slot).
struct snippet_result {
  token_batch batch{0, 0, 2, 0};
  std::vector<float> grads;
};

void fastermoe(std::int64_t H, moecomm::fastermoe_cost_params const& model, std::vector<snippet_result>& results,
               std::vector<std::vector<std::int32_t>>& shadowed) {
  // example-begin readme-fastermoe
  using fastermoe = moecomm::fastermoe_shadowing<>;  // Algorithm 1 every step; replicas point to point
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H,
                                                            moecomm::smart_schedule{/*group_size=*/4}, fastermoe{model});
    std::int32_t const first = comm.rank() * 2;  // 16 experts over 8 ranks: 2 local experts each, e scales by e + 1
    scaled_experts experts{{float(first + 1), float(first + 2)}, {0.0f, 0.0f}};
    token_batch b(/*tokens=*/48, H, /*experts=*/16, /*seed=*/comm.rank());
    layer.forward(b.routing(), b.rows(b.x), b.rows(b.out), experts);
    layer.backward(b.rows(b.d_out), b.rows(b.d_x), moecomm::array_view<float>(b.d_w),
                   experts);  // the owners' gradients include their replicas'
    shadowed[comm.rank()] = layer.shadow_state().decision().shadowed;  // this step's hot experts
    results[comm.rank()] = {b, experts.g};
  });
  // example-end readme-fastermoe
}

void parm(std::int64_t H, std::vector<snippet_result>& results, std::vector<moecomm::parm_report>& reports) {
  // example-begin readme-parm
  struct sliced_experts : scaled_experts {  // slice s of n of each expert: the slices' outputs sum to its output
    std::int32_t n = 1, s = 0;
    std::int32_t slices() const { return n; }
    std::int32_t slice() const { return s; }
  };
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    // MP 2 x EP 4, each expert sliced over its MP pair; world rank = (dp * EP + ep) * MP + mp
    moecomm::parallel_groups groups(comm, moecomm::parallel_sizes{/*model=*/2, /*expert=*/4, /*expert_slicing=*/2},
                                    moecomm::topology(8, /*ranks_per_node=*/4));
    moecomm::parallel_coordinates const at = groups.coordinates();
    // deepspeed_mp, parm_s1 or parm_s2{pieces}: one type changes the schedule
    moecomm::parm_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::parm_s2> layer(
        moecomm::host_backend{}, groups, /*num_experts=*/16, H, moecomm::parm_s2{/*pieces=*/4});
    sliced_experts experts;  // 4 local experts per EP rank; slice s of expert e holds half of e + 1
    experts.n = 2;
    experts.s = at.esp;
    for (std::int32_t l = 0; l < 4; ++l) experts.p.push_back(float(at.ep * 4 + l + 1) / 2);
    experts.g.assign(4, 0.0f);
    token_batch b(/*tokens=*/48, H, /*experts=*/16, /*seed=*/at.dp * 4 + at.ep);  // an MP group holds one batch
    layer.forward(b.routing(), b.rows(b.x), b.rows(b.out), experts);
    layer.backward(b.rows(b.d_out), b.rows(b.d_x), moecomm::array_view<float>(b.d_w), experts);
    results[comm.rank()] = {b, experts.g};
    reports[comm.rank()] = layer.report();
  });
  // example-end readme-parm
}

void hybridep(std::int64_t H, std::vector<snippet_result>& results, std::vector<moecomm::hybridep_report>& reports) {
  // example-begin readme-hybridep
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    // 2 data centres of one node of 4 ranks: topology(ranks, ranks_per_node, nodes_per_domain)
    moecomm::exchange_groups groups(comm, moecomm::topology(8, 4, /*nodes_per_domain=*/1));
    // expert domains of 2 ranks, one in each data centre: experts cross the slow link, tokens stay home
    moecomm::hybridep_layer<float, moecomm::host_backend, moecomm::inproc_communicator> layer(
        moecomm::host_backend{}, groups, /*num_experts=*/16, H, moecomm::hybridep{/*expert_domain=*/2});
    std::int32_t const first = comm.rank() * 2;  // parametric experts: the layer moves their parameters
    scaled_experts experts{{float(first + 1), float(first + 2)}, {0.0f, 0.0f}};
    token_batch b(/*tokens=*/48, H, /*experts=*/16, /*seed=*/comm.rank());
    layer.begin_expert_gather(experts);  // in the background, while ...
    /* ... the caller's attention and dense FFN run here ... */
    layer.forward(b.routing(), b.rows(b.x), b.rows(b.out), experts);
    layer.backward(b.rows(b.d_out), b.rows(b.d_x), moecomm::array_view<float>(b.d_w), experts);
    results[comm.rank()] = {b, experts.g};
    reports[comm.rank()] = layer.report();  // bytes inside a node, between nodes, between data centres
  });
  // example-end readme-hybridep
}

moecomm::replica_placement replicated(std::int64_t H, std::vector<snippet_result>& results, std::vector<std::int64_t>& busiest) {
  // example-begin readme-replicated
  std::vector<double> expected_load(16, 1.0);  // what the trainer expects: experts 0 and 1 are hot
  expected_load[0] = expected_load[1] = 6.0;
  // 8 ranks x 4 expert slots for 16 experts: hot experts get more replicas, each on one local index
  auto const placement = moecomm::replica_placement::from_loads(/*ranks=*/8, /*slots_per_rank=*/4, expected_load, /*seed=*/1);
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    // finemoe_split: the exact min-max split of every expert's tokens over its replicas (FineMoE);
    // even_split: FlexMoE's
    moecomm::replicated_expert_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::finemoe_split> layer(
        moecomm::host_backend{}, groups, placement, H);
    scaled_experts experts{{}, std::vector<float>(4)};  // slot l holds expert placement.expert_at(rank, l)
    for (std::int32_t l = 0; l < 4; ++l) experts.p.push_back(float(placement.expert_at(comm.rank(), l) + 1));
    token_batch b(/*tokens=*/48, H, /*experts=*/16, /*seed=*/comm.rank());
    layer.forward(b.routing(), b.rows(b.x), b.rows(b.out), experts);
    layer.backward(b.rows(b.d_out), b.rows(b.d_x), moecomm::array_view<float>(b.d_w), experts);
    results[comm.rank()] = {b, experts.g};                    // each replica holds its expert's whole gradient
    busiest[comm.rank()] = layer.report().busiest_rank_rows;  // the min-max bound
  });
  // example-end readme-replicated
  return placement;
}

moecomm::replica_placement flexmoe(std::int64_t H, std::vector<snippet_result>& results, std::vector<std::size_t>& moves) {
  // example-begin readme-flexmoe
  // The trainer's optimizer state per expert slot (here SGD's momentum), moved with the parameters
  struct momentum {
    std::vector<float> m = std::vector<float>(4 * 16);
    std::int64_t state_count() const { return 16; }  // elements per slot
    float* state(std::int32_t slot) { return m.data() + slot * 16; }
  };
  moecomm::flexmoe_planner_options planner;  // when a move pays off (planners/flexmoe_planner.hpp)
  planner.interval_steps = 50;               // its gain counts over the rebalancing interval ...
  planner.bytes_per_replica = 1e6;           // ... against parameters + optimizer state / bandwidth
  auto const start = moecomm::replica_placement::cyclic(/*ranks=*/8, /*slots_per_rank=*/4, /*replicas=*/2);
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*experts=*/16, H,
                                                            moecomm::flexmoe{start, {}, {planner}});
    scaled_experts experts{{}, std::vector<float>(4)};
    for (std::int32_t l = 0; l < 4; ++l) experts.p.push_back(float(start.expert_at(comm.rank(), l) + 1));
    momentum optimizer_state;
    token_batch b(/*tokens=*/48, H, /*experts=*/16, /*seed=*/comm.rank());
    layer.forward(b.routing(), b.rows(b.x), b.rows(b.out), experts);
    layer.backward(b.rows(b.d_out), b.rows(b.d_x), moecomm::array_view<float>(b.d_w), experts);
    results[comm.rank()] = {b, experts.g};
    // ... the optimizer's step; then, every interval, replicas move where the loads seen since call for them
    moecomm::placement_decision const& plan = layer.rebalance(experts, optimizer_state);
    moves[comm.rank()] = plan.moves.size();  // expand, shrink, migrate: layer.placement() is the new one
  });
  // example-end readme-flexmoe
  return start;
}

void proprophet(std::int64_t H, std::vector<snippet_result>& results, std::vector<std::vector<float>>& mids,
                std::vector<std::vector<float>>& grads1, std::vector<std::int64_t>& replicated) {
  // example-begin readme-proprophet
  moecomm::proprophet_cost_params costs;  // Pro-Prophet's model: its code's bandwidths and GEMM rate
  costs.hidden = H;
  costs.balance_factor = 0.5;  // plan while max - min rows per rank >= half the mean (the code: 3)
  using prophet = moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>>;
  prophet policy;  // its FasterMoE cost model is unused: Pro-Prophet's planner has its own
  policy.planner.model = moecomm::proprophet_cost_model(costs);
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto block0 = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H, policy);
    auto block1 = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H, policy);
    std::int32_t const first = comm.rank() * 2;
    scaled_experts experts0{{float(first + 1), float(first + 2)}, {0.0f, 0.0f}}, experts1 = experts0;
    // Each block's parameter transfers begin a block ahead; its gradient aggregation runs on until finish_backward
    moecomm::block_schedule<decltype(block0), scaled_experts> schedule({&block0, &block1}, {&experts0, &experts1});
    token_batch b(/*tokens=*/48, H, /*experts=*/16, /*seed=*/comm.rank());  // both blocks route alike here
    std::vector<float> mid(b.x.size()), d_mid(b.x.size());
    for (int iteration = 0; iteration < 3; ++iteration) {  // plans use the last iteration's counts
      schedule.before_forward(0);                          // then block 0's attention, then its MoE layer
      block0.forward(b.routing(), b.rows(b.x), b.rows(mid), experts0);
      schedule.before_forward(1);
      block1.forward(b.routing(), b.rows(mid), b.rows(b.out), experts1);
      block1.backward(b.rows(b.d_out), b.rows(d_mid), moecomm::not_needed, experts1);
      block0.backward(b.rows(d_mid), b.rows(b.d_x), moecomm::not_needed, experts0);
      schedule.finish_backward();  // the owners' gradients are whole: the optimizer may step
    }
    replicated[comm.rank()] = std::int64_t(block0.shadow_state().decision().subset_ranks.size());
    results[comm.rank()] = {b, experts0.g};
    mids[comm.rank()] = mid;
    grads1[comm.rank()] = experts1.g;
  });
  // example-end readme-proprophet
}

}  // namespace readme

#include "../support/test_support.hpp"

namespace test {

using readme::snippet_result;

// The step's closed form: `batches` with out, d_x and d_w recomputed for experts y = (e + 1) x, and
// each expert's parameter gradient summed over every batch's slots (the batches must be distinct).
struct scaled_reference {
  std::vector<token_batch> batches;
  std::vector<float> grads;
};
inline scaled_reference scaled_step(std::vector<token_batch> batches, std::int32_t experts) {
  std::vector<float> grads(static_cast<std::size_t>(experts), 0.0f);
  for (token_batch& b : batches)
    for (std::int64_t t = 0; t < b.T; ++t) {
      auto at = [&](std::vector<float>& v, std::int64_t h) -> float& { return v[static_cast<std::size_t>(t * b.H + h)]; };
      float dot = 0.0f;  // <x_t, d_out_t>
      for (std::int64_t h = 0; h < b.H; ++h) dot += at(b.x, h) * at(b.d_out, h);
      for (std::int64_t h = 0; h < b.H; ++h) at(b.out, h) = at(b.d_x, h) = 0.0f;
      for (std::int64_t k = 0; k < 2; ++k) {
        std::size_t const slot = static_cast<std::size_t>(2 * t + k);
        float const scale = float(b.topk_idx[slot] + 1), w = b.topk_weights[slot];
        for (std::int64_t h = 0; h < b.H; ++h) {
          at(b.out, h) += w * scale * at(b.x, h);
          at(b.d_x, h) += w * scale * at(b.d_out, h);
        }
        b.d_w[slot] = scale * dot;
        grads[static_cast<std::size_t>(b.topk_idx[slot])] += w * dot;
      }
    }
  return {std::move(batches), std::move(grads)};
}

// `got`'s out, d_x and d_w equal `want`'s, bit for bit.
inline void check_outputs(token_batch const& got, token_batch const& want) {
  check_bitwise(got.out, want.out, got.H, "out");
  check_bitwise(got.d_x, want.d_x, got.H, "d_x");
  check_bitwise(got.d_w, want.d_w, 2, "d_w");
}

// Every rank's outputs and, for local slot l, the gradient of expert expert_of(r, l) (zero for an
// empty slot, -1).
template <class ExpertOf>
void check_scaled_step(std::vector<snippet_result> const& got, std::int32_t experts, ExpertOf expert_of) {
  std::vector<token_batch> batches;
  for (snippet_result const& r : got) batches.push_back(r.batch);
  scaled_reference const want = scaled_step(batches, experts);
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    check_outputs(got[r].batch, want.batches[r]);
    for (std::size_t l = 0; l < got[r].grads.size(); ++l) {
      CAPTURE(l);
      std::int32_t const e = expert_of(static_cast<std::int32_t>(r), static_cast<std::int32_t>(l));
      CHECK(got[r].grads[l] == (e < 0 ? 0.0f : want.grads[static_cast<std::size_t>(e)]));
    }
  }
}

inline std::int32_t two_per_rank(std::int32_t r, std::int32_t l) { return 2 * r + l; }

TEST_CASE("README FasterMoE snippet runs: hot experts shadowed, every output and gradient exact") {
  std::int64_t const H = 16;
  moecomm::fastermoe_cost_params model;  // a slow GEMM: hot experts are worth shadowing
  model.gemm_flops = 1e8;
  model.net_bandwidth = model.local_bandwidth = 1e9;
  std::vector<snippet_result> results(8);
  std::vector<std::vector<std::int32_t>> shadowed(8);
  readme::fastermoe(H, model, results, shadowed);
  CHECK(shadowed[0] == std::vector<std::int32_t>{0, 1});
  check_scaled_step(results, 16, two_per_rank);
}

TEST_CASE("README Parm snippet runs: every schedule's output and gradients exact") {
  std::int64_t const H = 16;
  std::vector<snippet_result> results(8);
  std::vector<moecomm::parm_report> reports(8);
  readme::parm(H, results, reports);
  std::vector<token_batch> groups;  // one batch per MP pair (ranks 2 ep and 2 ep + 1)
  for (std::size_t r = 0; r < 8; r += 2) groups.push_back(results[r].batch);
  scaled_reference const want = scaled_step(groups, 16);
  for (std::size_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    check_outputs(results[r].batch, want.batches[r / 2]);
    for (std::size_t l = 0; l < 4; ++l) CHECK(results[r].grads[l] == want.grads[(r / 2) * 4 + l]);  // each slice's
    CHECK(reports[r].model_gather.intra_bytes > 0);  // the MP pair shares a node
  }
}

TEST_CASE("README HybridEP snippet runs: plain EP's results, exactly") {
  std::int64_t const H = 16;
  std::vector<snippet_result> results(8);
  std::vector<moecomm::hybridep_report> reports(8);
  readme::hybridep(H, results, reports);
  check_scaled_step(results, 16, two_per_rank);
  for (std::size_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(reports[r].exchange.inter_domain_bytes == 0);  // tokens stay in their data centre
    CHECK(reports[r].expert_gather.inter_domain_bytes > 0);  // experts cross
  }
}

TEST_CASE("README replicated experts snippet runs: plain EP's results, exactly, with the min-max split") {
  std::int64_t const H = 16;
  std::vector<snippet_result> results(8);
  std::vector<std::int64_t> busiest(8);
  auto const placement = readme::replicated(H, results, busiest);
  CHECK(placement.replica_count(0) > 1);  // the hot experts are replicated
  check_scaled_step(results, 16, [&](std::int32_t r, std::int32_t l) { return placement.expert_at(r, l); });
  for (std::int64_t b : busiest) CHECK(b == busiest[0]);
  CHECK(busiest[0] >= 8 * 48 * 2 / 8);  // at least the mean of all 8 · 48 · 2 rows
}

TEST_CASE("README flexmoe snippet runs: exact results, then replicas moved") {
  std::int64_t const H = 16;
  std::vector<snippet_result> results(8);
  std::vector<std::size_t> moves(8);
  auto const start = readme::flexmoe(H, results, moves);
  check_scaled_step(results, 16, [&](std::int32_t r, std::int32_t l) { return start.expert_at(r, l); });
  CHECK(moves[0] > 0);
  for (std::size_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(moves[r] == moves[0]);
  }
}

TEST_CASE("README Pro-Prophet snippet runs: a two-block stack, every output and gradient exact") {
  std::int64_t const H = 16;
  std::vector<snippet_result> results(8);  // block 0's gradients
  std::vector<std::vector<float>> mids(8), grads1(8);
  std::vector<std::int64_t> replicated(8);
  readme::proprophet(H, results, mids, grads1, replicated);
  CHECK(replicated[0] > 0);  // Pro-Prophet replicated something on a subset
  // Block 1 maps mid to out; block 0 maps x to mid, with block 1's d_x as its d_out.
  std::vector<token_batch> second, first;
  for (std::size_t r = 0; r < 8; ++r) {
    second.push_back(results[r].batch);
    second.back().x = mids[r];
  }
  scaled_reference const want1 = scaled_step(second, 16);
  for (std::size_t r = 0; r < 8; ++r) {
    first.push_back(results[r].batch);
    first.back().d_out = want1.batches[r].d_x;
  }
  scaled_reference const want0 = scaled_step(first, 16);
  for (std::size_t r = 0; r < 8; ++r) {
    CAPTURE(r);
    check_bitwise(mids[r], want0.batches[r].out, H, "mid");
    check_bitwise(results[r].batch.out, want1.batches[r].out, H, "out");
    check_bitwise(results[r].batch.d_x, want0.batches[r].d_x, H, "d_x");
    for (std::size_t l = 0; l < 2; ++l) {  // three iterations' gradients, accumulated
      CHECK(results[r].grads[l] == 3 * want0.grads[2 * r + l]);
      CHECK(grads1[r][l] == 3 * want1.grads[2 * r + l]);
    }
  }
}

}  // namespace test
