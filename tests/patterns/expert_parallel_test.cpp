// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer over in-process ranks (1, 2, 4, 8; 1 or 2 nodes) equals the
// single-process oracle for every capacity policy and all-to-all algorithm (layer_cases.hpp).

#include "layer_cases.hpp"

#include <moecomm/comm/inproc.hpp>

#include <atomic>
#include <cmath>
#include <numeric>
#include <set>
#include <chrono>
#include <thread>

namespace test {

template <class T, class Algorithm>
void check_all_capacities(layer_case const& c, Algorithm const& algorithm) {
  CAPTURE(c.ranks);
  CAPTURE(c.per_node);
  std::string const algorithm_name = Algorithm::name;
  CAPTURE(algorithm_name);
  for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
    std::string const policy = std::decay_t<decltype(capacity)>::name;
    CAPTURE(policy);
    auto const in = make_layer_inputs<T>(c, capacity, rule, drops, sum_order_of<Algorithm>());
    moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) { check_layer_on_rank(comm, c, in, capacity, algorithm); });
  });
}

TEST_CASE("the expert-parallel layer equals the single-process oracle") {
  // Ranks hold different token counts, one of them none.
  for (layer_case const& c : {layer_case{1, 1, 4, 2, 16, {37}, 0.0},
                              layer_case{2, 2, 4, 2, 16, {40, 0}, 1.2},
                              layer_case{4, 2, 8, 2, 8, {30, 1, 0, 57}, 0.0},
                              layer_case{8, 4, 16, 4, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_all_capacities<float>(c, moecomm::flat{});
    check_all_capacities<float>(c, moecomm::hierarchical_2d{});
    check_all_capacities<float>(c, moecomm::pairwise{1});
    check_all_capacities<float>(c, moecomm::smart_schedule{c.per_node});
  }
}

// Deduplicated exchange (semantics §10a): the experts see plain dispatch's rows, and the combine and
// the input gradient sum per expert rank first, as the oracle does.
TEST_CASE("the layer with a deduplicated exchange equals the oracle's per-rank (and per-node) sums, for every capacity policy") {
  for (layer_case const& c : {layer_case{1, 1, 4, 2, 16, {37}, 0.0},
                              layer_case{2, 2, 4, 3, 16, {40, 0}, 1.2},
                              layer_case{4, 2, 8, 4, 8, {30, 1, 0, 57}, 0.0},
                              layer_case{8, 4, 16, 8, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_all_capacities<float>(c, moecomm::dedup_per_rank<moecomm::flat>{});
    check_all_capacities<float>(c, moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
    check_all_capacities<float>(c, moecomm::dedup_per_rank<moecomm::pairwise>{{c.per_node}});
    check_all_capacities<float>(c, moecomm::dedup_per_node{});
  }
  // Per node: 3 nodes of 2, and 2 of 4 with 2 experts a rank; bf16 rounds each partial sum.
  check_all_capacities<float>(layer_case{6, 2, 12, 5, 8, {25, 0, 31, 1, 18, 40}, 1.2}, moecomm::dedup_per_node{});
  check_all_capacities<float>(layer_case{8, 4, 16, 8, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 0.0}, moecomm::dedup_per_node{});
  for (auto const& bf16 : {layer_case{8, 4, 16, 6, 16, {50, 50, 50, 50, 50, 50, 50, 50}, 2.0}}) {
    check_all_capacities<__nv_bfloat16>(bf16, moecomm::dedup_per_rank<moecomm::flat>{});
    check_all_capacities<__nv_bfloat16>(bf16, moecomm::dedup_per_node{4});
  }
}

// One row per (token, destination rank) crosses the network each way, with its slot list (8·K
// bytes) once per routing: counted exactly. Where each token's experts share one rank, the per-rank
// sum is the whole sum, and the deduplicated layer gives plain dispatch's bits (the plain oracle).
TEST_CASE("a deduplicated exchange moves one row per token and rank, and gives plain bits when a token's experts share a rank") {
  layer_case const c{4, 2, 16, 3, 16, {40, 25, 0, 33}, 0.0};
  auto in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false, sum_order::per_rank);
  auto const general = in.want;
  for (int32_t r = 0; r < c.ranks; ++r) {  // token t: experts d*4 + {t, t+1, t+2} mod 4 of rank d = (t + r) mod 4
    auto& routing = in.routing[static_cast<std::size_t>(r)];
    for (int64_t t = 0; t < routing.tokens; ++t)
      for (int32_t k = 0; k < c.top_k; ++k) {
        auto const slot = static_cast<std::size_t>(t * c.top_k + k);
        routing.idx[slot] = static_cast<int32_t>((t + r) % 4 * 4 + (t + k) % 4);
        if (std::isnan(routing.w[slot])) routing.w[slot] = 0.3f;  // a slot that was masked
      }
    in.want[static_cast<std::size_t>(r)] = layer_oracle(routing, routing.tokens * c.top_k, in.x[static_cast<std::size_t>(r)],
                                                        in.d_out[static_cast<std::size_t>(r)], c.hidden, c.experts);
    CHECK(layer_oracle(routing, routing.tokens * c.top_k, in.x[static_cast<std::size_t>(r)], in.d_out[static_cast<std::size_t>(r)],
                       c.hidden, c.experts, c.ranks).out == in.want[static_cast<std::size_t>(r)].out);
  }
  CHECK(general[0].out != make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false).want[0].out);
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    check_layer_on_rank(comm, c, in, moecomm::dropless{}, moecomm::dedup_per_rank<moecomm::flat>{});
    // The bytes: token t of rank s goes to rank (t + s) mod 4 only; those not to s itself cross.
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless,
                                   moecomm::dedup_per_rank<moecomm::flat>>
        dedup(moecomm::host_backend{}, groups, c.experts, c.hidden);
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator> plain(moecomm::host_backend{}, groups,
                                                                                                   c.experts, c.hidden);
    int32_t const me = comm.rank();
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    int64_t sent_rows = 0, returned_rows = 0;  // dispatch rows this rank sends; combine rows it sends back
    for (int32_t s = 0; s < c.ranks; ++s)
      for (int64_t t = 0; t < in.routing[static_cast<std::size_t>(s)].tokens; ++t) {
        int64_t const d = (t + s) % 4;
        sent_rows += s == me && d != me ? 1 : 0;
        returned_rows += s != me && d == me ? 1 : 0;
      }
    std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden));
    moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
    moecomm::matrix_view<float const> const x{in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden};
    scale_experts<float> const experts{me * 4};
    dedup.forward(view, x, {out.data(), r.tokens, c.hidden}, experts);
    plain.forward(view, x, {out.data(), r.tokens, c.hidden}, experts);
    auto sent = [](moecomm::alltoall_stats const& s) { return s.intra_bytes + s.inter_bytes; };
    int64_t const row = c.hidden * 4;
    CHECK(sent(dedup.dispatch_state().report().exchange) == (sent_rows + returned_rows) * row);
    CHECK(sent(dedup.dispatch_state().report().slot_metadata) == sent_rows * 8 * c.top_k);
    CHECK(sent(plain.dispatch_state().report().exchange) == (sent_rows + returned_rows) * c.top_k * row);
  });
}

