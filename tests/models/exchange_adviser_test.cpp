// SPDX-License-Identifier: Apache-2.0
// The exchange adviser (models/exchange_adviser.hpp) on hand-computed cases: the round model's loads,
// the rows each algorithm moves, and errors that name the argument. Its agreement with the
// simulation is measured by bench_exchange_adviser (docs/performance.md).

#include "../support/test_support.hpp"

#include <moecomm/models/exchange_adviser.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace test {

// Two nodes of two GPUs; launches free and HBM so fast that only the network counts.
moecomm::cluster_spec two_by_two() {
  moecomm::cluster_spec s;
  s.name = "two-by-two"; s.source = "a test";
  s.nodes_per_domain = 2; s.gpus_per_node = 2;
  s.gpu_flops = 1e12; s.hbm_bytes_per_second = 1e30; s.kernel_launch_seconds = 0;
  s.intra_node = {100e9, 1e-6}; s.pcie = {40e9, 2e-6}; s.nic = {20e9, 3e-6}; s.fabric = {0, 0.5e-6};
  return s;
}

TEST_CASE("exchange adviser: the busiest link and the longest route price a round, on hand-computed rows") {
  moecomm::exchange_adviser const adviser(two_by_two(), moecomm::topology(4, 2));
  std::int64_t const T = 1000;
  double const row = 4096;
  // Every token of rank s goes to the expert of rank (s + 2) mod 4 (the other node, same local
  // index) and to the next expert there: two slots, one rank, one node.
  std::vector<std::vector<std::int32_t>> idx(4);
  std::vector<moecomm::routing_view> routing;
  for (std::int32_t s = 0; s < 4; ++s) {
    std::int32_t const d = (s + 2) % 4;
    for (std::int64_t t = 0; t < T; ++t) idx[static_cast<std::size_t>(s)].insert(idx[static_cast<std::size_t>(s)].end(), {2 * d, 2 * d + 1});
    routing.push_back({idx[static_cast<std::size_t>(s)].data(), nullptr, T, 2});
  }
  auto const ranking = adviser.rank(routing, 8, row);
  REQUIRE(ranking.size() == 4);
  auto find = [&](std::string const& name) {
    for (auto const& p : ranking)
      if (p.algorithm == name) return p;
    FAIL("no prediction for ", name);
    return ranking.front();
  };
  // The node's NICs carry both GPUs' rows (2 x rows at 20 GB/s): busier than a PCIe link (40 GB/s).
  double const latency = 2 * 2e-6 + 2 * 3e-6 + 0.5e-6;
  auto const flat = find("flat");
  CHECK(flat.dispatch_seconds == doctest::Approx(latency + 2.0 * 2 * T * row / 20e9).epsilon(1e-12));
  CHECK(flat.combine_seconds == doctest::Approx(flat.dispatch_seconds).epsilon(1e-12));
  CHECK(flat.inter_node_bytes == doctest::Approx(2 * T * row));
  CHECK(flat.intra_node_bytes == 0);
  // One row per token crosses with dedup (both slots on one rank, the relay is that rank itself);
  // per node in `pieces` rounds, each paying the route's latency.
  for (char const* name : {"dedup_per_rank", "dedup_per_node"}) {
    CAPTURE(name);
    auto const p = find(name);
    double const rounds = std::string(name) == "dedup_per_node" ? moecomm::dedup_per_node{}.pieces : 1;
    CHECK(p.dispatch_seconds == doctest::Approx(rounds * latency + 2.0 * T * row / 20e9).epsilon(1e-12));
    CHECK(p.inter_node_bytes == doctest::Approx(T * row));
    CHECK(p.intra_node_bytes == 0);
  }
  // hierarchical_2d: nothing to forward inside the node here, then the same inter-node round.
  CHECK(find("hierarchical_2d").dispatch_seconds == doctest::Approx(flat.dispatch_seconds).epsilon(1e-12));
  // Fastest first; the deduplicated exchanges halve the bytes, but pay more in `route`.
  for (std::size_t i = 1; i < ranking.size(); ++i) CHECK(ranking[i - 1].seconds() <= ranking[i].seconds());
  CHECK(find("dedup_per_rank").route_seconds > flat.route_seconds);
  CHECK(ranking.front().algorithm.rfind("dedup", 0) == 0);
}

