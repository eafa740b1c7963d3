// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The row kernels every data-movement op is built from: gather rows by a source map, combine
//! (sum) the top-k rows of each token, and the per-slot dot product of the weight gradient.
//!
//! Each is a `MOECOMM_HOST_DEVICE` functor over rows, called as `f(row, team)`: the lanes of `team`
//! share one row, fragment by fragment (`team.size()` is 1 on the host, a warp on the GPU). The
//! host back-end and the CUDA back-end run this same code.

#include <moecomm/config.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/fragment.hpp>
#include <moecomm/core/matrix.hpp>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

// ---- what the team asks for ----------------------------------------------------------------------

//! Fragments one lane handles per step: `Team::fragments_per_step`, else 1 (the GPU's warps).
template <class Team, class = void>
struct team_fragments_per_step : std::integral_constant<int, 1> {};
template <class Team>
struct team_fragments_per_step<Team, std::void_t<decltype(Team::fragments_per_step)>>
    : std::integral_constant<int, Team::fragments_per_step> {};

//! Host only: a team that takes `Tile` > 1 fragments a step runs the kernel's host loop,
//! `kernel.host_row<Tile, Streaming>(row)`, streaming as `kernel.streaming` says. False (nothing
//! run) for a team of one fragment a step, which runs the kernel's fragment loop.
template <class Team, class Kernel>
bool run_host_row([[maybe_unused]] Kernel const& kernel, [[maybe_unused]] std::int64_t row) {
  if constexpr (team_fragments_per_step<Team>::value > 1) {
    constexpr int tile = team_fragments_per_step<Team>::value;
    if (kernel.streaming) kernel.template host_row<tile, true>(row);
    else kernel.template host_row<tile, false>(row);
    return true;
  } else {
    return false;
  }
}

//! Host outputs from this size on are written with non-temporal stores: they would not stay in
//! cache for their consumer anyway, and streaming saves the read-for-ownership of every line.
inline constexpr std::int64_t streaming_store_min_bytes = std::int64_t{8} << 20;

//! Host only: `n` elements from `in` to `out`, with `stream_bytes` when `Streaming` and the rows
//! allow 16-byte accesses (`N` elements of `T`), else a plain copy.
template <bool Streaming, int N, class T>
void host_copy_elements(T* out, T const* in, std::int64_t n) {
  if constexpr (Streaming && sizeof(fragment<T, N>) == 16) stream_bytes(out, in, n * std::int64_t{sizeof(T)});
  else std::memcpy(static_cast<void*>(out), in, static_cast<std::size_t>(n) * sizeof(T));
}

// ---- source maps: which input row feeds output row `r` (-1 writes a zero row) ----------------

//! Source row of a chunked reordering: output chunk `c` covers rows `[dst_begin[c], dst_begin[c+1])`
//! and reads rows from `src_begin[c]` on.
struct chunk_source {
  std::int64_t const* dst_begin;  //!< `[num_chunks + 1]`, ascending
  std::int64_t const* src_begin;  //!< `[num_chunks]`
  std::int32_t num_chunks;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t r) const {
    std::int32_t lo = 0, hi = num_chunks;  // the last chunk with dst_begin[c] <= r
    while (hi - lo > 1) {
      std::int32_t const mid = lo + (hi - lo) / 2;
      if (dst_begin[mid] <= r) lo = mid; else hi = mid;
    }
    return src_begin[lo] + (r - dst_begin[lo]);
  }
};

//! Source row of a reordering of equal chunks of `rows_per_chunk` rows, with no table: output chunk
//! `a * inner + b` reads input chunk `b * outer + a` (a transposition of `outer x inner` chunks).
struct transposed_chunk_source {
  std::int64_t rows_per_chunk;
  std::int32_t outer, inner;
  MOECOMM_HOST_DEVICE std::int64_t operator()(std::int64_t r) const {
    std::int64_t const chunk = r / rows_per_chunk, a = chunk / inner, b = chunk % inner;
    return (b * outer + a) * rows_per_chunk + r % rows_per_chunk;
  }
};

//! `dst[r] = src[source(r)]`, or zeros when `source(r) < 0`.
template <class T, int N, class Source>
struct gather_rows_kernel {
  T const* src;
  T* dst;
  std::int64_t hidden;
  Source source;
  bool streaming = false;  //!< host only: non-temporal stores (large outputs)

