// SPDX-License-Identifier: Apache-2.0
// Fuzz target: sort_chunks in both directions. Valid counts must give the oracle's reordering
// bit for bit (self-identifying NaN-free rows) with rows past the total still poisoned; negative
// counts, a null count array, non-positive sizes, num_ranks * num_local_experts beyond int32
// (which must be refused before a count is read), and the matrix faults of fuzz_driver.hpp must
// be rejected with a moecomm::error that writes nothing.
//
// CTest runs 20000 runs with seed 1 (host.fuzz.sort_chunks). Long run, >= 10^6 runs (about 4 minutes):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=$RANDOM OMP_WAIT_POLICY=passive build/host/tests/fuzz/moecomm_fuzz_sort_chunks

#include "fuzz_driver.hpp"

namespace {

using namespace fuzz;

bool one_case(run& r) {
  auto const be = any_backend(r);
  int32_t ranks = static_cast<int32_t>(1 + r.size(8, 31));
  int32_t locals = static_cast<int32_t>(1 + r.size(8, 31));
  int64_t const hidden = r.chance(0.02) ? 0 : r.uniform(1, 70);
  int64_t const max_count = r.pick<int64_t>({0, 1, 9, 50});
  bool const to_expert_major = r.chance(0.5);
  std::vector<int32_t> counts(static_cast<std::size_t>(ranks * locals));
  int64_t total = 0;
  bool const alike = r.chance(0.2);  // a padded exchange's chunks, moved without a table
  for (auto& c : counts) total += c = static_cast<int32_t>(alike ? max_count : r.uniform(0, max_count));
  r.note("R=", ranks, " L=", locals, " H=", hidden, " max_count=", max_count, " alike=", alike, " total=", total,
         " to_expert_major=", to_expert_major);
  auto m = make_matrices(r, random_fault(r), total, total, hidden);
  int32_t const* counts_arg = counts.data();
  if (m.why.empty() && r.chance(0.2)) {
    switch (r.uniform(0, 2)) {
      case 0: {
        auto const at = static_cast<std::size_t>(r.uniform(0, ranks * locals - 1));
        counts[at] = r.pick<int32_t>({-1, std::numeric_limits<int32_t>::min()});
        m.why = "a negative count";
        break;
      }
      case 1:  // sizes the count array cannot back: refused before a count is read
        (r.chance(0.5) ? ranks : locals) = r.pick<int32_t>({0, -1, std::numeric_limits<int32_t>::min()});
        if (ranks > 0 && locals > 0) {
          ranks = r.pick<int32_t>({65536, int32_max});
          locals = r.pick<int32_t>({65536, int32_max});
        }
        m.why = moecomm::detail::concat("num_ranks = ", ranks, ", num_local_experts = ", locals);
        break;
      default:
        counts_arg = nullptr;
        m.why = "a null count array";
        break;
    }
    r.note("R'=", ranks, " L'=", locals);
  }
  auto const order = to_expert_major ? moecomm::chunk_order::rank_major_to_expert_major
                                     : moecomm::chunk_order::expert_major_to_rank_major;
  bool const short_counts = m.why.empty() && counts_arg != nullptr && r.chance(0.05);  // a view one element short
  if (short_counts) m.why = "counts one element short";
  moecomm::array_view<int32_t const> const counts_view{
      counts_arg, counts_arg == nullptr ? 0 : static_cast<int64_t>(counts.size()) - (short_counts ? 1 : 0)};
  auto const call = [&] { moecomm::sort_chunks(be, m.in_view, counts_view, ranks, locals, m.out_view, order); };
  if (!m.why.empty()) return rejected(call, "moecomm::sort_chunks:", m, {});
  call();
  expect_bitwise(m.out, oracle::sort_chunks(rows_of(m.in_view), hidden, counts, ranks, locals, to_expert_major),
                 "sort_chunks");
  expect_untouched(m.out, static_cast<std::size_t>(total * hidden), "sort_chunks past the total");
  return true;
}

}  // namespace

int main() { return fuzz::main_loop("fuzz_sort_chunks", 20000, one_case); }
