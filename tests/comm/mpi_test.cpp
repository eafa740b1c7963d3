// SPDX-License-Identifier: Apache-2.0
// The MPI communicator, run as `mpiexec -n 4 moecomm_mpi_tests`: every collective's result (checked and
// unchecked, whole and cut into 7-byte chunks), sub-groups, and the failure contract (mismatched
// collectives, sizes and exchange pairs, and bad arguments, throw on every rank; a rank that skips a
// collective makes the others time out; negative and overflowing sizes), ordered_allreduce bitwise
// against the sequential oracle, and hierarchical_2d's world-level agreement. Every rank runs every test
// case and asserts on its own. The exit code is the worst over the ranks.
//
// The test case "timeout - ..." leaves a collective pending forever, so it must run last. It uses a
// communicator of its own, and ctest runs it in a separate mpiexec (host.mpi.timeout).

#define DOCTEST_CONFIG_IMPLEMENT
#include "../support/mpi_doctest.hpp"
#include "../support/test_support.hpp"
#include "communicator_checks.hpp"
#include "row_collectives_cases.hpp"
#include "ordered_values.hpp"

#include <moecomm/comm/mpi.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <limits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace test {

using moecomm::mpi_communicator;
using moecomm::mpi_options;
using std::chrono::milliseconds;

constexpr int ranks = 4;

// The MPI_Comm of every test case but the timeout test: a duplicate of MPI_COMM_WORLD, so that the
// tests' traffic never meets main's final MPI_Allreduce.
MPI_Comm test_comm = MPI_COMM_NULL;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Options for test cases that should pass: a failure on one rank turns into errors on the others
// within 30 s instead of a hang until ctest's timeout.
mpi_options options(bool checked = true, std::int64_t max_message_bytes = INT_MAX) {
  return mpi_options{milliseconds(30000), checked, max_message_bytes};
}

// The world size the tests are written for; a test case fails (rather than hangs) on another size.
#define MOECOMM_REQUIRE_FOUR_RANKS(comm)  \
  INFO("world rank ", world_rank());      \
  REQUIRE_MESSAGE((comm).size() == ranks, "run with mpiexec -n 4")

TEST_CASE("mpi collectives compute what they promise, checked and unchecked, whole and in 7-byte chunks") {
  for (bool checked : {true, false})
    for (std::int64_t max_bytes : {std::int64_t{INT_MAX}, std::int64_t{7}}) {
      CAPTURE(checked);
      CAPTURE(max_bytes);
      mpi_communicator comm(test_comm, options(checked, max_bytes));
      MOECOMM_REQUIRE_FOUR_RANKS(comm);
      int const me = comm.rank();
      // allgather (16 bytes per rank: three 7-byte chunks)
      std::int64_t const mine[2] = {me, 100 + me};
      std::vector<std::int64_t> all(2 * ranks, -1);
      comm.allgather(mine, all.data(), sizeof(mine));
      for (int r = 0; r < ranks; ++r) REQUIRE((all[2 * r] == r && all[2 * r + 1] == 100 + r));
      // allgather of an odd size: 13 bytes per rank
      std::vector<char> odd(13), odds(13 * ranks, 0);
      for (int i = 0; i < 13; ++i) odd[i] = static_cast<char>(me * 13 + i);
      comm.allgather(odd.data(), odds.data(), 13);
      for (int i = 0; i < 13 * ranks; ++i) REQUIRE(odds[i] == static_cast<char>(i));
      // allreduce: in place, sum and max, int64 and double
      check_allreduce_in_place(comm);
      std::int64_t const total = std::int64_t{ranks} * (ranks - 1) / 2;
      // allreduce: out of place, int32 min and float sum (exact: small integers)
      std::vector<std::int32_t> w{10 - me, me, -me}, lowest(3, 99);
      comm.allreduce(w.data(), lowest.data(), 3, moecomm::reduce_op::min);
      REQUIRE(lowest == std::vector<std::int32_t>{10 - (ranks - 1), 0, -(ranks - 1)});
      std::vector<float> f(5, static_cast<float>(me + 1)), fsum(5, 0.0f);
      comm.allreduce(f.data(), fsum.data(), 5, moecomm::reduce_op::sum);
      REQUIRE(fsum == std::vector<float>(5, static_cast<float>(ranks * (ranks + 1) / 2)));
      // reduce to rank 1: in place there, and nothing written elsewhere
      std::vector<double> r{double(me), 0.5};
      comm.reduce(r.data(), me == 1 ? r.data() : nullptr, 2, moecomm::reduce_op::sum, 1);
      REQUIRE(r == (me == 1 ? std::vector<double>{double(total), 0.5 * ranks} : std::vector<double>{double(me), 0.5}));
      // broadcast from the last rank, one word and 100 bytes
      std::int32_t word = me == ranks - 1 ? 4242 : -1;
      comm.broadcast(&word, sizeof(word), ranks - 1);
      REQUIRE(word == 4242);
      std::vector<char> text(100, me == 1 ? 'x' : '.');
      comm.broadcast(text.data(), 100, 1);
      REQUIRE(text == std::vector<char>(100, 'x'));
      check_exchange_between_every_pair(comm);
      // Zero-sized calls are fine too.
      comm.allgather(nullptr, nullptr, 0);
      comm.broadcast(nullptr, 0, 0);
      comm.allreduce<float>(nullptr, nullptr, 0, moecomm::reduce_op::sum);
      comm.exchange({}, {});
      comm.barrier();
      CHECK(comm.usable());
    }
}