  //! Device memory one row reads and writes (a simulated device charges it).
  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t) const { return 2 * hidden * std::int64_t{sizeof(T)} + 8; }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r, Team const& team) const {
#if !MOECOMM_DEVICE_PASS()
    if (run_host_row<Team>(*this, r)) return;
#endif
    std::int64_t const s = source(r);
    T* out = dst + r * hidden;
    std::int64_t const fragments = hidden / N;
    if (s < 0) {
      fragment<T, N> zero;
      for (int j = 0; j < N; ++j) zero.v[j] = dtype_traits<T>::from_float(0.0f);
      for (std::int64_t f = team.lane(); f < fragments; f += team.size()) store_fragment(out + f * N, zero);
      return;
    }
    T const* in = src + s * hidden;
    MOECOMM_DEVICE_UNROLL(2)  // deeper unrolling makes ptxas spill (tests/cuda/check_kernels.sh)
    for (std::int64_t f = team.lane(); f < fragments; f += team.size()) {
      store_fragment(out + f * N, load_fragment<T, N>(in + f * N));
    }
  }

 private:
  template <class Team, class Kernel>
  friend bool run_host_row(Kernel const&, std::int64_t);

  //! The host's row, `Tile` fragments per step with all loads before the stores, so that
  //! streaming stores fill whole cache lines back to back.
  template <int Tile, bool Streaming>
  void host_row(std::int64_t r) const {
    std::int64_t const s = source(r);
    T const* in = s < 0 ? nullptr : src + s * hidden;
    T* out = dst + r * hidden;
    std::int64_t const fragments = hidden / N;
    std::int64_t f = 0;
    for (; f + Tile <= fragments; f += Tile) host_step<Tile, Streaming>(in, out, f);
    for (; f < fragments; ++f) host_step<1, Streaming>(in, out, f);
  }

  template <int Count, bool Streaming>
  void host_step(T const* in, T* out, std::int64_t f0) const {
    for (int i = 0; i < Count; ++i) {  // one fragment at a time: no array for g++ to spill
      fragment<T, N> v;
      if (in == nullptr) {
        for (int j = 0; j < N; ++j) v.v[j] = dtype_traits<T>::from_float(0.0f);
      } else {
        v = load_fragment<T, N>(in + (f0 + i) * N);
      }
      store_fragment_host<Streaming>(out + (f0 + i) * N, v);
    }
  }
};

// ---- scatter: each token row read once, written to each of its slots' rows ---------------------

//! `v * w` in fp32, one rounding per element (the routing weight applied to a row).
template <class T, int N>
MOECOMM_HOST_DEVICE fragment<T, N> weighted_fragment(fragment<T, N> v, float w) {
  for (int j = 0; j < N; ++j) v.v[j] = dtype_traits<T>::from_float(mul32(w, dtype_traits<T>::to_float(v.v[j])));
  return v;
}

//! The slots of a token's `rows` that map to a row (masked, dropped and unsent slots do not): the
//! rows a slot kernel touches, which a simulated device charges.
inline std::int64_t mapped_slots(std::int32_t const* rows, std::int32_t top_k) {
  std::int64_t n = 0;
  for (std::int32_t k = 0; k < top_k; ++k) n += rows[k] >= 0 ? 1 : 0;
  return n;
}

//! `dst[row_of[t][k]] = src[t]` (times `weights[t][k]` when `Weighted`, in fp32, one rounding) for
//! every valid slot k of token t (TransformerEngine's permute): the token's row is read once and
//! written up to K times, where a gather by `token_of` reads it once per slot. Rows no slot maps
//! to are not written. `permute` (src = x) and the combine's backward (src = d_out).
template <class T, int N, bool Weighted>
struct scatter_rows_kernel {
  T const* src;
  T* dst;
  std::int64_t hidden;
  std::int32_t const* row_of;  //!< `[T][K]`
  std::int32_t top_k;
  float const* weights;    //!< `[T][K]`, read only when `Weighted`
  bool streaming = false;  //!< host only: non-temporal stores (large outputs)

