// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `copy_blocks(be, blocks)`: many byte blocks copied in one launch per `block_copies_kernel::max_blocks`
//! blocks, where one `be.copy` each would pay a launch each (hierarchical_2d's staging copies R
//! blocks a stage). The blocks travel in the kernel's parameters (no descriptor upload, so a CUDA
//! graph can hold the launch), and each is cut into chunks so that a GPU spreads a large block
//! over many warps.

#include <moecomm/config.hpp>
#include <moecomm/core/fragment.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! `bytes` from `src` to `dst`, in the back-end's memory; the blocks of one call do not overlap.
struct block_copy {
  char* dst;
  char const* src;
  std::int64_t bytes;
};

namespace detail {

//! Row r is one chunk of one block: block b covers rows `[first_chunk[b], first_chunk[b + 1])`.
struct block_copies_kernel {
  static constexpr int max_blocks = 64;  //!< 2.5 KiB of parameters: under CUDA's 4 KiB
  static constexpr std::int64_t chunk_bytes = std::int64_t{64} << 10;

  block_copy blocks[max_blocks];
  std::int64_t first_chunk[max_blocks + 1];
  std::int32_t count;

  // Declared, so not an aggregate: the CUDA emulation then reads the blocks' pointers word by word
  // (its member probe cannot count members that are arrays).
  MOECOMM_HOST_DEVICE block_copies_kernel() : blocks{}, first_chunk{}, count(0) {}

  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t r) const { return 2 * chunk_of(r).bytes; }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r, Team const& team) const {
    block_copy const c = chunk_of(r);
#if !MOECOMM_DEVICE_PASS()
    if (team.lane() == 0) std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.bytes));
#else
    bool const wide = reinterpret_cast<std::uintptr_t>(c.dst) % 16 == 0 && reinterpret_cast<std::uintptr_t>(c.src) % 16 == 0 &&
                      c.bytes % 16 == 0;
    if (wide) {
      for (std::int64_t i = team.lane(); i < c.bytes / 16; i += team.size())
        store_fragment(c.dst + 16 * i, load_fragment<char, 16>(c.src + 16 * i));
    } else {
      for (std::int64_t i = team.lane(); i < c.bytes; i += team.size()) c.dst[i] = c.src[i];
    }
#endif
  }

 private:
  MOECOMM_HOST_DEVICE block_copy chunk_of(std::int64_t r) const {
    std::int32_t lo = 0, hi = count;  // the last block with first_chunk[b] <= r
    while (hi - lo > 1) {
      std::int32_t const mid = lo + (hi - lo) / 2;
      if (first_chunk[mid] <= r) lo = mid; else hi = mid;
    }
    std::int64_t const offset = (r - first_chunk[lo]) * chunk_bytes;
    std::int64_t const left = blocks[lo].bytes - offset;
    return {blocks[lo].dst + offset, blocks[lo].src + offset, left < chunk_bytes ? left : chunk_bytes};
  }
};

}  // namespace detail

//! Copies every block of `blocks` (empty ones skipped) on `be`, in launches of up to
//! `max_blocks` blocks, ordered on `be`'s stream like `be.copy`.
template <class Backend>
void copy_blocks(Backend const& be, std::vector<block_copy> const& blocks) {
  detail::block_copies_kernel k;
  auto const launch = [&] {
    if (k.count > 0) be.for_each_row(k.first_chunk[k.count], k);
    k.count = 0;
  };
  for (block_copy const& b : blocks) {
    if (b.bytes <= 0) continue;
    if (k.count == detail::block_copies_kernel::max_blocks) launch();
    k.blocks[k.count] = b;
    k.first_chunk[k.count + 1] = k.first_chunk[k.count] + (b.bytes + k.chunk_bytes - 1) / k.chunk_bytes;
    ++k.count;
  }
  launch();
}

MOECOMM_NAMESPACE_END
