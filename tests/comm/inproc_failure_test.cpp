// SPDX-License-Identifier: Apache-2.0
// Regression tests of the in-process communicator's failure contract, each with the input that used
// to crash, hang or leak a foreign exception: null buffers and negative or overflowing sizes on one
// rank or on all, bad roots, a timeout <= 0, a non-standard throw in `run`, which objects are usable
// after which failure (any exception that leaves `run` kills the world), and ranks blocked in
// different groups (found at once, not by the timeout).

#include "inproc_support.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/collectives/alltoall.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>

namespace test {

using moecomm::inproc_communicator;
using moecomm::inproc_world;
using moecomm::status;
using std::chrono::milliseconds;

constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();

// What the other ranks' `aborted` says when world rank `r` passed a bad argument to `op`.
std::string aborted_by(char const* op, int r) {
  return "world rank " + std::to_string(r) + " passed an invalid argument to " + op;
}

// One call with a bad argument on rank `bad_rank` only: that rank throws `invalid_argument` with
// `message`, every other rank `aborted` naming it; no rank's buffers change, and the world stays usable.
struct bad_call {
  char const* name;
  char const* op;
  char const* message;
  void (*call)(inproc_communicator& comm, bool bad, std::vector<std::int64_t>& buffer);
};

// Each peer's buffer is 4 x 8 bytes (poisoned with -7), big enough for every call with 4 ranks.
bad_call const bad_calls[] = {
    {"exchange, null send", "exchange", "moecomm::inproc_communicator::exchange: sends[0].data is null but sends[0].bytes = 8",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) {
       int const next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
       c.exchange({{next, bad ? nullptr : &b[0], 8}}, {{prev, &b[1], 8}});
     }},
    {"allgather, null send", "allgather", "moecomm::inproc_communicator::allgather: send is null but its size is 8",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) { c.allgather(bad ? nullptr : &b[3], b.data(), 8); }},
    {"allgather, null recv", "allgather", "moecomm::inproc_communicator::allgather: recv is null but its size is 8",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) { c.allgather(&b[3], bad ? nullptr : b.data(), 8); }},
    {"broadcast, null data on the root", "broadcast", "moecomm::inproc_communicator::broadcast: data is null but its size is 8",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) { c.broadcast(bad ? nullptr : b.data(), 8, 1); }},
    {"broadcast, root out of range", "broadcast", "moecomm::inproc_communicator::broadcast: root = 4 is not a rank of this group of 4",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) { c.broadcast(b.data(), 8, bad ? 4 : 0); }},
    {"allreduce, null send", "allreduce", "moecomm::inproc_communicator::allreduce: send is null but its size is 2",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) {
       c.allreduce<std::int64_t>(bad ? nullptr : b.data(), b.data() + 2, 2, moecomm::reduce_op::sum);
     }},
    {"reduce, null send off the root", "reduce", "moecomm::inproc_communicator::reduce: send is null but its size is 2",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) {
       c.reduce<std::int64_t>(bad ? nullptr : b.data(), b.data() + 2, 2, moecomm::reduce_op::sum, 0);
     }},
    {"reduce, root -1", "reduce", "moecomm::inproc_communicator::reduce: root = -1 is not a rank of this group of 4",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) {
       c.reduce<std::int64_t>(b.data(), b.data() + 2, 2, moecomm::reduce_op::sum, bad ? -1 : 0);
     }},
    {"allgather, negative bytes on one rank (was: ranks disagree)", "allgather",
     "moecomm::inproc_communicator::allgather: bytes = -8 must be >= 0",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) { c.allgather(&b[3], b.data(), bad ? -8 : 8); }},
    {"allreduce, negative count (was: std::length_error)", "allreduce",
     "moecomm::inproc_communicator::allreduce: count = -1 must be >= 0",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) {
       c.allreduce<std::int64_t>(b.data(), b.data() + 2, bad ? -1 : 2, moecomm::reduce_op::sum);
     }},
    {"allgather, bytes whose gathered size overflows", "allgather",
     "moecomm::inproc_communicator::allgather: bytes = 2305843009213693952 is too large: bytes x 4 ranks overflows a 64-bit byte count",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) { c.allgather(&b[3], b.data(), bad ? int64_max / 4 + 1 : 8); }},
    {"allreduce, count whose byte size overflows", "allreduce",
     "moecomm::inproc_communicator::allreduce: count = 1152921504606846976 is too large: count x 8 bytes per element overflows a 64-bit byte count",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>& b) {
       c.allreduce<std::int64_t>(b.data(), b.data() + 2, bad ? int64_max / 8 + 1 : 2, moecomm::reduce_op::sum);
     }},
    {"split, negative color", "split", "moecomm::inproc_communicator::split: color = -1 must be >= 0",
     [](inproc_communicator& c, bool bad, std::vector<std::int64_t>&) { static_cast<void>(c.split(bad ? -1 : 0, 0)); }},
};