// Per node (semantics §10a): one row per (token, destination node) crosses between nodes, to the
// relay with the sender's local index, and one per (token, destination rank) inside the node, each
// way; the slot lists follow the same rows once per routing. Counted exactly, per link class.
TEST_CASE("a per-node deduplicated exchange moves one row per token and node between nodes, and one per token and rank inside") {
  layer_case const c{8, 4, 16, 4, 16, {40, 25, 0, 33, 17, 60, 9, 28}, 1.2};  // 2 nodes of 4 ranks, 2 experts a rank
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false, sum_order::per_node);
  auto node_of = [&](int32_t r) { return r / c.per_node; };
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  std::vector<int64_t> inter_per_node(8), inter_per_rank(8);
  world.run([&](moecomm::inproc_communicator comm) {
    int32_t const me = comm.rank();
    int64_t inter_rows = 0, intra_rows = 0, inter_lists = 0, intra_lists = 0;
    for (int32_t s = 0; s < c.ranks; ++s) {
      auto const& r = in.routing[static_cast<std::size_t>(s)];
      for (int64_t t = 0; t < r.tokens; ++t) {
        std::set<int32_t> nodes, ranks;
        for (int32_t k = 0; k < c.top_k; ++k)
          if (int32_t const e = r.at(t, k); e >= 0) {
            ranks.insert(e / 2);
            nodes.insert(node_of(e / 2));
          }
        for (int32_t n : nodes) {
          int32_t const relay = n * c.per_node + s % c.per_node;
          inter_rows += (s == me && relay != me) + (relay == me && s != me);  // there, and back
          inter_lists += s == me && relay != me;
          for (int32_t d : ranks)
            if (node_of(d) == n) {
              intra_rows += (relay == me && d != me) + (d == me && relay != me);
              intra_lists += relay == me && d != me;
            }
        }
      }
    }
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::dedup_per_node>
        per_node(moecomm::host_backend{}, groups, c.experts, c.hidden);
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless,
                                   moecomm::dedup_per_rank<moecomm::flat>>
        per_rank(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden));
    moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
    moecomm::matrix_view<float const> const x{in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden};
    scale_experts<float> const experts{me * 2};
    per_node.forward(view, x, {out.data(), r.tokens, c.hidden}, experts);
    check_bitwise(out, in.want[static_cast<std::size_t>(me)].out, c.hidden, "per-node output");
    per_rank.forward(view, x, {out.data(), r.tokens, c.hidden}, experts);
    int64_t const row = c.hidden * 4;
    auto const& report = per_node.dispatch_state().report();
    CHECK(report.exchange.inter_bytes == inter_rows * row);
    CHECK(report.exchange.intra_bytes == intra_rows * row);
    int64_t const list_bytes = 8 * c.top_k + (moecomm::dedup_per_node{}.pieces > 1 ? 4 : 0);  // with pieces, the row's source token
    CHECK(report.slot_metadata.inter_bytes == inter_lists * list_bytes);
    CHECK(report.slot_metadata.intra_bytes == intra_lists * list_bytes);
    inter_per_node[static_cast<std::size_t>(me)] = report.exchange.inter_bytes;
    inter_per_rank[static_cast<std::size_t>(me)] = per_rank.dispatch_state().report().exchange.inter_bytes;
  });
  // Top-4 of 16 over 2 nodes: most tokens reach a remote node through more than one of its ranks.
  int64_t const node_total = std::accumulate(inter_per_node.begin(), inter_per_node.end(), int64_t{0});
  int64_t const rank_total = std::accumulate(inter_per_rank.begin(), inter_per_rank.end(), int64_t{0});
  CHECK(node_total < rank_total * 3 / 4);
}

