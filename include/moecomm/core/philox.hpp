// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Philox4x32-10 (Salmon et al., SC'11), the counter-based generator behind `drop_random`: the
//! same (key, counter) gives the same bits on host and device, in any order.

#include <moecomm/config.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

struct philox_block {
  std::uint32_t x[4];
};

//! philox4x32_10(key, counter): ten rounds, the key bumped between rounds.
MOECOMM_HOST_DEVICE inline philox_block philox4x32_10(std::uint64_t key, philox_block counter) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  std::uint32_t* c = counter.x;
  for (int round = 0; round < 10; ++round) {
    std::uint64_t const p0 = std::uint64_t{0xD2511F53u} * c[0];
    std::uint64_t const p1 = std::uint64_t{0xCD9E8D57u} * c[2];
    std::uint32_t const next[4] = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
                                   static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
    for (int i = 0; i < 4; ++i) c[i] = next[i];
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return counter;
}

}  // namespace detail
MOECOMM_NAMESPACE_END