TEST_CASE("a bad argument on one rank: that rank throws invalid_argument, the others aborted, nothing is read or written") {
  inproc_world const world(4, milliseconds(20000));
  for (bad_call const& bc : bad_calls) {
    CAPTURE(bc.name);
    for (int bad_rank : {0, 1, 3}) {
      CAPTURE(bad_rank);
      std::vector<std::vector<std::int64_t>> buffers(4, std::vector<std::int64_t>(4, -7));
      auto const start = std::chrono::steady_clock::now();
      auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
        bc.call(comm, comm.rank() == bad_rank, buffers[static_cast<std::size_t>(comm.rank())]);
      });
      CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));  // long before the timeout
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        auto const& o = outcomes[static_cast<std::size_t>(r)];
        if (r == bad_rank) {
          CHECK(o.code == status::invalid_argument);
          CHECK(o.message == bc.message);
        } else {
          CHECK(o.code == status::aborted);
          CHECK_MESSAGE(o.message.find(aborted_by(bc.op, bad_rank)) != std::string::npos, o.message);
        }
        CHECK(buffers[static_cast<std::size_t>(r)] == std::vector<std::int64_t>(4, -7));
      }
    }
  }
  // After invalid_argument the world is still usable.
  auto const outcomes = on_every_rank(world, [](inproc_communicator comm) {
    std::int64_t v = comm.rank();
    comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
    REQUIRE(v == 6);
  });
  for (auto const& o : outcomes) CHECK(o.code == status::success);
}

TEST_CASE("negative and overflowing sizes on every rank are invalid_argument on every rank, naming the argument") {
  std::int64_t word = 1;
  std::vector<char> big(16);
  struct sized_call {
    char const* fragment;
    std::function<void(inproc_communicator&)> call;
  };
  std::vector<sized_call> const calls{
      {"exchange: sends[0].bytes = -1 must be >= 0", [&](inproc_communicator& c) { c.exchange({{c.rank(), &word, -1}}, {{c.rank(), &word, -1}}); }},
      {"allgather: bytes = -3 must be >= 0", [&](inproc_communicator& c) { c.allgather(big.data(), big.data(), -3); }},
      {"broadcast: bytes = -2 must be >= 0", [&](inproc_communicator& c) { c.broadcast(big.data(), -2, 0); }},
      {"allreduce: count = -5 must be >= 0", [&](inproc_communicator& c) { c.allreduce(&word, &word, -5, moecomm::reduce_op::max); }},
      {"reduce: count = -5 must be >= 0", [&](inproc_communicator& c) { c.reduce(&word, &word, -5, moecomm::reduce_op::min, 1); }},
      {"allreduce: count = 4611686018427387904 is too large: count x 4 bytes per element overflows",
       [&](inproc_communicator& c) {
         float f = 0;
         c.allreduce(&f, &f, int64_max / 2 + 1, moecomm::reduce_op::sum);
       }},
      {"allgather: bytes = 4611686018427387904 is too large: bytes x 2 ranks overflows",
       [&](inproc_communicator& c) { c.allgather(big.data(), big.data(), int64_max / 2 + 1); }},
  };
  inproc_world const world(2, milliseconds(20000));
  for (auto const& sc : calls) {
    CAPTURE(sc.fragment);
    for (auto const& o : on_every_rank(world, [&](inproc_communicator comm) { sc.call(comm); })) {
      CHECK(o.code == status::invalid_argument);
      CHECK_MESSAGE(o.message.find(sc.fragment) != std::string::npos, o.message);
    }
  }
}