// dedup_per_node's pieces: every token of rank s goes to both experts of the rank with the other
// local index on the other node: one row over the NICs to the relay (the rank of s's local index
// there), which forwards it over the node's own links. In P pieces the forward of piece j - 1 runs
// beside piece j's crossing and only the last piece's forward is left after the crossing.
TEST_CASE("exchange adviser: dedup_per_node's pieces hide the hop inside the node behind the hop between nodes") {
  std::int64_t const T = 1000;
  double const row = 4096;
  std::vector<std::vector<std::int32_t>> idx(4);
  std::vector<moecomm::routing_view> routing;
  for (std::int32_t s = 0; s < 4; ++s) {
    std::int32_t const d = ((s + 2) % 4) ^ 1;
    for (std::int64_t t = 0; t < T; ++t) idx[static_cast<std::size_t>(s)].insert(idx[static_cast<std::size_t>(s)].end(), {2 * d, 2 * d + 1});
    routing.push_back({idx[static_cast<std::size_t>(s)].data(), nullptr, T, 2});
  }
  double const between = 2 * 2e-6 + 2 * 3e-6 + 0.5e-6, inside = 2 * 1e-6;  // the routes' latencies
  double const crossing = 2.0 * T * row / 20e9, forward = T * row / 100e9;  // a node's NIC carries both GPUs' rows
  for (std::int32_t const pieces : {1, 2, 4, 16}) {
    CAPTURE(pieces);
    auto const ranking = moecomm::exchange_adviser(two_by_two(), moecomm::topology(4, 2), pieces).rank(routing, 8, row);
    auto const p = *std::find_if(ranking.begin(), ranking.end(), [](auto const& x) { return x.algorithm == "dedup_per_node"; });
    CHECK(p.dispatch_seconds == doctest::Approx(pieces * between + crossing + inside + forward / pieces).epsilon(1e-12));
    CHECK(p.combine_seconds == doctest::Approx(p.dispatch_seconds).epsilon(1e-12));
    CHECK(p.inter_node_bytes == doctest::Approx(T * row));
    CHECK(p.intra_node_bytes == doctest::Approx(T * row));
  }
  check_error([&] { moecomm::exchange_adviser(two_by_two(), moecomm::topology(4, 2), 0); }, moecomm::status::invalid_argument,
              {"dedup_pieces = 0"});
}

TEST_CASE("exchange adviser: groups on their own communicators all-gather their own counts; flat prices any slot matrix") {
  moecomm::cluster_spec const spec = two_by_two();
  moecomm::topology const topo(4, 2);
  moecomm::exchange_adviser const adviser(spec, topo);
  moecomm::link_model const links(spec, topo);
  std::int64_t const T = 100;
  double const row = 1024;
  // Each node is a group of its own (Megatron's EP groups): rank s sends its tokens to the other
  // rank of its node, whose first expert (of 2 a rank) they all choose.
  std::vector<std::vector<std::int32_t>> idx(4);
  std::vector<moecomm::routing_view> routing;
  for (std::int32_t s = 0; s < 4; ++s) {
    idx[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(T), 2 * (s ^ 1));
    routing.push_back({idx[static_cast<std::size_t>(s)].data(), nullptr, T, 1});
  }
  std::vector<std::vector<std::int32_t>> const nodes{{0, 1}, {2, 3}};
  auto const find = [](std::vector<moecomm::exchange_prediction> const& ranking, std::string const& name) {
    for (auto const& p : ranking)
      if (p.algorithm == name) return p;
    FAIL("no prediction for ", name);
    return ranking.front();
  };
  auto const world = adviser.rank(routing, 8, row), grouped = adviser.rank(routing, 8, row, nodes);
  // A group of 2 all-gathers its 4 experts' counts (and, deduplicated, its 2 ranks'), beside the other.
  CHECK(find(world, "flat").route_seconds == doctest::Approx(links.allgather_seconds(8.0 * 8)).epsilon(1e-12));
  CHECK(find(grouped, "flat").route_seconds == doctest::Approx(links.allgather_seconds(nodes, 8.0 * 4)).epsilon(1e-12));
  CHECK(find(grouped, "flat").route_seconds < find(world, "flat").route_seconds);
  CHECK(find(grouped, "dedup_per_rank").route_seconds - find(world, "dedup_per_rank").route_seconds ==
        doctest::Approx(links.allgather_seconds(nodes, 8.0 * (4 + 2)) - links.allgather_seconds(8.0 * (8 + 4))).epsilon(1e-9));
  for (auto const& p : grouped) {
    CAPTURE(p.algorithm);
    CHECK(p.dispatch_seconds == doctest::Approx(find(world, p.algorithm).dispatch_seconds).epsilon(1e-12));
  }
  // `flat` on the same rows, given as a matrix, with the route it is given.
  moecomm::link_model::matrix slots = links.zeros();
  for (std::int32_t s = 0; s < 4; ++s) slots[links.cell(s, s ^ 1)] = T;
  auto const given = adviser.flat(slots, std::vector<double>(4, double(T)), row, 1e-3);
  CHECK(given.route_seconds == 1e-3);
  CHECK(given.dispatch_seconds == doctest::Approx(find(world, "flat").dispatch_seconds).epsilon(1e-12));
  CHECK(given.combine_seconds == doctest::Approx(find(world, "flat").combine_seconds).epsilon(1e-12));
  check_error([&] { (void)adviser.flat({1.0}, std::vector<double>(4, 1.0), row, 0); }, moecomm::status::invalid_argument,
              {"argument 'slots' has 1 cells"});
  check_error([&] { (void)adviser.flat(slots, {1.0}, row, 0); }, moecomm::status::invalid_argument, {"argument 'tokens' has 1 entries"});
  check_error([&] { (void)adviser.flat(slots, std::vector<double>(4, 1.0), 0, 0); }, moecomm::status::invalid_argument, {"row_bytes = 0"});
  check_error([&] { (void)adviser.rank(routing, 8, row, {{0, 1, 2}, {3}}); }, moecomm::status::invalid_argument,
              {"argument 'groups'", "of one size"});
  check_error([&] { (void)adviser.rank(routing, 8, row, {{0, 1}}); }, moecomm::status::invalid_argument,
              {"argument 'groups' holds 2 ranks"});
  check_error([&] { (void)adviser.rank(routing, 8, row, {{0, 1}, {1, 2}}); }, moecomm::status::invalid_argument,
              {"argument 'groups' holds rank 1 twice"});
  check_error([&] { (void)adviser.rank(routing, 8, row, {{0, 1}, {2, 7}}); }, moecomm::status::invalid_argument,
              {"argument 'groups' holds rank 7 of a topology of 4"});
}