TEST_CASE("mpi exchange cuts messages into 7-byte chunks and skips absent pairs") {
  mpi_communicator comm(test_comm, options(true, 7));
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  int const me = comm.rank();
  // i sends (7 * i + 3 * j) % 23 bytes to j (0, 1, 6, 7, 8, 14, ... : around the chunk boundaries),
  // except that nobody sends to the next rank but one, and rank 0 also sends 1000 bytes to rank 3.
  auto const bytes = [](int from, int to) -> std::int64_t {
    if (to == (from + 2) % ranks) return 0;
    if (from == 0 && to == 3) return 1000;
    return (7 * from + 3 * to) % 23;
  };
  auto const byte_at = [](int from, int to, std::int64_t k) { return static_cast<char>((from * 31 + to * 7 + k) % 251); };
  std::vector<std::vector<char>> out(ranks), in(ranks);
  std::vector<moecomm::send_block> sends;
  std::vector<moecomm::recv_block> recvs;
  for (int peer = 0; peer < ranks; ++peer) {
    for (std::int64_t k = 0; k < bytes(me, peer); ++k) out[peer].push_back(byte_at(me, peer, k));
    in[peer].assign(static_cast<std::size_t>(bytes(peer, me)) + 1, '#');  // one byte more, which must stay '#'
    if (peer != (me + 2) % ranks) sends.push_back({peer, out[peer].data(), bytes(me, peer)});
    if (me != (peer + 2) % ranks) recvs.push_back({peer, in[peer].data(), bytes(peer, me)});
  }
  comm.exchange(sends, recvs);
  for (int peer = 0; peer < ranks; ++peer) {
    CAPTURE(peer);
    for (std::int64_t k = 0; k < bytes(peer, me); ++k) REQUIRE(in[peer][static_cast<std::size_t>(k)] == byte_at(peer, me, k));
    REQUIRE(in[peer].back() == '#');
  }
  // The same again, unchecked: the chunks still match up.
  mpi_communicator unchecked(test_comm, options(false, 7));
  for (auto& buffer : in) std::fill(buffer.begin(), buffer.end(), '#');
  unchecked.exchange(sends, recvs);
  for (int peer = 0; peer < ranks; ++peer)
    for (std::int64_t k = 0; k < bytes(peer, me); ++k) REQUIRE(in[peer][static_cast<std::size_t>(k)] == byte_at(peer, me, k));
}

TEST_CASE("mpi row collectives and parallel groups equal the in-process ones") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  check_row_collectives_on_rank<float>(moecomm::host_backend{}, comm);
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{2, 2, 1},
                                              moecomm::parallel_sizes{1, 4, 1}, moecomm::parallel_sizes{4, 1, 4}})
    check_parallel_groups_on_rank(comm, sizes);
}

