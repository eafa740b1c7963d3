// SPDX-License-Identifier: Apache-2.0
#pragma once
// The simulated cluster of the sim.* tests: 2 nodes x 4 GPUs (NVLink 100 GB/s per port, PCIe
// 25 GB/s, one 100 Gb/s NIC per node, 10 TFLOP/s and 1 TB/s per GPU). Every test of a process
// uses this one platform (SimGrid builds one per process).

#include <moecomm/backend/simulated.hpp>
#include <moecomm/comm/simgrid.hpp>
#include <moecomm/simulation/platform.hpp>

#include <cstdint>
#include <vector>

namespace test {

inline moecomm::cluster_spec two_nodes_of_four() {
  moecomm::cluster_spec s;
  s.name = "test-2x4"; s.source = "the sim.* tests' own";
  s.nodes_per_domain = 2; s.gpus_per_node = 4;
  s.gpu_flops = 10e12; s.hbm_bytes_per_second = 1e12; s.kernel_launch_seconds = 2e-6;
  s.intra_node = {100e9, 1e-6}; s.pcie = {25e9, 1e-6}; s.nic = {12.5e9, 2e-6}; s.fabric = {0, 1e-6};
  s.inter_domain = {0, 0};
  return s;
}

inline moecomm::simulated_platform const& test_platform() {
  static moecomm::simulated_platform const platform(two_nodes_of_four());
  return platform;
}

// `ranks` ranks, `per_node` on each node: rank r on GPU r % per_node of node r / per_node; every wait
// bounded by `timeout_seconds` of simulated time.
inline moecomm::simgrid_world sim_world(int ranks, int per_node, double timeout_seconds = 3600) {
  std::vector<std::int32_t> gpus;
  for (int r = 0; r < ranks; ++r) gpus.push_back(r / per_node * test_platform().gpus_per_node() + r % per_node);
  return moecomm::simgrid_world(test_platform(), gpus, timeout_seconds);
}

}  // namespace test
