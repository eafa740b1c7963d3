// SPDX-License-Identifier: Apache-2.0
// The expert-parallel layer across 4 MPI processes (2 nodes x 2) equals the single-process oracle,
// for every capacity policy and all-to-all algorithm: the same check as the in-process test
// (layer_cases.hpp), each process running its own rank. And FasterMoE's shadowed layer equals the
// plain one (shadow_cases.hpp), over both replica paths, with the smart schedule; and HybridEP
// equals it too (hybridep_cases.hpp), and so do replicated experts (replicated_cases.hpp).

#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/mpi_doctest.hpp"
#include "layer_cases.hpp"
#include "hybridep_cases.hpp"
#include "replicated_cases.hpp"
#include "shadow_cases.hpp"

#include <moecomm/comm/mpi.hpp>

#include <mpi.h>

#include <cstdio>

namespace test {

template <class Algorithm>
void check_mpi_layer(Algorithm const& algorithm) {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  REQUIRE(comm.size() == 4);
  layer_case const c{4, 2, 8, 2, 16, {45, 0, 31, 60}, 1.2};
  CAPTURE(Algorithm::name);
  for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
    CAPTURE(std::decay_t<decltype(capacity)>::name);
    auto const in = make_layer_inputs<float>(c, capacity, rule, drops, sum_order_of<Algorithm>());
    check_layer_on_rank(comm, c, in, capacity, algorithm);
  });
}

TEST_CASE("the expert-parallel layer over MPI equals the oracle: flat") { check_mpi_layer(moecomm::flat{}); }
TEST_CASE("the expert-parallel layer over MPI equals the oracle: hierarchical_2d") { check_mpi_layer(moecomm::hierarchical_2d{}); }
TEST_CASE("the expert-parallel layer over MPI equals the oracle: pairwise") { check_mpi_layer(moecomm::pairwise{1}); }
TEST_CASE("the expert-parallel layer over MPI equals the oracle: dedup_per_rank") {
  check_mpi_layer(moecomm::dedup_per_rank<moecomm::flat>{});
}
TEST_CASE("the expert-parallel layer over MPI equals the oracle: dedup_per_node") { check_mpi_layer(moecomm::dedup_per_node{4}); }

template <class Path>
void check_mpi_shadowing(Path const& path, bool exact) {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  REQUIRE(comm.size() == 4);
  shadow_case const c{4, 2, 8, 2, 16, {60, 45, 0, 70}, 1.2, exact};
  auto const in = make_shadow_inputs<float>(c);
  auto const home = check_shadowed_equals_plain(comm, c, in, moecomm::fastermoe_shadowing<Path>{small_model(), path, {}},
                                                moecomm::dropless{}, moecomm::smart_schedule{2}, moecomm::pairwise{2});
  CHECK(!home.empty());
}

TEST_CASE("FasterMoE over MPI: shadowed == plain, point-to-point replicas") { check_mpi_shadowing(moecomm::point_to_point_path{256}, true); }
TEST_CASE("FasterMoE over MPI: shadowed == plain, collective replicas") { check_mpi_shadowing(moecomm::collective_path{}, false); }

// Scheduled steps over MPI: transfers and aggregation on a second thread, over a copy of the world.
TEST_CASE("FasterMoE over MPI: scheduled steps (overlapped transfers and aggregation) equal plain EP") {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  shadow_case const c{4, 2, 8, 2, 16, {60, 45, 0, 70}, 1.2, true};
  auto const in = make_shadow_inputs<float>(c);
  CHECK(!check_scheduled_equals_plain(comm, c, in, moecomm::fastermoe_shadowing<>{small_model(), {}, {}}, moecomm::flat{}).empty());
}

// HybridEP on 4 processes as 2 data centres of 2: every expert-domain size, across and within,
// equals plain EP bit for bit with the paper's pair counts. Its gather runs on a second thread.
TEST_CASE("HybridEP over MPI: every expert-domain size equals plain expert parallelism bit for bit") {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  REQUIRE(comm.size() == 4);
  hybridep_case const h{{4, 2, 8, 2, 8, {96, 96, 96, 96}, 0.0, true}, 1};
  auto const in = make_shadow_inputs<float>(h.layer);
  for (std::int32_t s : {1, 2, 4}) {
    CAPTURE(s);
    check_hybridep_on_rank(comm, h, in, {s, moecomm::expert_domain_spread::across_data_centres}, s != 1, moecomm::dropless{});
    if (s <= 2) check_hybridep_on_rank(comm, h, in, {s, moecomm::expert_domain_spread::within_data_centres}, true, moecomm::dropless{});
  }
}

// Replicated experts on 4 processes: a cyclic placement (8 experts, 2 replicas each), both splits,
// uniform and Zipf 1.2 routing, equal to plain EP.
TEST_CASE("Replicated experts over MPI: both splits equal plain expert parallelism bit for bit") {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  moecomm::replica_placement const placement = moecomm::replica_placement::cyclic(4, 4, 2);
  for (double zipf : {0.0, 1.2}) {
    CAPTURE(zipf);
    shadow_case const c{4, 2, 8, 2, 8, {64, 40, 0, 96}, zipf, true};
    auto const in = make_shadow_inputs<float>(c);
    check_replicated_on_rank<moecomm::finemoe_split>(comm, c, in, placement);
    check_replicated_on_rank<moecomm::even_split>(comm, c, in, placement);
  }
}

// Replicas moved between two steps over MPI (cyclic -> load-aware): both steps equal plain EP, and
// every slot holds its expert's parameters and optimizer state after the move.
TEST_CASE("Replicated experts over MPI: replicas move with their optimizer state and still equal plain EP") {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  shadow_case const c{4, 2, 8, 2, 8, {64, 40, 0, 96}, 1.2, true};
  auto const in = make_shadow_inputs<float>(c);
  check_moved_replicas_on_rank(comm, c, in, moecomm::replica_placement::cyclic(4, 4, 2),
                               moecomm::replica_placement::from_loads(4, 4, {8, 4, 2, 1, 1, 1, 1, 1}, 3));
}

}  // namespace test

int main(int argc, char** argv) {
  int provided = 0;  // HybridEP's background gather calls MPI from the lane's thread
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "moecomm_mpi_layer_tests: MPI provides thread level %d, HybridEP needs MPI_THREAD_MULTIPLE (%d)\n",
                 provided, MPI_THREAD_MULTIPLE);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int const worst = test::run_doctest_over_mpi(argc, argv);
  MPI_Finalize();
  return worst;
}