TEST_CASE("mpi split makes intra-node and inter-node groups of a 2 x 2 world") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  moecomm::topology const topo(ranks, 2);
  int const me = comm.rank();
  mpi_communicator intra = comm.split(topo.node_of(me), me);
  mpi_communicator inter = comm.split(topo.local_of(me), me);
  REQUIRE(intra.size() == 2);
  REQUIRE(intra.rank() == topo.local_of(me));
  REQUIRE(inter.size() == 2);
  REQUIRE(inter.rank() == topo.node_of(me));
  CHECK(intra.world_rank() == world_rank());
  CHECK(intra.native_handle() != MPI_COMM_NULL);
  CHECK(intra.options().timeout == milliseconds(30000));
  std::int64_t sum = me;
  intra.allreduce(&sum, &sum, 1, moecomm::reduce_op::sum);
  REQUIRE(sum == (topo.node_of(me) == 0 ? 0 + 1 : 2 + 3));
  std::int64_t across = me;
  inter.allreduce(&across, &across, 1, moecomm::reduce_op::sum);
  REQUIRE(across == 2 * topo.local_of(me) + 2);
  // An exchange inside a node: swap one word with the other local rank.
  std::int32_t const mine = 1000 + me;
  std::int32_t theirs = -1;
  int const other = 1 - intra.rank();
  intra.exchange({{other, &mine, sizeof(mine)}}, {{other, &theirs, sizeof(theirs)}});
  REQUIRE(theirs == 1000 + topo.rank_at(topo.node_of(me), other));
  // A second split reverses the order by key; moving a communicator moves its MPI_Comm.
  mpi_communicator reversed = comm.split(0, -me);
  REQUIRE(reversed.rank() == ranks - 1 - me);
  MPI_Comm const handle = reversed.native_handle();
  mpi_communicator moved(std::move(reversed));
  CHECK(moved.native_handle() == handle);
  CHECK(reversed.native_handle() == MPI_COMM_NULL);  // NOLINT(bugprone-use-after-move): tested on purpose
  CHECK_FALSE(reversed.usable());
  test::check_error([&] { reversed.barrier(); }, moecomm::status::invalid_usage, {"moved from"});
  moved = std::move(intra);  // frees the reversed group's MPI_Comm
  REQUIRE(moved.size() == 2);
  moved.barrier();
  inter.barrier();
  // Colors must be >= 0 (MPI_UNDEFINED is not supported): every rank passes -1, every rank throws.
  test::check_error([&] { static_cast<void>(comm.split(-1, 0)); }, moecomm::status::invalid_argument, {"color = -1 must be >= 0"});
  comm.barrier();
}

TEST_CASE("mpi ranks calling different collectives all get an error naming the operation and the ranks") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  auto const [code, message] = thrown_error([&] {
    std::int64_t v = 1;
    if (comm.rank() == 2) comm.broadcast(&v, sizeof(v), 0);
    else comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  });
  CHECK(code == moecomm::status::invalid_usage);
  CHECK_MESSAGE(message.find("ranks disagree: world rank 0 called allreduce(size 1, 16)") != std::string::npos, message);
  CHECK_MESSAGE(message.find("world rank 2 called broadcast(size 8, 0)") != std::string::npos, message);
  CHECK_MESSAGE(message.find("moecomm::mpi_communicator::") == 0, message);
  // Every rank stopped at the same point: the communicator is still usable.
  CHECK(comm.usable());
  std::int64_t v = 1;
  comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  CHECK(v == ranks);
}

// As in-process ("in group 3 {1,3}"), a sub-group's messages say which group, by its world ranks.
TEST_CASE("mpi messages from a sub-group name its world ranks") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  mpi_communicator odd_even = comm.split(comm.rank() % 2, comm.rank());
  auto const [code, message] = thrown_error([&] {
    std::int64_t v = 1;
    if (comm.rank() == 3) odd_even.barrier();
    else odd_even.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  });
  if (comm.rank() % 2 == 0) {
    CHECK(code == moecomm::status::success);
  } else {
    CHECK(code == moecomm::status::invalid_usage);
    CHECK_MESSAGE(message.find("ranks disagree: world rank 1 called allreduce(size 1, 16), but world rank 3 called "
                               "barrier(size 0, 0) in group {1,3}") != std::string::npos,
                  message);
  }
  auto const [bad_code, bad_message] = thrown_error([&] {
    std::int64_t v = 1;
    odd_even.allreduce(comm.rank() == 2 ? nullptr : &v, &v, 1, moecomm::reduce_op::sum);
  });
  if (comm.rank() == 0) {
    CHECK(bad_code == moecomm::status::aborted);
    CHECK_MESSAGE(bad_message.find("world rank 2 passed an invalid argument to allreduce in group {0,2}") != std::string::npos,
                  bad_message);
  }
  comm.barrier();
}

