// SPDX-License-Identifier: Apache-2.0
// HybridEP (patterns/hybridep.hpp) over in-process ranks: on 8 and 16 ranks in 2 and 4 domains, for
// every expert-domain size S dividing the ranks (1 = plain EP, all = every expert gathered) with
// expert domains across the data centres, and every S dividing a data centre's ranks within them, the layer's output, input gradient, routing-weight gradient and owners'
// parameter gradients equal plain expert parallelism's bit for bit (dyadic payloads: exact sums),
// with and without the explicit background gather; each rank exchanges tokens with exactly the
// R/S − 1 same-offset ranks and parameters with its S − 1 expert-domain peers (the paper's pair
// counts), parameters never leave a domain, and with S = the domain every token message crosses
// domains. Bad layouts are clear errors.

#include "hybridep_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <numeric>

namespace test {

template <class Capacity>
void check_hybridep_equals_plain(hybridep_case const& h, moecomm::hybridep policy, bool background, Capacity const& capacity) {
  CAPTURE(h.layer.ranks);
  CAPTURE(h.nodes_per_domain);
  CAPTURE(policy.expert_domain);
  CAPTURE(policy.spread == moecomm::expert_domain_spread::across_data_centres);
  CAPTURE(background);
  auto const in = make_shadow_inputs<float>(h.layer);
  moecomm::inproc_world const world(h.layer.ranks, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) { check_hybridep_on_rank(comm, h, in, policy, background, capacity); });
}

// Uniform top-2 routing over 16 experts, 96 tokens per rank: every rank reaches every expert.
shadow_case const dense8{8, 2, 16, 2, 8, {96, 96, 96, 96, 96, 96, 96, 96}, 0.0, true};
shadow_case const dense16{16, 4, 32, 2, 8, std::vector<std::int64_t>(16, 160), 0.0, true};

TEST_CASE("HybridEP: every expert-domain size equals plain expert parallelism bit for bit (8 and 16 ranks, 2 and 4 domains)") {
  for (hybridep_case const& h : {hybridep_case{dense8, 2}, hybridep_case{dense8, 1}, hybridep_case{dense16, 2},
                                 hybridep_case{dense16, 1}}) {
    std::int32_t const per_domain = h.layer.per_node * h.nodes_per_domain;
    for (std::int32_t s = 1; s <= h.layer.ranks; ++s) {
      if (h.layer.ranks % s != 0) continue;
      check_hybridep_equals_plain(h, {s, moecomm::expert_domain_spread::across_data_centres}, s % 2 == 0, moecomm::dropless{});
      if (per_domain % s == 0)
        check_hybridep_equals_plain(h, {s, moecomm::expert_domain_spread::within_data_centres}, s % 2 == 1, moecomm::dropless{});
    }
  }
}

TEST_CASE("HybridEP: with capacity it drops plain expert parallelism's slots, in the background gather too") {
  shadow_case skewed = dense8;
  skewed.zipf = 1.2;
  for (std::int32_t s : {2, 4})
    for (bool background : {false, true})
      check_hybridep_equals_plain(hybridep_case{skewed, 2}, {s, background ? moecomm::expert_domain_spread::across_data_centres
                                                                           : moecomm::expert_domain_spread::within_data_centres},
                                  background,
                                  moecomm::capacity<moecomm::drop_by_position>{0.75, 0, false, {}});
}

TEST_CASE("HybridEP: an expert domain that does not divide a domain, or domains not of consecutive ranks, are refused") {
  using comm_t = moecomm::inproc_communicator;
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](comm_t comm) {
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(4, 2, 1));  // 2 domains of 2
    check_error([&] { moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> l(moecomm::host_backend{}, groups, 8, 4, moecomm::hybridep{3}); },
                moecomm::status::invalid_argument, {"moecomm::hybridep_layer: policy.expert_domain = 3 must be positive and divide the 4 ranks"});
    moecomm::hybridep const within{4, moecomm::expert_domain_spread::within_data_centres};
    check_error([&] { moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> l(moecomm::host_backend{}, groups, 8, 4, within); },
                moecomm::status::invalid_argument,
                {"moecomm::hybridep_layer: policy.expert_domain = 4 must be positive and divide the 2 ranks of a domain"});
    // Ranks 0, 2 on node 0 and 1, 3 on node 1: domains that interleave the ranks.
    moecomm::exchange_groups<comm_t> interleaved(comm, moecomm::topology({0, 1, 0, 1}, {0, 1}));
    check_error([&] { moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> l(moecomm::host_backend{}, interleaved, 8, 4, moecomm::hybridep{2}); },
                moecomm::status::invalid_argument, {"rank 1 is in domain 1: HybridEP needs each domain's ranks consecutive"});
  });
}

}  // namespace test