TEST_CASE("inproc_world rejects a timeout <= 0, naming it") {
  check_error([] { inproc_world w(2, milliseconds(0)); }, status::invalid_argument,
              {"moecomm::inproc_world: timeout = 0 ms must be positive"});
  check_error([] { inproc_world w(2, milliseconds(-5)); }, status::invalid_argument, {"timeout = -5 ms must be positive"});
}

TEST_CASE("a rank that throws a non-standard exception in run: every rank ends with an error, run names the rank") {
  inproc_world const world(4, milliseconds(20000));
  std::atomic<int> aborted{0};
  auto const start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(world.run([&](inproc_communicator comm) {
    if (comm.rank() == 2) throw 42;
    try {
      comm.barrier();
    } catch (moecomm::error const& e) {
      if (e.code() == status::aborted &&
          std::string(e.what()).find("world rank 2 threw an exception not derived from std::exception") != std::string::npos)
        ++aborted;
      throw;
    }
  }),
                       "moecomm::inproc_world::run: world rank 2 threw an exception not derived from std::exception",
                       moecomm::error);
  CHECK(aborted == 3);
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));
}

TEST_CASE("run rethrows the cause, not the aborted errors it caused") {
  for (int attempt = 0; attempt < 20; ++attempt) {
    inproc_world const fresh(4, milliseconds(20000));
    check_error([&] {
      fresh.run([](inproc_communicator comm) {
        std::int64_t v = 0;
        comm.broadcast(&v, sizeof(v), comm.rank() == 1 ? 7 : 0);
      });
    }, status::invalid_argument, {"broadcast: root = 7 is not a rank of this group of 4"});
  }
}

TEST_CASE("after a timeout the world is dead: every later call on any of its communicators throws aborted at once") {
  inproc_world const world(3, milliseconds(2000));
  // Split while healthy, so that sub-groups exist before the failure.
  std::vector<std::vector<inproc_communicator>> halves(3);
  on_every_rank(world, [&](inproc_communicator comm) {
    halves[static_cast<std::size_t>(comm.rank())].push_back(comm.split(comm.rank() % 2, 0));
  });
  auto const first = on_every_rank(world, [](inproc_communicator comm) {
    if (comm.rank() != 1) comm.barrier();  // rank 1 skips it: the others time out
  });
  CHECK((first[0].code == status::timeout || first[2].code == status::timeout));
  auto const start = std::chrono::steady_clock::now();
  auto const later = on_every_rank(world, [&](inproc_communicator comm) {
    std::int64_t v = 1;
    check_error([&] { comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum); }, status::aborted, {"timed out after 2000 ms"});
    check_error([&] { comm.barrier(); }, status::aborted, {"timed out"});
    check_error([&] { static_cast<void>(comm.split(0, 0)); }, status::aborted, {"timed out"});
    inproc_communicator& half = halves[static_cast<std::size_t>(comm.rank())].front();
    check_error([&] { half.allgather(&v, &v, 0); }, status::aborted, {"timed out"});
  });
  for (auto const& o : later) CHECK(o.code == status::success);
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(1500));  // no call waited for the timeout
}

TEST_CASE("after a rank's exception leaves run the world is dead, whatever it was; a new world works") {
  struct leaving {
    char const* name;
    void (*body)(inproc_communicator& comm);
    char const* reason;  // what the later calls' `aborted` names
  };
  leaving const endings[] = {
      {"a std exception", [](inproc_communicator& c) { if (c.rank() == 1) throw std::runtime_error("expert failed"); c.barrier(); },
       "world rank 1 failed: expert failed"},
      {"throw 42", [](inproc_communicator& c) { if (c.rank() == 1) throw 42; c.barrier(); },
       "world rank 1 threw an exception not derived from std::exception"},
      // invalid_argument on every rank, which is reusable when the ranks catch it, not when it leaves run.
      {"invalid_argument on every rank", [](inproc_communicator& c) { c.allgather(nullptr, nullptr, 8); },
       "failed: moecomm::inproc_communicator::allgather: send is null but its size is 8"},
  };
  for (leaving const& l : endings) {
    CAPTURE(l.name);
    inproc_world const world(3, milliseconds(20000));
    CHECK_THROWS(world.run([&](inproc_communicator comm) { l.body(comm); }));
    auto const start = std::chrono::steady_clock::now();
    auto const later = on_every_rank(world, [](inproc_communicator comm) {
      std::int64_t v = 1;
      comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
    });
    for (auto const& o : later) {
      CHECK(o.code == status::aborted);
      CHECK_MESSAGE(o.message.find(l.reason) != std::string::npos, o.message);
    }
    CHECK(std::chrono::steady_clock::now() - start < milliseconds(1500));  // no call waited for the timeout
    inproc_world const fresh(3, milliseconds(20000));
    fresh.run([](inproc_communicator comm) {
      std::int64_t v = 1;
      comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
      REQUIRE(v == 3);
    });
  }
}

