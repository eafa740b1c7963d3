// SPDX-License-Identifier: Apache-2.0
// The Parm layer across 4 MPI processes, one rank each: every schedule equals the unsliced
// single-process oracle bit for bit (parm_cases.hpp, the in-process test's check), in every layout
// of 4 ranks, EP = 1 and data parallelism included. parm_s2 runs the second collective of its
// pipeline on the back-end's lane, a second thread of the rank, so MPI must allow
// MPI_THREAD_MULTIPLE.

#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/mpi_doctest.hpp"
#include "parm_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/mpi.hpp>

#include <mpi.h>

#include <cstdio>

namespace test {

// Every schedule against the oracle on this process's rank.
template <class Capacity>
void check_mpi_parm(parm_case const& c, Capacity capacity) {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  REQUIRE(comm.size() == 4);
  CAPTURE(c.sizes.model);
  CAPTURE(c.sizes.expert);
  CAPTURE(c.sizes.expert_slicing);
  CAPTURE(c.tokens);
  check_parm_schedules_on_rank<float>(moecomm::host_backend{}, comm, c, capacity);
}

// (MP, EP, ESP) on 4 ranks: EP only; MP without slicing; sliced; EP = 1 (all experts on one MP
// group, sliced 4 ways); and EP = 1 with DP 2.
constexpr moecomm::parallel_sizes mpi_parm_layouts[] = {{1, 4, 1}, {2, 2, 1}, {2, 2, 2}, {4, 1, 4}, {2, 1, 2}};

TEST_CASE("Parm over MPI: every schedule equals the unsliced oracle bit for bit (5 layouts, T = 0, 1, 37)") {
  for (moecomm::parallel_sizes const& sizes : mpi_parm_layouts)
    for (std::int64_t tokens : {0, 1, 37}) check_mpi_parm(parm_case{sizes, tokens, 8, 2, 0}, moecomm::dropless{});
}

TEST_CASE("Parm over MPI: with capacity every schedule drops the baseline's slots (factor 0.75, top-4, 16 experts)") {
  check_mpi_parm(parm_case{{2, 2, 2}, 211, 16, 4, 0.75}, moecomm::capacity<moecomm::drop_by_position>{0.75});
}

TEST_CASE("Parm over MPI: Zipf(1.2) routing (hot experts on one EP rank), dropless and with capacity") {
  check_mpi_parm(parm_case{{2, 2, 2}, 97, 8, 2, 0, 1.2}, moecomm::dropless{});
  check_mpi_parm(parm_case{{2, 2, 2}, 97, 8, 2, 0.75, 1.2}, moecomm::capacity<moecomm::drop_by_position>{0.75});
}

TEST_CASE("Parm over MPI: parm_auto runs the schedule its model picks, the same on every rank") {
  moecomm::mpi_communicator comm(MPI_COMM_WORLD, {});
  for (moecomm::parallel_sizes const& sizes : {moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{2, 2, 1}}) {
    CAPTURE(sizes.expert_slicing);
    check_parm_auto_on_rank(moecomm::host_backend{}, comm, parm_case{sizes, 37, 8, 2, 0}, moecomm::dropless{});
  }
}

}  // namespace test

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0)
      std::fprintf(stderr, "moecomm_mpi_parm_tests: MPI provides thread level %d, parm_s2 needs MPI_THREAD_MULTIPLE (%d)\n",
                   provided, MPI_THREAD_MULTIPLE);
    MPI_Finalize();
    return 1;
  }
  int const worst = test::run_doctest_over_mpi(argc, argv);
  MPI_Finalize();
  return worst;
}
