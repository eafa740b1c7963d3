// SPDX-License-Identifier: Apache-2.0
// The pattern adviser (models/pattern_adviser.hpp) and the link model under it (models/link_model.hpp)
// on hand-computed cases, and errors that name the argument. Its agreement with the simulation is
// measured by bench_pattern_adviser (docs/performance.md, "The pattern adviser").

#include "../support/test_support.hpp"

#include <moecomm/models/pattern_adviser.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace test {

// One node of `gpus` GPUs on a 10 GB/s port; launches free, HBM so fast that its passes vanish.
moecomm::cluster_spec one_node(std::int32_t gpus, double latency, double overhead) {
  moecomm::cluster_spec s;
  s.name = "one-node"; s.source = "a test";
  s.nodes_per_domain = 1; s.gpus_per_node = gpus;
  s.gpu_flops = 1e12;
  s.gemm_efficiency = 0.5; s.gemm_ridge_rows = 1;
  s.hbm_bytes_per_second = 1e30; s.kernel_launch_seconds = 0;
  s.collective_overhead_seconds = overhead;
  s.intra_node = {10e9, latency}; s.pcie = {10e9, latency}; s.nic = {10e9, latency};
  return s;
}

// Two nodes of two GPUs: ports of 40 GB/s, PCIe links and NICs of 12 and 20 GB/s.
moecomm::cluster_spec two_nodes(double latency) {
  moecomm::cluster_spec s = one_node(2, latency, 0);
  s.name = "two-nodes";
  s.nodes_per_domain = 2;
  s.intra_node = {40e9, latency}; s.pcie = {12e9, latency}; s.nic = {20e9, latency};
  return s;
}

// A transformer of two MoE blocks of H = 64; the adviser's experts are 64 -> 128 -> 64 in fp32.
moecomm::transformer_shape small_model() {
  moecomm::transformer_shape m;
  m.layers = m.moe_layers = 2; m.hidden = 64; m.sequence = 100; m.tokens_per_rank = 100; m.gradient_bytes = 4;
  return m;
}
constexpr std::int64_t H = 64, F = 128;
constexpr double row_bytes = H * 4.0;

// Each rank's top-1 routing: `tokens[r]` tokens, all to expert `expert[r]`.
struct top1 {
  std::vector<std::vector<std::int32_t>> ids;
  std::vector<moecomm::routing_view> views;
  top1(std::vector<std::int64_t> const& tokens, std::vector<std::int32_t> const& expert) : ids(tokens.size()) {
    for (std::size_t r = 0; r < tokens.size(); ++r) {
      ids[r].assign(static_cast<std::size_t>(tokens[r]), expert[r]);
      views.push_back({ids[r].data(), nullptr, tokens[r], 1});
    }
  }
};

moecomm::pattern_prediction find(std::vector<moecomm::pattern_prediction> const& ranking, std::string const& pattern,
                                 std::string const& setting) {
  for (auto const& p : ranking)
    if (p.pattern == pattern && p.setting == setting) return p;
  FAIL("no prediction for ", pattern, " ", setting);
  return {};
}

TEST_CASE("link model: a broadcast is a chain of at most 64 chunks of 1 MiB, and a GEMM below its ridge pays for its weights") {
  moecomm::link_model const links(one_node(4, 1e-6, 5e-6), moecomm::topology(4, 4));
  double const MiB = 1 << 20, stage = 2e-6 + MiB / 10e9;  // a chunk over one port, and its route's latency
  // 3 MiB: 3 chunks down a chain of 4 ranks, 3 + 4 - 2 stages.
  CHECK(links.chain_seconds(3 * MiB) == doctest::Approx(5e-6 + 5 * stage).epsilon(1e-12));
  // 200 MiB: 64 chunks of 3.125 MiB, 66 stages.
  CHECK(links.chain_seconds(200 * MiB) == doctest::Approx(5e-6 + 66 * (2e-6 + 200 * MiB / 64 / 10e9)).epsilon(1e-12));
  // A ring all-gather: 3 dependent steps, one overhead.
  CHECK(links.allgather_seconds(MiB) == doctest::Approx(5e-6 + 3 * stage).epsilon(1e-12));
  // Two nodes: the first chunk crosses a port, the network, a port; the other three follow at the
  // network hop's pace (12 GB/s PCIe links, routes of two PCIe and two NIC latencies).
  moecomm::link_model const chain(two_nodes(1e-6), moecomm::topology(4, 2));
  double const port = 2e-6 + MiB / 40e9, network = 4e-6 + MiB / 12e9;
  CHECK(chain.chain_seconds(4 * MiB) == doctest::Approx(2 * port + network + 3 * network).epsilon(1e-12));
  moecomm::cluster_spec spec = one_node(4, 0, 0);
  spec.gemm_ridge_rows = 100;
  CHECK(spec.gemm_seconds(1e9) == doctest::Approx(1e9 / 0.5e12).epsilon(1e-15));
  CHECK(spec.gemm_seconds(1e9, 1000) == doctest::Approx(1e9 / 0.5e12).epsilon(1e-15));
  CHECK(spec.gemm_seconds(1e9, 25) == doctest::Approx(4 * 1e9 / 0.5e12).epsilon(1e-15));  // a quarter of the ridge
  CHECK(spec.gemm_seconds(1e9, 0) == doctest::Approx(100 * 1e9 / 0.5e12).epsilon(1e-15));  // as one row
}

