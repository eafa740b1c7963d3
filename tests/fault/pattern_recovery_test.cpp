// SPDX-License-Identifier: Apache-2.0
// The recover-mode fault campaign (pattern_recovery.hpp) on in-process ranks. A run must end within
// the watchdog's 30 s (a hang aborts the binary, naming the run; a crash ends the binary, which CTest
// reports). The counts (runs, clean errors, recovered, silent wrong, data lost, and runs in which a
// rank waited out the world's 1 s timeout) are printed; silent wrong and data lost must be 0. CTest
// runs 420 runs (7 patterns x 10 faults x 6 seeds). For a long run:
//   MOECOMM_RECOVERY_RUNS=20 build/tests/fault/moecomm_fault_tests -tc='pattern recovery*' -s
// and to see what the ranks of some runs threw (any part of the runs' names):
//   MOECOMM_RECOVERY_SHOW="hybridep / swapped" build/tests/fault/moecomm_fault_tests -tc='pattern recovery: after*'

#include "pattern_recovery.hpp"

namespace test {
namespace recovery {

TEST_CASE("pattern recovery: after a fault, every rank's last step fails or equals a clean run, for every pattern" *
          doctest::test_suite("fault")) {
  watchdog dog(std::chrono::seconds(30));
  auto const run_world = [&](std::string const& what, auto&& per_rank, bool clean) {
    moecomm::inproc_world const world(4, clean ? std::chrono::milliseconds(10000) : std::chrono::milliseconds(1000));
    auto const run = watched_run(world, dog, what, [&](moecomm::inproc_communicator comm) { per_rank(comm, moecomm::host_backend{}); });
    return run.took >= std::chrono::milliseconds(1000);  // a rank waited out the timeout: bounded, not a hang
  };
  tally const total = run_campaign("in-process ranks", env_knob("MOECOMM_RECOVERY_RUNS", 6), run_world);
  CHECK(total.runs == pattern_count * fault_count * env_knob("MOECOMM_RECOVERY_RUNS", 6));
}

TEST_CASE("pattern recovery: two backwards of one forward add every pattern's gradients twice, nothing more" *
          doctest::test_suite("fault")) {
  watchdog dog(std::chrono::seconds(30));
  check_second_backward("in-process ranks", [&](std::string const& what, auto&& per_rank, bool) {
    moecomm::inproc_world const world(4, std::chrono::milliseconds(10000));
    (void)watched_run(world, dog, what, [&](moecomm::inproc_communicator comm) { per_rank(comm, moecomm::host_backend{}); });
    return false;
  });
}

}  // namespace recovery
}  // namespace test