  //! Device memory token t reads (its row, its indices) and writes (its mapped slots' rows).
  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t t) const {
    return (mapped_slots(row_of + t * top_k, top_k) + 1) * hidden * std::int64_t{sizeof(T)} + 8 * top_k;
  }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t t, Team const& team) const {
#if !MOECOMM_DEVICE_PASS()
    if constexpr (team_fragments_per_step<Team>::value > 1) {
      if (streaming) host_row<true>(t); else host_row<false>(t);
      return;
    }
#endif
    std::int32_t const* rows = row_of + t * top_k;
    T const* in = src + t * hidden;
    std::int64_t const fragments = hidden / N;
    for (std::int64_t f = team.lane(); f < fragments; f += team.size()) {
      fragment<T, N> const v = load_fragment<T, N>(in + f * N);
      MOECOMM_DEVICE_UNROLL(1)
      for (std::int32_t k = 0; k < top_k; ++k) {
        std::int32_t const r = rows[k];
        if (r < 0) continue;
        T* out = dst + static_cast<std::int64_t>(r) * hidden + f * N;
        if constexpr (Weighted) store_fragment(out, weighted_fragment(v, weights[t * top_k + k]));
        else store_fragment(out, v);
      }
    }
  }

 private:
  //! The host's row, copied to one slot's row after the other: each output row is one sequential
  //! run of stores (a step over all K rows at once keeps K write streams open), and the token's row
  //! stays in L1 for its K reads.
  template <bool Streaming>
  void host_row(std::int64_t t) const {
    std::int32_t const* rows = row_of + t * top_k;
    T const* in = src + t * hidden;
    std::int64_t const fragments = hidden / N;
    for (std::int32_t k = 0; k < top_k; ++k) {
      if (rows[k] < 0) continue;
      T* out = dst + static_cast<std::int64_t>(rows[k]) * hidden;
      if constexpr (Weighted) {
        float const w = weights[t * top_k + k];
        for (std::int64_t f = 0; f < fragments; ++f)
          store_fragment_host<Streaming>(out + f * N, weighted_fragment(load_fragment<T, N>(in + f * N), w));
      } else {
        host_copy_elements<Streaming, N>(out, in, hidden);
      }
    }
  }
};

//! The most slots per token the fused combine backward keeps in registers.
inline constexpr std::int32_t fused_dot_max_slots = 8;

//! The weighted combine's backward in one pass per token (TransformerEngine fuses it the same way):
//! `d_y[row_of[t][k]] = w[t][k] * d_out[t]` and `dw[t][k] = <y[row_of[t][k]], d_out[t]>` (0 for a
//! slot without a row), reading `d_out[t]` once. Each dot product accumulates as `slot_dot_kernel`
//! does (per lane in ascending fragment, then the team's sum), so the bits are the same. Needs
//! `top_k <= fused_dot_max_slots`.
template <class T, int N>
struct scatter_weighted_rows_with_dot_kernel {
  T const* d_out;  //!< `[T][H]`
  T const* y;      //!< `[P][H]` the forward's expert outputs
  T* d_y;          //!< `[P][H]`
  float* dw;       //!< `[T][K]`
  std::int64_t hidden;
  std::int32_t const* row_of;  //!< `[T][K]`
  float const* weights;        //!< `[T][K]`
  std::int32_t top_k;

  //! Device memory token t reads (its gradient row, its mapped slots' expert rows, indices, weights)
  //! and writes (those slots' rows, K floats).
  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t t) const {
    return (2 * mapped_slots(row_of + t * top_k, top_k) + 1) * hidden * std::int64_t{sizeof(T)} + 12 * top_k;
  }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t t, Team const& team) const {
    std::int32_t const* rows = row_of + t * top_k;
    float partial[fused_dot_max_slots];
    for (int k = 0; k < fused_dot_max_slots; ++k) partial[k] = 0.0f;
    for (std::int64_t f = team.lane(); f < hidden / N; f += team.size()) {
      fragment<T, N> const g = load_fragment<T, N>(d_out + t * hidden + f * N);
      MOECOMM_DEVICE_UNROLL(8)  // constant indices keep `partial` in registers
      for (std::int32_t k = 0; k < fused_dot_max_slots; ++k) {
        if (k >= top_k || rows[k] < 0) continue;
        std::int64_t const at = static_cast<std::int64_t>(rows[k]) * hidden + f * N;
        fragment<T, N> const a = load_fragment<T, N>(y + at);
        for (int j = 0; j < N; ++j) partial[k] = fma32(dtype_traits<T>::to_float(a.v[j]), dtype_traits<T>::to_float(g.v[j]), partial[k]);
        store_fragment(d_y + at, weighted_fragment(g, weights[t * top_k + k]));
      }
    }
    MOECOMM_DEVICE_UNROLL(8)
    for (std::int32_t k = 0; k < fused_dot_max_slots; ++k) {
      if (k >= top_k) continue;
      float const total = team.reduce_sum(partial[k]);
      if (team.lane() == 0) dw[t * top_k + k] = rows[k] < 0 ? 0.0f : total;
    }
  }
};