// dedup_per_node's overlapped hops (the rows to each relay cut into `pieces`, piece j's first hop and
// piece j - 1's second in one exchange): any number of pieces, more than a rank's rows included,
// gives the oracle's bits, the same bytes and pieces + 1 row exchanges each way.
TEST_CASE("dedup_per_node cut into any number of pieces equals the oracle, with the same bytes in pieces + 1 exchanges each way") {
  for (int32_t const pieces : {1, 2, 3, 7, 64}) {
    CAPTURE(pieces);
    check_all_capacities<float>(layer_case{6, 2, 12, 5, 8, {25, 0, 31, 1, 18, 40}, 1.2}, moecomm::dedup_per_node{pieces});
    check_all_capacities<float>(layer_case{8, 4, 16, 8, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 0.0}, moecomm::dedup_per_node{pieces});
  }
  layer_case const c{8, 4, 16, 4, 16, {40, 25, 0, 33, 17, 60, 9, 28}, 1.2};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false, sum_order::per_node);
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    int32_t const me = comm.rank();
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
    moecomm::matrix_view<float const> const x{in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden};
    std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden));
    moecomm::alltoall_stats one_piece;
    for (int32_t const pieces : {1, 5}) {
      moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::dedup_per_node>
          layer(moecomm::host_backend{}, groups, c.experts, c.hidden, {}, moecomm::dedup_per_node{pieces});
      layer.forward(view, x, {out.data(), r.tokens, c.hidden}, scale_experts<float>{me * 2});
      check_bitwise(out, in.want[static_cast<std::size_t>(me)].out, c.hidden, "per-node output");
      moecomm::alltoall_stats const& moved = layer.dispatch_state().report().exchange;
      CHECK(moved.rounds == 2 * (pieces + 1));  // the dispatch's and the combine's
      if (pieces == 1) one_piece = moved;
      CHECK(moved.inter_bytes == one_piece.inter_bytes);
      CHECK(moved.intra_bytes == one_piece.intra_bytes);
    }
  });
}

