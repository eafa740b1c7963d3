// SPDX-License-Identifier: Apache-2.0
// Fuzz test of every in-process communicator call (exchange, allgather, allreduce, reduce, broadcast,
// barrier, split) over 2-4 ranks: seeded random valid calls and invalid ones (null buffers, negative
// and overflowing sizes, bad roots and peers, a size, root or operation that differs on one rank).
// Every rank must end every call within the timeout, either with the oracle's result or with a
// `moecomm::error` of the expected status (a bad argument: `invalid_argument` on its rank, `aborted`
// on the others; a disagreement: `invalid_usage` everywhere), with no buffer written after an error,
// and never crash. The calls of one batch run one after another on the same communicators, so the
// test also shows that a failed call leaves them usable.
//
// CTest runs 3000 calls with seed 1. For a long run (>= 10^6 calls):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=7 build/host/tests/moecomm_host_tests -tc='*fuzz*' -s
// It prints the calls made, correct results, clean errors, hangs (a timeout) and wrong outcomes.

#include "inproc_support.hpp"

#include <moecomm/comm/inproc.hpp>

#include <chrono>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

namespace test {

using moecomm::inproc_communicator;
using moecomm::reduce_op;
using moecomm::status;

namespace fuzz {

enum class operation { exchange, allgather, allreduce, reduce, broadcast, barrier, split };
enum class fault { none, null_buffer, negative_size, overflowing_size, bad_root_or_peer, other_size, other_root, other_operation };

constexpr char poison_byte = '\x5A';
constexpr double poison_value = -12345.5;

// One call, as every rank makes it; `culprit` (or every rank, if `everywhere`) makes it wrong.
struct call {
  operation op = operation::barrier;
  fault wrong = fault::none;
  int culprit = 0;
  bool everywhere = false;
  std::int64_t n = 0;  // bytes or elements
  int root = 0;
  reduce_op reduction = reduce_op::sum;
  std::uint32_t salt = 0;
};

[[nodiscard]] bool is_bad_argument(fault f) {
  return f == fault::null_buffer || f == fault::negative_size || f == fault::overflowing_size || f == fault::bad_root_or_peer;
}

// The faults that make sense for an operation (a null buffer needs bytes, an overflow a product).
std::vector<fault> faults_of(operation op) {
  switch (op) {
    case operation::exchange: return {fault::null_buffer, fault::negative_size, fault::bad_root_or_peer, fault::other_size, fault::other_operation};
    case operation::allgather: return {fault::null_buffer, fault::negative_size, fault::overflowing_size, fault::other_size, fault::other_operation};
    case operation::allreduce: return {fault::null_buffer, fault::negative_size, fault::overflowing_size, fault::other_size, fault::other_operation};
    case operation::reduce:
      return {fault::null_buffer, fault::negative_size, fault::overflowing_size, fault::bad_root_or_peer, fault::other_size,
              fault::other_root, fault::other_operation};
    case operation::broadcast:
      return {fault::null_buffer, fault::negative_size, fault::bad_root_or_peer, fault::other_size, fault::other_root, fault::other_operation};
    case operation::barrier: return {fault::other_operation};
    case operation::split: return {fault::negative_size, fault::other_operation};  // negative: color -1
  }
  return {};
}

call random_call(std::mt19937& rng, int ranks) {
  call c;
  c.op = static_cast<operation>(rng() % 7);
  c.n = 1 + static_cast<std::int64_t>(rng() % 24);
  c.root = static_cast<int>(rng() % static_cast<unsigned>(ranks));
  c.reduction = static_cast<reduce_op>(rng() % 3);
  c.salt = static_cast<std::uint32_t>(rng());
  c.culprit = static_cast<int>(rng() % static_cast<unsigned>(ranks));
  if (rng() % 2 == 0) {  // half the calls are wrong
    auto const faults = faults_of(c.op);
    c.wrong = faults[rng() % faults.size()];
    c.everywhere = is_bad_argument(c.wrong) && rng() % 4 == 0;
  }
  return c;
}

[[nodiscard]] status expected_status(call const& c, int rank) {
  if (c.wrong == fault::none) return status::success;
  if (!is_bad_argument(c.wrong)) return status::invalid_usage;
  return c.everywhere || rank == c.culprit ? status::invalid_argument : status::aborted;
}

char byte_of(std::uint32_t salt, int from, int to, std::int64_t k) { return static_cast<char>((salt + 31u * from + 7u * to + k) % 251); }
double value_of(std::uint32_t salt, int rank, std::int64_t i) {
  return static_cast<double>((salt + 13u * rank + 7u * static_cast<unsigned>(i)) % 1000) * 1e13 - 4.9e15 + 0.1 * rank;
}
std::int64_t exchange_bytes(call const& c, int from, int to) { return 1 + (c.salt + 3u * from + 5u * to) % static_cast<unsigned>(c.n); }

// Makes call `c` as `comm.rank()`; returns whether the result equals the oracle (or, after an error,
// whether every buffer is unchanged). Throws what the communicator throws.
bool make_call(inproc_communicator& comm, call const& c, bool& unchanged) {
  int const me = comm.rank(), ranks = comm.size();
  bool const guilty = c.everywhere || me == c.culprit;
  fault const f = guilty ? c.wrong : fault::none;
  unchanged = true;
  if (f == fault::other_operation) {
    if (c.op == operation::barrier) comm.allgather(nullptr, nullptr, 0);
    else comm.barrier();
    return true;
  }
  std::int64_t const max = std::numeric_limits<std::int64_t>::max();
  switch (c.op) {
    case operation::exchange: {
      std::vector<std::vector<char>> out(static_cast<std::size_t>(ranks)), in(static_cast<std::size_t>(ranks));
      std::vector<moecomm::send_block> sends;
      std::vector<moecomm::recv_block> recvs;
      for (int p = 0; p < ranks; ++p) {
        for (std::int64_t k = 0; k < exchange_bytes(c, me, p); ++k) out[static_cast<std::size_t>(p)].push_back(byte_of(c.salt, me, p, k));
        in[static_cast<std::size_t>(p)].assign(static_cast<std::size_t>(exchange_bytes(c, p, me)) + 1, poison_byte);
        sends.push_back({p, out[static_cast<std::size_t>(p)].data(), exchange_bytes(c, me, p)});
        recvs.push_back({p, in[static_cast<std::size_t>(p)].data(), exchange_bytes(c, p, me)});
      }
      if (f == fault::null_buffer) sends.back().data = nullptr;
      if (f == fault::negative_size) recvs.front().bytes = -1;
      if (f == fault::bad_root_or_peer) sends.front().peer = c.salt % 2 == 0 ? ranks : -1;
      if (f == fault::other_size) recvs.front().bytes += 1;
      try {
        comm.exchange(sends, recvs);
      } catch (...) {
        for (auto const& b : in) unchanged = unchanged && std::all_of(b.begin(), b.end(), [](char x) { return x == poison_byte; });
        throw;
      }
      for (int p = 0; p < ranks; ++p)
        for (std::int64_t k = 0; k <= exchange_bytes(c, p, me); ++k)
          if (in[static_cast<std::size_t>(p)][static_cast<std::size_t>(k)] != (k < exchange_bytes(c, p, me) ? byte_of(c.salt, p, me, k) : poison_byte)) return false;
      return true;
    }
    case operation::allgather:
    case operation::broadcast: {
      bool const gather = c.op == operation::allgather;
      std::vector<char> send(static_cast<std::size_t>(c.n));
      for (std::int64_t k = 0; k < c.n; ++k) send[static_cast<std::size_t>(k)] = byte_of(c.salt, me, 0, k);
      std::vector<char> recv(static_cast<std::size_t>(gather ? ranks * c.n + 1 : c.n), poison_byte);
      if (!gather && me == c.root) recv = send;
      std::vector<char> const before = recv;
      std::int64_t bytes = c.n;
      int root = c.root;
      if (f == fault::negative_size) bytes = -bytes;
      if (f == fault::overflowing_size) bytes = max / ranks + 1;
      if (f == fault::other_size) bytes += 1;
      if (f == fault::bad_root_or_peer) root = c.salt % 2 == 0 ? ranks : -1;
      if (f == fault::other_root) root = (root + 1) % ranks;
      try {
        if (gather) comm.allgather(f == fault::null_buffer && c.salt % 2 == 0 ? nullptr : send.data(),
                                   f == fault::null_buffer && c.salt % 2 != 0 ? nullptr : recv.data(), bytes);
        else comm.broadcast(f == fault::null_buffer ? nullptr : recv.data(), bytes, root);
      } catch (...) {
        unchanged = recv == before;
        throw;
      }
      for (std::size_t k = 0; k < recv.size(); ++k) {
        std::int64_t const from = gather ? static_cast<std::int64_t>(k) / c.n : c.root;
        char const want = from < ranks ? byte_of(c.salt, static_cast<int>(from), 0, gather ? static_cast<std::int64_t>(k) % c.n : static_cast<std::int64_t>(k)) : poison_byte;
        if (recv[k] != want) return false;
      }
      return true;
    }
    case operation::allreduce:
    case operation::reduce: {
      bool const all = c.op == operation::allreduce;
      std::vector<double> send(static_cast<std::size_t>(c.n)), recv(static_cast<std::size_t>(c.n), poison_value);
      for (std::int64_t i = 0; i < c.n; ++i) send[static_cast<std::size_t>(i)] = value_of(c.salt, me, i);
      std::int64_t count = c.n;
      int root = c.root;
      if (f == fault::negative_size) count = -count;
      if (f == fault::overflowing_size) count = max / 8 + 1;
      if (f == fault::other_size) count += 1;
      if (f == fault::bad_root_or_peer) root = c.salt % 2 == 0 ? ranks : -1;
      if (f == fault::other_root) root = (root + 1) % ranks;
      bool const null_send = f == fault::null_buffer && (c.salt % 2 == 0 || (!all && me != c.root));
      try {
        if (all) comm.allreduce(null_send ? nullptr : send.data(), f == fault::null_buffer && !null_send ? nullptr : recv.data(), count, c.reduction);
        else comm.reduce(null_send ? nullptr : send.data(), f == fault::null_buffer && !null_send ? nullptr : recv.data(), count, c.reduction, root);
      } catch (...) {
        unchanged = std::all_of(recv.begin(), recv.end(), [](double x) { return x == poison_value; });
        throw;
      }
      for (std::int64_t i = 0; i < c.n; ++i) {
        double want = value_of(c.salt, 0, i);
        for (int r = 1; r < ranks; ++r) want = moecomm::detail::reduce(want, value_of(c.salt, r, i), c.reduction);
        if (!all && me != c.root) want = poison_value;
        if (std::memcmp(&recv[static_cast<std::size_t>(i)], &want, sizeof(double)) != 0) return false;
      }
      return true;
    }
    case operation::barrier: comm.barrier(); return true;
    case operation::split: {
      auto const color_of = [&](int r) { return static_cast<int>((c.salt + static_cast<unsigned>(r)) % 2); };
      auto const key_of = [&](int r) { return static_cast<int>((c.salt >> 3) + 7u * static_cast<unsigned>(r)) % 5; };
      inproc_communicator sub = comm.split(f == fault::negative_size ? -1 : color_of(me), key_of(me));
      std::vector<std::pair<int, int>> mine;  // (key, rank) of my color
      for (int r = 0; r < ranks; ++r)
        if (color_of(r) == color_of(me)) mine.emplace_back(key_of(r), r);
      std::sort(mine.begin(), mine.end());
      if (sub.size() != static_cast<int>(mine.size()) || mine[static_cast<std::size_t>(sub.rank())].second != me) return false;
      std::int64_t world_ranks = comm.rank(), want = 0;
      for (auto const& kr : mine) want += kr.second;
      sub.allreduce(&world_ranks, &world_ranks, 1, reduce_op::sum);
      return world_ranks == want;
    }
  }
  return false;
}

std::int64_t env_or(char const* name, std::int64_t fallback) {
  char const* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoll(v, nullptr, 10) : fallback;
}

}  // namespace fuzz

TEST_CASE("fuzz: every communicator call over 2-4 in-process ranks ends with the oracle's result or the expected error") {
  std::int64_t const runs = fuzz::env_or("MOECOMM_FUZZ_RUNS", 3000);
  auto const seed = static_cast<std::uint32_t>(fuzz::env_or("MOECOMM_FUZZ_SEED", 1));
  std::mt19937 rng(seed);
  std::int64_t made = 0, correct = 0, clean_errors = 0, hangs = 0, wrong = 0;
  constexpr std::int64_t batch = 50;
  for (std::int64_t first = 0; first < runs; first += batch) {
    int const ranks = 2 + static_cast<int>(rng() % 3);
    std::vector<fuzz::call> calls;
    for (std::int64_t i = first; i < std::min(runs, first + batch); ++i) calls.push_back(fuzz::random_call(rng, ranks));
    moecomm::inproc_world const world(ranks, std::chrono::seconds(10));
    std::vector<std::vector<outcome>> seen(calls.size(), std::vector<outcome>(static_cast<std::size_t>(ranks)));
    std::vector<std::vector<char>> right(calls.size(), std::vector<char>(static_cast<std::size_t>(ranks), 0));
    on_every_rank(world, [&](inproc_communicator comm) {
      auto const me = static_cast<std::size_t>(comm.rank());
      for (std::size_t i = 0; i < calls.size(); ++i) {
        bool unchanged = true;
        try {
          right[i][me] = fuzz::make_call(comm, calls[i], unchanged);
        } catch (moecomm::error const& e) {
          seen[i][me] = {e.code(), e.what()};
          right[i][me] = unchanged;
          if (e.code() != fuzz::expected_status(calls[i], comm.rank())) return;  // reported below; the world may be dead
        }
      }
    });
    for (std::size_t i = 0; i < calls.size(); ++i) {
      ++made;
      bool ok = true, hung = false;
      for (int r = 0; r < ranks; ++r) {
        outcome const& o = seen[i][static_cast<std::size_t>(r)];
        hung = hung || o.code == status::timeout;
        ok = ok && o.code == fuzz::expected_status(calls[i], r) && right[i][static_cast<std::size_t>(r)] != 0;
      }
      if (hung) ++hangs;
      else if (!ok) ++wrong;
      else if (calls[i].wrong == fuzz::fault::none) ++correct;
      else ++clean_errors;
      if (!ok) {
        fuzz::call const& c = calls[i];
        FAIL_CHECK("call ", i, " of the batch from ", first, ": operation ", static_cast<int>(c.op), ", fault ", static_cast<int>(c.wrong),
                   " on rank ", c.culprit, c.everywhere ? " (every rank)" : "", ", n ", c.n, ", root ", c.root, "; rank 0 ended with ",
                   moecomm::to_string(seen[i][0].code), " ", seen[i][0].message);
        break;
      }
    }
  }
  MESSAGE("fuzz seed ", seed, ": ", made, " calls, ", correct, " correct results, ", clean_errors, " clean errors, ", hangs,
          " hangs, ", wrong, " wrong, 0 crashes");
  CHECK(hangs == 0);
  CHECK(wrong == 0);
  CHECK(correct + clean_errors == runs);
}

}  // namespace test
