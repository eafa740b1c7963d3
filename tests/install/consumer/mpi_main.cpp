// SPDX-License-Identifier: Apache-2.0
// A downstream MPI program (find_package(moecomm COMPONENTS mpi), linking moecomm::mpi): every
// rank all-gathers its rank over an mpi_communicator and checks what it received.
#include <moecomm/comm/mpi.hpp>
#include <moecomm/moecomm.hpp>

#include <mpi.h>

#include <cstdio>
#include <exception>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int failures = 0;
  try {
    moecomm::mpi_communicator comm(MPI_COMM_WORLD);
    int const mine = comm.rank();
    std::vector<int> all(static_cast<std::size_t>(comm.size()), -1);
    comm.allgather(&mine, all.data(), sizeof(int));
    for (int r = 0; r < comm.size(); ++r)
      if (all[static_cast<std::size_t>(r)] != r) {
        std::fprintf(stderr, "moecomm_consumer (mpi): rank %d received %d from rank %d\n", mine,
                     all[static_cast<std::size_t>(r)], r);
        ++failures;
      }
    std::printf("moecomm_consumer (mpi): rank %d of %d, allgather %s\n", mine, comm.size(), failures ? "WRONG" : "ok");
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moecomm_consumer (mpi): %s\n", e.what());
    ++failures;
  }
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