//! Zeros row `r` when no token maps to it (`token_of[r] < 0`: a padded plan's tail rows).
template <class T, int N>
struct zero_unmapped_rows_kernel {
  T* dst;
  std::int64_t hidden;
  std::int32_t const* token_of;  //!< `[P]`

  //! Device memory row r reads (its token) and writes (the row, when it is zeroed).
  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t r) const { return 4 + (token_of[r] < 0 ? hidden * std::int64_t{sizeof(T)} : 0); }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r, Team const& team) const {
    if (token_of[r] >= 0) return;
    fragment<T, N> zero;
    for (int j = 0; j < N; ++j) zero.v[j] = dtype_traits<T>::from_float(0.0f);
    for (std::int64_t f = team.lane(); f < hidden / N; f += team.size()) store_fragment(dst + r * hidden + f * N, zero);
  }
};

//! After a scatter into `rows` (`[P][H]`): zeros a padded plan's tail rows, which no slot maps to.
template <class T, int N, class Backend, class Plan, class Rows>
void zero_padding_rows(Backend const& be, Plan const& plan, Rows const& rows) {
  if (plan.padded_capacity() > 0)
    be.for_each_row(plan.num_rows(), zero_unmapped_rows_kernel<T, N>{rows.data, rows.hidden, plan.token_of()});
}

// ---- combine: out[t] = sum over the token's valid slots, fp32, ascending k -------------------

//! `dst[t] = round(sum_k w[t][k] * src[row_of[t][k]])` (weighted, explicit FMA) or the plain sum
//! (unweighted), accumulated in fp32 from +0.0 in ascending `k`, skipping slots with `row_of < 0`.
template <class T, int N, bool Weighted>
struct combine_rows_kernel {
  T const* src;
  T* dst;
  std::int64_t hidden;
  std::int32_t const* row_of;  //!< `[T][K]`
  float const* weights;        //!< `[T][K]`, read only when `Weighted`
  std::int32_t top_k;
  bool streaming = false;      //!< host only: non-temporal stores (large outputs)
  std::int64_t num_tokens = 0;  //!< host only: T, so that the prefetch runs on into the next token's rows

