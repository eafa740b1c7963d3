// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `host_backend`: runs moecomm's kernel functors on the CPU, serially or with OpenMP threads.
//!
//! It is a real back-end, not a mock: the functors it runs are the ones the CUDA back-end launches
//! on the GPU, so the CPU tests execute the device's per-element code.

#include <moecomm/config.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/fragment.hpp>
#include <moecomm/error.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if MOECOMM_HAS_OPENMP()
#  include <omp.h>
#endif

MOECOMM_NAMESPACE_BEGIN

//! 64-byte aligned host memory (a cache line; enough for every vector access moecomm issues).
//! A failed allocation is `error(out_of_memory)` with the byte count, never `std::bad_alloc`.
struct host_allocator {
  static constexpr std::align_val_t alignment{64};
  void* allocate(std::size_t bytes) const {
    void* const p = ::operator new(bytes, alignment, std::nothrow);
    if (p == nullptr)
      detail::fail(status::out_of_memory, "host_allocator", "cannot allocate ", bytes, " bytes of host memory");
    return p;
  }
  void deallocate(void* p, std::size_t) const noexcept { ::operator delete(p, alignment); }
};

//! The cooperating group that works on one row: on the host, a single lane that runs the same
//! per-fragment loop a GPU warp runs (`host_kernels::portable`).
struct host_portable_team {
  [[nodiscard]] int lane() const { return 0; }
  [[nodiscard]] int size() const { return 1; }
  //! Sum over the team's lanes; one lane holds the whole sum already.
  [[nodiscard]] float reduce_sum(float partial) const { return partial; }
};

//! The host's fast team (`host_kernels::tiled`): the row kernels take their host paths
//! (row_kernels.hpp): the gather and the combine handle 8 fragments (128 bytes) per step, for
//! independent FMA chains and whole cache lines per store burst; the scatter copies whole rows.
//! The bits are those of the portable loop; the tests run both.
struct host_team : host_portable_team {
  static constexpr int fragments_per_step = 8;
};

//! Which row loop the host back-end runs.
enum class host_kernels {
  tiled,     //!< the host's fast path (default)
  portable,  //!< exactly the per-lane loop the CUDA back-end runs, one lane per row
};

//! Runs kernel functors on the host. Memory is ordinary host memory, and every call has finished
//! when it returns.
class host_backend {
 public:
  template <class T>
  using buffer_type = buffer<T, host_allocator>;
  //! Host memory can be read directly after `synchronize()` (a no-op here).
  static constexpr bool is_host_accessible = true;

  //! @param num_threads OpenMP threads for index spaces (1 = serial). Without OpenMP the work is
  //!        serial whatever the value. Results are bit-identical for every thread count.
  //! @param kernels the row loop to run; both give identical bits.
  explicit host_backend(int num_threads = 1, host_kernels kernels = host_kernels::tiled)
      : num_threads_(num_threads < 1 ? 1 : num_threads), kernels_(kernels) {}

  [[nodiscard]] int num_threads() const { return num_threads_; }
  [[nodiscard]] host_kernels kernels() const { return kernels_; }

  //! `n` uninitialised elements of host memory.
  //! @throws error (out_of_memory) naming the bytes requested, when they cannot be had.
  template <class T>
  [[nodiscard]] buffer_type<T> allocate(std::int64_t n) const {
    (void)detail::allocation_bytes<T>(n, "host_backend::allocate");  // a byte count that wraps is refused here
    return buffer_type<T>(host_allocator{}, n);
  }

  //! Calls `f(i)` for every `i` in `[0, n)`, in any order.
  template <class F>
  void for_each_index(std::int64_t n, F const& f) const {
#if MOECOMM_HAS_OPENMP()
    if (num_threads_ > 1) {
#  pragma omp parallel for num_threads(num_threads_) schedule(static)
      for (std::int64_t i = 0; i < n; ++i) f(i);
      return;
    }
#endif
    for (std::int64_t i = 0; i < n; ++i) f(i);
  }

  //! Calls `f(row, team)` for every row in `[0, rows)`; `team` is the group of lanes sharing the
  //! row (one lane on the host).
  template <class F>
  void for_each_row(std::int64_t rows, F const& f) const {
    if (kernels_ == host_kernels::portable) {
      rows_on_threads(rows, f, host_portable_team{});
    } else {
      rows_on_threads(rows, f, host_team{});
    }
  }