// Found by the fault test under ASan (a heap-use-after-free): a rank that had read its peers'
// buffers left the collective's second wait when another group's rank aborted the world, and freed
// its send buffer while its peer was still reading it. Here world rank 0 sends 256 MiB (freed with
// munmap, so a late read faults even without ASan) to rank 1 and gets 8 bytes back, and rank 2,
// outside their group, aborts the world while rank 1 copies. The exchange must complete for both.
TEST_CASE("an abort while a peer still reads this rank's buffers does not let the rank free them") {
  std::int64_t const big = std::int64_t{256} << 20;
  for (int attempt = 0; attempt < 4; ++attempt) {
    CAPTURE(attempt);
    inproc_world const world(3, milliseconds(20000));
    std::vector<std::optional<inproc_communicator>> pair(3);
    on_every_rank(world, [&](inproc_communicator comm) {
      pair[static_cast<std::size_t>(comm.rank())] = comm.split(comm.rank() < 2 ? 0 : 1, comm.rank());
    });
    std::atomic<int> calling{0};
    std::vector<char> received(static_cast<std::size_t>(big), 0);
    auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
      if (comm.rank() == 2) {
        while (calling.load() < 2) std::this_thread::yield();
        std::this_thread::sleep_for(milliseconds(2 + attempt * 3));  // rank 1 is copying by now
        world.abort("world rank 2 stops the world");
        return;
      }
      inproc_communicator& c = *pair[static_cast<std::size_t>(comm.rank())];
      std::int64_t word = 7;
      if (comm.rank() == 0) {
        std::vector<char> send(static_cast<std::size_t>(big), 'x');
        ++calling;
        c.exchange({{1, send.data(), big}}, {{1, &word, 8}});
      } else {
        ++calling;
        c.exchange({{0, &word, 8}}, {{0, received.data(), big}});
      }
    });  // rank 0's send buffer is freed here, once it has left the exchange
    for (int r = 0; r < 2; ++r)
      CHECK_MESSAGE((outcomes[static_cast<std::size_t>(r)].code == status::success ||
                     outcomes[static_cast<std::size_t>(r)].code == status::aborted),
                    outcomes[static_cast<std::size_t>(r)].message);
    CHECK(outcomes[0].code == outcomes[1].code);  // both completed the exchange, or neither began it
    if (outcomes[1].code == status::success) CHECK(std::count(received.begin(), received.end(), 'x') == big);
  }
}