// Each piece carries its share of every link's rows on both hops, whatever the routing's order. Every
// rank sends all its tokens to node 1, whose two ranks take them either in runs (the first half to
// rank 2, the rest to rank 3, as a replicated layer's contiguous shares do) or in turns (even tokens
// to rank 2, odd to rank 3, as alternating replicas do). Each of 4 pieces sends each relay a quarter
// of its rows, and each relay forwards each rank of its node a quarter of its rows in each piece.
// Token ranges would give the runs' pieces 0 and 1 to rank 2 alone; every fourth row (row i in piece
// i mod 4) would give the turns' pieces 0 and 2 to rank 2 alone.
TEST_CASE("dedup_per_node's pieces carry a share of every link on both hops, for rows in runs and in turns") {
  constexpr int32_t ranks = 4, per_node = 2, experts = 8, tokens = 40, pieces = 4;
  for (bool const turns : {false, true}) {
    CAPTURE(turns);
    moecomm::inproc_world const world(ranks, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(ranks, per_node));
      std::vector<int32_t> idx(tokens);
      std::vector<float> weights(tokens, 1.0f);
      for (int32_t t = 0; t < tokens; ++t) idx[static_cast<std::size_t>(t)] = (turns ? t % 2 == 0 : t < tokens / 2) ? 4 : 6;
      moecomm::host_backend const be;
      moecomm::workspace<moecomm::host_backend> scratch;
      moecomm::dedup_node_plan<moecomm::host_backend> plan;
      plan.cut_into(pieces, groups.topo());
      plan.build_source(be, {idx.data(), weights.data(), tokens, 1}, {}, experts, groups, scratch);
      plan.gather_counts(be, groups);
      int32_t const me = comm.rank(), relay = per_node + me % per_node;
      for (int32_t j = 0; j < pieces; ++j) {
        CAPTURE(j);
        CHECK(plan.rows_to_relay(j, relay) == tokens / pieces);
        CHECK(plan.rows_to_relay(j, relay - per_node) == 0);
        for (int32_t d = 0; d < ranks; ++d) {
          CAPTURE(d);
          // A relay of node 1 gets every token of the 2 ranks with its local index: half of them for each rank there.
          CHECK(plan.rows_forwarded(j, d) == (me >= per_node && d >= per_node ? tokens / pieces : 0));
        }
      }
    });
  }
}

// The experts see plain dispatch's rows in its order, (expert, source rank, source token), whatever
// the exchange: per rank, and per node with any number of pieces, whose rows reach the experts'
// ranks piece by piece and are put back in each source's token order there.
TEST_CASE("deduplicated exchanges give the experts plain dispatch's rows in plain dispatch's order, for any pieces") {
  layer_case const c{8, 4, 16, 4, 8, {40, 25, 0, 33, 17, 60, 9, 28}, 1.2};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false);
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
    auto const& r = in.routing[static_cast<std::size_t>(comm.rank())];
    moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
    moecomm::matrix_view<float const> const x{in.x[static_cast<std::size_t>(comm.rank())].data(), r.tokens, c.hidden};
    moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator> plain(be, groups, c.experts);
    plain.route(view);
    auto want = poisoned<float>(plain.received_rows() * c.hidden);
    plain.dispatch<float>(x, {want.data(), plain.received_rows(), c.hidden});
    auto check = [&](auto& dedup, char const* what) {
      dedup.route(view);
      REQUIRE(dedup.received_rows() == plain.received_rows());
      auto got = poisoned<float>(dedup.received_rows() * c.hidden);
      dedup.template dispatch<float>(x, {got.data(), dedup.received_rows(), c.hidden});
      check_bitwise(got, want, c.hidden, what);
    };
    moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::dedup_per_rank<moecomm::flat>>
        per_rank(be, groups, c.experts);
    check(per_rank, "per-rank expert rows");
    for (int32_t const pieces : {1, 2, 3, 4, 7}) {
      CAPTURE(pieces);
      moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::dedup_per_node> per_node(
          be, groups, c.experts, {}, moecomm::dedup_per_node{pieces});
      check(per_node, "per-node expert rows");
    }
  });
}

