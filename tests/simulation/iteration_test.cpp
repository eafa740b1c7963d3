// SPDX-License-Identifier: Apache-2.0
// The iteration around the MoE layers: `transformer_shape`'s FLOPs and parameters by hand,
// `iteration_model`'s errors, and its prediction against `simulate_dense_iteration` run on the
// sim.* tests' platform (inside one node, and across both).

#include "../support/test_support.hpp"
#include "sim_support.hpp"

#include <moecomm/models/iteration_model.hpp>
#include <moecomm/models/dense_iteration.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace test {

namespace {

// 2 blocks (1 MoE), H 4, dense F 8, sequences of 2, 4 tokens a rank, vocabulary 10.
moecomm::transformer_shape tiny_shape() {
  moecomm::transformer_shape s;
  s.layers = 2; s.moe_layers = 1; s.hidden = 4; s.dense_ffn = 8; s.sequence = 2; s.tokens_per_rank = 4;
  s.vocabulary = 10;
  return s;
}

// GPT-2 medium's blocks at a reduced scale, `tokens` a rank: big enough that the all-reduce is
// bandwidth-bound.
moecomm::transformer_shape gpt_medium_blocks(std::int64_t tokens) {
  moecomm::transformer_shape s;
  s.layers = 4; s.moe_layers = 2; s.hidden = 1024; s.dense_ffn = 4096; s.sequence = 512;
  s.tokens_per_rank = tokens; s.vocabulary = 50257;
  return s;
}

std::string shape_error(moecomm::transformer_shape const& s) {
  try {
    s.validate();
  } catch (moecomm::error const& e) {
    CHECK(e.code() == moecomm::status::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("iteration: a transformer's FLOPs and dense parameters, by hand, and its bad shapes by name") {
  moecomm::transformer_shape const s = tiny_shape();
  // per block: projections 8·4·16 = 512, scores and context 4·4·2·4 = 128; one dense FFN 4·4·4·8 =
  // 512; the LM head 2·4·4·10 = 320.
  CHECK(s.dense_forward_flops() == 2 * (512 + 128) + 512 + 320);
  // per block 4·16 + 6·4 = 88; a dense FFN 2·4·8 + 8 + 4 = 76; the embedding 10·4 = 40.
  CHECK(s.dense_parameters() == 2 * 88 + 76 + 40);

  moecomm::transformer_shape bad = s;
  bad.tokens_per_rank = 5;
  CHECK(shape_error(bad).find("tokens_per_rank = 5 must be a positive multiple of sequence = 2") != std::string::npos);
  bad = s;
  bad.dense_ffn = 0;
  CHECK(shape_error(bad).find("dense_ffn = 0 must be positive: 1 block(s) have a dense FFN") != std::string::npos);
  bad = s;
  bad.moe_layers = 3;
  CHECK(shape_error(bad).find("moe_layers = 3 must be in [0, layers = 2]") != std::string::npos);
  bad.moe_layers = bad.layers = 2;
  bad.dense_ffn = 0;
  CHECK(shape_error(bad).empty());  // every block is MoE: no dense FFN needed
  CHECK_THROWS_WITH_AS((void)moecomm::iteration_model(two_nodes_of_four(), 8, s).optimizer_seconds(-1),
                       doctest::Contains("expert_parameters = -1 must be finite and >= 0"), moecomm::error);
  CHECK_THROWS_WITH_AS(moecomm::iteration_model(two_nodes_of_four(), 9, s), doctest::Contains("ranks = 9 must be in [1, the platform's 8 GPUs]"),
                       moecomm::error);
  bad = s;
  bad.model_parallel = 0;
  CHECK(shape_error(bad).find("model_parallel = 0 must be positive") != std::string::npos);
  bad.model_parallel = 4;
  CHECK_THROWS_WITH_AS(moecomm::iteration_model(two_nodes_of_four(), 6, bad),
                       doctest::Contains("ranks = 6 must be a multiple of shape.model_parallel = 4"), moecomm::error);
  // Tensor parallelism: attention's two all-reduces in both blocks, the dense FFN's two; a rank's
  // quarter of the FLOPs and of the dense parameters.
  CHECK(s.tensor_parallel_allreduces() == 0);
  CHECK(bad.tensor_parallel_allreduces() == 2 * 2 + 2 * 1);
  moecomm::iteration_model const whole(two_nodes_of_four(), 8, s), quarter(two_nodes_of_four(), 8, bad);
  CHECK(quarter.compute_seconds() == relatively(whole.compute_seconds() / 4, 1e-12));
  CHECK(whole.tensor_parallel_seconds() == 0);
  CHECK(quarter.tensor_parallel_seconds() > 0);
}

TEST_CASE("iteration: the model's dense part equals the simulated one, inside a node and across nodes and over two micro-batches") {
  moecomm::transformer_shape shape = gpt_medium_blocks(512);
  double const experts = 2 * 2 * 1024.0 * 4096;  // two local experts' weights
  for (int const ranks : {4, 8}) {  // 4: one node (NVLink ring); 8: two nodes (the NIC is the slowest ring link)
    CAPTURE(ranks);
    shape.micro_batches = ranks / 4;  // and two micro-batches: twice the compute, one all-reduce
    moecomm::iteration_model const model(two_nodes_of_four(), ranks, shape);
    double span = 0;
    moecomm::simgrid_world world = sim_world(ranks, 4);
    world.run([&](moecomm::simgrid_communicator comm) {
      comm.barrier();
      double const start = moecomm::simulated_seconds{}();
      moecomm::simulate_dense_iteration(comm, shape, experts);
      comm.barrier();
      if (comm.rank() == 0) span = moecomm::simulated_seconds{}() - start;
    });
    double const predicted = model.dense_seconds(experts);
    MESSAGE(ranks << " ranks: simulated " << span * 1e3 << " ms, model " << predicted * 1e3 << " ms (compute "
                  << model.compute_seconds() * 1e3 << ", all-reduce " << model.allreduce_seconds() * 1e3 << ", optimizer "
                  << model.optimizer_seconds(experts) * 1e3 << ")");
    CHECK(model.allreduce_seconds() > (ranks == 8 ? 0.25 : 0.05) * predicted);  // it matters, most across the NIC
    CHECK(span == relatively(predicted, 0.01));
    CHECK(model.iteration_seconds(1e-3, experts) == relatively(predicted + shape.micro_batches * 2e-3, 1e-12));
    CHECK(model.iteration_seconds(1e-3, experts, 5e-4) == relatively(predicted + shape.micro_batches * 2e-3 + 1e-3, 1e-12));
  }
}

TEST_CASE("iteration: with tensor parallelism the model's dense part equals the simulated one (MP 2 and 4 over two nodes)") {
  moecomm::transformer_shape shape = gpt_medium_blocks(1024);
  double const experts = 2 * 2 * 1024.0 * 4096;
  for (int const M : {2, 4}) {  // the MP groups inside a node; the DP groups across both, M of them sharing each node's NIC
    CAPTURE(M);
    shape.model_parallel = M;
    moecomm::iteration_model const model(two_nodes_of_four(), 8, shape);
    double span = 0, tensor_parallel = 0;
    std::vector<double> started(8), finished(8);  // the MP all-reduces alone, per rank (no barrier after them)
    moecomm::simgrid_world world = sim_world(8, 4);
    world.run([&](moecomm::simgrid_communicator comm) {
      std::int32_t const me = comm.rank();
      moecomm::simgrid_communicator mp = comm.split(me / M, me), dp = comm.split(me % M, me);
      CHECK_THROWS_WITH_AS(moecomm::simulate_dense_iteration(comm, shape, experts), doctest::Contains("shape.model_parallel = "),
                           moecomm::error);
      comm.barrier();
      double const start = moecomm::simulated_seconds{}();
      moecomm::simulate_dense_iteration(mp, dp, shape, experts);
      comm.barrier();
      double const middle = moecomm::simulated_seconds{}();
      if (me == 0) span = middle - start;
      started[static_cast<std::size_t>(me)] = middle;
      moecomm::simulate_tensor_parallel(mp, shape);  // alone: a small part of the whole
      finished[static_cast<std::size_t>(me)] = moecomm::simulated_seconds{}();
    });
    tensor_parallel = *std::max_element(finished.begin(), finished.end()) - *std::min_element(started.begin(), started.end());
    double const predicted = model.dense_seconds(experts);
    MESSAGE("MP " << M << ": simulated " << span * 1e3 << " ms, model " << predicted * 1e3 << " ms (MP all-reduces "
                  << model.tensor_parallel_seconds() * 1e3 << ", simulated " << tensor_parallel * 1e3 << "; DP all-reduce "
                  << model.allreduce_seconds() * 1e3 << ")");
    CHECK(model.allreduce_seconds() > 0.25 * predicted);  // across the NIC, M rings sharing it
    CHECK(span == relatively(predicted, 0.01));
    CHECK(tensor_parallel == relatively(model.tensor_parallel_seconds(), 0.02));
  }
}

}  // namespace test
