// SPDX-License-Identifier: Apache-2.0
// moecomm_torch_tests: with `--processes N` it starts N copies of itself (a torch.distributed world
// under torchrun's environment, moecomm/torch/launch.hpp) and exits with the worst of their results;
// without, it runs the test cases in this process.

#define DOCTEST_CONFIG_IMPLEMENT
#include "torch_doctest.hpp"

#include <moecomm/torch/launch.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::vector<std::string> rest;
  int processes = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--processes") == 0 && i + 1 < argc) processes = std::atoi(argv[++i]);
    else rest.emplace_back(argv[i]);
  }
  if (processes > 0) return moecomm::libtorch::spawn_local_processes(processes, rest, std::chrono::seconds(240));
  at::set_num_threads(1);  // the same bits whatever the machine: no intra-op split of a reduction
  doctest::Context context(argc, argv);
  return context.run();
}
