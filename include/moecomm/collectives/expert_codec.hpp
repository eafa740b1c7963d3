// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! HybridEP's parameter-efficient expert migration (arXiv 2510.19470 §IV-B): experts move between
//! the GPUs of an expert domain as a *shared expert*, the mean of the domain's experts, plus each
//! expert's top-k sparsified residual `expert - shared`.
//!
//! - `shared_expert_mean`: the mean, summed in a fixed order (`ordered_allreduce`), so every rank
//!   and every transport gets the same bits and decodes the same parameters.
//! - `encode_expert`: keeps the `k` parameters of largest |expert - shared| (ties: the smaller
//!   index), as `indices[k]` (int32, ascending) and `values[k]`.
//! - `decode_expert`: `params = shared`, then the kept values scattered over it.
//! - `top_k_for_ratio`: `k = ceil(n / ratio)`; `dropped_residual_max_abs`: what decode loses.
//!
//! **Values, not residuals.** `values[j]` is the expert's own value `expert[indices[j]]`; the
//! residual only chooses which parameters are kept. In floating point `shared + (expert - shared)`
//! is not `expert`, so a codec that sent residuals could not give back the expert it was given even
//! with compression off. Sending the values, decode does no arithmetic: kept parameters come back
//! bit for bit, with `k = n` (compression off) the whole expert does, and a dropped parameter
//! decodes to `shared[i]`, off by exactly its residual. The bytes are the same (one float and one
//! int32 index per kept parameter). A codec that quantised the values would send residuals instead,
//! whose range is smaller; this one does not quantise.
//!
//! The selection is a stable radix sort of the parameters by |residual| (the back-end's
//! `stable_sort_by_key`, CUB on the GPU), then of the `k` kept indices by index. Its scratch comes
//! from a `workspace`: a steady state allocates nothing. A radix select of the k-th largest key
//! would do less work for small `k`; the sort is the simple, exact first version.

#include <moecomm/comm/detail/p2p_chunks.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/rows/kernels/expert_codec_kernels.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Checks an input the codec reads: size not negative, memory present.
inline void validate_codec_input(char const* op, char const* name, void const* data, std::int64_t size) {
  require(size >= 0, op, "argument '", name, "' has size ", size, ", which is negative");
  require(data != nullptr || size == 0, op, "argument '", name, "' is null but its size is ", size);
}

//! Checks that output `name` holds at least `needed` elements.
inline void validate_codec_output(char const* op, char const* name, void const* data, std::int64_t size,
                                  std::int64_t needed) {
  require(size >= needed, op, "argument '", name, "' holds ", size, " elements, fewer than the ", needed, " it receives");
  require(data != nullptr || needed == 0, op, "argument '", name, "' is null but receives ", needed, " elements");
}

//! Throws naming the argument and index of the first NaN or ±Inf in `expert` or `shared`.
template <class Backend>
void check_finite(Backend const& be, array_view<float const> expert, array_view<float const> shared, char const* op) {
  std::int64_t const n = expert.size;
  std::int64_t const bad = be.reduce(n, n, first_index_where<not_finite_at>{{expert.data, shared.data}, n}, minimum{});
  if (bad == n) return;
  float at[2];
  be.copy(at, expert.data + bad, 1);
  be.copy(at + 1, shared.data + bad, 1);
  be.synchronize();
  bool const in_expert = !is_finite_float(at[0]);
  fail(status::invalid_argument, op, "argument '", in_expert ? "expert" : "shared", "' holds ", in_expert ? at[0] : at[1],
       " at index ", bad, "; the codec encodes finite parameters only");
}

//! Throws naming the first position of `indices` whose index is outside `[0, n)` or not above the
//! one before it.
template <class Backend>
void check_index_list(Backend const& be, array_view<std::int32_t const> indices, std::int64_t n, char const* op) {
  std::int64_t const k = indices.size;
  std::int64_t const bad = be.reduce(k, k, first_index_where<bad_index_at>{{indices.data, n}, k}, minimum{});
  if (bad == k) return;
  std::int32_t at[2] = {0, 0};  // indices[bad - 1], indices[bad]
  if (bad > 0) be.copy(at, indices.data + bad - 1, 1);
  be.copy(at + 1, indices.data + bad, 1);
  be.synchronize();
  if (at[1] < 0 || at[1] >= n)
    fail(status::invalid_argument, op, "argument 'indices' has indices[", bad, "] = ", at[1], ", outside [0, ", n,
         ") (the parameter count)");
  fail(status::invalid_argument, op, "argument 'indices' has indices[", bad, "] = ", at[1], ", not above indices[",
       bad - 1, "] = ", at[0], "; indices must be strictly ascending");
}

}  // namespace detail