TEST_CASE("link model: messages share a link max-min fairly, so a flow held back elsewhere finishes after the busiest link's load") {
  moecomm::link_model const links(two_nodes(0), moecomm::topology(4, 2));
  moecomm::link_model::matrix bytes = links.zeros();
  bytes[links.cell(0, 2)] = 3e9;  // to rank 2, through its 12 GB/s PCIe link
  bytes[links.cell(1, 3)] = 1e9;  // to rank 3
  // Both share the nodes' 20 GB/s NICs at 10 GB/s until the second finishes (0.1 s); the first's
  // last 2 GB then go at its PCIe link's 12 GB/s. The busiest link alone (that PCIe link, 3 GB at
  // 12 GB/s: 0.25 s) would say less.
  CHECK(links.links_seconds(bytes) == doctest::Approx(0.1 + 2e9 / 12e9).epsilon(1e-12));
  // Equal flows finish together, at the busiest link's load.
  bytes[links.cell(1, 3)] = 3e9;
  CHECK(links.links_seconds(bytes) == doctest::Approx(6e9 / 20e9).epsilon(1e-12));
}

TEST_CASE("link model: ring all-reduces over disjoint groups run side by side, 2(n - 1) steps of 1 / n of the bytes") {
  moecomm::link_model const links(one_node(4, 1e-6, 5e-6), moecomm::topology(4, 4));
  double const MiB = 1 << 20;
  // Two pairs: 2 steps in which each rank sends half the bytes to its partner over its own port.
  CHECK(links.allreduce_seconds({{0, 1}, {2, 3}}, MiB) == doctest::Approx(5e-6 + 2 * (2e-6 + MiB / 2 / 10e9)).epsilon(1e-12));
  // One ring of four: 6 steps of a quarter.
  CHECK(links.allreduce_seconds({{0, 1, 2, 3}}, MiB) == doctest::Approx(5e-6 + 6 * (2e-6 + MiB / 4 / 10e9)).epsilon(1e-12));
  // A pair beside a ring of four, on ports of their own: the four's 6 steps of a quarter are the longer.
  moecomm::link_model const six(one_node(6, 1e-6, 5e-6), moecomm::topology(6, 6));
  CHECK(six.allreduce_seconds({{0, 1}, {2, 3, 4, 5}}, MiB) == doctest::Approx(5e-6 + 6 * (2e-6 + MiB / 4 / 10e9)).epsilon(1e-12));
  // Rings that share a link share its bandwidth: across two nodes, pairs (0, 2) and (1, 3) both
  // cross the nodes' 20 GB/s NICs, B each way per edge, at 10 GB/s each.
  moecomm::link_model const two(two_nodes(1e-6), moecomm::topology(4, 2));
  CHECK(two.allreduce_seconds({{0, 2}, {1, 3}}, MiB) == doctest::Approx(2 * 4e-6 + MiB / 10e9).epsilon(1e-12));
  // Nothing to reduce with.
  CHECK(links.allreduce_seconds({{0}, {3}}, MiB) == 0);
  CHECK(links.allreduce_seconds({}, MiB) == 0);
}

