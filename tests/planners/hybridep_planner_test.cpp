// SPDX-License-Identifier: Apache-2.0
// HybridEP's stream model and planner (planners/hybridep_planner.hpp): every term on hand-computed
// numbers, the pair counts and the p of each expert-domain size, S_ED = 1 as plain EP, the regimes
// of §III-E's decision rule against its case formulas, the conversion from a cluster_spec, scaling,
// and errors that name the field.
//
// Table IV is not reproduced: systems.md §5 records its chosen p (0.75, 0.5) and that they follow
// only if "128 Gbps" is read as 128 GB/s, but not the layer (D, P_E, Lat_PE, G) they were chosen
// for. The platform files, and so `from_cluster`, read it as 128 Gb/s = 16 GB/s.

#include "../support/test_support.hpp"

#include <moecomm/planners/hybridep_planner.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

namespace test {

using moecomm::hybridep_choice;
using moecomm::hybridep_layer_shape;
using moecomm::hybridep_params;
using moecomm::hybridep_planner;
using moecomm::hybridep_prediction;

// Units in which every term below is a small binary fraction, so predictions compare exactly
// (links as {alpha, bandwidth}, then GEMM FLOP/s).
hybridep_params hybridep_unit_params() { return {{0.25, 4}, {1, 0.5}, 16}; }

// The paper's setting for §III-E: one bandwidth of 1 B/s, no α, GEMMs free.
hybridep_params hybridep_paper_params() { return {{0, 1}, {0, 1}, 1}; }

hybridep_layer_shape hybridep_shape(std::int32_t G, std::int32_t K, std::int32_t n, std::int64_t P_E, std::int64_t D,
                                    double Lat_PE, double flops) {
  hybridep_layer_shape s;
  s.ranks_per_domain = G; s.domains = K; s.experts_per_rank = n;
  s.parameter_bytes_per_expert = P_E; s.token_bytes = D; s.pre_expert_seconds = Lat_PE; s.expert_flops = flops;
  s.spread = moecomm::expert_domain_spread::within_data_centres;  // the layout of the hand-computed cases
  return s;
}

void check_same_prediction(hybridep_prediction const& got, hybridep_prediction const& want) {
  CHECK(got.expert_domain_ranks == want.expert_domain_ranks); CHECK(got.p == want.p);
  CHECK(got.a2a_pairs == want.a2a_pairs); CHECK(got.ag_pairs == want.ag_pairs);
  CHECK(got.allgather_bytes == want.allgather_bytes); CHECK(got.a2a_bytes_intra == want.a2a_bytes_intra);
  CHECK(got.a2a_bytes_inter == want.a2a_bytes_inter); CHECK(got.allgather == want.allgather);
  CHECK(got.a2a == want.a2a); CHECK(got.compute == want.compute);
  CHECK(got.communication == want.communication); CHECK(got.overlap == want.overlap);
  CHECK(got.total == want.total);
}

TEST_CASE("hybridep_planner: each term against hand-computed numbers") {
  hybridep_planner const planner(hybridep_unit_params());

  // Two data centres of G = 4 ranks (N = 8), n = 2 experts of 8 B, D = 32 B, Lat_PE = 3 s, 64 FLOPs
  // of GEMMs (n·Lat_Ep = 4 s). Every rank sends D·(K − 1)/K = 16 B to the other data centre:
  // 1 + 16/0.5 = 33 s whatever S, the larger class each time.
  hybridep_layer_shape const two = hybridep_shape(4, 2, 2, 8, 32, 3, 64);
  // S = 1: no all-gather; in the data centre D·3/8 = 12 B -> 0.25 + 3 = 3.25 s; A2A 33.
  //   comp 3 + 4 = 7, comm 0 + 66, overlap min(3, 0) + min(4, 66) = 4, total 7 + 66 − 4 = 69.
  check_same_prediction(planner.predict(two, 1), {1, 1, 56, 0, 0, 12, 16, 0, 33, 7, 66, 4, 69});
  // S = 2: p = (N − S)/(N − 1) = 6/7; A2A pairs 8·(4 − 1), AG pairs 8·1; V_AG = 2·8·1 = 16 B ->
  //   0.25 + 4 = 4.25 s; in the data centre D·2/8 = 8 B; comm 4.25 + 66, overlap 3 + 4, total 7 + 70.25 − 7.
  check_same_prediction(planner.predict(two, 2), {2, 6.0 / 7, 24, 8, 16, 8, 16, 4.25, 33, 7, 70.25, 7, 70.25});
  // S = 4 = G: p = 4/7; V_AG = 2·8·3 = 48 B -> 12.25 s; nothing left for the own data centre.
  check_same_prediction(planner.predict(two, 4), {4, 4.0 / 7, 8, 24, 48, 0, 16, 12.25, 33, 7, 78.25, 7, 78.25});
  // Expert domains inside a data centre cannot cut the cross-DC bytes, the slower class here.
  hybridep_choice const c = planner.choose(two);
  CHECK(c.expert_domain_ranks == 1);
  CHECK(c.p == 1);
  // §III-E in the one-DC view: p* = 1 − 4·3/(2·8·3) = 0.75; 2D − G·n·P_E = 64 − 64 = 0 -> p = 0.
  CHECK(c.p_star == 0.75);
  CHECK(c.p_rule == 0);

  // One data centre, GEMMs longer than the all-to-alls: G 4, n 1, P_E 8, D 16, Lat_PE 1, 160 FLOPs
  // (10 s). S = 1: in-DC 12 B -> 3.25 s, comm 6.5, overlap 0 + min(10, 6.5), total 11 + 6.5 − 6.5.
  hybridep_layer_shape const one = hybridep_shape(4, 1, 1, 8, 16, 1, 160);
  check_same_prediction(planner.predict(one, 1), {1, 1, 12, 0, 0, 12, 0, 0, 3.25, 11, 6.5, 6.5, 11});
  // S = 2: V_AG 8 B -> 2.25 s, in-DC 8 B -> 2.25 s; comm 6.75, overlap 1 + 4.5, total 12.25.
  check_same_prediction(planner.predict(one, 2), {2, 2.0 / 3, 4, 4, 8, 8, 0, 2.25, 2.25, 11, 6.75, 5.5, 12.25});
  // S = 4: V_AG 24 B -> 6.25 s, no all-to-all, so nothing hides the GEMMs: total 6.25 + 10 (the
  // paper's unbounded overlap would say 6.25).
  check_same_prediction(planner.predict(one, 4), {4, 0, 0, 12, 24, 0, 0, 6.25, 0, 11, 6.25, 1, 16.25});
  CHECK(planner.choose(one).expert_domain_ranks == 1);
}

TEST_CASE("hybridep_planner: pair counts and p of each expert-domain size, G = 8") {
  hybridep_planner const planner(hybridep_paper_params());
  hybridep_layer_shape const shape = hybridep_shape(8, 1, 1, 8, 64, 0, 0);
  struct row {
    std::int32_t S;
    std::int64_t a2a_pairs, ag_pairs;
  };
  // systems.md §5 [I from Table VII]: A2A pairs G·(G/S − 1), AG pairs G·(S − 1).
  row const rows[] = {{1, 56, 0}, {2, 24, 8}, {4, 8, 24}, {8, 0, 56}};
  hybridep_choice const c = planner.choose(shape);
  REQUIRE(c.candidates.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    row const r = rows[i];
    CAPTURE(r.S);
    hybridep_prediction const got = planner.predict(shape, r.S);
    check_same_prediction(c.candidates[i], got);
    CHECK(got.a2a_pairs == r.a2a_pairs);
    CHECK(got.ag_pairs == r.ag_pairs);
    // p = (G − S)/(G − 1): 1, 6/7, 4/7, 0. The volumes are §III-E's V_A2A = p·D·(G − 1)/G and
    // V_AG = (1 − p)·(G − 1)·P_E. The share of pairs, (G/S − 1)/(G − 1), differs for 1 < S < G:
    // the pairs then total 32, not G·(G − 1) = 56.
    CHECK(got.p == static_cast<double>(8 - r.S) / 7);
    CHECK(got.a2a_bytes_intra == 64.0 * (8 - r.S) / 8);
    CHECK(got.allgather_bytes == 8.0 * (r.S - 1));
    CHECK(std::fabs(got.a2a_bytes_intra - got.p * 64 * 7 / 8) <= 1e-12);
    CHECK(std::fabs(got.allgather_bytes - (1 - got.p) * 7 * 8) <= 1e-12);
  }
  CHECK(planner.predict(shape, 2).a2a_pairs + planner.predict(shape, 2).ag_pairs == 32);
  // Over two data centres N = 16: A2A N·(N/S − 1), AG N·(S − 1).
  hybridep_layer_shape two = shape;
  two.domains = 2;
  CHECK(planner.predict(two, 4).a2a_pairs == 16 * 3);
  CHECK(planner.predict(two, 4).ag_pairs == 16 * 3);
  CHECK(planner.predict(two, 4).p == 12.0 / 15);  // (N − S)/(N − 1): of all outgoing bytes
}

TEST_CASE("hybridep_planner: expert domains across data centres move experts over the slow links and keep tokens home") {
  // Two data centres of 4 (N = 8), the unit links (inside 4 B/s + 0.25 s, across 0.5 B/s + 1 s), n 2
  // experts of 8 B, D 32 B, Lat_PE 3 s, GEMMs 64 FLOPs (4 s). Positions l·2 + d: expert domain j of
  // S = 2 holds local rank j of both data centres; its same-offset group (positions 2j + o) is data
  // centre o: tokens never cross.
  hybridep_planner const planner(hybridep_unit_params());
  hybridep_layer_shape across = hybridep_shape(4, 2, 2, 8, 32, 3, 64);
  across.spread = moecomm::expert_domain_spread::across_data_centres;
  // S = 2: one peer across: V_AG 16 B -> 1 + 32 = 33 s; A2A: 3 peers in the data centre, D·2/8 = 8 B
  // each -> 0.25 + 6 = 6.25 s. total max(3, 33) + max(4, 12.5) = 45.5; comm 33 + 12.5, overlap 3 + 4.
  hybridep_prediction const two = planner.predict(across, 2);
  check_same_prediction(two, {2, 6.0 / 7, 24, 8, 16, 24, 0, 33, 6.25, 7, 45.5, 7, 45.5, 16});
  // S = 4: positions 0..3 = local ranks 0, 1 of both: 1 peer near (16 B -> 4.25 s), 2 far (32 B -> 65 s);
  // A2A: the other expert domain (positions 4..7) at the same offset is in the same data centre: 16 B -> 4.25 s.
  hybridep_prediction const four = planner.predict(across, 4);
  check_same_prediction(four, {4, 4.0 / 7, 8, 24, 48, 16, 0, 65, 4.25, 7, 73.5, 7, 73.5, 32});
  // S = 8 gathers all: 3 near (48 B -> 12.25 s), 4 far (64 B -> 129 s); no all-to-all.
  CHECK(planner.predict(across, 8).allgather == 129);
  CHECK(planner.predict(across, 8).a2a == 0);
  // Within data centres every S pays the 33 s all-to-all across (the first test case): across, S = 2
  // pays 33 s of gather once and a 6.25 s all-to-all twice, and wins.
  hybridep_choice const c = planner.choose(across);
  CHECK(c.candidates.size() == 4);  // the divisors of N = 8
  CHECK(c.expert_domain_ranks == 2);
  CHECK(c.chosen().total == 45.5);
  // The backward: 2 x 6.25 + 33 + 2 x 4 = 53.5; the step 45.5 + 53.5.
  CHECK(two.backward == 53.5);
  CHECK(two.step_total == 99);
  check_error([&] { (void)planner.predict(across, 3); }, moecomm::status::invalid_argument,
              {"moecomm::hybridep_planner::predict: expert_domain_ranks = 3 does not divide the 8 ranks"});
}

TEST_CASE("hybridep_planner: S_ED = 1 is plain EP's two all-to-alls") {
  // Plain EP: no all-gather, and a rank sends D·(N − 1)/N, D/N to each peer, twice.
  hybridep_params p;
  p.intra = {0.5, 2};
  p.inter = {4, 0.25};
  p.gemm_flops = 1;
  hybridep_planner const planner(p);
  // One data centre of 8: 0.5 + 64·7/8 / 2 = 28.5 s per all-to-all.
  hybridep_prediction const one = planner.predict(hybridep_shape(8, 1, 1, 1024, 64, 3, 1), 1);
  CHECK(one.allgather == 0);
  CHECK(one.a2a == 28.5);
  CHECK(one.total == 3 + 2 * 28.5);
  // Four data centres of 2: 64·1/8 B inside (0.5 + 4), 64·3/4 B outside (4 + 192): 196 s.
  hybridep_prediction const four = planner.predict(hybridep_shape(2, 4, 1, 1024, 64, 3, 1), 1);
  CHECK(four.allgather == 0);
  CHECK(four.a2a == 196);
  CHECK(four.total == 3 + 2 * 196);
  // §III-E case 1 at p = 1, no α: Lat_PE + 2D·(G − 1)/(G·B) = 3 + 2·64·7/8.
  CHECK(hybridep_planner(hybridep_paper_params()).predict(hybridep_shape(8, 1, 1, 1024, 64, 3, 0), 1).total == 115);
}

// §III-E's case formulas for one data centre, one bandwidth B = 1, no α, GEMMs hidden.
double case_formula(hybridep_layer_shape const& s, double p, double p_star) {
  double const G = s.ranks_per_domain, D = static_cast<double>(s.token_bytes);
  double const P_E = static_cast<double>(s.experts_per_rank * s.parameter_bytes_per_expert);
  if (p >= p_star) return s.pre_expert_seconds + 2 * D * (G - 1) * p / G;  // case 1
  return p * (G - 1) * (2 * D - G * P_E) / G + (G - 1) * P_E;             // case 2
}

void check_regime(hybridep_layer_shape const& shape, std::int32_t chosen, double p_star, double p_rule) {
  hybridep_choice const c = hybridep_planner(hybridep_paper_params()).choose(shape);
  CHECK(c.expert_domain_ranks == chosen);
  CHECK(c.p == c.chosen().p);
  CHECK(c.chosen().expert_domain_ranks == chosen);
  CHECK(c.p_star == p_star);
  CHECK(c.p_rule == p_rule);
  for (hybridep_prediction const& r : c.candidates) {
    CAPTURE(r.expert_domain_ranks);
    CHECK(r.total == relatively(case_formula(shape, r.p, c.p_star), 1e-15));
    CHECK(r.total >= c.chosen().total);
  }
}

TEST_CASE("hybridep_planner: the regimes of the decision rule") {
  // G = 8, P_E = 8 B, B = 1 B/s: gathering everything takes (G − 1)·P_E = 56 s.
  // 2D − G·P_E < 0 (D = 16): mixed. p* = 1 − 28/56 = 0.5; totals 56, 52, 44, 56 for S = 1, 2, 4, 8:
  // S = 4 (p = 4/7) is the divisor nearest above p*.
  check_regime(hybridep_shape(8, 1, 1, 8, 16, 28, 0), 4, 0.5, 0.5);
  // 2D − G·P_E > 0 (D = 40): gather every expert. Totals 98, 88, 68, 56.
  check_regime(hybridep_shape(8, 1, 1, 8, 40, 28, 0), 8, 0.5, 0);
  // 2D − G·P_E = 0 (D = 32): case 2 is flat, p = 0 still. Totals 84, 76, 60, 56.
  check_regime(hybridep_shape(8, 1, 1, 8, 32, 28, 0), 8, 0.5, 0);
  // Lat_PE = 112 s hides even the whole all-gather: p* = 1 − 112/56 = −1, every p is case 1 and the
  // latency grows with p, so p = 0.
  check_regime(hybridep_shape(8, 1, 1, 8, 16, 112, 0), 8, -1, 0);
  // Nothing to hide the all-gather under (Lat_PE = 0): p* = 1, plain EP. Totals 28, 32, 40, 56.
  check_regime(hybridep_shape(8, 1, 1, 8, 16, 0, 0), 1, 1, 1);
  // n experts per rank weigh as one expert of n·P_E: n = 2 of 4 B is the mixed case above.
  check_regime(hybridep_shape(8, 1, 2, 4, 16, 28, 0), 4, 0.5, 0.5);
  // One rank per data centre: nothing to gather, p* = p = 1.
  hybridep_choice const lone = hybridep_planner(hybridep_paper_params()).choose(hybridep_shape(1, 4, 1, 8, 16, 28, 0));
  REQUIRE(lone.candidates.size() == 1);
  CHECK(lone.expert_domain_ranks == 1);
  CHECK(lone.p_star == 1);
  CHECK(lone.p_rule == 1);
  CHECK(lone.candidates[0].a2a_pairs == 4 * 3);
}

TEST_CASE("hybridep_planner: a tie keeps the smaller expert domain") {
  // G 2, P_E 8, D 8, Lat_PE 0: S = 1 sends 4 B twice (8 s), S = 2 gathers 8 B (8 s).
  hybridep_choice const c = hybridep_planner(hybridep_paper_params()).choose(hybridep_shape(2, 1, 1, 8, 8, 0, 0));
  REQUIRE(c.candidates.size() == 2);
  CHECK(c.candidates[0].total == 8);
  CHECK(c.candidates[1].total == 8);
  CHECK(c.expert_domain_ranks == 1);
  // Divisors only, ascending: 12 -> 1, 2, 3, 4, 6, 12.
  hybridep_choice const twelve = hybridep_planner(hybridep_paper_params()).choose(hybridep_shape(12, 1, 1, 8, 8, 0, 0));
  REQUIRE(twelve.candidates.size() == 6);
  std::int32_t const want[] = {1, 2, 3, 4, 6, 12};
  for (std::size_t i = 0; i < 6; ++i) CHECK(twelve.candidates[i].expert_domain_ranks == want[i]);
}

// The figures of platforms/hybridep-a800-<8 x domains / 2>.platform.
moecomm::cluster_spec hybridep_a800_spec(std::int32_t domains) {
  moecomm::cluster_spec c;
  c.name = "hybridep-a800"; c.source = "test";
  c.domains = domains; c.nodes_per_domain = 1; c.gpus_per_node = 4; c.nics_per_node = 1;
  c.gpu_flops = 312e12; c.hbm_bytes_per_second = 1935e9; c.kernel_launch_seconds = 4e-6;
  c.gemm_efficiency = 0.8; c.gemm_ridge_rows = 129; c.comm_sm_share = 0.15;
  c.collective_overhead_seconds = 8e-6;
  c.intra_node_over_pcie = true; c.intra_node = c.pcie = {16e9, 1e-6}; c.nic = {1.25e9, 5e-6};
  c.fabric = {0, 0}; c.inter_domain = {1.25e9, 25e-6};
  return c;
}

TEST_CASE("hybridep_planner: from_cluster prices the routes of the HybridEP platforms") {
  hybridep_params const defaults;
  for (std::int32_t domains : {2, 4, 8}) {  // hybridep-a800-8, -16, -32
    CAPTURE(domains);
    hybridep_params const p = hybridep_params::from_cluster(hybridep_a800_spec(domains));
    // Inside: 8 µs of overhead, two PCIe ports of 1 µs, 16 GB/s. Across: 8 + 2·(1 + 5 + 0 + 25) µs;
    // the 10 Gb/s NIC and uplink shared by the 4 GPUs: 312.5 MB/s. GEMMs at 80 % of 312 TFLOP/s.
    CHECK(p.intra.alpha_seconds == relatively(10e-6, 1e-12));
    CHECK(p.intra.bytes_per_second == relatively(16e9, 1e-12));
    CHECK(p.inter.alpha_seconds == relatively(70e-6, 1e-12));
    CHECK(p.inter.bytes_per_second == relatively(312.5e6, 1e-12));
    CHECK(p.gemm_flops == relatively(249.6e12, 1e-12));
    CHECK(p.intra.alpha_seconds == relatively(defaults.intra.alpha_seconds, 1e-12));
    CHECK(p.intra.bytes_per_second == relatively(defaults.intra.bytes_per_second, 1e-12));
    CHECK(p.inter.alpha_seconds == relatively(defaults.inter.alpha_seconds, 1e-12));
    CHECK(p.inter.bytes_per_second == relatively(defaults.inter.bytes_per_second, 1e-12));
    CHECK(p.gemm_flops == relatively(defaults.gemm_flops, 1e-12));
  }
  // A faster NIC leaves the uplink as the limit; a blocking fabric of 0.5 GB/s over 4 GPUs limits further.
  moecomm::cluster_spec c = hybridep_a800_spec(2);
  c.nic = {12.5e9, 5e-6};
  CHECK(hybridep_params::from_cluster(c).inter.bytes_per_second == relatively(312.5e6, 1e-12));
  c.inter_domain = {100e9, 25e-6};
  CHECK(hybridep_params::from_cluster(c).inter.bytes_per_second == relatively(3.125e9, 1e-12));
  c.fabric = {0.5e9, 0.5e-6};
  CHECK(hybridep_params::from_cluster(c).inter.bytes_per_second == relatively(125e6, 1e-12));
  CHECK(hybridep_params::from_cluster(c).inter.alpha_seconds == relatively(71e-6, 1e-12));
  // One data centre: nothing crosses, inter is intra.
  hybridep_params const lone = hybridep_params::from_cluster(hybridep_a800_spec(1));
  CHECK(lone.inter.bytes_per_second == lone.intra.bytes_per_second);
  CHECK(lone.inter.alpha_seconds == lone.intra.alpha_seconds);

  c = hybridep_a800_spec(2);
  c.nodes_per_domain = 2;
  check_error([&] { (void)hybridep_params::from_cluster(c); }, moecomm::status::invalid_argument,
              {"moecomm::hybridep_params::from_cluster: spec.nodes_per_domain = 2 must be 1"});
  c = hybridep_a800_spec(2);
  c.gpus_per_node = 0;
  check_error([&] { (void)hybridep_params::from_cluster(c); }, moecomm::status::invalid_argument,
              {"cluster_spec::validate", "gpus_per_node = 0 must be >= 1"});
}

TEST_CASE("hybridep_planner: a scaled planner prices the bytes and FLOPs the real ones stand for") {
  hybridep_planner const planner(hybridep_unit_params());
  hybridep_layer_shape const real = hybridep_shape(4, 2, 2, 8, 32, 3, 64);
  hybridep_layer_shape big = real;
  big.token_bytes *= 2;
  big.parameter_bytes_per_expert *= 3;
  big.expert_flops *= 5;
  for (std::int32_t s : {1, 2, 4}) {
    CAPTURE(s);
    check_same_prediction(planner.scaled(2, 3, 5).predict(real, s), planner.predict(big, s));
    check_same_prediction(planner.scaled(2, 1, 5).scaled(1, 3, 1).predict(real, s), planner.predict(big, s));
  }
  // p* sees the scaled parameter bytes: 1 − 4·3/(2·8·3) = 0.75 unscaled, 1 − 4·3/(2·32·3) at scale 4.
  CHECK(planner.choose(real).p_star == 0.75);
  CHECK(planner.scaled(1, 4, 1).choose(real).p_star == 0.9375);
  check_error([&] { (void)planner.scaled(0, 1, 1); }, moecomm::status::invalid_argument,
              {"moecomm::hybridep_planner: token_bytes scale = 0 must be finite and positive"});
  check_error([&] { (void)planner.scaled(1, std::numeric_limits<double>::quiet_NaN(), 1); },
              moecomm::status::invalid_argument, {"parameter_bytes scale = nan"});
  check_error([&] { (void)planner.scaled(1, 1, -2); }, moecomm::status::invalid_argument, {"flops scale = -2"});
}

TEST_CASE("hybridep_planner: errors name the field") {
  hybridep_planner const planner(hybridep_unit_params());
  struct bad_shape {
    void (*spoil)(hybridep_layer_shape&);
    char const* message;
  };
  bad_shape const shapes[] = {
      {[](hybridep_layer_shape& s) { s.ranks_per_domain = 0; }, "shape.ranks_per_domain = 0 must be at least 1"},
      {[](hybridep_layer_shape& s) { s.domains = -1; }, "shape.domains = -1 must be at least 1"},
      {[](hybridep_layer_shape& s) { s.experts_per_rank = 0; }, "shape.experts_per_rank = 0 must be at least 1"},
      {[](hybridep_layer_shape& s) { s.parameter_bytes_per_expert = 0; },
       "shape.parameter_bytes_per_expert = 0 must be at least 1"},
      {[](hybridep_layer_shape& s) { s.token_bytes = -3; }, "shape.token_bytes = -3 must be at least 1"},
      {[](hybridep_layer_shape& s) { s.pre_expert_seconds = std::numeric_limits<double>::quiet_NaN(); },
       "shape.pre_expert_seconds = nan must be finite and >= 0"},
      {[](hybridep_layer_shape& s) { s.pre_expert_seconds = -1; }, "shape.pre_expert_seconds = -1 must be finite and >= 0"},
      {[](hybridep_layer_shape& s) { s.expert_flops = std::numeric_limits<double>::infinity(); },
       "shape.expert_flops = inf must be finite and >= 0"},
      {[](hybridep_layer_shape& s) {
         s.domains = 1 << 20;
         s.ranks_per_domain = 1 << 12;
       },
       "shape.domains = 1048576 x shape.ranks_per_domain = 4096 is more ranks than int32 can number"},
  };
  for (bad_shape const& bad : shapes) {
    hybridep_layer_shape s = hybridep_shape(4, 2, 2, 8, 32, 3, 64);
    bad.spoil(s);
    check_error([&] { (void)planner.choose(s); }, moecomm::status::invalid_argument,
                {std::string("moecomm::hybridep_planner::choose: ") + bad.message});
    check_error([&] { (void)planner.predict(s, 1); }, moecomm::status::invalid_argument,
                {std::string("moecomm::hybridep_planner::predict: ") + bad.message});
  }
  hybridep_layer_shape const eight = hybridep_shape(8, 1, 1, 8, 32, 3, 64);
  check_error([&] { (void)planner.predict(eight, 3); }, moecomm::status::invalid_argument,
              {"moecomm::hybridep_planner::predict: expert_domain_ranks = 3 does not divide shape.ranks_per_domain = 8"});
  check_error([&] { (void)planner.predict(eight, 0); }, moecomm::status::invalid_argument,
              {"expert_domain_ranks = 0 does not divide"});
  check_error([&] { (void)planner.predict(eight, 16); }, moecomm::status::invalid_argument,
              {"expert_domain_ranks = 16 does not divide"});

  struct bad_params {
    void (*spoil)(hybridep_params&);
    char const* message;
  };
  bad_params const params[] = {
      {[](hybridep_params& p) { p.intra.alpha_seconds = -1; }, "intra.alpha_seconds = -1 must be finite and >= 0"},
      {[](hybridep_params& p) { p.inter.alpha_seconds = std::numeric_limits<double>::infinity(); },
       "inter.alpha_seconds = inf must be finite and >= 0"},
      {[](hybridep_params& p) { p.intra.bytes_per_second = 0; }, "intra.bytes_per_second = 0 must be finite and positive"},
      {[](hybridep_params& p) { p.inter.bytes_per_second = std::numeric_limits<double>::quiet_NaN(); },
       "inter.bytes_per_second = nan must be finite and positive"},
      {[](hybridep_params& p) { p.gemm_flops = -5; }, "gemm_flops = -5 must be finite and positive"},
  };
  for (bad_params const& bad : params) {
    hybridep_params p;
    bad.spoil(p);
    check_error([&] { hybridep_planner const m(p); }, moecomm::status::invalid_argument,
                {std::string("moecomm::hybridep_planner: ") + bad.message});
  }
}

}  // namespace test
