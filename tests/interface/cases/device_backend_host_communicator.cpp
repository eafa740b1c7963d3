// SPDX-License-Identifier: Apache-2.0
// expect-error: wrap the communicator in staged_communicator<Comm> (moecomm/comm/staged.cuh)
// A back-end whose buffers are device memory with a communicator whose buffers are host memory (the
// in-process one, as MPI's): one error, at the layer's construction, that says how to stage. The
// cases compile without CUDA, so a stand-in takes cuda_backend's place: the host back-end's work,
// declared not host-accessible as cuda_backend is (the emulated tests check cuda_backend itself).
#include "../layer_calls.hpp"

struct device_memory_backend : moecomm::host_backend {
  static constexpr bool is_host_accessible = false;
};

void construct(moecomm::exchange_groups<moecomm::inproc_communicator>& groups) {
  moecomm::expert_parallel_layer<float, device_memory_backend, moecomm::inproc_communicator> layer(device_memory_backend(),
                                                                                                  groups, 8, 16);
  (void)layer;
}