TEST_CASE("exchange adviser: a routing per rank of one top_k, experts a multiple of the ranks, a row size, or an error naming them") {
  moecomm::exchange_adviser const adviser(two_by_two(), moecomm::topology(4, 2));
  std::vector<std::int32_t> idx{0, 1};
  std::vector<moecomm::routing_view> const three(3, moecomm::routing_view{idx.data(), nullptr, 1, 2});
  check_error([&] { (void)adviser.rank(three, 8, 16); }, moecomm::status::invalid_argument, {"'routing'", "3", "4"});
  std::vector<moecomm::routing_view> const four(4, moecomm::routing_view{idx.data(), nullptr, 1, 2});
  check_error([&] { (void)adviser.rank(four, 6, 16); }, moecomm::status::invalid_argument, {"num_experts = 6"});
  check_error([&] { (void)adviser.rank(four, 8, 0); }, moecomm::status::invalid_argument, {"row_bytes = 0"});
  std::vector<moecomm::routing_view> mixed = four;
  mixed[2].top_k = 1;
  check_error([&] { (void)adviser.rank(mixed, 8, 16); }, moecomm::status::invalid_argument, {"routing[2].top_k = 1"});
  std::vector<moecomm::routing_view> missing = four;
  missing[3].topk_idx = nullptr;
  check_error([&] { (void)adviser.rank(missing, 8, 16); }, moecomm::status::invalid_argument, {"routing[3]", "topk_idx null"});
  moecomm::cluster_spec bad = two_by_two();
  bad.pcie.bytes_per_second = -1;
  check_error([&] { moecomm::exchange_adviser(bad, moecomm::topology(4, 2)); }, moecomm::status::invalid_argument, {"pcie"});
}

// What bench_exchange_adviser --advise refuses, the adviser refuses too. A top_k above
// the experts hung the command line's routing draw; an infinite row size hung the adviser's fluid
// flows; a cluster of 2^20 nodes, or a topology beyond the platform's GPUs, is refused by size.
TEST_CASE("exchange adviser: top_k in [1, experts], a finite row size, a topology within the platform, or an error naming them") {
  moecomm::exchange_adviser const adviser(two_by_two(), moecomm::topology(4, 2));
  std::vector<std::int32_t> idx(9, -1);
  idx[0] = 0;
  std::vector<moecomm::routing_view> const nine(4, moecomm::routing_view{idx.data(), nullptr, 1, 9});
  check_error([&] { (void)adviser.rank(nine, 8, 16); }, moecomm::status::invalid_argument, {"top_k = 9 must be in [1, num_experts = 8]"});
  std::vector<moecomm::routing_view> const two(4, moecomm::routing_view{idx.data(), nullptr, 1, 2});
  double const inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  check_error([&] { (void)adviser.rank(two, 8, inf); }, moecomm::status::invalid_argument, {"row_bytes = inf must be positive and finite"});
  check_error([&] { (void)adviser.rank(two, 8, nan); }, moecomm::status::invalid_argument, {"row_bytes = nan must be positive and finite"});
  check_error([&] { (void)adviser.flat(std::vector<double>(16, 1.0), std::vector<double>(4, 1.0), inf, 0); },
              moecomm::status::invalid_argument, {"row_bytes = inf must be positive and finite"});
  check_error([&] { moecomm::exchange_adviser(two_by_two(), moecomm::topology(8, 2)); }, moecomm::status::invalid_argument,
              {"argument 'topo' has 8 ranks; they must be in [1, the platform's 4 GPUs]"});
  moecomm::cluster_spec huge = two_by_two();
  huge.nodes_per_domain = 1 << 20;
  check_error([&] { moecomm::exchange_adviser(huge, moecomm::topology(4, 2)); }, moecomm::status::invalid_argument,
              {"nodes_per_domain = 1048576", "more than the limit of cluster_spec::max_gpus = 4096"});
  huge.nodes_per_domain = 2048;  // 4096 GPUs: the limit (cluster_spec::max_gpus) itself is a cluster
  CHECK(moecomm::exchange_adviser(huge, moecomm::topology(4, 2)).rank(two, 8, 16).size() == 4);
}

}  // namespace test