namespace test {

// With compression the other members' experts are the shared expert with each one's farthest
// parameters restored; the owners compute their own exactly. For x -> x * w + b every output and
// input-gradient element moves by at most |x| |dw| + |db| per slot (|g| |dw| for d_x), weighted and
// summed over the token's slots; here bounded by the largest dropped residual, e, times (1 + |x|)
// (times |g|) per slot. The owners' parameter gradients do not depend on the parameters: exact.
TEST_CASE("HybridEP: with compression the gathered experts are decoded, and the output moves no more than the dropped residuals allow") {
  shadow_case const c = dense8;
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  for (double ratio : {1.0, 2.0, 4.0, 16.0}) {
    CAPTURE(ratio);
    on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
      moecomm::expert_parallel_layer<float, moecomm::host_backend, comm_t> plain(moecomm::host_backend{}, groups, c.experts, c.hidden);
      auto const want = run_step(plain, me, c, in);
      moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> layer(
          moecomm::host_backend{}, groups, c.experts, c.hidden, moecomm::hybridep{4, moecomm::expert_domain_spread::across_data_centres, ratio});
      auto const got = run_step(layer, me, c, in);
      // The largest dropped residual of any expert of this rank's expert domain, from the world's parameters.
      std::int32_t const locals = c.experts / c.ranks;
      std::vector<float> all(static_cast<std::size_t>(c.ranks * locals * 2 * c.hidden));
      scale_bias_experts<float> const mine(me, locals, c.hidden, c.exact);
      groups.world().allgather(mine.params.data(), all.data(), static_cast<std::int64_t>(mine.params.size() * sizeof(float)));
      std::int64_t const n = 2 * c.hidden;
      float worst = 0;
      {
        moecomm::host_backend const be;
        std::int32_t const per_node = c.per_node, D = c.ranks / per_node;  // positions l·D + d, expert domains of 4
        std::int32_t const first = (me % per_node * D + me / per_node) / 4 * 4;
        std::vector<float> shared(static_cast<std::size_t>(n), 0.0f), members;
        for (std::int32_t p = first; p < first + 4; ++p) {
          std::int32_t const r = p % D * per_node + p / D;
          members.insert(members.end(), all.begin() + r * locals * n, all.begin() + (r + 1) * locals * n);
        }
        for (std::int64_t i = 0; i < n; ++i) {  // per rank left to right, then ranks in order: the codec's order
          float total = 0;
          for (std::int32_t m = 0; m < 4; ++m) {
            float part = 0;
            for (std::int32_t l = 0; l < locals; ++l) part += members[static_cast<std::size_t>((m * locals + l) * n + i)];
            total += part;
          }
          shared[static_cast<std::size_t>(i)] = total / float(4 * locals);
        }
        std::int64_t const k = moecomm::top_k_for_ratio(n, ratio);
        std::vector<std::int32_t> idx(static_cast<std::size_t>(k));
        std::vector<float> val(static_cast<std::size_t>(k));
        moecomm::workspace<moecomm::host_backend> ws;
        for (std::int32_t e = 0; e < 4 * locals; ++e) {
          moecomm::array_view<float const> expert{members.data() + e * n, n};
          moecomm::encode_expert(be, expert, {shared.data(), n}, k, {idx.data(), k}, {val.data(), k}, ws);
          worst = std::max(worst, moecomm::dropped_residual_max_abs(be, expert, {shared.data(), n}, {idx.data(), k}));
        }
      }
      if (ratio == 1) CHECK(worst == 0);
      else CHECK(worst > 0);  // the bound below is not vacuous
      auto const& r = in.routing[static_cast<std::size_t>(me)];
      auto const& x = in.x[static_cast<std::size_t>(me)];
      auto const& g = in.d_out[static_cast<std::size_t>(me)];
      for (std::int64_t t = 0; t < r.tokens; ++t) {
        float weight = 0;
        for (std::int32_t k = 0; k < r.top_k; ++k)
          if (r.idx[static_cast<std::size_t>(t * r.top_k + k)] >= 0) weight += r.w[static_cast<std::size_t>(t * r.top_k + k)];
        for (std::int64_t h = 0; h < c.hidden; ++h) {
          std::size_t const i = static_cast<std::size_t>(t * c.hidden + h);
          float const slack = 1e-5f * (1 + std::fabs(want.out[i]));  // reassociation of the weighted sum
          REQUIRE(std::fabs(got.out[i] - want.out[i]) <= weight * worst * (1 + std::fabs(x[i])) + slack);
          REQUIRE(std::fabs(got.d_x[i] - want.d_x[i]) <= float(r.top_k) * worst * std::fabs(g[i]) + slack);
        }
      }
      check_bitwise(got.grads, want.grads, 2 * c.hidden, "owner's parameter gradient vs plain");
      if (ratio == 1) check_same_result(got, want, me, c);
    }, 1);
  }
}