TEST_CASE("dedup_per_node with pieces < 1 is refused, naming the field") {
  moecomm::inproc_world const world(2, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(2, 1));
    auto make = [&] {
      moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, moecomm::dedup_per_node> d(
          moecomm::host_backend{}, groups, 4, {}, moecomm::dedup_per_node{0});
    };
    CHECK_THROWS_WITH_AS(make(), doctest::Contains("algorithm.pieces = 0 must be at least 1"), moecomm::error);
  });
}

TEST_CASE("the layer handles bf16 rows, an expert nobody uses and all tokens on one expert") {
  layer_case const skewed{8, 4, 16, 1, 16, {50, 50, 50, 50, 50, 50, 50, 50}, 8.0};  // Zipf 8: almost all to expert 0
  check_all_capacities<__nv_bfloat16>(skewed, moecomm::hierarchical_2d{});
  check_all_capacities<__nv_bfloat16>(skewed, moecomm::flat{});
}

TEST_CASE("a second, smaller batch through the same layer leaves no stale rows") {
  layer_case const big{4, 2, 8, 2, 16, {60, 50, 40, 30}, 1.0}, small{4, 2, 8, 2, 16, {3, 0, 5, 1}, 1.0};
  moecomm::capacity<moecomm::drop_by_position> const capacity{1.0, 0, true, {}};
  auto const in_big = make_layer_inputs<float>(big, capacity, oracle::drop_rule::position, true);
  auto const in_small = make_layer_inputs<float>(small, capacity, oracle::drop_rule::position, true);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(4, 2));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, decltype(capacity),
                                   moecomm::hierarchical_2d>
        layer(moecomm::host_backend{}, groups, 8, 16, capacity);
    check_layer_step(layer, comm.rank(), big, in_big);
    check_layer_step(layer, comm.rank(), small, in_small);
  });
}

TEST_CASE("dispatch before route is an error, not a crash") {
  moecomm::inproc_world const world(1);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(1, 1));
    moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator> d(moecomm::host_backend{}, groups, 4);
    std::vector<float> x(8), rows(8);
    check_error([&] { d.dispatch<float>({x.data(), 2, 4}, {rows.data(), 2, 4}); }, moecomm::status::invalid_usage,
                {"dispatch was called before route()"});
    check_error([&] { moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator>(moecomm::host_backend{}, groups, 0); },
                moecomm::status::invalid_argument, {"num_experts = 0 must be a positive multiple of the 1 ranks"});
  });
}

// A caller that holds the routing's plan (the replicated layer, Parm) routes with it: the same
// rows reach the same experts as when the dispatcher builds the plan, for every capacity policy;
// the plan comes back holding the dispatcher's previous arrays; a plan over other experts or padded is named.
TEST_CASE("dispatcher::route(plan) equals route(routing) and names a plan it cannot take") {
  layer_case const c{4, 2, 8, 2, 8, {30, 1, 0, 57}, 1.2};
  for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
    using Capacity = std::decay_t<decltype(capacity)>;
    std::string const policy = Capacity::name;
    CAPTURE(policy);
    auto const in = make_layer_inputs<float>(c, capacity, rule, drops);
    moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      moecomm::host_backend const be;
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
      using dispatcher_t = moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, Capacity>;
      dispatcher_t by_routing(be, groups, c.experts, capacity), by_plan(be, groups, c.experts, capacity);
      auto const& r = in.routing[comm.rank()];
      moecomm::routing_view const view{r.idx.data(), r.w.data(), r.tokens, r.top_k};
      moecomm::matrix_view<float const> const x{in.x[comm.rank()].data(), r.tokens, c.hidden};
      moecomm::workspace<moecomm::host_backend> scratch;
      moecomm::permute_plan<moecomm::host_backend> plan;
      for (int step = 0; step < 2; ++step) {
        by_routing.route(view);
        moecomm::build_permute_plan(be, view, c.experts, plan, scratch);
        by_plan.route(plan);
        REQUIRE(by_plan.received_rows() == by_routing.received_rows());
        CHECK(by_plan.report().dropped_slots == by_routing.report().dropped_slots);
        CHECK(by_plan.plan().routing().topk_weights == r.w.data());  // the ids are the kept ones when dropping
        auto want = poisoned<float>(by_routing.received_rows() * c.hidden), got = want;
        by_routing.template dispatch<float>(x, {want.data(), by_routing.received_rows(), c.hidden});
        by_plan.template dispatch<float>(x, {got.data(), by_plan.received_rows(), c.hidden});
        check_bitwise(got, want, c.hidden, "expert rows");
      }
      moecomm::build_permute_plan(be, view, c.experts / 2, plan, scratch, moecomm::unchecked_routing);
      check_error([&] { by_plan.route(plan); }, moecomm::status::invalid_argument,
                  {"dispatcher::route", "argument 'plan' is over 4 experts; the dispatcher's num_experts = 8"});
      std::int64_t const padded = r.tokens * r.top_k + 1;
      moecomm::build_permute_plan(be, view, c.experts, plan, scratch, {}, padded);
      check_error([&] { by_plan.route(plan); }, moecomm::status::invalid_argument,
                  {"argument 'plan' is padded to " + std::to_string(padded) + " rows per expert"});
    });
  });
}