TEST_CASE("mpi inconsistent sizes across ranks are an error on every rank") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  std::vector<char> send(comm.rank() == 1 ? 16 : 8), recv(ranks * 16);
  test::check_error([&] { comm.allgather(send.data(), recv.data(), static_cast<std::int64_t>(send.size())); },
                    moecomm::status::invalid_usage,
                    {"moecomm::mpi_communicator::allgather: ranks disagree: world rank 0 called allgather(size 8, 0), "
                     "but world rank 1 called allgather(size 16, 0)"});
  std::int32_t root_word = 5;
  test::check_error([&] { comm.broadcast(&root_word, sizeof(root_word), comm.rank() == 3 ? 1 : 0); },
                    moecomm::status::invalid_usage, {"world rank 0 called broadcast(size 4, 0), but world rank 3 called broadcast(size 4, 1)"});
  comm.barrier();
}

TEST_CASE("mpi an exchange whose sizes disagree names the pair on every rank") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  std::vector<char> buf(64);
  std::vector<moecomm::send_block> sends;
  std::vector<moecomm::recv_block> recvs;
  int const me = comm.rank();
  for (int peer = 0; peer < ranks; ++peer) {
    sends.push_back({peer, buf.data(), me == 1 && peer == 3 ? 12 : 8});
    recvs.push_back({peer, buf.data() + 32, 8});
  }
  test::check_error([&] { comm.exchange(sends, recvs); }, moecomm::status::invalid_usage,
                    {"pair (1, 3): rank 1 sends 12 bytes to rank 3, but rank 3 expects 8 bytes from rank 1"});
  // Two mismatches: every rank names the first pair in (sender, receiver) order. Rank 3 expects
  // nothing from rank 2 (which still sends 8 bytes), and rank 2 expects 4 bytes from rank 0.
  sends.clear();
  recvs.clear();
  for (int peer = 0; peer < ranks; ++peer) {
    sends.push_back({peer, buf.data(), 8});
    if (!(me == 3 && peer == 2)) recvs.push_back({peer, buf.data() + 32, me == 2 && peer == 0 ? 4 : 8});
  }
  test::check_error([&] { comm.exchange(sends, recvs); }, moecomm::status::invalid_usage,
                    {"pair (0, 2): rank 0 sends 8 bytes to rank 2, but rank 2 expects 4 bytes from rank 0"});
  CHECK(comm.usable());
  comm.barrier();
}