TEST_CASE("HybridEP: a compression ratio below 1 or not finite is refused, naming the policy field") {
  using comm_t = moecomm::inproc_communicator;
  moecomm::inproc_world const world(2, std::chrono::seconds(30));
  world.run([&](comm_t comm) {
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(2, 1, 1));
    for (double bad : {0.5, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
      check_error([&] {
        moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> l(moecomm::host_backend{}, groups, 4, 4,
                                                                        moecomm::hybridep{2, moecomm::expert_domain_spread::across_data_centres, bad});
      }, moecomm::status::invalid_argument, {"moecomm::hybridep_layer: policy.compression = ", "must be finite and >= 1"});
  });
}

}  // namespace test

#include <moecomm/patterns/layer_policies.hpp>

namespace test {

// The short form: one policy value, `hybridep{S}`, among the others in any order, turns the layer
// a trainer builds with make_expert_parallel_layer into HybridEP, with the same results.
TEST_CASE("HybridEP: one policy value in make_expert_parallel_layer makes the layer HybridEP") {
  shadow_case const c = dense8;
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  moecomm::capacity<moecomm::drop_by_position> const capacity{1.0, 0, false, {}};
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    auto plain = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden, capacity);
    auto hybrid = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                             moecomm::hybridep{2}, capacity);
    static_assert(std::is_same_v<decltype(hybrid), moecomm::hybridep_layer<float, moecomm::host_backend, comm_t,
                                                                           moecomm::capacity<moecomm::drop_by_position>>>);
    auto const want = run_step(plain, me, c, in);
    auto const got = run_step(hybrid, me, c, in);
    check_same_result(got, want, me, c);
    CHECK(hybrid.report().expert_domain == 2);
  }, 1);
}

// The exchange over each offset's ranks is a policy too: with dedup_per_rank a token crosses once to
// each rank that holds one of its experts (here each destination holds S · L = 4 of the 16 experts,
// so a token's two experts share one about a fifth of the time). The payloads are exact, so the
// results are plain EP's bit for bit; the rows moved are fewer than flat's in total, never more.
TEST_CASE("HybridEP: with dedup_per_rank or dedup_per_node, plain EP's results, and fewer rows moved") {
  shadow_case const c = dense8;
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  std::vector<std::int64_t> flat_bytes(static_cast<std::size_t>(c.ranks)), dedup_bytes(flat_bytes.size());
  std::vector<std::int64_t> node_inter(flat_bytes.size()), rank_inter(flat_bytes.size());
  on_ranks_of(c, [&](moecomm::exchange_groups<comm_t>& groups, std::int32_t me) {
    auto plain = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto hybrid = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden, moecomm::hybridep{2});
    auto dedup = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                            moecomm::dedup_per_rank<moecomm::flat>{}, moecomm::hybridep{2});
    static_assert(std::is_same_v<decltype(dedup), moecomm::hybridep_layer<float, moecomm::host_backend, comm_t, moecomm::dropless,
                                                                          moecomm::weighted, moecomm::dedup_per_rank<moecomm::flat>>>);
    auto const want = run_step(plain, me, c, in);
    (void)run_step(hybrid, me, c, in);
    auto const got = run_step(dedup, me, c, in);
    check_same_result(got, want, me, c);
    auto node = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                           moecomm::dedup_per_node{}, moecomm::hybridep{2});
    check_same_result(run_step(node, me, c, in), want, me, c);
    node_inter[static_cast<std::size_t>(me)] = node.report().exchange.inter_bytes + node.report().exchange.inter_domain_bytes;
    rank_inter[static_cast<std::size_t>(me)] = dedup.report().exchange.inter_bytes + dedup.report().exchange.inter_domain_bytes;
    auto const bytes = [](moecomm::alltoall_stats const& s) { return s.intra_bytes + s.inter_bytes + s.inter_domain_bytes; };
    flat_bytes[static_cast<std::size_t>(me)] = bytes(hybrid.report().exchange);
    dedup_bytes[static_cast<std::size_t>(me)] = bytes(dedup.report().exchange);
    CHECK(dedup.dispatch_state().report().slot_metadata.intra_bytes + dedup.dispatch_state().report().slot_metadata.inter_bytes > 0);
  }, 1);
  std::int64_t flat_total = 0, dedup_total = 0;
  for (std::size_t r = 0; r < flat_bytes.size(); ++r) {
    CAPTURE(r);
    CHECK(dedup_bytes[r] <= flat_bytes[r]);
    flat_total += flat_bytes[r];
    dedup_total += dedup_bytes[r];
  }
  CHECK(dedup_total < flat_total);
  MESSAGE("HybridEP S = 2 token rows moved: flat ", flat_total, " B, dedup_per_rank ", dedup_total, " B");
  // dedup_per_node, the same results: between nodes, no more row bytes than dedup_per_rank.
  std::int64_t const node_total = std::accumulate(node_inter.begin(), node_inter.end(), std::int64_t{0});
  std::int64_t const rank_total = std::accumulate(rank_inter.begin(), rank_inter.end(), std::int64_t{0});
  CHECK(node_total < rank_total);
  MESSAGE("HybridEP S = 2 row bytes between nodes: dedup_per_rank ", rank_total, " B, dedup_per_node ", node_total, " B");
}

}  // namespace test

