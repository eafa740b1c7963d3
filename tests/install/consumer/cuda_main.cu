// SPDX-License-Identifier: Apache-2.0
// A downstream .cu file (find_package(moecomm COMPONENTS cuda), linking moecomm::cuda), compiled by
// nvcc: it instantiates the CUDA back-end. Built, not run (a GPU may be absent).
#include <moecomm/moecomm.cuh>

#if !MOECOMM_HAS_CUDA()
#  error "moecomm::cuda must define MOECOMM_ENABLE_CUDA for nvcc"
#endif

int main() {
  moecomm::cuda_backend be;
  auto rows = be.allocate<float>(16);
  return rows.size() == 16 ? 0 : 1;
}