TEST_CASE("pattern adviser: plain expert parallelism is the exchange adviser's exchange each way and the busiest rank's GEMMs") {
  moecomm::cluster_spec const spec = one_node(2, 1e-6, 5e-6);
  moecomm::pattern_adviser const adviser(spec, moecomm::topology(2, 2), small_model(), {2, F, 4});
  top1 const routing({300, 100}, {1, 1});  // every token to expert 1, on rank 1
  auto const ranking = adviser.rank(routing.views);
  auto const exchange = moecomm::exchange_adviser(spec, moecomm::topology(2, 2)).rank(routing.views, 2, row_bytes);
  double const forward = 4.0 * 400 * H * F / 0.5e12;  // rank 1's expert: 400 rows, two GEMMs of 2·rows·H·F
  for (auto const& x : exchange) {
    CAPTURE(x.algorithm);
    auto const p = find(ranking, "expert_parallel", x.algorithm);
    CHECK(p.exchange_seconds == doctest::Approx(x.route_seconds + 2 * (x.dispatch_seconds + x.combine_seconds)).epsilon(1e-12));
    CHECK(p.compute_seconds == doctest::Approx(3 * forward).epsilon(1e-12));  // the backward twice the forward
    CHECK(p.replica_seconds == 0);
    CHECK(p.layer_seconds == doctest::Approx(p.exchange_seconds + p.compute_seconds).epsilon(1e-12));
    moecomm::iteration_model const rest(spec, 2, small_model());
    CHECK(p.iteration_seconds == doctest::Approx(2 * p.layer_seconds + rest.dense_seconds(2.0 * H * F)).epsilon(1e-12));
  }
  for (std::size_t i = 1; i < ranking.size(); ++i) CHECK(ranking[i - 1].iteration_seconds <= ranking[i].iteration_seconds);
  // One node of 2: flat and dedup_per_rank (no second node for hierarchical_2d and dedup_per_node),
  // smart_schedule{1} with and without shadowing, FasterMoE on flat, Pro-Prophet.
  CHECK(ranking.size() == 2 + 2 + 1 + 1);
}

TEST_CASE("pattern adviser: the smart schedule's pipeline, by hand on two ranks") {
  // No latency, overhead, launch or HBM time: only the rounds' bytes and the GEMMs (at 2 TFLOP/s) count.
  moecomm::cluster_spec spec = one_node(2, 0, 0);
  spec.gpu_flops = 4e12;
  moecomm::pattern_adviser const adviser(spec, moecomm::topology(2, 2), small_model(), {2, F, 4});
  top1 const routing({300, 100}, {1, 1});
  auto const p = find(adviser.rank(routing.views), "expert_parallel", "smart_schedule{1}");
  double const u = 4.0 * H * F / 2e12;       // one row through an expert (ridge of 1 row: linear)
  double const X = 300 * row_bytes / 10e9;   // round 1: rank 0's 300 rows to rank 1 (and back)
  double const route = 8.0 * 2 / 10e9;       // the counts' all-gather, one ring step
  REQUIRE(X > 200 * u);                      // so rank 1's own rows are done before the others arrive
  // Rank 1, forward: round 0 is its own 100 rows (no message), round 1 brings rank 0's 300 at X;
  // those are computed at X + 300u and return by X + 300u + X. The backward computes twice as long.
  double const forward = 2 * X + 300 * u, backward = 2 * X + 600 * u;
  CHECK(p.layer_seconds == doctest::Approx(route + forward + backward).epsilon(1e-9));
  CHECK(p.compute_seconds == doctest::Approx(3 * 400 * u).epsilon(1e-12));
  // Plain flat exchanges before it computes: the rows' computation is not hidden.
  auto const flat = find(adviser.rank(routing.views), "expert_parallel", "flat");
  CHECK(flat.layer_seconds > p.layer_seconds);
}

TEST_CASE("pattern adviser: shadowing computes the hot expert where its tokens are, and pays one broadcast and one reduce for it") {
  moecomm::cluster_spec const spec = one_node(4, 1e-6, 5e-6);
  moecomm::pattern_adviser const adviser(spec, moecomm::topology(4, 4), small_model(), {4, F, 4});
  std::int64_t const T = 20000;
  top1 const routing({T, T, T, T}, {0, 0, 0, 0});  // every rank's tokens to expert 0
  auto const ranking = adviser.rank(routing.views);
  std::vector<std::int64_t> counts(16, 0);
  for (std::size_t r = 0; r < 4; ++r) counts[r * 4] = T;
  auto const decision = moecomm::select_shadowed_experts(moecomm::fastermoe_cost_model(adviser.fastermoe_params()), moecomm::topology(4, 4),
                                                         std::vector<std::int32_t>{0, 1, 2, 3}, {counts.data(), 16});
  REQUIRE(decision.shadowed == std::vector<std::int32_t>{0});
  auto const shadowed = find(ranking, "fastermoe", "flat");
  CHECK(shadowed.replicated == 1);
  moecomm::link_model const links(spec, moecomm::topology(4, 4));
  CHECK(shadowed.replica_seconds == doctest::Approx(2 * links.chain_seconds(2.0 * H * F * 4)).epsilon(1e-12));
  CHECK(shadowed.compute_seconds == doctest::Approx(3 * 4.0 * T * H * F / 0.5e12).epsilon(1e-12));  // T rows on every rank
  auto const plain = find(ranking, "expert_parallel", "flat");
  CHECK(plain.compute_seconds == doctest::Approx(4 * shadowed.compute_seconds).epsilon(1e-12));  // 4T rows on rank 0
  CHECK(ranking.front().pattern != "expert_parallel");
}