TEST_CASE("after invalid_argument or invalid_usage the communicators are reusable: 300 random bad/good alternations, bit-identical results") {
  constexpr int ranks = 3;
  inproc_world const world(ranks, milliseconds(20000));
  // Rank r's doubles: sums depend on the order, so a result computed from the wrong data or order shows.
  auto const values = [](int r) {
    std::vector<double> v(9);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = (r % 2 == 0 ? 1e16 : -1e16) * (r + 1) + 0.3 * (static_cast<double>(i) + r);
    return v;
  };
  std::vector<std::vector<double>> reference(ranks);
  std::vector<std::vector<std::int64_t>> gathered_reference(ranks);
  on_every_rank(world, [&](inproc_communicator comm) {
    auto v = values(comm.rank());
    comm.allreduce(v.data(), v.data(), 9, moecomm::reduce_op::sum);
    reference[static_cast<std::size_t>(comm.rank())] = v;
    std::int64_t const mine = 100 + comm.rank();
    gathered_reference[static_cast<std::size_t>(comm.rank())].resize(ranks);
    comm.allgather(&mine, gathered_reference[static_cast<std::size_t>(comm.rank())].data(), 8);
  });
  std::mt19937 rng(20261123);
  int bad_seen = 0, usage_seen = 0;
  for (int round = 0; round < 300; ++round) {
    int const kind = static_cast<int>(rng() % 4), culprit = static_cast<int>(rng() % ranks);
    auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
      bool const me = comm.rank() == culprit;
      std::vector<double> v = values(comm.rank());
      std::int64_t word = 5;
      switch (kind) {
        case 0: comm.allreduce(me ? nullptr : v.data(), v.data(), 9, moecomm::reduce_op::sum); break;  // invalid_argument
        case 1: comm.allreduce(v.data(), v.data(), me ? 8 : 9, moecomm::reduce_op::sum); break;        // invalid_usage
        case 2: if (me) comm.barrier(); else comm.broadcast(&word, 8, 0); break;                       // invalid_usage
        default: comm.reduce(v.data(), v.data(), 9, moecomm::reduce_op::sum, me ? ranks : 0); break;   // invalid_argument
      }
    });
    for (int r = 0; r < ranks; ++r) {
      status const want = kind == 1 || kind == 2 ? status::invalid_usage : r == culprit ? status::invalid_argument : status::aborted;
      CHECK(outcomes[static_cast<std::size_t>(r)].code == want);
    }
    (kind == 1 || kind == 2 ? usage_seen : bad_seen) += 1;
    // The good call right after gives the reference bits.
    auto const good = on_every_rank(world, [&](inproc_communicator comm) {
      auto v = values(comm.rank());
      comm.allreduce(v.data(), v.data(), 9, moecomm::reduce_op::sum);
      check_bitwise(v, reference[static_cast<std::size_t>(comm.rank())], 9, "allreduce after a failed call");
      std::vector<std::int64_t> all(ranks, -1);
      std::int64_t const mine = 100 + comm.rank();
      comm.allgather(&mine, all.data(), 8);
      REQUIRE(all == gathered_reference[static_cast<std::size_t>(comm.rank())]);
    });
    for (auto const& o : good) REQUIRE_MESSAGE(o.code == status::success, o.message);
  }
  CHECK(bad_seen > 50);
  CHECK(usage_seen > 50);
}

TEST_CASE("ranks blocked in different groups throw invalid_usage at once, naming the operations, groups and world ranks") {
  // 2 nodes x 2: world rank 1 skips its intra-node allgather and goes on to the world barrier; world
  // rank 0 waits for it in the allgather of group {0,1}, ranks 2 and 3 finish theirs and wait in the barrier.
  inproc_world const world(4, milliseconds(20000));
  moecomm::topology const topo(4, 2);
  std::vector<std::optional<inproc_communicator>> intra(4);
  on_every_rank(world, [&](inproc_communicator comm) {
    intra[static_cast<std::size_t>(comm.rank())] = comm.split(topo.node_of(comm.rank()), comm.rank());
  });
  auto const start = std::chrono::steady_clock::now();
  auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
    std::int64_t mine = comm.rank(), all[2] = {};
    if (comm.rank() != 1) intra[static_cast<std::size_t>(comm.rank())]->allgather(&mine, all, 8);
    comm.barrier();
  });
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));  // not the 20 s timeout
  std::string const both = "no rank can go on: world ranks 1-3 wait in barrier on group 1 {0,1,2,3}; "
                           "world rank 0 waits in allgather on group 2 {0,1}";
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(outcomes[static_cast<std::size_t>(r)].code == status::invalid_usage);
    CHECK_MESSAGE(outcomes[static_cast<std::size_t>(r)].message.find(both) != std::string::npos,
                  outcomes[static_cast<std::size_t>(r)].message);
  }
  // Every blocked rank withdrew its arrival: the world and the sub-groups are usable.
  auto const after = on_every_rank(world, [&](inproc_communicator comm) {
    std::int64_t v = comm.rank();
    intra[static_cast<std::size_t>(comm.rank())]->allreduce(&v, &v, 1, moecomm::reduce_op::sum);
    REQUIRE(v == (topo.node_of(comm.rank()) == 0 ? 1 : 5));
    comm.barrier();
  });
  for (auto const& o : after) CHECK_MESSAGE(o.code == status::success, o.message);
}

