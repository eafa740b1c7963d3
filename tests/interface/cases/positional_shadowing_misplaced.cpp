// SPDX-License-Identifier: Apache-2.0
// expect-error: the 6th argument must be a weighting policy
// The shadowing policy given where the weighting goes (the weighting left out): one error.
#include "../layer_calls.hpp"

using misplaced = moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless,
                                                 moecomm::flat, moecomm::fastermoe_shadowing<>>;

void step(moecomm::exchange_groups<moecomm::inproc_communicator>& groups, interface_case::parametric_experts& e) {
  misplaced layer(moecomm::host_backend{}, groups, 8, 16);
  interface_case::forward(layer, e);
}