  //! `op`-reduction of `map(i)` over `[0, n)`, starting from `init`. `op` must be associative and
  //! commutative (moecomm uses it for integer sums and minima, which are exact in any order).
  template <class T, class Map, class Op>
  [[nodiscard]] T reduce(std::int64_t n, T init, Map const& map, Op const& op) const {
#if MOECOMM_HAS_OPENMP()
    if (num_threads_ > 1 && n > 1) {
      std::vector<T> partial(static_cast<std::size_t>(num_threads_), init);
#  pragma omp parallel num_threads(num_threads_)
      {
        T acc = init;
#  pragma omp for schedule(static)
        for (std::int64_t i = 0; i < n; ++i) acc = op(acc, map(i));
        partial[static_cast<std::size_t>(omp_get_thread_num())] = acc;
      }
      for (T const& p : partial) init = op(init, p);
      return init;
    }
#endif
    for (std::int64_t i = 0; i < n; ++i) init = op(init, map(i));
    return init;
  }

  //! `*result = reduce(n, init, map, op)`, `result` in the back-end's memory: on a device the value
  //! stays there (no host wait), for later device work or one read-back with others.
  template <class T, class Map, class Op>
  void reduce_into(T* result, std::int64_t n, T init, Map const& map, Op const& op) const {
    *result = reduce(n, init, map, op);
  }

  //! Bytes of scratch `stable_sort_by_key` needs for `n` pairs (CUB's two-phase temporary storage).
  [[nodiscard]] static std::size_t stable_sort_scratch_bytes(std::int64_t n) {
    return n > 0 ? static_cast<std::size_t>(n) * (sizeof(std::uint32_t) + sizeof(std::int32_t)) : 0;
  }

  //! Stable sort of `(key, value)` pairs by the low `end_bit` bits of the key: a least-significant-
  //! digit radix sort, 8 bits per pass, which is what `cub::DeviceRadixSort::SortPairs` computes.
  //! Keys must be below `2^end_bit`. `scratch` holds `stable_sort_scratch_bytes(n)` bytes, 4-aligned.
  void stable_sort_by_key(std::uint32_t const* keys_in, std::uint32_t* keys_out, std::int32_t const* values_in,
                          std::int32_t* values_out, std::int64_t n, int end_bit, void* scratch,
                          std::size_t scratch_bytes) const {
    if (n <= 0) return;
    detail::require(scratch != nullptr && scratch_bytes >= stable_sort_scratch_bytes(n), "host_backend::stable_sort_by_key",
                    "scratch of ", scratch_bytes, " bytes; needs ", stable_sort_scratch_bytes(n));
    std::copy(keys_in, keys_in + n, keys_out);
    std::copy(values_in, values_in + n, values_out);
    std::uint32_t* keys[2] = {keys_out, static_cast<std::uint32_t*>(scratch)};
    std::int32_t* values[2] = {values_out, reinterpret_cast<std::int32_t*>(keys[1] + n)};
    int current = 0;
    for (int shift = 0; shift < std::max(end_bit, 1); shift += 8) {
      std::array<std::int64_t, 257> start{};
      for (std::int64_t i = 0; i < n; ++i) ++start[((keys[current][i] >> shift) & 0xFFu) + 1];
      for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
      int const next = 1 - current;
      for (std::int64_t i = 0; i < n; ++i) {
        std::int64_t const at = start[(keys[current][i] >> shift) & 0xFFu]++;
        keys[next][at] = keys[current][i];
        values[next][at] = values[current][i];
      }
      current = next;
    }
    if (current != 0) {
      std::copy(keys[1], keys[1] + n, keys_out);
      std::copy(values[1], values[1] + n, values_out);
    }
  }

  //! Bytes of scratch `exclusive_sum` needs for `n` elements: none on the host.
  [[nodiscard]] static std::size_t exclusive_sum_scratch_bytes(std::int64_t) { return 0; }

  //! `out[i]` = the sum of `in[0, i)` for `i` in `[0, n)` (what `cub::DeviceScan::ExclusiveSum`
  //! computes); `in` and `out` may be the same array. Integers, so any order gives the same sums.
  void exclusive_sum(std::int32_t const* in, std::int32_t* out, std::int64_t n, void*, std::size_t) const {
    std::int32_t sum = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      std::int32_t const value = in[i];
      out[i] = sum;
      sum += value;
    }
  }

  //! Copies `n` elements (host to host).
  template <class T>
  void copy(T* dst, T const* src, std::int64_t n) const {
    if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T));
  }

  //! Waits for all submitted work: nothing to wait for on the host.
  void synchronize() const {}

 private:
  template <class F, class Team>
  void rows_on_threads(std::int64_t rows, F const& f, Team team) const {
#if MOECOMM_HAS_OPENMP()
    if (num_threads_ > 1) {
#  pragma omp parallel num_threads(num_threads_)
      {
#  pragma omp for schedule(static)
        for (std::int64_t r = 0; r < rows; ++r) f(r, team);
        detail::streaming_store_fence();  // each thread orders its own streaming stores
      }
      return;
    }
#endif
    for (std::int64_t r = 0; r < rows; ++r) f(r, team);
    detail::streaming_store_fence();
  }

  int num_threads_;
  host_kernels kernels_;
};

MOECOMM_NAMESPACE_END