TEST_CASE("pattern adviser: with memory for two copies, expert data parallelism, FineMoE and FlexMoE, by hand on two ranks") {
  moecomm::cluster_spec const spec = one_node(2, 1e-6, 5e-6);
  moecomm::topology const topo(2, 2);
  moecomm::pattern_adviser const adviser(spec, topo, small_model(), {2, F, 4, 2});
  top1 const routing({300, 100}, {1, 1});  // 400 rows of expert 1, 300 of them on rank 0
  auto const ranking = adviser.rank(routing.views);
  moecomm::link_model const links(spec, topo);
  moecomm::iteration_model const rest(spec, 2, small_model());
  double const row = 4.0 * H * F / 0.5e12, sync = links.allreduce_seconds({{0, 1}}, 2.0 * H * F * 4);
  auto const find_placed = [&](std::string const& pattern, std::string const& placement) {
    for (auto const& p : ranking)
      if (p.pattern == pattern && p.setting == "flat" && p.placement == placement) return p;
    FAIL("no prediction for ", pattern, " flat ", placement);
    return moecomm::pattern_prediction{};
  };

  // EP 1 x EDP 2: each rank holds both experts and computes its own tokens; nothing crosses. Each
  // expert's gradient is all-reduced over both ranks once per iteration, one slot row after the other.
  auto const edp = find_placed("expert_data_parallel", "EP 1 x EDP 2");
  CHECK(edp.ep_size == 1);
  CHECK(edp.slot_experts == std::vector<std::int32_t>{0, 1, 0, 1});
  CHECK(edp.replicated == 2);
  CHECK(edp.compute_seconds == doctest::Approx(3 * 300 * row).epsilon(1e-12));
  CHECK(edp.gradient_sync_seconds == doctest::Approx(2 * sync).epsilon(1e-12));
  std::vector<std::int32_t> const home0(300, 1), home1(100, 3);  // slot ids rank * S + local index
  std::vector<moecomm::routing_view> const by_slot{{home0.data(), nullptr, 300, 1}, {home1.data(), nullptr, 100, 1}};
  // Each EP group of one rank is its own communicator: it has no counts to all-gather.
  auto const x = moecomm::exchange_adviser(spec, topo).rank(by_slot, 4, row_bytes, {{0}, {1}});
  CHECK(x.front().route_seconds == 0);
  auto const flat = std::find_if(x.begin(), x.end(), [](auto const& e) { return e.algorithm == "flat"; });
  REQUIRE(flat != x.end());
  CHECK(edp.exchange_seconds == doctest::Approx(flat->route_seconds + 2 * (flat->dispatch_seconds + flat->combine_seconds)).epsilon(1e-12));
  CHECK(edp.iteration_seconds == doctest::Approx(2 * (edp.layer_seconds + edp.gradient_sync_seconds) + rest.dense_seconds(2 * 2.0 * H * F)).epsilon(1e-12));

  // FineMoE, both experts on both ranks: the min-max split gives each replica of expert 1 200 rows;
  // Algorithm 1 keeps each rank's own first, so only rank 0's last 100 cross.
  auto const fine = find_placed("finemoe", "symmetric");
  CHECK(fine.compute_seconds == doctest::Approx(3 * 200 * row).epsilon(1e-12));
  CHECK(fine.gradient_sync_seconds == doctest::Approx(2 * sync).epsilon(1e-12));
  // FlexMoE, the same placement (its planner sees the ranks balanced): each rank's tokens split
  // evenly, 150 + 50 rows cross for the same 200 per rank.
  auto const flex = find_placed("flexmoe", "planned");
  CHECK(flex.slot_experts == fine.slot_experts);
  CHECK(flex.compute_seconds == doctest::Approx(fine.compute_seconds).epsilon(1e-12));
  CHECK(flex.exchange_seconds > fine.exchange_seconds);
  // The layer's own all-gather of the counts, one ring step of 2 experts' 8 bytes, beyond the slots' exchange.
  CHECK(fine.exchange_seconds > edp.exchange_seconds + 5e-6 + 2e-6);
  CHECK(find_placed("finemoe", "asymmetric").compute_seconds <= doctest::Approx(fine.compute_seconds));
  // Four micro-batches an iteration: four steps per layer, one sync.
  moecomm::transformer_shape accumulated = small_model();
  accumulated.micro_batches = 4;
  auto const four = moecomm::pattern_adviser(spec, topo, accumulated, {2, F, 4, 2}).rank(routing.views);
  auto const edp4 = std::find_if(four.begin(), four.end(), [](auto const& p) { return p.pattern == "expert_data_parallel" && p.setting == "flat"; });
  REQUIRE(edp4 != four.end());
  CHECK(edp4->iteration_seconds == doctest::Approx(2 * (4 * edp.layer_seconds + edp.gradient_sync_seconds) +
                                                   moecomm::iteration_model(spec, 2, accumulated).dense_seconds(2 * 2.0 * H * F)).epsilon(1e-12));
  // Every expert once: plain EP with the slots it does not need left empty.
  CHECK(find(ranking, "expert_parallel", "flat").gradient_sync_seconds == 0);
}