  //! Device memory token t reads (its mapped slots' rows, indices, weights) and writes (its row).
  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t t) const {
    return (mapped_slots(row_of + t * top_k, top_k) + 1) * hidden * std::int64_t{sizeof(T)} + 8 * top_k;
  }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t t, Team const& team) const {
#if !MOECOMM_DEVICE_PASS()
    if (run_host_row<Team>(*this, t)) return;
#endif
    fragment_row(t, team.lane(), team.size());
  }

 private:
  template <class Team, class Kernel>
  friend bool run_host_row(Kernel const&, std::int64_t);

  //! Token t's row, fragment `lane`, `lane + lanes`, ...: the GPU's loop (a warp's lanes share the row).
  MOECOMM_HOST_DEVICE void fragment_row(std::int64_t t, std::int64_t lane, std::int64_t lanes) const {
    std::int32_t const* rows = row_of + t * top_k;
    T* out = dst + t * hidden;
    std::int64_t const fragments = hidden / N;
    for (std::int64_t f = lane; f < fragments; f += lanes) {
      float acc[N];
      for (int j = 0; j < N; ++j) acc[j] = 0.0f;
      MOECOMM_DEVICE_UNROLL(1)  // unrolled, ptxas spills the 16-bit paths (tests/cuda/check_kernels.sh)
      for (std::int32_t k = 0; k < top_k; ++k) {
        std::int32_t const r = rows[k];
        if (r < 0) continue;
        fragment<T, N> const y = load_fragment<T, N>(src + static_cast<std::int64_t>(r) * hidden + f * N);
        if constexpr (Weighted) {
          float const w = weights[t * top_k + k];
          for (int j = 0; j < N; ++j) acc[j] = fma32(w, dtype_traits<T>::to_float(y.v[j]), acc[j]);
        } else {
          for (int j = 0; j < N; ++j) acc[j] = add32(acc[j], dtype_traits<T>::to_float(y.v[j]));
        }
      }
      fragment<T, N> o;
      for (int j = 0; j < N; ++j) o.v[j] = dtype_traits<T>::from_float(acc[j]);
      store_fragment(out + f * N, o);
    }
  }

  //! How far ahead of its reads the host prefetches each slot's row, in bytes. The K rows are
  //! scattered, so the hardware prefetcher, which stops at page ends, starts cold on each, and the
  //! bf16 combine, with twice the instructions per byte of fp32, keeps too few misses in flight to
  //! hide that (docs/performance.md: bf16 with K = 8 went from about 0.55 to 0.7 of memcpy).
  static constexpr std::int64_t host_prefetch_bytes = 2048;

  //! The most slots the host's row keeps pointers to; a token with more takes the fragment loop.
  static constexpr std::int32_t host_max_slots = 32;

  //! The host's row. Per token, once: the valid slots' row pointers and weights, in ascending k, and
  //! the rows of the next token's same slots. Then a tight loop of steps of `Tile` fragments: each
  //! slot's row feeds `Tile * N` independent FMA chains (one fragment per step is bound by the FMA
  //! latency), the K rows are read side by side (one row after the other was measured slower), and
  //! every element still sums its slots in ascending k with one FMA each from +0.0, so the bits are
  //! those of the loop above. Per-step work was the limit on data in cache (docs/performance.md).
  template <int Tile, bool Streaming>
  void host_row(std::int64_t t) const {
    if (top_k > host_max_slots) return fragment_row(t, 0, 1);
    T const* rows[host_max_slots];
    T const* next_rows[host_max_slots];
    float w[host_max_slots];
    std::int32_t const* slots = row_of + t * top_k;
    std::int32_t const* next = t + 1 < num_tokens ? slots + top_k : nullptr;
    std::int32_t n = 0;
    for (std::int32_t k = 0; k < top_k; ++k) {
      if (slots[k] < 0) continue;
      rows[n] = src + static_cast<std::int64_t>(slots[k]) * hidden;
      next_rows[n] = next != nullptr && next[k] >= 0 ? src + static_cast<std::int64_t>(next[k]) * hidden : nullptr;
      w[n] = Weighted ? weights[t * top_k + k] : 1.0f;
      ++n;
    }
    T* const out = dst + t * hidden;
    std::int64_t const fragments = hidden / N;
    std::int64_t f = 0;
    constexpr std::int64_t step_bytes = Tile * N * std::int64_t{sizeof(T)};
    if constexpr (Streaming && step_bytes % 64 == 0) {
      if (is_aligned(out, 64))  // whole lines: straight from registers
        for (; f + Tile <= fragments; f += Tile) host_step<Tile, Streaming, true>(rows, next_rows, w, n, out, f);
    }
    for (; f + Tile <= fragments; f += Tile) host_step<Tile, Streaming, false>(rows, next_rows, w, n, out, f);
    for (; f < fragments; ++f) host_step<1, Streaming, false>(rows, next_rows, w, n, out, f);
  }

  template <int Count, bool Streaming, bool Lines>
  void host_step(T const* const* rows, T const* const* next_rows, float const* w, std::int32_t n, T* out, std::int64_t f0) const {
    // Prefetch `host_prefetch_bytes` past this step in each slot's row, or past its end in the next
    // token's row of the same slot.
    constexpr std::int64_t step_bytes = Count * N * std::int64_t{sizeof(T)};
    std::int64_t const row_bytes = hidden * std::int64_t{sizeof(T)};
    std::int64_t const ahead = f0 * N * std::int64_t{sizeof(T)} + host_prefetch_bytes;
    bool const into_next = ahead >= row_bytes;
    std::int64_t const offset = into_next ? ahead - row_bytes : ahead;
    float acc[Count * N];
    for (int e = 0; e < Count * N; ++e) acc[e] = 0.0f;
    for (std::int32_t i = 0; i < n; ++i) {
      T const* ahead_row = into_next ? next_rows[i] : rows[i];
      if (ahead_row != nullptr && offset + step_bytes <= row_bytes) {
        char const* p = reinterpret_cast<char const*>(ahead_row) + offset;
        for (std::int64_t b = 0; b < step_bytes; b += 64) prefetch_line(p + b);
      }
      // Elements are read directly: copies through `fragment` (memcpy) make g++ move them
      // through general registers instead of vectorising this loop.
      T const* in = rows[i] + f0 * N;
      float const wi = w[i];
      if constexpr (Weighted) {
        for (int e = 0; e < Count * N; ++e) acc[e] = fma32(wi, dtype_traits<T>::to_float(in[e]), acc[e]);
      } else {
        for (int e = 0; e < Count * N; ++e) acc[e] = add32(acc[e], dtype_traits<T>::to_float(in[e]));
      }
    }
    alignas(64) T rounded[Count * N];
    for (int e = 0; e < Count * N; ++e) rounded[e] = dtype_traits<T>::from_float(acc[e]);
    if constexpr (Lines) stream_lines<static_cast<int>(step_bytes)>(out + f0 * N, rounded);
    else host_copy_elements<Streaming, N>(out + f0 * N, rounded, Count * N);
  }
};

