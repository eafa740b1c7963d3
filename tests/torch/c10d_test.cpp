// SPDX-License-Identifier: Apache-2.0
// The c10d communicator over Gloo, as 4 processes this program starts itself
// (`moecomm_torch_tests --processes 4 --test-case=c10d*`, moecomm/torch/launch.hpp), each with a
// ProcessGroupGloo over rank 0's TCPStore: every collective's result, splits, the failure contract
// (the same messages as MPI's), ordered_allreduce bitwise, and the expert-parallel layer, FasterMoE
// and the deduplicated exchange equal to the single-process oracle, as over MPI
// (tests/patterns/mpi_layer_test.cpp). "c10d timeout" leaves a collective pending: ctest runs it in
// a world of its own.

#include "torch_doctest.hpp"

#include "../comm/communicator_checks.hpp"
#include "../comm/ordered_values.hpp"
#include "../patterns/layer_cases.hpp"
#include "../patterns/shadow_cases.hpp"
#include "../support/test_support.hpp"
#include "torch_world.hpp"

#include <moecomm/comm/c10d.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>

#include <chrono>
#include <thread>
#include <cstdint>
#include <string>
#include <vector>

namespace test {

using moecomm::c10d_communicator;
using std::chrono::milliseconds;

TEST_CASE("c10d collectives compute what they promise, checked and unchecked") {
  for (bool checked : {true, false}) {
    CAPTURE(checked);
    c10d_communicator comm = gloo_world(checked ? "checked" : "unchecked", milliseconds(30000), checked);
    int const me = comm.rank(), n = comm.size();
    REQUIRE(n == 4);
    std::int64_t const mine[2] = {me, 100 + me};
    std::vector<std::int64_t> all(2 * n, -1);
    comm.allgather(mine, all.data(), sizeof mine);
    for (int r = 0; r < n; ++r) CHECK((all[2 * r] == r && all[2 * r + 1] == 100 + r));
    std::vector<std::int64_t> v{me, 2 * me, 7};
    comm.allreduce(v.data(), v.data(), 3, moecomm::reduce_op::sum);
    CHECK(v == std::vector<std::int64_t>{6, 12, 28});
    std::vector<std::int32_t> w{10 - me, me}, lowest(2, 99);
    comm.allreduce(w.data(), lowest.data(), 2, moecomm::reduce_op::min);
    CHECK(lowest == std::vector<std::int32_t>{7, 0});
    double x = me + 0.5, biggest = 0;
    comm.allreduce(&x, &biggest, 1, moecomm::reduce_op::max);
    CHECK(biggest == 3.5);
    std::vector<float> r{float(me), 0.5f};  // reduce to rank 1: nothing written elsewhere
    comm.reduce(r.data(), me == 1 ? r.data() : nullptr, 2, moecomm::reduce_op::sum, 1);
    CHECK(r == (me == 1 ? std::vector<float>{6.0f, 2.0f} : std::vector<float>{float(me), 0.5f}));
    std::vector<char> b(5, me == 2 ? 'x' : '-');
    comm.broadcast(b.data(), 5, 2);
    CHECK(std::string(b.begin(), b.end()) == "xxxxx");
    // exchange: rank i sends i + j + 1 bytes of value 16 i + j to j, none from 0 to 3, itself included
    std::vector<std::vector<char>> out(n), in(n);
    std::vector<moecomm::send_block> sends;
    std::vector<moecomm::recv_block> recvs;
    for (int j = 0; j < n; ++j) {
      if (!(me == 0 && j == 3)) {
        out[j].assign(me + j + 1, static_cast<char>(16 * me + j));
        sends.push_back({j, out[j].data(), static_cast<std::int64_t>(out[j].size())});
      }
      if (!(j == 0 && me == 3)) {
        in[j].assign(j + me + 1, 0);
        recvs.push_back({j, in[j].data(), static_cast<std::int64_t>(in[j].size())});
      }
    }
    comm.exchange(sends, recvs);
    for (int j = 0; j < n; ++j)
      if (!(j == 0 && me == 3)) CHECK(in[j] == std::vector<char>(j + me + 1, static_cast<char>(16 * j + me)));
    comm.barrier();
  }
}

TEST_CASE("c10d split makes the groups of a 2 x 2 world, named by world rank in messages") {
  c10d_communicator comm = gloo_world("split", milliseconds(30000), true);
  int const me = comm.rank();
  c10d_communicator odd_even = comm.split(me % 2, -me);  // key -me: descending world rank
  REQUIRE(odd_even.size() == 2);
  CHECK(odd_even.rank() == 1 - me / 2);
  std::int64_t v = me;
  odd_even.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  CHECK(v == (me % 2 == 0 ? 2 : 4));
  auto const [code, message] = thrown_error([&] {
    std::int64_t u = 1;
    if (me == 3) odd_even.barrier();
    else odd_even.allreduce(&u, &u, 1, moecomm::reduce_op::sum);
  });
  if (me % 2 == 0) {
    CHECK(code == moecomm::status::success);
  } else {
    CHECK(code == moecomm::status::invalid_usage);
    CHECK_MESSAGE(message.find("moecomm::c10d_communicator::") == 0, message);
    CHECK_MESSAGE(message.find("world rank 3 called barrier(size 0, 0), but world rank 1 called allreduce(size 1, 16) "
                               "in group {3,1}") != std::string::npos,
                  message);
  }
  c10d_communicator again = odd_even.split(0, 0);  // a split of a split: a group of its own
  CHECK(again.size() == 2);
  comm.barrier();
}

TEST_CASE("c10d mismatched calls, sizes and exchange pairs throw on every rank, and the group stays usable") {
  c10d_communicator comm = gloo_world("mismatch", milliseconds(30000), true);
  int const me = comm.rank();
  auto const [code, message] = thrown_error([&] {
    std::int64_t v = 1;
    if (me == 2) comm.broadcast(&v, sizeof v, 0);
    else comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  });
  CHECK(code == moecomm::status::invalid_usage);
  CHECK_MESSAGE(message.find("ranks disagree: world rank 0 called allreduce(size 1, 16)") != std::string::npos, message);
  CHECK_MESSAGE(message.find("world rank 2 called broadcast(size 8, 0)") != std::string::npos, message);
  std::vector<char> buf(64);
  std::vector<moecomm::send_block> sends;
  std::vector<moecomm::recv_block> recvs;
  for (int peer = 0; peer < 4; ++peer) {
    sends.push_back({peer, buf.data(), me == 1 && peer == 3 ? 12 : 8});
    recvs.push_back({peer, buf.data() + 32, 8});
  }
  check_error([&] { comm.exchange(sends, recvs); }, moecomm::status::invalid_usage,
              {"moecomm::c10d_communicator::exchange: pair (1, 3): rank 1 sends 12 bytes to rank 3, but rank 3 expects 8 "
               "bytes from rank 1"});
  std::int64_t v = 0;
  auto const [bad_code, bad_message] = thrown_error([&] { comm.broadcast(&v, sizeof v, me == 2 ? 9 : 0); });
  if (me == 2) {
    CHECK(bad_code == moecomm::status::invalid_argument);
    CHECK(bad_message == "moecomm::c10d_communicator::broadcast: root = 9 is not a rank of this group of 4");
  } else {
    CHECK(bad_code == moecomm::status::aborted);
    CHECK_MESSAGE(bad_message.find("world rank 2 passed an invalid argument to broadcast") != std::string::npos, bad_message);
  }
  CHECK(comm.usable());
  v = 1;
  comm.allreduce(&v, &v, 1, moecomm::reduce_op::sum);
  CHECK(v == 4);
}

TEST_CASE("c10d ordered_allreduce equals the sequential sum in ascending rank, bit for bit") {
  c10d_communicator comm = gloo_world("ordered", milliseconds(30000), true);
  moecomm::host_backend const be;
  moecomm::workspace<moecomm::host_backend> scratch;
  auto values = rank_values<double>(comm.rank(), 37);
  moecomm::ordered_allreduce(be, comm, moecomm::array_view<double>(values), scratch, 8);  // in chunks of 8
  CHECK(values == sequential_sum<double>(4, 37));
  CHECK(values != sequential_sum<double>(4, 37, true));  // the order matters for these values
}

TEST_CASE("c10d the expert-parallel layer equals the oracle: flat, hierarchical_2d, pairwise, dedup_per_rank, dedup_per_node") {
  c10d_communicator comm = gloo_world("layer", milliseconds(30000), true);
  layer_case const c{4, 2, 8, 2, 16, {45, 0, 31, 60}, 1.2};
  auto const run = [&](auto const& algorithm) {
    using algorithm_t = std::decay_t<decltype(algorithm)>;
    CAPTURE(algorithm_t::name);
    for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
      CAPTURE(std::decay_t<decltype(capacity)>::name);
      auto const in = make_layer_inputs<float>(c, capacity, rule, drops, sum_order_of<algorithm_t>());
      check_layer_on_rank(comm, c, in, capacity, algorithm);
    });
  };
  run(moecomm::flat{});
  run(moecomm::hierarchical_2d{});
  run(moecomm::pairwise{1});
  run(moecomm::dedup_per_rank<moecomm::flat>{});
  run(moecomm::dedup_per_node{4});
}

TEST_CASE("c10d FasterMoE: shadowed == plain with the smart schedule's lane on a group of its own") {
  c10d_communicator comm = gloo_world("fastermoe", milliseconds(30000), true);
  shadow_case const c{4, 2, 8, 2, 16, {60, 45, 0, 70}, 1.2, true};
  auto const in = make_shadow_inputs<float>(c);
  auto const home = check_shadowed_equals_plain(comm, c, in,
                                                moecomm::fastermoe_shadowing<moecomm::point_to_point_path>{small_model(), moecomm::point_to_point_path{256}, {}},
                                                moecomm::dropless{}, moecomm::smart_schedule{2}, moecomm::pairwise{2});
  CHECK(!home.empty());
}

TEST_CASE("c10d timeout - a rank that skips a collective makes the others time out, and the group is then unusable") {
  c10d_communicator comm = gloo_world("timeout", milliseconds(300), true);
  comm.barrier();  // everyone is here: the timeout below measures only the missing rank
  if (comm.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(3));  // alive, but never calls: the others time out
    return;
  }
  check_allreduce_times_out(comm, "moecomm::c10d_communicator", comm.rank(), 300, milliseconds(3000));
}

}  // namespace test
