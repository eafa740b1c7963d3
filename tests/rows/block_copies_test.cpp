// SPDX-License-Identifier: Apache-2.0
// copy_blocks: many byte blocks in few launches (hierarchical_2d's staging). Odd sizes and
// offsets, empty blocks, blocks over a chunk (64 KiB), more blocks than one launch holds; every
// byte of the destination is its block's source byte or untouched (poisoned) between blocks.

#include "../support/test_support.hpp"

#include <moecomm/rows/kernels/block_copies.hpp>

namespace test {

TEST_CASE("copy_blocks copies every block, odd sizes and more blocks than one launch") {
  moecomm::host_backend const be;
  for (int count : {0, 1, 7, 64, 65, 150}) {
    CAPTURE(count);
    std::vector<std::int64_t> sizes;
    for (int b = 0; b < count; ++b) sizes.push_back(b % 11 == 3 ? 0 : b % 17 == 5 ? 200001 : 1 + (b * 7919) % 3001);
    std::int64_t total = 0;
    for (std::int64_t s : sizes) total += s + 3;  // 3 poisoned bytes after each block
    std::vector<char> src(static_cast<std::size_t>(total)), dst(static_cast<std::size_t>(total), '\x7f');
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>((i * 131 + 7) % 251);
    // Block b goes from the source in order to the destination in reverse order.
    std::vector<moecomm::block_copy> blocks;
    std::vector<std::int64_t> dst_at(sizes.size());
    std::int64_t at = total;
    for (std::size_t b = 0; b < sizes.size(); ++b) dst_at[b] = (at -= sizes[b] + 3);
    std::int64_t from = 0;
    for (std::size_t b = 0; b < sizes.size(); ++b) {
      blocks.push_back({dst.data() + dst_at[b], src.data() + from, sizes[b]});
      from += sizes[b] + 3;
    }
    moecomm::copy_blocks(be, blocks);
    from = 0;
    for (std::size_t b = 0; b < sizes.size(); ++b) {
      CAPTURE(b);
      REQUIRE(std::memcmp(dst.data() + dst_at[b], src.data() + from, static_cast<std::size_t>(sizes[b])) == 0);
      for (int p = 0; p < 3; ++p) REQUIRE(dst[static_cast<std::size_t>(dst_at[b] + sizes[b] + p)] == '\x7f');
      from += sizes[b] + 3;
    }
  }
}

}  // namespace test