namespace test {

// A silent-data defect once: 4 ranks, hybridep{2}; rank 1 skips one backward, every rank
// catches what it gets and runs one more step. Each rank must then fail, or equal a clean run's step
// bit for bit: never finish with a different result. The layer calls' identity (layer, call, step)
// in every collective's check is what stops the retry pairing with the failed step's leftovers.
TEST_CASE("HybridEP: after a rank skips a backward, every rank's retry fails or equals a clean run, never silently differs") {
  shadow_case const c{4, 2, 8, 2, 8, {40, 40, 40, 40}, 0.0, true};
  auto const in = make_shadow_inputs<float>(c);
  using comm_t = moecomm::inproc_communicator;
  auto run = [&](bool skip) {
    std::vector<layer_result<float>> last(4);
    std::vector<std::string> errors(4);
    std::vector<int> failed(4, 0);
    moecomm::inproc_world const world(4, std::chrono::seconds(20));
    world.run([&](comm_t comm) {
      std::int32_t const me = comm.rank();
      moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(4, 2, 1));
      moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> layer(moecomm::host_backend{}, groups, c.experts, c.hidden,
                                                                          moecomm::hybridep{2});
      (void)run_step(layer, me, c, in);
      try {  // step 2: rank 1 skips its backward
        auto const& r = in.routing[static_cast<std::size_t>(me)];
        scale_bias_experts<float> experts(me, c.experts / c.ranks, c.hidden, c.exact);
        std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden)), d_x(out.size());
        layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden},
                      {out.data(), r.tokens, c.hidden}, experts);
        if (!(skip && me == 1))
          layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {d_x.data(), r.tokens, c.hidden},
                         moecomm::not_needed, experts);
      } catch (moecomm::error const& e) {
        errors[static_cast<std::size_t>(me)] = e.what();
      }
      try {  // step 3, the retry
        last[static_cast<std::size_t>(me)] = run_step(layer, me, c, in);
      } catch (moecomm::error const& e) {
        failed[static_cast<std::size_t>(me)] = 1;
        errors[static_cast<std::size_t>(me)] = e.what();
      }
    });
    return std::make_tuple(last, failed, errors);
  };
  auto const [clean, clean_failed, clean_errors] = run(false);
  for (int f : clean_failed) REQUIRE(f == 0);
  auto const [retried, failed, errors] = run(true);
  int silent = 0, fails = 0;
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    if (failed[r]) {
      ++fails;
      continue;
    }
    bool const same = retried[r].out == clean[r].out && retried[r].d_x == clean[r].d_x && retried[r].grads == clean[r].grads;
    silent += same ? 0 : 1;
  }
  CHECK(silent == 0);
  CHECK(fails > 0);  // the skipped backward cannot go unnoticed
  bool named = false;
  for (std::string const& e : errors) named = named || e.find("hybridep_layer::") != std::string::npos;
  CHECK_MESSAGE(named, "an error names the user's calls (hybridep_layer::forward / backward and their steps)");
}

}  // namespace test

namespace test {

TEST_CASE("HybridEP: ranks that pass different policies are refused at construction, naming the field") {
  using comm_t = moecomm::inproc_communicator;
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](comm_t comm) {
    moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(4, 2, 1));
    moecomm::hybridep const policy{comm.rank() == 3 ? 4 : 2};
    check_error([&] { moecomm::hybridep_layer<float, moecomm::host_backend, comm_t> l(moecomm::host_backend{}, groups, 8, 4, policy); },
                moecomm::status::invalid_usage,
                {"hybridep_layer: ranks disagree on the layer's configuration", "they differ in policy.expert_domain"});
  });
}

}  // namespace test