template <class Algorithm>
void check_throwing_expert_stops_every_rank(Algorithm const& algorithm) {
  CAPTURE(Algorithm::name);
  auto const in = make_layer_inputs<float>(throwing_expert_case, moecomm::dropless{}, oracle::drop_rule::position, false);
  moecomm::inproc_world const world(4, std::chrono::seconds(20));
  std::atomic<int> stopped{0};
  auto const start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([&](moecomm::inproc_communicator comm) {
    forward_with_a_throwing_expert(comm, moecomm::host_backend{}, algorithm, in, stopped);
  }), "expert 5 ran out of memory", std::runtime_error);
  CHECK(stopped == 3);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("grouped experts (one call for all local experts) equal the oracle, and the layer prefers that form") {
  layer_case const c{4, 2, 16, 2, 8, {30, 1, 0, 57}, 1.2};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false);
  auto run = [&](auto const& algorithm) {
    using Algorithm = std::decay_t<decltype(algorithm)>;
    CAPTURE(Algorithm::name);
    moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
      moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless, Algorithm>
          layer(moecomm::host_backend{}, groups, c.experts, c.hidden, {}, algorithm);
      check_layer_step<float, grouped_scale_experts<float>>(layer, comm.rank(), c, in);
    });
  };
  run(moecomm::flat{});
  run(moecomm::smart_schedule{c.per_node});
  grouped_scale_experts<float> const experts(0);  // a forward's and a backward's grouped call, no per-expert one
  moecomm::inproc_world const world(1, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(1, 1));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto const& r = in.routing[0];
    std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden)), d_x(out.size());
    layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[0].data(), r.tokens, c.hidden}, {out.data(), r.tokens, c.hidden},
                  experts);
    layer.backward({in.d_out[0].data(), r.tokens, c.hidden}, {d_x.data(), r.tokens, c.hidden}, moecomm::not_needed, experts);
    CHECK(experts.grouped_calls == 2);
  });
}

TEST_CASE("the dispatch report gives the row access width: 16 bytes, or narrower for rows not 16-byte aligned") {
  auto width = [](int64_t hidden, int64_t offset) {
    int result = 0;
    moecomm::inproc_world const world(1, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(1, 1));
      auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 2, hidden);
      auto const routing = make_routing({5, 1, 2, 0.0, false, 0.0, 3});
      std::vector<float> x(static_cast<std::size_t>(5 * hidden + offset), 1.0f), out(x.size());
      layer.forward({routing.idx.data(), routing.w.data(), 5, 1}, {x.data() + offset, 5, hidden}, {out.data() + offset, 5, hidden},
                    scale_experts<float>{0});
      result = layer.dispatch_state().report().row_access_bytes;
    });
    return result;
  };
  CHECK(width(16, 0) == 16);
  CHECK(width(6, 0) == 8);   // 24-byte rows
  CHECK(width(7, 0) == 4);   // 28-byte rows: one float at a time
  CHECK(width(16, 1) == 4);  // rows start 4 bytes past a 16-byte boundary
}

