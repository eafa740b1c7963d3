// SPDX-License-Identifier: Apache-2.0
#pragma once
// Running the doctest cases of an MPI test program on every rank: one rank's failure fails every
// rank (each exits with the worst result).

#include <doctest/doctest.h>
#include <mpi.h>

namespace test {

// Runs the test cases between MPI's initialisation and MPI_Finalize; returns the worst exit code over
// the ranks.
inline int run_doctest_over_mpi(int argc, char** argv) {
  int rc = 0;
  {
    doctest::Context context(argc, argv);
    rc = context.run();
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

}  // namespace test