TEST_CASE("mpi a bad argument on one rank fails that rank and aborts the call on the others") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  int const me = comm.rank();
  std::int64_t v = 0;
  auto const [code, message] = thrown_error([&] { comm.broadcast(&v, sizeof(v), me == 2 ? 9 : 0); });
  if (me == 2) {
    CHECK(code == moecomm::status::invalid_argument);
    CHECK_MESSAGE(message == "moecomm::mpi_communicator::broadcast: root = 9 is not a rank of this group of 4", message);
  } else {
    CHECK(code == moecomm::status::aborted);
    CHECK_MESSAGE(message.find("world rank 2 passed an invalid argument to broadcast") != std::string::npos, message);
  }
  // Exchange: rank 0 names a peer outside the group, then rank 1 posts two receives from one peer.
  char byte = 0;
  auto const [code2, message2] = thrown_error([&] { comm.exchange({{me == 0 ? 4 : me, &byte, 1}}, {{me, &byte, 1}}); });
  CHECK(code2 == (me == 0 ? moecomm::status::invalid_argument : moecomm::status::aborted));
  CHECK_MESSAGE(message2.find(me == 0 ? "mpi_communicator::exchange: sends[0].peer = 4 is not a rank of this group of 4"
                                      : "world rank 0 passed an invalid argument to exchange") != std::string::npos,
                message2);
  std::vector<moecomm::recv_block> twice{{me, &byte, 1}};
  if (me == 1) twice.push_back({me, &byte, 1});
  auto const [code3, message3] = thrown_error([&] { comm.exchange({{me, &byte, 1}}, twice); });
  CHECK(code3 == (me == 1 ? moecomm::status::invalid_argument : moecomm::status::aborted));
  CHECK_MESSAGE(message3.find(me == 1 ? "recvs[0] and recvs[1] both name peer 1; post one block per peer"
                              : "world rank 1 passed an invalid argument to exchange") != std::string::npos,
                message3);
  // A null buffer with bytes is an invalid argument too; here every rank passes one, so every rank throws it.
  test::check_error([&] { comm.allgather(nullptr, &byte, 1); }, moecomm::status::invalid_argument,
                    {"mpi_communicator::allgather: send is null"});
  // Options and handles are checked when the communicator is made.
  test::check_error([] { mpi_communicator bad(test_comm, mpi_options{milliseconds(0)}); }, moecomm::status::invalid_argument,
                    {"options.timeout = 0 ms must be positive"});
  test::check_error([] { mpi_communicator bad(test_comm, mpi_options{milliseconds(100), true, 0}); },
                    moecomm::status::invalid_argument, {"options.max_message_bytes = 0"});
  test::check_error([] { mpi_communicator bad(MPI_COMM_NULL); }, moecomm::status::invalid_argument, {"MPI_COMM_NULL"});
  CHECK(comm.usable());
  comm.barrier();
}

TEST_CASE("mpi negative and overflowing sizes and reduce to root -1 are invalid_argument naming the argument") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  std::int64_t const max = std::numeric_limits<std::int64_t>::max();
  std::vector<double> v(8, 1.0);
  // On every rank: every rank throws its own invalid_argument.
  test::check_error([&] { comm.allgather(v.data(), v.data() + 4, max / 4 + 1); }, moecomm::status::invalid_argument,
                    {"mpi_communicator::allgather: bytes = 2305843009213693952 is too large: bytes x 4 ranks overflows a 64-bit byte count"});
  test::check_error([&] { comm.allreduce(v.data(), v.data(), max / 8 + 1, moecomm::reduce_op::sum); },
                    moecomm::status::invalid_argument, {"count = 1152921504606846976 is too large: count x 8 bytes per element"});
  test::check_error([&] { comm.broadcast(v.data(), -3, 0); }, moecomm::status::invalid_argument, {"broadcast: bytes = -3 must be >= 0"});
  // A reduce to root -1 used to run as an allreduce.
  test::check_error([&] { comm.reduce(v.data(), v.data(), 2, moecomm::reduce_op::sum, -1); }, moecomm::status::invalid_argument,
                    {"mpi_communicator::reduce: root = -1 is not a rank of this group of 4"});
  CHECK(v == std::vector<double>(8, 1.0));
  // A negative size on one rank is its invalid_argument (not "ranks disagree"); the others are aborted.
  auto const [code, message] = thrown_error([&] { comm.allgather(v.data(), v.data() + 4, comm.rank() == 1 ? -8 : 8); });
  CHECK(code == (comm.rank() == 1 ? moecomm::status::invalid_argument : moecomm::status::aborted));
  CHECK_MESSAGE(message.find(comm.rank() == 1 ? "allgather: bytes = -8 must be >= 0" : "world rank 1 passed an invalid argument to allgather") !=
                    std::string::npos,
                message);
  CHECK(comm.usable());
  comm.barrier();
}