TEST_CASE("an expert that throws on one rank stops every rank with an error, not a hang") {
  check_throwing_expert_stops_every_rank(moecomm::flat{});
  check_throwing_expert_stops_every_rank(moecomm::smart_schedule{2});  // thrown on the worker thread
}

TEST_CASE("the smart schedule runs the experts on a worker thread, one step's sources at a time, in step order") {
  // 8 ranks in 4 groups of 2, one expert per rank; every element of rank s's tokens is s, so an
  // expert's input tells which source rank's chunk it is.
  std::int32_t const ranks = 8, group = 2, tokens = 40, hidden = 4;
  moecomm::inproc_world const world(ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    std::int32_t const me = comm.rank();
    auto const routing = make_routing({tokens, 2, ranks, 0.0, false, 0.0, static_cast<std::uint32_t>(900 + me)});
    std::vector<float> const x(static_cast<std::size_t>(tokens * hidden), static_cast<float>(me));
    std::vector<float> out(x.size());
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(ranks, 4));
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless,
                                   moecomm::smart_schedule>
        layer(moecomm::host_backend{}, groups, ranks, hidden, {}, moecomm::smart_schedule{group});
    std::vector<std::int32_t> sources;  // the source rank of each call, in call order
    bool on_caller_thread = false;
    auto const caller = std::this_thread::get_id();
    auto experts = [&](int32_t l, moecomm::matrix_view<float const> a, moecomm::matrix_view<float> b) {
      on_caller_thread = on_caller_thread || std::this_thread::get_id() == caller;
      sources.push_back(static_cast<std::int32_t>(a.data[0]));
      scale_experts<float>{me}(l, a, b);
    };
    layer.forward({routing.idx.data(), routing.w.data(), tokens, 2}, {x.data(), tokens, hidden}, {out.data(), tokens, hidden},
                  experts);
    CHECK_FALSE(on_caller_thread);
    // Step j brings the rows of group (mine - j) mod 4: sources in that order, ascending in a group.
    std::vector<std::int32_t> order;
    for (std::int32_t step = 0; step < ranks / group; ++step)
      for (std::int32_t i = 0; i < group; ++i) order.push_back(((me / group - step + 4) % 4) * group + i);
    std::size_t next = 0;
    for (std::int32_t s : sources) {
      while (next < order.size() && order[next] != s) ++next;
      REQUIRE_MESSAGE(next < order.size(), "rank ", me, ": source ", s, " computed out of step order");
      ++next;
    }
    CHECK(sources.size() >= 6);  // nearly every source sends this expert rows
  });
}

template <class Capacity>
void check_a_bad_routing_on_one_rank(Capacity const& capacity) {
  // The value scan's verdict rides on the route's first all-gather (the dropless count exchange,
  // or a capacity policy's agreement): the bad rank names the token and slot, every other rank
  // that rank, and no rank waits for rows.
  constexpr int32_t ranks = 4, experts = 8, top_k = 2, tokens = 3;
  for (bool const nan_weight : {false, true}) {
    CAPTURE(nan_weight);
    moecomm::inproc_world const world(ranks, std::chrono::seconds(20));
    world.run([&](moecomm::inproc_communicator comm) {
      int32_t const me = comm.rank();
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(ranks, 2));
      moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator, Capacity> d(moecomm::host_backend{}, groups,
                                                                                           experts, capacity);
      auto ids = [&](int32_t rank) {
        std::vector<int32_t> idx;
        for (int32_t t = 0; t < tokens; ++t)
          for (int32_t k = 0; k < top_k; ++k) idx.push_back((t + rank + k) % experts);
        return idx;
      };
      std::vector<int32_t> idx = ids(me);
      std::vector<float> w(idx.size(), 0.5f);
      if (me == 2) {
        if (nan_weight) w[3] = std::nanf("");  // token 1, slot 1
        else idx[3] = experts + 1;
      }
      moecomm::routing_view const bad{idx.data(), w.data(), tokens, top_k};
      if (me == 2) {
        check_error([&] { d.route(bad); }, moecomm::status::invalid_argument,
                    {"make_permute_plan", nan_weight ? "topk_weights[1][1] is NaN" : "topk_idx[1][1] = 9", "(token 1, slot 1)"});
      } else {
        check_error([&] { d.route(bad); }, moecomm::status::aborted,
                    {"dispatcher::route", "rank 2's routing is invalid at slot 3", "No rows were exchanged"});
      }
      idx = ids(me);
      std::fill(w.begin(), w.end(), 0.5f);
      d.route({idx.data(), w.data(), tokens, top_k});
      int64_t expected = 0;  // nothing is dropped: no expert gets more than 2 slots of a rank
      for (int32_t s = 0; s < ranks; ++s)
        for (int32_t e : ids(s)) expected += e / (experts / ranks) == me ? 1 : 0;
      CHECK(d.received_rows() == expected);
      CHECK(d.report().dropped_slots == 0);
    });
  }
}

