// SPDX-License-Identifier: Apache-2.0
#pragma once
// Bodies of the pipelined-collective tests (Parm's fused all-to-all ∥ all-gather and its mirror),
// generic over the communicator so that in-process and simulated ranks run the same checks.
//
// The all-to-all runs over the EP groups and the gather over the ESP groups of `parallel_groups`;
// blocks have uneven sizes (0 to 5 rows, from the sender and receiver), rows name their sender,
// block, row and column, outputs start poisoned, and the result must equal the composition of the
// two collectives computed by a single-process oracle, byte for byte, for every piece count.

#include "../support/test_support.hpp"

#include <moecomm/comm/parallel_groups.hpp>
#include <moecomm/collectives/pipelined_collectives.hpp>

#include <cstdint>
#include <vector>

namespace test {

// Rows world rank `source` sends all-to-all rank `dest` of its EP group: 0 to 5, uneven.
inline std::int64_t pipelined_rows(std::int32_t source, std::int32_t dest) { return (source * 7 + dest * 3 + 1) % 6; }

// Element (row, col) of block `block` of world rank `holder`: names all four, exact in bf16 sums.
template <class T>
T pipelined_value(std::int32_t holder, std::int32_t block, std::int64_t row, std::int64_t col) {
  return oracle::from32<T>(static_cast<float>(((holder * 16 + block) * 8 + row) % 97) + static_cast<float>(col % 4) * 0.25f);
}

// One rank: alltoall_allgather and reduce_scatter_alltoall over (EP, ESP) against the oracle.
template <class T, class Backend, class Comm>
void check_pipelined_collectives_on_rank(Backend const& be, Comm& world, moecomm::parallel_sizes const sizes) {
  moecomm::parallel_groups<Comm> groups(world, sizes);
  auto const at = groups.coordinates();
  std::int32_t const P = sizes.expert, G = sizes.expert_slicing, me = world.rank(), first_g = at.mp - at.esp;
  auto world_rank = [&](std::int32_t ep, std::int32_t mp) { return (at.dp * P + ep) * sizes.model + mp; };
  std::int64_t const h = 3;
  std::vector<std::int64_t> send_rows(static_cast<std::size_t>(P)), recv_rows(static_cast<std::size_t>(G * P));
  for (std::int32_t p = 0; p < P; ++p) send_rows[static_cast<std::size_t>(p)] = pipelined_rows(me, p);
  for (std::int32_t g = 0; g < G; ++g)
    for (std::int32_t p = 0; p < P; ++p)
      recv_rows[static_cast<std::size_t>(g * P + p)] = pipelined_rows(world_rank(p, first_g + g), at.ep);
  auto rows_of = [](std::vector<std::int64_t> const& v, std::size_t n) {
    std::int64_t s = 0;
    for (std::size_t i = 0; i < n; ++i) s += v[i];
    return s;
  };
  std::int64_t const sent = rows_of(send_rows, send_rows.size()), gathered = rows_of(recv_rows, recv_rows.size());
  // this rank's all-to-all input: block p for EP rank p
  std::vector<T> in(static_cast<std::size_t>(sent * h));
  for (std::int32_t p = 0, row0 = 0; p < P; row0 += static_cast<std::int32_t>(send_rows[static_cast<std::size_t>(p)]), ++p)
    for (std::int64_t r = 0; r < send_rows[static_cast<std::size_t>(p)]; ++r)
      for (std::int64_t c = 0; c < h; ++c) in[static_cast<std::size_t>((row0 + r) * h + c)] = pipelined_value<T>(me, p, r, c);
  // oracle of the all-gather of the all-to-all: block (g, p) is what EP rank p of member g's group sent it
  std::vector<T> want_gathered;
  for (std::int32_t g = 0; g < G; ++g)
    for (std::int32_t p = 0; p < P; ++p)
      for (std::int64_t r = 0; r < recv_rows[static_cast<std::size_t>(g * P + p)]; ++r)
        for (std::int64_t c = 0; c < h; ++c) want_gathered.push_back(pipelined_value<T>(world_rank(p, first_g + g), at.ep, r, c));
  // the mirror's input: this rank's partial sums of every member's blocks; the oracle of its output
  std::vector<T> partials(static_cast<std::size_t>(gathered * h));
  for (std::size_t i = 0; i < partials.size(); ++i)
    partials[i] = pipelined_value<T>(me, 31, static_cast<std::int64_t>(i) / h, static_cast<std::int64_t>(i) % h);
  std::vector<T> want_returned;
  for (std::int32_t a = 0; a < P; ++a) {
    // the holders: the ESP group at EP index a; this rank's block there is (at.esp, at.ep)
    std::int64_t before = 0;  // rows of the holders' blocks before (at.esp, at.ep)
    for (std::int32_t q = 0; q < at.esp * P + at.ep; ++q)
      before += pipelined_rows(world_rank(q % P, first_g + q / P), a);
    for (std::int64_t r = 0; r < send_rows[static_cast<std::size_t>(a)]; ++r)
      for (std::int64_t c = 0; c < h; ++c) {
        float acc = 0;
        for (std::int32_t g = 0; g < G; ++g) {
          std::int64_t const i = (before + r) * h + c;
          float const v = oracle::f32(pipelined_value<T>(world_rank(a, first_g + g), 31, i / h, i % h));
          acc = g == 0 ? v : acc + v;
        }
        want_returned.push_back(oracle::from32<T>(acc));
      }
  }
  moecomm::pipeline_workspace<Backend> scratch;
  for (std::int32_t pieces : {1, 2, 7}) {
    CAPTURE(pieces);
    std::vector<T> out = poisoned<T>(gathered * h + 2);
    moecomm::alltoall_allgather(be, groups.ep(), groups.esp(), moecomm::matrix_view<T const>{in.data(), sent, h},
                                moecomm::array_view<std::int64_t const>(send_rows),
                                moecomm::array_view<std::int64_t const>(recv_rows),
                                moecomm::matrix_view<T>{out.data(), gathered, h}, scratch, pieces);
    check_bitwise(std::vector<T>(out.begin(), out.begin() + gathered * h), want_gathered, h, "alltoall_allgather");
    check_untouched(out, static_cast<std::size_t>(gathered * h), "alltoall_allgather");
    std::vector<T> back = poisoned<T>(sent * h + 2);
    moecomm::reduce_scatter_alltoall(be, groups.esp(), groups.ep(), moecomm::matrix_view<T const>{partials.data(), gathered, h},
                                     moecomm::array_view<std::int64_t const>(recv_rows),
                                     moecomm::array_view<std::int64_t const>(send_rows),
                                     moecomm::matrix_view<T>{back.data(), sent, h}, scratch, pieces);
    check_bitwise(std::vector<T>(back.begin(), back.begin() + sent * h), want_returned, h, "reduce_scatter_alltoall");
    check_untouched(back, static_cast<std::size_t>(sent * h), "reduce_scatter_alltoall");
  }
}

}  // namespace test