TEST_CASE("a rank that returns from run while the others wait for it: they throw invalid_usage at once, naming it") {
  inproc_world const world(4, milliseconds(20000));
  auto const start = std::chrono::steady_clock::now();
  check_error([&] {
    world.run([](inproc_communicator comm) {
      if (comm.rank() == 3) return;  // e.g. a backward skipped on one rank
      std::int64_t v = 1;
      comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
    });
  }, status::invalid_usage, {"no rank can go on: world ranks 0-2 wait in allreduce on group 1 {0,1,2,3}; world rank 3 has returned from run"});
  CHECK(std::chrono::steady_clock::now() - start < milliseconds(5000));
}

TEST_CASE("a world reused after run: ranks that returned from the last run are not taken as gone") {
  inproc_world const world(3, milliseconds(20000));
  for (int again = 0; again < 3; ++again) {
    world.run([](inproc_communicator comm) {
      // The last rank starts late: the others wait for it, and must not be told it has returned.
      if (comm.rank() == 2) std::this_thread::sleep_for(milliseconds(50));
      comm.barrier();
    });
    auto const outcomes = on_every_rank(world, [](inproc_communicator comm) {
      if (comm.rank() == 0) std::this_thread::sleep_for(milliseconds(50));
      comm.barrier();
    });
    for (auto const& o : outcomes) CHECK_MESSAGE(o.code == status::success, o.message);
  }
}

TEST_CASE("messages from a sub-group name it by its id and world ranks") {
  inproc_world const world(4, milliseconds(20000));
  auto const outcomes = on_every_rank(world, [](inproc_communicator comm) {
    inproc_communicator odd_even = comm.split(comm.rank() % 2, comm.rank());
    std::int64_t v = 1;
    if (comm.rank() == 3) odd_even.barrier();
    else odd_even.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  });
  CHECK(outcomes[0].code == status::success);
  CHECK(outcomes[2].code == status::success);
  for (int r : {1, 3}) {
    CHECK(outcomes[static_cast<std::size_t>(r)].code == status::invalid_usage);
    CHECK_MESSAGE(outcomes[static_cast<std::size_t>(r)].message.find(
                      "ranks disagree: world rank 1 called allreduce(size 1, 16), but world rank 3 called barrier(size 0, 0) in group 3 {1,3}") !=
                      std::string::npos,
                  outcomes[static_cast<std::size_t>(r)].message);
  }
}

TEST_CASE("hierarchical_2d: ranks that pass different byte matrices all throw invalid_usage before the sub-group phases") {
  moecomm::topology const topo(4, 2);
  inproc_world const world(4, milliseconds(20000));
  auto const outcomes = on_every_rank(world, [&](inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::exchange_groups<inproc_communicator> groups(comm, topo);
    std::vector<std::int64_t> cells(16, 4);
    if (comm.rank() == 2) cells[5] = 8;  // rank 2 believes rank 1 sends 8 bytes to rank 1
    moecomm::byte_matrix const m(4, cells);
    std::vector<char> send(64, 'x'), recv(64, '#');
    moecomm::alltoall_stats stats;
    moecomm::alltoallv(be, groups, m, moecomm::array_view<char const>(send), moecomm::array_view<char>(recv), stats, moecomm::hierarchical_2d{});
  });
  for (auto const& o : outcomes) {
    CHECK(o.code == status::invalid_usage);
    CHECK_MESSAGE(o.message.find("moecomm::hierarchical_2d: ranks disagree before the sub-group phases: rank 0 has (nodes 2, "
                                 "ranks per node 2, hash of node map and byte matrix ") != std::string::npos,
                  o.message);
    CHECK_MESSAGE(o.message.find("but rank 2 has (nodes 2, ranks per node 2") != std::string::npos, o.message);
  }
}

}  // namespace test