TEST_CASE("a bad routing value on one rank makes every rank raise at the route's first all-gather, naming that rank; the next route works") {
  SUBCASE("dropless") { check_a_bad_routing_on_one_rank(moecomm::dropless{}); }
  SUBCASE("capacity") { check_a_bad_routing_on_one_rank(moecomm::capacity<moecomm::drop_by_position>{8.0, 0, false, {}}); }
  SUBCASE("receiver budget") { check_a_bad_routing_on_one_rank(moecomm::receiver_budget{100}); }
}

TEST_CASE("ranks that disagree on the number of experts get an error on every rank") {
  moecomm::inproc_world const world(2, std::chrono::seconds(20));
  std::atomic<int> named{0};
  CHECK_THROWS_AS(world.run([&](moecomm::inproc_communicator comm) {
    int32_t const experts = comm.rank() == 0 ? 4 : 8;  // rank 1 was configured differently
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(2, 1));
    moecomm::dispatcher<moecomm::host_backend, moecomm::inproc_communicator> d(moecomm::host_backend{}, groups, experts);
    std::vector<int32_t> const idx{0, 1};
    try {
      d.route({idx.data(), nullptr, 1, 2});
    } catch (moecomm::error const& e) {
      if (e.code() == moecomm::status::invalid_usage &&
          std::string(e.what()).find("world rank 0 called allgather(size 48, 0), but world rank 1 called allgather(size 80, 0)") !=
              std::string::npos)
        ++named;
      throw;
    }
  }), moecomm::error);
  CHECK(named == 2);
}

}  // namespace test

namespace test {

TEST_CASE("a forward without its backward is an error in training mode, and allowed in inference mode") {
  layer_case const c{2, 2, 4, 2, 8, {12, 7}, 0.0};
  auto const in = make_layer_inputs<float>(c, moecomm::dropless{}, oracle::drop_rule::position, false);
  moecomm::inproc_world const world(2, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    std::int32_t const me = comm.rank();
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(2, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, c.experts, c.hidden);
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    std::vector<float> out(static_cast<std::size_t>(r.tokens * c.hidden)), d_x(out.size());
    scale_experts<float> const experts{me * 2};
    auto forward = [&] {
      layer.forward({r.idx.data(), r.w.data(), r.tokens, r.top_k}, {in.x[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden},
                    {out.data(), r.tokens, c.hidden}, experts);
    };
    auto backward = [&] {
      layer.backward({in.d_out[static_cast<std::size_t>(me)].data(), r.tokens, c.hidden}, {d_x.data(), r.tokens, c.hidden},
                     moecomm::not_needed, experts);
    };
    CHECK(layer.training());
    forward();
    check_error(forward, moecomm::status::invalid_usage,
                {"expert_parallel_layer::forward: called for step 2, but step 1's forward has had no backward"});
    backward();  // the step's backward still runs, and the next forward is fine
    forward();
    backward();
    layer.set_training(false);
    forward();
    forward();  // inference: forwards follow each other
    check_error(backward, moecomm::status::invalid_usage, {"expert_parallel_layer::backward: called in inference mode"});
    layer.set_training(true);
    forward();
    backward();
    check_bitwise(out, in.want[static_cast<std::size_t>(me)].out, c.hidden, "output after the misuse");
    check_bitwise(d_x, in.want[static_cast<std::size_t>(me)].d_x, c.hidden, "input gradient after the misuse");
  });
}

}  // namespace test