TEST_CASE("pattern adviser: with tensor parallelism, Parm's layouts that fit, by hand on two MP groups of two") {
  moecomm::cluster_spec const spec = one_node(4, 1e-6, 5e-6);
  moecomm::topology const topo(4, 4);
  moecomm::transformer_shape model = small_model();
  model.model_parallel = 2;  // MP groups {0, 1}, {2, 3}; EP groups {0, 2}, {1, 3}; 2 local experts a rank
  // Every token of both groups to expert 2, held by the second group (rank 2 + the MP rank).
  top1 const routing({100, 100, 100, 100}, {2, 2, 2, 2});
  moecomm::link_model const links(spec, topo);
  double const row = 4.0 * H * F / 0.5e12, b = row_bytes;
  auto const names = [](std::vector<moecomm::pattern_prediction> const& ranking) {
    std::vector<std::string> n;
    for (auto const& p : ranking) n.push_back(p.pattern + " " + p.setting);
    std::sort(n.begin(), n.end());
    return n;
  };
  // One slot a rank (E / R): only the halves of two experts fit, ESP 2.
  auto const sliced = moecomm::pattern_adviser(spec, topo, model, {4, F, 4}).rank(routing.views);
  CHECK(names(sliced) == std::vector<std::string>{"deepspeed_mp ESP 2", "parm_s1 ESP 2", "parm_s2 ESP 2, 2 pieces", "parm_s2 ESP 2, 4 pieces"});
  // Two slots: whole experts too.
  auto const ranking = moecomm::pattern_adviser(spec, topo, model, {4, F, 4, 2}).rank(routing.views);
  CHECK(names(ranking) == std::vector<std::string>{"deepspeed_mp ESP 1", "deepspeed_mp ESP 2", "drop_tokens ESP 1", "parm_s1 ESP 2",
                                                   "parm_s2 ESP 2, 2 pieces", "parm_s2 ESP 2, 4 pieces"});
  auto const s1 = find(ranking, "parm_s1", "ESP 2");
  CHECK(s1.placement == "MP 2 x EP 2");
  CHECK(s1.ep_size == 2);
  // S1: ranks 0 and 1 send their 50 tokens' rows to ranks 2 and 3 (2 and 3 keep theirs); each of
  // 2 and 3 all-gathers its 100 rows to the other and computes half of expert 2 on all 200; the
  // reduce-scatter and the all-to-all back; each MP pair all-gathers its 50 combined rows. Memory
  // passes are free on this platform; the route all-gathers the counts over the EP groups, and the
  // blocks' counts over the ESP groups.
  moecomm::link_model::matrix there = links.zeros(), members = links.zeros(), slices = links.zeros();
  there[links.cell(0, 2)] = there[links.cell(1, 3)] = 50 * b;
  members[links.cell(2, 3)] = members[links.cell(3, 2)] = 100 * b;
  for (std::int32_t r = 0; r < 4; ++r) slices[links.cell(r, r ^ 1)] = 50 * b;
  moecomm::link_model::matrix back = links.zeros();
  back[links.cell(2, 0)] = back[links.cell(3, 1)] = 50 * b;
  double const route = links.allgather_seconds({{0, 2}, {1, 3}}, 8.0 * 4) + links.allgather_seconds({{0, 1}, {2, 3}}, 8.0 * 2 * 2);
  double const one_way = links.round_seconds(there) + 2 * links.round_seconds(members) + links.round_seconds(back) + links.round_seconds(slices);
  CHECK(s1.exchange_seconds == doctest::Approx(route + 2 * one_way).epsilon(1e-9));
  CHECK(s1.compute_seconds == doctest::Approx(3 * 200 * row / 2).epsilon(1e-12));
  CHECK(s1.gradient_sync_seconds == 0);  // ESP = MP: no two ranks hold the same slice
  CHECK(s1.iteration_seconds == doctest::Approx(moecomm::iteration_model(spec, 4, model).iteration_seconds(s1.layer_seconds, 2.0 * H * F)).epsilon(1e-12));
  // drop_tokens: the same rows on whole experts, no ESP collectives; the MP pair's gradients of
  // both local experts summed once per iteration, one expert after the other.
  auto const drop = find(ranking, "drop_tokens", "ESP 1");
  CHECK(drop.compute_seconds == doctest::Approx(3 * 100 * row).epsilon(1e-12));
  CHECK(drop.gradient_sync_seconds == doctest::Approx(2 * links.allreduce_seconds({{0, 1}, {2, 3}}, 2.0 * H * F * 4)).epsilon(1e-12));
  CHECK(drop.exchange_seconds < s1.exchange_seconds);
  // deepspeed_mp: every MP rank dispatches its group's 100 tokens, so ranks 2 and 3 compute 200 rows
  // each: twice drop_tokens' on whole experts; sliced in two, as S1. Its MP peers' gradients agree.
  CHECK(find(ranking, "deepspeed_mp", "ESP 1").compute_seconds == doctest::Approx(3 * 200 * row).epsilon(1e-12));
  CHECK(find(ranking, "deepspeed_mp", "ESP 2").compute_seconds == doctest::Approx(s1.compute_seconds).epsilon(1e-12));
  CHECK(find(ranking, "deepspeed_mp", "ESP 1").gradient_sync_seconds == 0);
  // S2 moves S1's rows in pieces: the same compute.
  CHECK(find(ranking, "parm_s2", "ESP 2, 4 pieces").compute_seconds == doctest::Approx(s1.compute_seconds).epsilon(1e-12));
  // The ranks of an MP group must hold the same tokens.
  top1 const differs({100, 100, 100, 100}, {2, 3, 2, 2});
  CHECK_THROWS_WITH((void)moecomm::pattern_adviser(spec, topo, model, {4, F, 4}).rank(differs.views),
                    doctest::Contains("routing[1] differs from routing[0]"));
  // The layout model's own checks, for a caller that uses it alone.
  moecomm::parm_layout_model const layouts(links, 2, 4, H, F, 4, 4);
  std::vector<moecomm::routing_view> missing = routing.views;
  missing[3].topk_idx = nullptr;
  CHECK_THROWS_WITH((void)layouts.count(missing), doctest::Contains("routing[3] has 100 tokens, top_k 1 and topk_idx null"));
  CHECK_THROWS_WITH((void)layouts.predict({}, {}), doctest::Contains("argument 's' is not a step of 4 ranks and 4 experts"));
  CHECK_THROWS_WITH((void)layouts.predict(layouts.count(routing.views), {true, 3, 1}), doctest::Contains("layout.expert_slicing = 3"));
  CHECK_THROWS_WITH((void)layouts.predict(layouts.count(routing.views), {false, 2, 2}), doctest::Contains("layout.pieces = 2"));
}