// ---- weight gradient: dw[t][k] = <src[row_of[t][k]], grad[t]> --------------------------------

//! One slot per "row": the fp32 dot product of the expert output row that slot produced and the
//! token's output gradient; 0 for masked or dropped slots.
template <class T, int N>
struct slot_dot_kernel {
  T const* y;     //!< expert outputs, `[P][H]`
  T const* grad;  //!< output gradient, `[T][H]`
  float* dw;      //!< `[T][K]`
  std::int64_t hidden;
  std::int32_t const* row_of;
  std::int32_t top_k;

  //! Device memory a slot reads (its index; two rows when it has one) and writes (its weight gradient).
  [[nodiscard]] std::int64_t bytes_of_row(std::int64_t slot) const { return 8 + (row_of[slot] < 0 ? 0 : 2 * hidden * std::int64_t{sizeof(T)}); }

  template <class Team>
  MOECOMM_HOST_DEVICE void operator()(std::int64_t slot, Team const& team) const {
    std::int32_t const r = row_of[slot];
    if (r < 0) {  // uniform across the team: every lane reads the same r
      if (team.lane() == 0) dw[slot] = 0.0f;
      return;
    }
    T const* a = y + static_cast<std::int64_t>(r) * hidden;
    T const* b = grad + (slot / top_k) * hidden;
    float partial = 0.0f;
    for (std::int64_t f = team.lane(); f < hidden / N; f += team.size()) {
      fragment<T, N> const fa = load_fragment<T, N>(a + f * N);
      fragment<T, N> const fb = load_fragment<T, N>(b + f * N);
      for (int j = 0; j < N; ++j)
        partial = fma32(dtype_traits<T>::to_float(fa.v[j]), dtype_traits<T>::to_float(fb.v[j]), partial);
    }
    float const total = team.reduce_sum(partial);
    if (team.lane() == 0) dw[slot] = total;
  }
};

// ---- choosing the access width ----------------------------------------------------------------

//! The widest access, in bytes, that every row of every pointer allows: 16, else 8, else one
//! element (a row of `hidden` elements of `T` must span a multiple of the width, and each pointer
//! be aligned to it).
template <class T>
[[nodiscard]] int row_access_bytes(std::int64_t hidden, std::initializer_list<void const*> pointers) {
  for (int bytes = max_access_bytes; bytes >= 8 && bytes > static_cast<int>(sizeof(T)); bytes /= 2) {
    bool aligned = (hidden * static_cast<std::int64_t>(sizeof(T))) % bytes == 0;
    for (void const* p : pointers) aligned = aligned && is_aligned(p, bytes);
    if (aligned) return bytes;
  }
  return static_cast<int>(sizeof(T));
}

//! Calls `f(std::integral_constant<int, N>{})` with the widest fragment `row_access_bytes` allows:
//! 16 bytes, 8 bytes, or single elements. Every path computes identical bits; only the access
//! width differs (the dispatcher reports the narrowest it met: `dispatch_report::row_access_bytes`).
template <class T, class F>
void with_fragment_width(std::int64_t hidden, std::initializer_list<void const*> pointers, F&& f) {
  constexpr int wide = max_access_bytes / static_cast<int>(sizeof(T)), half = 8 / static_cast<int>(sizeof(T));
  int const bytes = row_access_bytes<T>(hidden, pointers);
  if (bytes == max_access_bytes) {
    f(std::integral_constant<int, wide>{});
  } else if constexpr (half > 1) {
    if (bytes == 8) f(std::integral_constant<int, half>{});
    else f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace detail
MOECOMM_NAMESPACE_END
