// SPDX-License-Identifier: Apache-2.0
// expect-error: the 4th argument must be a capacity policy
// The positional form with the capacity policy and the all-to-all algorithm swapped: one error,
// naming the position and the kind it takes (once: 7 errors deep in the dispatcher).
#include "../layer_calls.hpp"

using interface_case::matrix_view;
using swapped = moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::flat,
                                               moecomm::capacity<moecomm::drop_by_probability>>;

struct experts {
  void operator()(std::int32_t, matrix_view<float const>, matrix_view<float>) const {}
  void operator()(std::int32_t, matrix_view<float const>, matrix_view<float const>, matrix_view<float>) const {}
};

void step(moecomm::exchange_groups<moecomm::inproc_communicator>& groups, experts& e) {
  swapped layer(moecomm::host_backend{}, groups, 8, 16);
  interface_case::forward(layer, e);
  interface_case::backward(layer, e);
}