TEST_CASE("pattern adviser: across data centres, HybridEP's expert domains that fit, by hand on two data centres of two") {
  // Two data centres of one node of two GPUs, joined by 1 GB/s uplinks; launches and HBM free.
  moecomm::cluster_spec spec = one_node(2, 1e-6, 5e-6);
  spec.domains = 2;
  spec.inter_domain = {1e9, 2e-6};
  moecomm::topology const topo(4, 2, 1);
  moecomm::link_model const links(spec, topo);
  double const row = 4.0 * H * F / 0.5e12, b = row_bytes, expert = 2.0 * H * F * 4;
  top1 const routing({100, 100, 100, 100}, {2, 2, 2, 2});  // every token to expert 2, on rank 2
  auto const hybrid = [](std::vector<moecomm::pattern_prediction> const& ranking) {
    std::vector<std::string> n;
    for (auto const& p : ranking)
      if (p.pattern == "hybridep") n.push_back(p.setting + " " + p.placement);
    std::sort(n.begin(), n.end());
    return n;
  };
  // One slot a rank: no room for a second expert; on one data centre, never.
  CHECK(hybrid(moecomm::pattern_adviser(spec, topo, small_model(), {4, F, 4}).rank(routing.views)).empty());
  CHECK(hybrid(moecomm::pattern_adviser(one_node(4, 1e-6, 5e-6), moecomm::topology(4, 4), small_model(), {4, F, 4, 2}).rank(routing.views))
            .empty());
  auto const ranking = moecomm::pattern_adviser(spec, topo, small_model(), {4, F, 4, 2}).rank(routing.views);
  CHECK(hybrid(ranking) == std::vector<std::string>{"S 2 across data centres", "S 2 within data centres"});
  // Across: positions 0, 2, 1, 3 for ranks 0..3, so the expert domains are {0, 2} and {1, 3} and
  // the same-offset groups {0, 1} and {2, 3}: tokens stay in their data centre. Rank 2's expert
  // is gathered by rank 0, which computes rank 1's rows of it (rank 3's go to rank 2).
  moecomm::pattern_prediction across, within;
  for (auto const& p : ranking)
    if (p.pattern == "hybridep") (p.placement == "across data centres" ? across : within) = p;
  CHECK(across.ep_size == 2);
  moecomm::link_model::matrix there = links.zeros(), members = links.zeros();
  there[links.cell(1, 0)] = there[links.cell(3, 2)] = 100 * b;
  for (auto [a, c] : {std::pair{0, 2}, {2, 0}, {1, 3}, {3, 1}}) members[links.cell(a, c)] = expert;
  double const route = links.allgather_seconds({{0, 1}, {2, 3}}, 8.0 * 4), dispatch = links.round_seconds(there);
  CHECK(across.exchange_seconds == doctest::Approx(route + 2 * (dispatch + links.round_seconds(links.transposed(there)))).epsilon(1e-9));
  CHECK(across.compute_seconds == doctest::Approx(3 * 200 * row).epsilon(1e-12));
  // The gather runs under the block's attention, the route and the dispatch, its messages sharing
  // the links with the dispatch's (here none: the tokens stay inside the data centres); what is
  // left of it, and the gradients' reduce-scatter (the same messages), are the replicas' part.
  double const attention = (8.0 * 100 * H * H + 4.0 * 100 * 100 * H) / 0.5e12;
  moecomm::link_model::matrix both = members;
  for (std::size_t i = 0; i < both.size(); ++i) both[i] += there[i];
  double const exposed = std::max(links.round_seconds(members), links.round_seconds(both)) - attention - route - dispatch;
  CHECK(exposed > 0);
  CHECK(across.replica_seconds == doctest::Approx(exposed + links.round_seconds(members)).epsilon(1e-9));
  CHECK(across.layer_seconds == doctest::Approx(across.exchange_seconds + across.compute_seconds + across.replica_seconds).epsilon(1e-12));
  CHECK(across.gradient_sync_seconds == 0);  // the owners' gradients are whole after the step
  CHECK(across.iteration_seconds ==
        doctest::Approx(moecomm::iteration_model(spec, 4, small_model()).iteration_seconds(across.layer_seconds, expert / 4)).epsilon(1e-12));
  // Within: expert domains {0, 1} and {2, 3}; ranks 0 and 1 send their rows across to ranks 2 and 3.
  CHECK(within.compute_seconds == doctest::Approx(across.compute_seconds).epsilon(1e-12));
  CHECK(within.exchange_seconds > across.exchange_seconds);
  // The strongest baseline is there too: EP inside each data centre, experts data-parallel across.
  CHECK(find(ranking, "expert_data_parallel", "flat").placement == "EP 2 x EDP 2");
  // The layout model's own checks, for a caller that uses it alone.
  moecomm::hybridep_layout_model const model(links, 4, H, F, 4);
  std::vector<std::int64_t> const counts(16, 1);
  std::vector<double> const tokens(4, 1.0);
  CHECK_THROWS_WITH((void)model.predict({counts.data(), 15}, tokens, {2}, 0), doctest::Contains("argument 'counts' has 15 entries"));
  CHECK_THROWS_WITH((void)model.predict(counts, {1.0}, {2}, 0), doctest::Contains("argument 'tokens' has 1 entries"));
  CHECK_THROWS_WITH((void)model.predict(counts, tokens, {3}, 0), doctest::Contains("layout.expert_domain = 3"));
  CHECK_THROWS_WITH((void)model.predict(counts, tokens, {4, moecomm::expert_domain_spread::within_data_centres}, 0),
                    doctest::Contains("divide the 2 ranks of a domain"));
  CHECK_THROWS_WITH((void)model.predict(counts, tokens, {2}, -1), doctest::Contains("pre_expert_seconds = -1"));
  std::vector<std::int64_t> negative = counts;
  negative[6] = -3;
  CHECK_THROWS_WITH((void)model.predict(negative, tokens, {2}, 0), doctest::Contains("holds -3 slots of rank 1 to expert 2"));
}

