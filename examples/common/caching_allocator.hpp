// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Making glibc's malloc behave as the caching allocator a framework would put under the layer.

#include <limits>

#if defined(__GLIBC__)
#  include <malloc.h>
#endif

namespace example_support {

//! The layer allocates its row buffers in every forward and backward (tens of MiB each here).
//! glibc serves blocks that large with mmap and returns them with munmap, so every step would
//! fault in all its pages again (most of a step's time at the default sizes). Frameworks put a
//! caching allocator under such code; glibc becomes one when it may not mmap and never trims.
//! Must run before any thread starts; `allocator_note` then says what it did, for the setup line.
inline char const* allocator_note = "the system allocator";
inline void use_caching_allocator() {
#if defined(__GLIBC__)
  if (mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1 &&
      mallopt(M_ARENA_MAX, 1) == 1)
    allocator_note = "glibc malloc keeping freed memory for reuse (mallopt), as a caching allocator would";
#endif
}

}  // namespace example_support