//! The `k` that keeps `n / ratio` of `n` parameters: `ceil(n / ratio)` (computed in double), 1 for
//! any `n > 0` however large the ratio, `n` for ratio 1 (compression off). Each kept parameter
//! sends a float and an int32 index, so the bytes shrink by `ratio / 2`.
//! @param n parameters of one expert (>= 0).
//! @param ratio the compression ratio, finite and >= 1 (HybridEP uses 50).
//! @throws error (invalid_argument) naming `n` or `ratio`.
[[nodiscard]] inline std::int64_t top_k_for_ratio(std::int64_t n, double ratio) {
  char const* const op = "top_k_for_ratio";
  detail::require(n >= 0, op, "argument 'n' = ", n, " is negative");
  detail::require(std::isfinite(ratio) && ratio >= 1.0, op, "argument 'ratio' = ", ratio,
                  " must be finite and >= 1 (1 keeps every parameter)");
  // n / ratio may round above n (n > 2^53), even to 2^63, which no int64 holds: compare as doubles
  // first, and convert only a value below n.
  double const k = std::ceil(static_cast<double>(n) / ratio);
  return k >= static_cast<double>(n) ? n : static_cast<std::int64_t>(k);
}

//! `shared` becomes the mean of the expert domain's experts: every rank of `comm` passes the experts
//! it holds, and `shared[i]` is, bitwise the same on every rank and over every communicator,
//! `(p_0[i] + p_1[i] + ... ) / E`, where `p_r[i]` is rank r's experts added left to right (+0.0 if
//! it holds none), the ranks' sums are added left to right in ascending rank (`ordered_allreduce`),
//! and `E` is the domain's number of experts. With one expert per rank that is the plain
//! left-to-right sum of the domain's experts over their count. Ranks may hold different numbers of
//! experts. Collective over `comm`.
//!
//! The ranks first all-gather their expert counts and parameter counts, so that a bad argument or a
//! disagreement throws on every rank before any write: the rank with the bad argument throws
//! `invalid_argument`, the others `aborted` naming it; parameter counts that differ are
//! `invalid_usage` on every rank, and a domain with no expert is `invalid_argument` on every rank.
//! @param be the back-end that owns the memory; it runs the sums.
//! @param comm the expert domain.
//! @param local_experts `[rows][n]`: the rank's experts (`rows` may be 0), `n` the same on every rank.
//! @param shared `[n]` (or more; the first `n` are written): the mean.
//! @param scratch the exchange's buffers, kept between calls.
template <class Backend, class Comm>
void shared_expert_mean(Backend const& be, Comm& comm, matrix_view<float const> local_experts, array_view<float> shared,
                        workspace<Backend>& scratch) {
  char const* const op = "shared_expert_mean";
  detail::require_one_stream(be, comm, op);
  std::int32_t const ranks = comm.size();
  std::int64_t const n = local_experts.hidden;
  std::optional<error> const bad = detail::argument_error([&] {
    detail::require(local_experts.rows >= 0 && n >= 0, op, "argument 'local_experts' is ", local_experts.rows, " x ", n,
                    "; both must be >= 0");
    std::int64_t const elements =
        detail::checked_mul(local_experts.rows, n, op, "local_experts.rows * local_experts.hidden");
    detail::validate_codec_input(op, "local_experts", local_experts.data, elements);
    detail::validate_codec_output(op, "shared", shared.data, shared.size, n);
  });

  // Agreement, in the back-end's memory (NCCL gathers device memory): -1 marks a bad argument.
  std::int64_t const mine[2] = {bad ? -1 : local_experts.rows, n};
  std::int64_t* const all = scratch.template host<std::int64_t>(2 * std::int64_t{ranks});
  auto* const words = scratch.template get<std::int64_t>(be, 2 * (std::int64_t{ranks} + 1));
  {
    [[maybe_unused]] auto const control = detail::payload_scope(be, detail::payload_kind::control);
    be.copy(words, mine, 2);
    be.synchronize();
    comm.allgather(words, words + 2, sizeof(mine));
    be.copy(all, words + 2, 2 * std::int64_t{ranks});
    be.synchronize();
  }
  if (bad) throw *bad;
  std::int64_t experts = 0;
  for (std::int32_t r = 0; r < ranks; ++r) {
    if (all[2 * r] < 0)
      detail::fail(status::aborted, op, "rank ", r, " passed an invalid argument (see its error); nothing was written");
    experts += all[2 * r];
  }
  for (std::int32_t r = 1; r < ranks; ++r)
    if (all[2 * r + 1] != all[1])
      detail::fail(status::invalid_usage, op, "ranks disagree: rank 0 has experts of ", all[1], " parameters, but rank ",
                   r, " has experts of ", all[2 * r + 1]);
  detail::require(experts > 0, op, "argument 'local_experts' has no rows on any of the ", ranks,
                  " ranks: the domain holds no expert to average");

  [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
  be.for_each_index(n, detail::sum_local_experts{local_experts.data, local_experts.rows, n, shared.data});
  ordered_allreduce(be, comm, array_view<float>(shared.data, n), scratch);
  be.for_each_index(n, detail::divide_by_count{shared.data, static_cast<float>(experts)});
}

//! Encodes one expert against the shared expert: keeps the `k` parameters of largest
//! |expert[i] - shared[i]|, ties going to the smaller index, and writes them in ascending index:
//! `indices[j]` and `values[j] = expert[indices[j]]` for `j < k` (values, not residuals: see the file
//! comment). `k = 0` writes nothing; `k = n` keeps every parameter, and decoding gives back
//! `expert` bit for bit. Every argument is checked, and the inputs scanned for NaN and ±Inf,
//! before anything is written.
//! @param be the back-end that owns the memory; it runs the selection.
//! @param expert `[n]` the expert's parameters, finite; `n < 2^31` (indices are int32: encode a
//!        larger expert in slices).
//! @param shared `[n]` the shared expert (`shared_expert_mean`), finite.
//! @param k parameters to keep, in `[0, n]` (`top_k_for_ratio`).
//! @param indices `[k]` or more: the kept indices, ascending.
//! @param values `[k]` or more: the kept values.
//! @param scratch the sort's keys and scratch (`16 n` bytes and the back-end's sort scratch), kept
//!        between calls.
//! @throws error (invalid_argument) naming the argument: sizes that differ or fall short, `k` out of
//!         range, or a NaN or ±Inf (with its index).
template <class Backend>
void encode_expert(Backend const& be, array_view<float const> expert, array_view<float const> shared, std::int64_t k,
                   array_view<std::int32_t> indices, array_view<float> values, workspace<Backend>& scratch) {
  char const* const op = "encode_expert";
  detail::validate_codec_input(op, "expert", expert.data, expert.size);
  detail::validate_codec_input(op, "shared", shared.data, shared.size);
  detail::require(shared.size == expert.size, op, "argument 'shared' has ", shared.size,
                  " elements and argument 'expert' has ", expert.size, "; they must match");
  std::int32_t const n = detail::checked_int32(expert.size, op, "expert.size", "indices are int32 (encode it in slices)");
  detail::require(k >= 0 && k <= n, op, "argument 'k' = ", k, " is not in [0, ", n, "] (the parameter count)");
  detail::validate_codec_output(op, "indices", indices.data, indices.size, k);
  detail::validate_codec_output(op, "values", values.data, values.size, k);
  detail::check_finite(be, expert, shared, op);
  if (k == 0) return;

  [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
  std::size_t const sort_bytes = std::max(be.stable_sort_scratch_bytes(n), be.stable_sort_scratch_bytes(k));
  std::int64_t const words = 4 * std::int64_t{n};
  auto* const base = scratch.template get<std::int32_t>(be, words + static_cast<std::int64_t>(sort_bytes / 4 + 1));
  auto* const keys = reinterpret_cast<std::uint32_t*>(base);
  std::uint32_t* const sorted_keys = keys + n;
  std::int32_t* const ids = base + 2 * std::int64_t{n};
  std::int32_t* const sorted_ids = ids + n;
  void* const sort_scratch = base + words;

  be.for_each_index(n, detail::residual_order_key{expert.data, shared.data, keys, ids});
  be.stable_sort_by_key(keys, sorted_keys, ids, sorted_ids, n, detail::residual_key_bits, sort_scratch, sort_bytes);
  // The first k ids are the kept ones; sorting them by themselves puts them in index order. An id
  // below 2^31 has the same bits as int32 and as uint32, so they serve as their own keys.
  be.stable_sort_by_key(reinterpret_cast<std::uint32_t const*>(sorted_ids), keys, sorted_ids, indices.data, k,
                        detail::index_key_bits(n), sort_scratch, sort_bytes);
  be.for_each_index(k, detail::gather_kept_values{indices.data, expert.data, values.data});
}

//! Decodes one expert: `params[i] = shared[i]`, then `params[indices[j]] = values[j]` for every
//! `j`. No arithmetic: kept parameters come back bit for bit, dropped ones as the shared expert's.
//! The indices are checked before anything is written; the values are data and are not checked.
//! @param be the back-end that owns the memory; it runs the copy and the scatter.
//! @param shared `[n]` the shared expert, the one the expert was encoded against.
//! @param indices `[k]` strictly ascending, each in `[0, n)` (`encode_expert`'s output).
//! @param values `[k]` the kept values.
//! @param params `[n]` or more (the first `n` are written); may be `shared` itself (decode in
//!        place), else must not overlap it.
//! @throws error (invalid_argument) naming the argument, and for a bad index its position.
template <class Backend>
void decode_expert(Backend const& be, array_view<float const> shared, array_view<std::int32_t const> indices,
                   array_view<float const> values, array_view<float> params) {
  char const* const op = "decode_expert";
  detail::validate_codec_input(op, "shared", shared.data, shared.size);
  detail::validate_codec_input(op, "indices", indices.data, indices.size);
  detail::validate_codec_input(op, "values", values.data, values.size);
  detail::require(values.size == indices.size, op, "argument 'values' has ", values.size,
                  " elements and argument 'indices' has ", indices.size, "; one value per index");
  std::int64_t const n = shared.size;
  detail::validate_codec_output(op, "params", params.data, params.size, n);
  detail::check_index_list(be, indices, n, op);

  [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::parameters);
  if (params.data != shared.data) be.copy(params.data, shared.data, n);
  be.for_each_index(indices.size, detail::scatter_kept_values{indices.data, values.data, params.data});
}

//! What decoding loses: the largest |expert[i] - shared[i]| over the parameters `indices` dropped
//! (0 when none was), which equals `max_i |decoded[i] - expert[i]|` exactly, since kept parameters
//! decode bit for bit and dropped ones to `shared[i]`. Selection by |residual| makes it the
//! `(k+1)`-th largest |residual|. A test of a layer built on decoded experts bounds its output
//! error with it: a linear map `y = W a` moves by at most this value times `sum |a|`. Blocks until
//! the value is on the host.
//! @param expert `[n]` the encoded expert, finite.
//! @param shared `[n]` the shared expert it was encoded against, finite.
//! @param indices `[k]` the kept indices, strictly ascending, in `[0, n)`.
//! @throws error (invalid_argument) as `encode_expert` and `decode_expert` do for the same arguments.
template <class Backend>
[[nodiscard]] float dropped_residual_max_abs(Backend const& be, array_view<float const> expert,
                                             array_view<float const> shared, array_view<std::int32_t const> indices) {
  char const* const op = "dropped_residual_max_abs";
  detail::validate_codec_input(op, "expert", expert.data, expert.size);
  detail::validate_codec_input(op, "shared", shared.data, shared.size);
  detail::validate_codec_input(op, "indices", indices.data, indices.size);
  detail::require(shared.size == expert.size, op, "argument 'shared' has ", shared.size,
                  " elements and argument 'expert' has ", expert.size, "; they must match");
  detail::check_finite(be, expert, shared, op);
  detail::check_index_list(be, indices, expert.size, op);
  return be.reduce(expert.size, 0.0f,
                   detail::dropped_residual_magnitude{expert.data, shared.data, indices.data, indices.size},
                   detail::maximum{});
}

MOECOMM_NAMESPACE_END