TEST_CASE("pattern adviser: a routing per rank with ids in range, experts a multiple of the ranks, or an error naming them") {
  moecomm::cluster_spec const spec = one_node(2, 0, 0);
  moecomm::topology const topo(2, 2);
  CHECK_THROWS_WITH(moecomm::pattern_adviser(spec, topo, small_model(), {3, F, 4}), doctest::Contains("moe.num_experts = 3"));
  CHECK_THROWS_WITH(moecomm::pattern_adviser(spec, topo, small_model(), {2, 0, 4}), doctest::Contains("moe.expert_ffn = 0"));
  CHECK_THROWS_WITH(moecomm::pattern_adviser(spec, topo, small_model(), {2, F, 0}), doctest::Contains("moe.element_bytes = 0"));
  CHECK_THROWS_WITH(moecomm::pattern_adviser(spec, topo, small_model(), {2, F, 4, 3}), doctest::Contains("moe.slots_per_rank = 3"));
  moecomm::transformer_shape bad = small_model();
  bad.tokens_per_rank = 150;
  CHECK_THROWS_WITH(moecomm::pattern_adviser(spec, topo, bad, {2, F, 4}), doctest::Contains("tokens_per_rank = 150"));
  bad = small_model();
  bad.micro_batches = 0;
  CHECK_THROWS_WITH(moecomm::pattern_adviser(spec, topo, bad, {2, F, 4}), doctest::Contains("micro_batches = 0"));
  moecomm::pattern_adviser const adviser(spec, topo, small_model(), {2, F, 4});
  top1 const one({5}, {0});
  CHECK_THROWS_WITH((void)adviser.rank(one.views), doctest::Contains("argument 'routing' has 1 ranks' routings"));
  top1 const out_of_range({5, 5}, {0, 2});
  CHECK_THROWS_WITH((void)adviser.rank(out_of_range.views), doctest::Contains("routing[1] token 0 slot 0 names expert 2"));
  CHECK_THROWS_WITH((void)moecomm::pattern_adviser(spec, topo, small_model(), {2, F, 4, 2}).flexmoe_placement({5}),
                    doctest::Contains("argument 'loads' has 1 entries; the layer has 2 experts"));
}

