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

}  // namespace moecomm_emulation
