// SPDX-License-Identifier: Apache-2.0
// The expert-parallel layer on GPUs with the deduplicated exchanges, grouped experts and bf16 rows,
// on both placements of the ranks (device_layer_cases.hpp).

#include "device_layer_cases.hpp"

namespace test {

TEST_CASE_TEMPLATE("the layer with a deduplicated exchange on GPUs equals the oracle's per-rank (and per-node) sums", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  for (layer_case const& c : {layer_case{2, 2, 4, 3, 16, {40, 0}, 1.2}, layer_case{8, 4, 16, 8, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_emulated_layer<Placement, float>(c, moecomm::dedup_per_rank<moecomm::flat>{});
    check_emulated_layer<Placement, float>(c, moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
    check_emulated_layer<Placement, float>(c, moecomm::dedup_per_node{3});
  }
  check_emulated_layer<Placement, __nv_bfloat16>(layer_case{4, 2, 8, 4, 16, {30, 1, 0, 57}, 2.0},
                                                 moecomm::dedup_per_rank<moecomm::pairwise>{});
}

TEST_CASE_TEMPLATE("grouped experts (one call for every local expert) on GPUs equal the oracle", Placement, gpu_per_rank,
                   ranks_on_one_gpu) {
  layer_case const c{4, 2, 16, 2, 8, {30, 1, 0, 57}, 1.2};
  check_emulated_layer<Placement, float, moecomm::flat, true>(c, moecomm::flat{});
  check_emulated_layer<Placement, float, moecomm::smart_schedule, true>(c, moecomm::smart_schedule{c.per_node});
}

TEST_CASE_TEMPLATE("the layer on GPUs handles bf16 rows", Placement, gpu_per_rank, ranks_on_one_gpu) {
  check_emulated_layer<Placement, __nv_bfloat16>(layer_case{4, 2, 8, 2, 16, {30, 1, 0, 57}, 8.0}, moecomm::hierarchical_2d{});
}

}  // namespace test