// What bench_pattern_adviser --advise refuses, the adviser refuses too: a top_k above the
// experts (which hung the command line's routing draw), an infinite element size, a topology beyond
// the platform's GPUs, a cluster beyond cluster_spec::max_gpus.
TEST_CASE("pattern adviser: top_k in [1, experts], a finite element size, a topology within the platform, or an error naming them") {
  moecomm::cluster_spec const spec = one_node(2, 0, 0);
  moecomm::topology const topo(2, 2);
  moecomm::pattern_adviser const adviser(spec, topo, small_model(), {2, F, 4});
  std::vector<std::int32_t> idx(3, -1);
  idx[0] = 0;
  std::vector<moecomm::routing_view> const three(2, moecomm::routing_view{idx.data(), nullptr, 1, 3});
  check_error([&] { (void)adviser.rank(three); }, moecomm::status::invalid_argument, {"top_k = 3 must be in [1, num_experts = 2]"});
  check_error([&] { moecomm::pattern_adviser(spec, topo, small_model(), {2, F, std::numeric_limits<double>::infinity()}); },
              moecomm::status::invalid_argument, {"moe.element_bytes = inf must be positive and finite"});
  check_error([&] { moecomm::pattern_adviser(spec, moecomm::topology(4, 2), small_model(), {4, F, 4}); }, moecomm::status::invalid_argument,
              {"4 ranks", "the platform's 2 GPUs"});
  moecomm::cluster_spec huge = spec;
  huge.nodes_per_domain = 1 << 20;
  check_error([&] { moecomm::pattern_adviser(huge, topo, small_model(), {2, F, 4}); }, moecomm::status::invalid_argument,
              {"nodes_per_domain = 1048576", "cluster_spec::max_gpus = 4096"});
}

}  // namespace test
