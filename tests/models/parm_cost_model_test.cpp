// SPDX-License-Identifier: Apache-2.0
// Parm's cost model (models/parm_cost_model.hpp): the three schedules on hand-computed numbers, where
// each group's peers are, S2 against S1 (equal in one piece, cheaper by overlap, dearer with many
// pieces, a large α or many copy launches), predictions that grow with the tokens, the conversion
// from a cluster_spec, and errors that name the field.

#include "../support/test_support.hpp"

#include <moecomm/models/parm_cost_model.hpp>

#include <functional>
#include <string>

namespace test {

using moecomm::parm_cost_model;
using moecomm::parm_cost_params;
using moecomm::parm_layer_shape;
using moecomm::parm_prediction;
using moecomm::parm_schedule;

// Units in which every term below is a small binary fraction, so predictions compare exactly.
parm_cost_params parm_unit_params() {
  parm_cost_params p;
  p.intra = {0.25, 0.125}; p.inter = {0.5, 0.25};
  p.gemm_flops = 64; p.copy_bytes_per_second = 128; p.kernel_launch_seconds = 0.0625;
  p.shared_port_bytes_per_second = 0;
  return p;
}

// T 8, K 2 (S = 16 slot rows), H 4 x 2 bytes (b = 8), F 8, E 4 (L = 2 per rank), 128 bytes per
// expert (a slice: 64); M 4, P 2, G 2, 4 ranks per node: MP, ESP and the MP / ESP = 2 ranks holding
// one slice inside a node, the EP peer in the other node (one EP rank per node); W 2.
parm_layer_shape parm_small_shape() {
  parm_layer_shape s;
  s.tokens = 8; s.top_k = 2;
  s.hidden = 4;
  s.ffn = 8; s.element_bytes = 2; s.num_experts = 4; s.parameter_bytes_per_expert = 128;
  s.sizes = {4, 2, 2}; s.ranks_per_node = 4; s.pieces = 2;
  return s;
}

void check_same_prediction(parm_prediction const& got, parm_prediction const& want) {
  CHECK(got.dispatch == want.dispatch); CHECK(got.expert == want.expert); CHECK(got.combine == want.combine);
  CHECK(got.mp_gather == want.mp_gather); CHECK(got.backward_extra == want.backward_extra);
  CHECK(got.forward_total == want.forward_total); CHECK(got.step_total == want.step_total);
}

TEST_CASE("parm_cost_model: the three schedules against hand-computed numbers") {
  parm_cost_model const model(parm_unit_params());
  parm_layer_shape const shape = parm_small_shape();
  // Expert FLOPs per row: 2 GEMMs x 2·H·F/G = 4·4·8/2 = 64, i.e. 1 s per row at 64 FLOP/s.
  // A kernel: 1/16 s + bytes / 128.

  // DeepSpeed-MoE with MP: every MP rank dispatches all S = 16 rows.
  //   A2A over EP (1 peer, inter): 16·8/2 = 64 B to it -> 0.5 + 0.25·64 = 16.5
  //   ESP (1 peer, intra), S/G·b = 64 B to it -> 0.25 + 8 = 8.25 per collective;
  //     reduce-scatter: + 2 kernels, the own slice copied (64 B) and 2 slices summed (3·64 B = 1.5 copies)
  //       -> 8.25 + 0.125 + 160/128 = 9.625;  all-gather: + 1 copy of 64 B -> 8.25 + 0.0625 + 0.5 = 8.8125
  //   expert: 16 rows -> 16;  combine = 9.625 + 8.8125 + 16.5 = 34.9375;  no MP gather, nothing backward-only
  //   forward = 16.5 + 16 + 34.9375 = 67.4375;  step = 2·(16.5 + 34.9375) + 3·16 = 150.875
  check_same_prediction(model.predict_deepspeed_mp(shape), {16.5, 16, 34.9375, 0, 0, 67.4375, 150.875});

  // S1: S/M = 4 rows (32 B) per MP rank.
  //   A2A: 16 B to the peer -> 0.5 + 4 = 4.5;  ESP all-gather: 32 B to the peer -> 0.25 + 4 = 4.25
  //   unpacking: G·P = 4 copies of G·32 = 64 B in all -> 0.25 + 0.5;  dispatch = 4.5 + 5 = 9.5
  //   reduce-scatter: 4.25 + G·P + 2 = 6 kernels (0.375) + (64 packed + 32 own + 1.5·32 summed) / 128 = 5.75
  //   combine = 5.75 + 4.5 = 10.25;  expert: G·S/M = 8 rows -> 8
  //   MP all-gather (3 intra peers): T/M = 2 rows, 16 B to each -> 0.25 + 6, + 1 copy of 16 B -> 6.4375
  //   gradient sum over the 2 ranks holding a slice (intra): L·slice = 128 B -> 0.25 + 16 = 16.25
  //   forward = 9.5 + 8 + 10.25 + 6.4375 = 34.1875;  step = 2·(9.5 + 10.25 + 6.4375) + 3·8 + 16.25 = 92.625
  check_same_prediction(model.predict_s1(shape), {9.5, 8, 10.25, 6.4375, 16.25, 34.1875, 92.625});

  // S2, W = 2: pieces of A2A 0.5 + 0.25·8 = 2.5 and of ESP 0.25 + 0.125·16 = 2.25; every piece has
  // all of S1's kernels and half its bytes: gather 2.25 + 0.25 + 0.25 = 2.75, reduce 2.25 + 0.375 + 0.5625 = 3.1875.
  //   dispatch 2.5 + 1·max(2.5, 2.75) + 2.75 = 8, combine 3.1875 + 1·max(3.1875, 2.5) + 2.5 = 8.875
  //   forward = 8 + 8 + 8.875 + 6.4375 = 31.3125;  step = 2·(8 + 8.875 + 6.4375) + 3·8 + 16.25 = 86.875
  check_same_prediction(model.predict_s2(shape), {8, 8, 8.875, 6.4375, 16.25, 31.3125, 86.875});

  auto const choice = model.choose(shape);
  CHECK(choice.schedule == parm_schedule::s2);
  check_same_prediction(choice.s1, model.predict_s1(shape));
  check_same_prediction(choice.s2, model.predict_s2(shape));

  // Capacity keeping half the slots halves S and the slot-row terms, not the kernels, the MP gather
  // or the gradient sum. S1: A2A 0.5 + 2 = 2.5; ESP 0.25 + 2 = 2.25; gather 2.25 + 0.25 + 0.25 = 2.75;
  // reduce 2.25 + 0.375 + 0.5625 = 3.1875; expert 4.
  parm_layer_shape half = shape;
  half.kept_fraction = 0.5;
  check_same_prediction(model.predict_s1(half), {5.25, 4, 5.6875, 6.4375, 16.25, 21.375, 63});
}

TEST_CASE("parm_cost_model: each group's peers in the node are priced intra, the others inter") {
  // β 1 s/B inside a node, 2 s/B across, no α, copies and kernels free, no shared port: a term is
  // the larger of a rank's intra-node bytes and twice its inter-node bytes.
  parm_cost_params p;
  p.intra = {0, 1}; p.inter = {0, 2};
  p.copy_bytes_per_second = 1e300; p.kernel_launch_seconds = 0;
  p.shared_port_bytes_per_second = 0;
  parm_cost_model const model(p);
  parm_layer_shape s;
  s.tokens = 8;
  s.hidden = 1;
  s.element_bytes = 1; s.ffn = 1; s.num_experts = 8; s.parameter_bytes_per_expert = 2;

  // M 2, P 2, G 1: S1's dispatch is its A2A, (8/2)/2 = 2 B to the peer; its MP gather 4 B to the peer.
  s.sizes = {2, 2, 1};
  s.ranks_per_node = 4;  // EP groups in blocks of P·M = 4: inside a node
  CHECK(model.predict_s1(s).dispatch == 2);
  CHECK(model.predict_s1(s).mp_gather == 4);
  s.ranks_per_node = 6;  // P·M = 4 <= 6, but ranks 4..7 straddle two nodes: priced as all inter
  CHECK(model.predict_s1(s).dispatch == 4);
  CHECK(model.predict_s1(s).mp_gather == 4);
  s.ranks_per_node = 1;  // one rank per node: every group spans nodes
  CHECK(model.predict_s1(s).dispatch == 4);
  CHECK(model.predict_s1(s).mp_gather == 8);

  // M 2, P 4, 4 ranks per node: an EP group covers two whole nodes, 2 of its ranks in each, so each
  // rank has 1 peer inside its node (1 B at 1 s/B) and 2 outside (2 B at 2 s/B): 4, the inter side.
  s.sizes = {2, 4, 1};
  s.ranks_per_node = 4;
  CHECK(model.predict_s1(s).dispatch == 4);
  // Through a shared port of 0.5 B/s all 3 B queue at the port: 6.
  p.shared_port_bytes_per_second = 0.5;
  CHECK(parm_cost_model(p).predict_s1(s).dispatch == 6);
  p.shared_port_bytes_per_second = 0;

  // M 4, G 2, P 1 on 6 ranks per node: ESP groups (pairs) fit, MP groups (fours) do not, the
  // EP group of one rank costs nothing.
  s.sizes = {4, 1, 2};
  s.ranks_per_node = 6;
  auto const s1 = model.predict_s1(s);
  CHECK(s1.dispatch == 2);         // ESP all-gather: 8/4 = 2 B to the peer, intra
  CHECK(s1.mp_gather == 12);       // 2 B to each of 3 peers, inter
  CHECK(s1.backward_extra == 16);  // the 2 ranks holding a slice, 2 apart, straddle nodes: L·slice = 8·1 B, inter
  CHECK(model.predict_deepspeed_mp(s).dispatch == 0);
}

TEST_CASE("parm_cost_model: S2 pays W times S1's copy launches") {
  // Only kernels cost (1 s each): S1 unpacks G·P blocks once and packs G·P + 2 (own copy, sum) once;
  // S2 does it in every one of its W pieces.
  parm_cost_params p;
  p.intra = p.inter = {0, 1e-300};
  p.copy_bytes_per_second = 1e300; p.kernel_launch_seconds = 1;
  p.shared_port_bytes_per_second = 0;
  parm_cost_model const model(p);
  parm_layer_shape s = parm_small_shape();  // G 2, P 2, W 2
  for (std::int32_t pieces : {1, 2, 5}) {
    CAPTURE(pieces);
    s.pieces = pieces;
    CHECK(model.predict_s2(s).dispatch == 4.0 * pieces);
    CHECK(model.predict_s2(s).combine == 6.0 * pieces);
  }
  CHECK(model.predict_s1(s).dispatch == 4);
  CHECK(model.choose(s).schedule == parm_schedule::s1);
}

TEST_CASE("parm_cost_model: in one piece S2 is S1, and S1 wins the tie") {
  parm_cost_model const model(parm_unit_params());
  for (std::int32_t slicing : {1, 2}) {
    CAPTURE(slicing);
    parm_layer_shape shape = parm_small_shape();
    shape.sizes.expert_slicing = slicing;
    shape.pieces = 1;
    check_same_prediction(model.predict_s2(shape), model.predict_s1(shape));
    CHECK(model.choose(shape).schedule == parm_schedule::s1);
  }
}

// M 2, G 2, P 16 (EP across nodes, MP and ESP inside), 2048 slot rows of 2 KiB per MP rank: the
// A2A moves 15/16 of them, the ESP all-gather all of them, so the two stages nearly balance.
parm_layer_shape parm_balanced_shape(std::int32_t pieces) {
  parm_layer_shape s;
  s.tokens = 2048; s.top_k = 2;
  s.hidden = 1024;
  s.ffn = 4096; s.element_bytes = 2; s.num_experts = 16; s.parameter_bytes_per_expert = 2 * 1024 * 4096 * 2;
  s.sizes = {2, 16, 2}; s.ranks_per_node = 2; s.pieces = pieces;
  return s;
}

TEST_CASE("parm_cost_model: S2 overlaps the two links when they are equally slow") {
  parm_cost_params p;
  p.intra = p.inter = {1e-6, 1e-9};  // 1 GB/s both
  p.kernel_launch_seconds = 0;
  p.shared_port_bytes_per_second = 0;
  parm_cost_model const model(p);
  auto const choice = model.choose(parm_balanced_shape(8));
  CHECK(choice.schedule == parm_schedule::s2);
  // S1 runs the stages one after the other, ~2 x 4 MiB; S2 ~ the slower stage plus one piece of the
  // other, ~(1 + 1/8) x 4 MiB; both unpack the G·S/M = 4096 gathered rows of 2 KiB at 308 GB/s.
  double const mib4 = 4194304e-9;  // seconds of 4 MiB at 1 GB/s
  CHECK(choice.s1.dispatch == relatively(mib4 * (1 + 15.0 / 16) + 2e-6 + 2 * 4194304 / 308e9, 1e-9));
  CHECK(choice.s2.dispatch < 0.6 * choice.s1.dispatch);
  CHECK(choice.s2.combine < 0.6 * choice.s1.combine);
  CHECK(choice.s2.step_total < choice.s1.step_total);
}

TEST_CASE("parm_cost_model: through one shared port S2's stages do not overlap") {
  // Both links 1 GB/s and one port of 1 GB/s that both stages cross (GPUs on PCIe, one node): a
  // step of both pipelined stages moves both pieces through the port, so S2 is S1's bytes plus
  // S2's extra αs and copies, and S1 wins.
  parm_cost_params p;
  p.intra = p.inter = {1e-6, 1e-9};
  p.shared_port_bytes_per_second = 1e9;
  p.copy_bytes_per_second = 1e30;  // copies free: S2 could otherwise hide them behind the all-to-all
  p.kernel_launch_seconds = 0;
  parm_cost_model const model(p);
  auto const shared = model.choose(parm_balanced_shape(8));
  CHECK(shared.schedule == parm_schedule::s1);
  CHECK(shared.s2.dispatch > shared.s1.dispatch);
  // A port 4x faster than either link leaves room for both: the overlap is back.
  p.shared_port_bytes_per_second = 4e9;
  CHECK(parm_cost_model(p).choose(parm_balanced_shape(8)).schedule == parm_schedule::s2);
  p.shared_port_bytes_per_second = -1;
  check_error([&] { parm_cost_model const m(p); }, moecomm::status::invalid_argument,
              {"moecomm::parm_cost_model: shared_port_bytes_per_second = -1 must be finite and >= 0"});
}

TEST_CASE("parm_cost_model: many pieces and a large alpha make S1 cheaper") {
  parm_cost_params p;
  p.intra = p.inter = {1e-3, 1e-9};  // 1 ms per collective
  p.kernel_launch_seconds = 0;
  p.shared_port_bytes_per_second = 0;
  parm_cost_model const model(p);
  auto const many = model.choose(parm_balanced_shape(64));
  CHECK(many.schedule == parm_schedule::s1);
  // S2 pays W + 1 = 65 α per pipeline where S1 pays 2; its overlap saves only ~4 of S1's 8 ms of bytes.
  CHECK(many.s2.dispatch > many.s1.dispatch + 55e-3);
  // The same layer in 2 pieces still overlaps enough to win.
  CHECK(model.choose(parm_balanced_shape(2)).schedule == parm_schedule::s2);
}

TEST_CASE("parm_cost_model: predictions grow with the tokens") {
  parm_cost_model const model;  // the default, parm-2080ti constants
  struct layout {
    moecomm::parallel_sizes sizes;
    std::int32_t ranks_per_node, pieces;
  };
  layout const layouts[] = {
      {{4, 2, 2}, 4, 2},   // MP, ESP inside a node, EP across
      {{2, 8, 1}, 16, 4},  // everything inside a node, no ESP
      {{8, 4, 8}, 4, 16},  // MP and ESP span nodes
      {{1, 4, 1}, 2, 3},   // plain EP
  };
  using schedule = std::function<parm_prediction(parm_layer_shape const&)>;
  schedule const schedules[] = {
      [&](parm_layer_shape const& s) { return model.predict_deepspeed_mp(s); },
      [&](parm_layer_shape const& s) { return model.predict_s1(s); },
      [&](parm_layer_shape const& s) { return model.predict_s2(s); },
  };
  for (layout const& at : layouts) {
    for (std::size_t k = 0; k < 3; ++k) {
      CAPTURE(at.sizes.model);
      CAPTURE(k);
      parm_layer_shape s;
      s.top_k = 2;
      s.hidden = 512;
      s.ffn = 1024;
      s.kept_fraction = 0.75;
      s.num_experts = 16;
      s.parameter_bytes_per_expert = 2 * 512 * 1024 * 2;
      s.sizes = at.sizes;
      s.ranks_per_node = at.ranks_per_node;
      s.pieces = at.pieces;
      s.tokens = 1;
      parm_prediction before = schedules[k](s);
      for (std::int64_t tokens = 2; tokens <= 1 << 16; tokens *= 2) {
        CAPTURE(tokens);
        s.tokens = tokens;
        parm_prediction const now = schedules[k](s);
        CHECK(now.dispatch >= before.dispatch);
        CHECK(now.expert > before.expert);
        CHECK(now.combine >= before.combine);
        CHECK(now.mp_gather >= before.mp_gather);
        CHECK(now.backward_extra == before.backward_extra);  // parameters do not depend on tokens
        CHECK(now.forward_total > before.forward_total);
        CHECK(now.step_total > before.step_total);
        before = now;
      }
    }
  }
}

// The figures of platforms/parm-2080ti.platform.
moecomm::cluster_spec parm_2080ti_spec() {
  moecomm::cluster_spec c;
  c.name = "parm-2080ti"; c.source = "test";
  c.nodes_per_domain = 8; c.gpus_per_node = 4; c.nics_per_node = 1;
  c.gpu_flops = 53.8e12; c.hbm_bytes_per_second = 616e9; c.kernel_launch_seconds = 4e-6;
  c.gemm_efficiency = 0.7; c.gemm_ridge_rows = 61; c.comm_sm_share = 0.06;
  c.collective_overhead_seconds = 12e-6;
  c.intra_node_over_pcie = true; c.intra_node = c.pcie = {15.75e9, 1e-6}; c.nic = {12.5e9, 1e-6};
  c.fabric = {0, 0.5e-6};
  return c;
}

TEST_CASE("parm_cost_model: from_cluster prices the routes of a simulated cluster") {
  // The defaults are parm-2080ti's.
  parm_cost_params const defaults;
  parm_cost_params const p = parm_cost_params::from_cluster(parm_2080ti_spec());
  CHECK(p.intra.alpha_seconds == relatively(defaults.intra.alpha_seconds, 1e-12));
  CHECK(p.intra.beta_seconds_per_byte == relatively(defaults.intra.beta_seconds_per_byte, 1e-12));
  CHECK(p.inter.alpha_seconds == relatively(defaults.inter.alpha_seconds, 1e-12));
  CHECK(p.inter.beta_seconds_per_byte == relatively(defaults.inter.beta_seconds_per_byte, 1e-12));
  CHECK(p.gemm_flops == relatively(defaults.gemm_flops, 1e-12));
  CHECK(p.copy_bytes_per_second == relatively(defaults.copy_bytes_per_second, 1e-12));
  // Inside a node: 12 µs of overhead and two PCIe ports of 1 µs; across: 12 + 1 + 1 + 0.5 + 1 + 1 µs,
  // the NIC's 12.5 GB/s over 4 GPUs.
  CHECK(p.intra.alpha_seconds == relatively(14e-6, 1e-12));
  CHECK(p.inter.alpha_seconds == relatively(16.5e-6, 1e-12));
  CHECK(p.inter.beta_seconds_per_byte == relatively(1 / 3.125e9, 1e-12));
  CHECK(p.copy_bytes_per_second == relatively(308e9, 1e-12));
  CHECK(p.kernel_launch_seconds == relatively(4e-6, 1e-12));
  CHECK(p.kernel_launch_seconds == relatively(defaults.kernel_launch_seconds, 1e-12));
  CHECK(p.shared_port_bytes_per_second == relatively(defaults.shared_port_bytes_per_second, 1e-12));
  CHECK(p.shared_port_bytes_per_second == relatively(15.75e9, 1e-12));  // GPUs talk over PCIe

  // NVLink and a NIC per GPU: the PCIe link limits a GPU; a blocking fabric shared by the 32 GPUs
  // limits it further.
  moecomm::cluster_spec c = parm_2080ti_spec();
  c.intra_node_over_pcie = false; c.intra_node = {150e9, 0.25e-6};
  c.nics_per_node = 4;
  c.nic = {25e9, 1e-6};
  parm_cost_params const q = parm_cost_params::from_cluster(c);
  CHECK(q.intra.alpha_seconds == relatively(12.5e-6, 1e-12));  // the overhead and two NVLink ports
  CHECK(q.intra.beta_seconds_per_byte == relatively(1 / 150e9, 1e-12));
  CHECK(q.inter.beta_seconds_per_byte == relatively(1 / 15.75e9, 1e-12));
  CHECK(q.shared_port_bytes_per_second == 0);  // NVLink inside the node, PCIe out of it
  c.fabric = {320e9, 0.5e-6};
  CHECK(parm_cost_params::from_cluster(c).inter.beta_seconds_per_byte == relatively(1 / 10e9, 1e-12));

  c.domains = 2;
  c.inter_domain = {1.25e9, 25e-6};
  check_error([&] { (void)parm_cost_params::from_cluster(c); }, moecomm::status::invalid_argument,
              {"moecomm::parm_cost_params::from_cluster: spec.domains = 2 must be 1"});
  c = parm_2080ti_spec();
  c.gpus_per_node = 0;
  check_error([&] { (void)parm_cost_params::from_cluster(c); }, moecomm::status::invalid_argument,
              {"cluster_spec::validate", "gpus_per_node = 0 must be >= 1"});
}

TEST_CASE("parm_cost_model: a scaled model prices the rows, parameters and FLOPs the real ones stand for") {
  // Scaling row bytes by 8 is a shape with 8x the hidden size and 1/8 of the inner width (same
  // FLOPs); parameter bytes and FLOPs scale on their own.
  parm_cost_model const model;
  parm_layer_shape const real = parm_small_shape();
  parm_layer_shape wide = real;
  wide.hidden *= 8;
  wide.ffn = 1;
  wide.parameter_bytes_per_expert *= 3;
  parm_cost_model const scaled = model.scaled(8, 3, 1);
  check_same_prediction(scaled.predict_s1(real), model.predict_s1(wide));
  check_same_prediction(scaled.predict_s2(real), model.predict_s2(wide));
  check_same_prediction(scaled.predict_deepspeed_mp(real), model.predict_deepspeed_mp(wide));
  parm_layer_shape heavy = real;
  heavy.ffn *= 5;
  check_same_prediction(model.scaled(1, 1, 5).predict_s1(real), model.predict_s1(heavy));
  check_same_prediction(model.scaled(2, 1, 1).scaled(4, 3, 1).predict_s1(real), model.predict_s1(wide));
  check_error([&] { (void)model.scaled(0, 1, 1); }, moecomm::status::invalid_argument,
              {"moecomm::parm_cost_model: token_bytes scale = 0 must be finite and positive"});
  check_error([&] { (void)model.scaled(1, std::numeric_limits<double>::quiet_NaN(), 1); }, moecomm::status::invalid_argument,
              {"parameter_bytes scale = nan"});
  check_error([&] { (void)model.scaled(1, 1, -2); }, moecomm::status::invalid_argument, {"flops scale = -2"});
  // Experts without parameters: nothing to sum over the MP peers.
  parm_layer_shape bare = real;
  bare.parameter_bytes_per_expert = 0;
  CHECK(model.predict_s1(bare).backward_extra == 0);
}

TEST_CASE("parm_cost_model: refuses parameters that are not finite and positive") {
  struct bad_field {
    void (*spoil)(parm_cost_params&);
    char const* message;
  };
  bad_field const cases[] = {
      {[](parm_cost_params& p) { p.intra.alpha_seconds = -1; }, "intra.alpha_seconds = -1 must be finite and >= 0"},
      {[](parm_cost_params& p) { p.inter.alpha_seconds = std::numeric_limits<double>::infinity(); },
       "inter.alpha_seconds = inf must be finite and >= 0"},
      {[](parm_cost_params& p) { p.intra.beta_seconds_per_byte = 0; },
       "intra.beta_seconds_per_byte = 0 must be finite and positive"},
      {[](parm_cost_params& p) { p.inter.beta_seconds_per_byte = std::numeric_limits<double>::quiet_NaN(); },
       "inter.beta_seconds_per_byte = nan must be finite and positive"},
      {[](parm_cost_params& p) { p.gemm_flops = 0; }, "gemm_flops = 0 must be finite and positive"},
      {[](parm_cost_params& p) { p.copy_bytes_per_second = -5; }, "copy_bytes_per_second = -5 must be finite and positive"},
  };
  for (bad_field const& bad : cases) {
    parm_cost_params p;
    bad.spoil(p);
    check_error([&] { parm_cost_model const m(p); }, moecomm::status::invalid_argument,
                {std::string("moecomm::parm_cost_model: ") + bad.message});
  }
  parm_cost_params free_start;
  free_start.intra.alpha_seconds = free_start.inter.alpha_seconds = 0;  // allowed
  CHECK(parm_cost_model(free_start).predict_s1(parm_small_shape()).step_total > 0);
}

TEST_CASE("parm_cost_model: errors name each bad field of the shape") {
  struct bad_field {
    void (*spoil)(parm_layer_shape&);
    char const* message;
  };
  bad_field const cases[] = {
      {[](parm_layer_shape& s) { s.tokens = 0; }, "shape.tokens = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.hidden = -4; }, "shape.hidden = -4 must be at least 1"},
      {[](parm_layer_shape& s) { s.ffn = 0; }, "shape.ffn = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.element_bytes = 0; }, "shape.element_bytes = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.num_experts = 0; }, "shape.num_experts = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.parameter_bytes_per_expert = -1; },
       "shape.parameter_bytes_per_expert = -1 must be at least 0"},
      {[](parm_layer_shape& s) { s.sizes.model = 0; }, "shape.sizes.model = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.sizes.expert = -1; }, "shape.sizes.expert = -1 must be at least 1"},
      {[](parm_layer_shape& s) { s.sizes.expert_slicing = 0; }, "shape.sizes.expert_slicing = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.ranks_per_node = 0; }, "shape.ranks_per_node = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.pieces = 0; }, "shape.pieces = 0 must be at least 1"},
      {[](parm_layer_shape& s) { s.top_k = 0; }, "shape.top_k = 0 must be in [1, shape.num_experts = 4]"},
      {[](parm_layer_shape& s) { s.top_k = 5; }, "shape.top_k = 5 must be in [1, shape.num_experts = 4]"},
      {[](parm_layer_shape& s) { s.kept_fraction = 0; }, "shape.kept_fraction = 0 must be in (0, 1]"},
      {[](parm_layer_shape& s) { s.kept_fraction = 1.5; }, "shape.kept_fraction = 1.5 must be in (0, 1]"},
      {[](parm_layer_shape& s) { s.kept_fraction = std::numeric_limits<double>::quiet_NaN(); },
       "shape.kept_fraction = nan must be in (0, 1]"},
      {[](parm_layer_shape& s) { s.num_experts = 5; }, "shape.num_experts = 5 is not a multiple of shape.sizes.expert = 2"},
      {[](parm_layer_shape& s) { s.sizes.expert_slicing = 3; },
       "shape.sizes.expert_slicing = 3 does not divide shape.sizes.model = 4"},
  };
  parm_cost_model const model;
  for (bad_field const& bad : cases) {
    parm_layer_shape s = parm_small_shape();
    bad.spoil(s);
    check_error([&] { (void)model.predict_deepspeed_mp(s); }, moecomm::status::invalid_argument,
                {std::string("moecomm::parm_cost_model::predict_deepspeed_mp: ") + bad.message});
    check_error([&] { (void)model.predict_s1(s); }, moecomm::status::invalid_argument,
                {std::string("moecomm::parm_cost_model::predict_s1: ") + bad.message});
    check_error([&] { (void)model.predict_s2(s); }, moecomm::status::invalid_argument,
                {std::string("moecomm::parm_cost_model::predict_s2: ") + bad.message});
    check_error([&] { (void)model.choose(s); }, moecomm::status::invalid_argument,
                {std::string("moecomm::parm_cost_model::choose: ") + bad.message});
  }
}

}  // namespace test