TEST_CASE("mpi ordered_allreduce equals the sequential sum in ascending rank, bit for bit, checked and unchecked") {
  for (bool checked : {true, false}) {
    CAPTURE(checked);
    mpi_communicator comm(test_comm, options(checked, 7));  // 7-byte messages: the gathers are chunked too
    MOECOMM_REQUIRE_FOUR_RANKS(comm);
    moecomm::host_backend const be;
    moecomm::workspace<moecomm::host_backend> scratch;
    for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{2039}})
      for (std::int64_t chunk : {std::int64_t{3}, std::int64_t{64}, moecomm::ordered_allreduce_chunk}) {
        CAPTURE(count);
        CAPTURE(chunk);
        std::vector<float> f = test::rank_values<float>(comm.rank(), count);
        moecomm::ordered_allreduce(be, comm, moecomm::array_view<float>(f), scratch, chunk);
        test::check_bitwise(f, test::sequential_sum<float>(ranks, count), 1, "ordered_allreduce<float> over MPI");
        std::vector<double> d = test::rank_values<double>(comm.rank(), count);
        moecomm::ordered_allreduce(be, comm, moecomm::array_view<double>(d), scratch, chunk);
        test::check_bitwise(d, test::sequential_sum<double>(ranks, count), 1, "ordered_allreduce<double> over MPI");
      }
    // A bad argument on rank 2: it throws invalid_argument, the others aborted; nothing is written.
    std::vector<float> f(4, 2.5f);
    auto const [code, message] = thrown_error([&] {
      moecomm::ordered_allreduce(be, comm, moecomm::array_view<float>(comm.rank() == 2 ? nullptr : f.data(), 4), scratch, 2);
    });
    CHECK(code == (comm.rank() == 2 ? moecomm::status::invalid_argument : moecomm::status::aborted));
    CHECK_MESSAGE(message.find(comm.rank() == 2 ? "ordered_allreduce: data.data is null but its size is 4"
                                                : "ordered_allreduce: rank 2 passed an invalid argument") != std::string::npos,
                  message);
    CHECK(f == std::vector<float>(4, 2.5f));
  }
}

TEST_CASE("mpi hierarchical_2d: ranks with different byte matrices throw invalid_usage before the sub-group phases (checked mode)") {
  mpi_communicator comm(test_comm, options());
  MOECOMM_REQUIRE_FOUR_RANKS(comm);
  moecomm::host_backend const be;
  moecomm::exchange_groups<mpi_communicator> groups(comm, moecomm::topology(ranks, 2));
  std::vector<std::int64_t> cells(16, 4);
  if (comm.rank() == 2) cells[5] = 8;  // rank 2 believes rank 1 sends itself 8 bytes
  std::vector<char> send(64, 'x'), recv(64, '#');
  moecomm::alltoall_stats stats;
  test::check_error([&] { moecomm::alltoallv(be, groups, moecomm::byte_matrix(4, cells), moecomm::array_view<char const>(send), moecomm::array_view<char>(recv), stats, moecomm::hierarchical_2d{}); },
                    moecomm::status::invalid_usage,
                    {"moecomm::hierarchical_2d: ranks disagree before the sub-group phases: rank 0 has (nodes 2, ranks per node 2",
                     "but rank 2 has"});
  CHECK(recv == std::vector<char>(64, '#'));
  // The same matrix everywhere: the exchange runs, and everything is still usable.
  cells[5] = 4;
  moecomm::alltoallv(be, groups, moecomm::byte_matrix(4, cells), moecomm::array_view<char const>(send), moecomm::array_view<char>(recv), stats, moecomm::hierarchical_2d{});
  CHECK(std::count(recv.begin(), recv.begin() + 16, 'x') == 16);
  CHECK(comm.usable());
  comm.barrier();
}

// Must stay the last test case of this file (doctest runs them in file order): it leaves a collective
// pending forever on its own MPI_Comm.
TEST_CASE("timeout - a rank that skips a collective makes the others time out, and the communicator is then unusable") {
  MPI_Comm own = MPI_COMM_NULL;  // never freed (neither is the second one): a collective stays pending on it
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &own) == MPI_SUCCESS);
  for (bool checked : {true, false}) {
    CAPTURE(checked);
    if (!checked) REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &own) == MPI_SUCCESS);
    mpi_communicator comm(own, mpi_options{milliseconds(300), checked});
    MOECOMM_REQUIRE_FOUR_RANKS(comm);
    comm.barrier();  // everyone is here: the timeout below measures only the missing rank
    if (comm.rank() == 1) continue;  // skips the collective
    check_allreduce_times_out(comm, "moecomm::mpi_communicator", world_rank(), 300, milliseconds(5000));
  }
}

}  // namespace test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_dup(MPI_COMM_WORLD, &test::test_comm);
  int const worst = test::run_doctest_over_mpi(argc, argv);
  MPI_Finalize();  // test_comm is not freed: after a failed test case it may still have pending operations
  return worst;
}
