// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the emulation's CUB headers share.
#include <moecomm_emulation/emulation.hpp>

#include <cstddef>
#include <memory>
#include <type_traits>
#include <typeinfo>
#include <vector>

namespace moecomm_emulation {

//! The scratch an emulated CUB call asks for: 256 bytes plus `working`, so that a caller who
//! passes too little (or no) scratch is caught as on a GPU.
constexpr std::size_t cub_scratch_bytes(std::size_t working) { return 256 + (working + 255) / 256 * 256; }

//! CUB's two-phase protocol: a null scratch asks for its size (answered, and the call is done), too
//! little scratch is an error (the call is done, `result` says which); true: the call goes on.
inline bool cub_scratch_ready(void* d_temp_storage, std::size_t& temp_storage_bytes, std::size_t need, cudaError_t& result) {
  result = cudaSuccess;
  if (d_temp_storage == nullptr) {
    temp_storage_bytes = need;
    return false;
  }
  if (temp_storage_bytes < need) {
    result = cudaErrorInvalidValue;
    return false;
  }
  return true;
}

}  // namespace moecomm_emulation
