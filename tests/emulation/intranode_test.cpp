// SPDX-License-Identifier: Apache-2.0
// intranode_communicator: ranks on one GPU (threads, a stream each) whose rows move by
// device-to-device copies ordered by events. Every collective against values computed on the host,
// with self-identifying payloads and NaN-poisoned outputs, many calls in a row (one pair of events
// per rank is reused), sub-groups and a lane's split on another stream; bad arguments and ranks that
// disagree stop every rank before any copy, naming the argument or the ranks. On the emulation the
// stream order of every copy is checked; under nvcc the same cases run on a real GPU.

#include "emulated_ranks.hpp"

#include <moecomm/comm/intranode.cuh>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace test {
namespace {

using moecomm::intranode_communicator;
using one_gpu_rank = device_rank<intranode_communicator>;

// Element i of rank r's payload for peer p in round k: unique, so a row in the wrong place is seen.
float payload(int r, int p, std::int64_t i, int k) { return float(r * 1000000 + p * 10000 + k * 100) + float(i % 97); }

// Rank r sends (r + p + k) % 4 * 3 rows of 1 float to peer p in round k: 0 rows included.
std::int64_t rows_between(int r, int p, int k) { return (r + p + k) % 4 * 3; }

void check_violations() {
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

// One round of each collective on `comm`, checked against the host's values.
void one_round(one_gpu_rank& rank, intranode_communicator& comm, int k) {
  moecomm::cuda_backend const& be = rank.be;
  int const me = comm.rank(), n = comm.size();
  // exchange: a block per peer (itself included), sizes that differ per pair and round
  std::vector<moecomm::cuda_backend::buffer_type<float>> out, in;
  std::vector<moecomm::send_block> sends;
  std::vector<moecomm::recv_block> recvs;
  for (int p = 0; p < n; ++p) {
    std::vector<float> rows(static_cast<std::size_t>(rows_between(me, p, k)));
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = payload(me, p, static_cast<std::int64_t>(i), k);
    out.push_back(upload(be, rows));
    in.push_back(upload(be, poisoned<float>(rows_between(p, me, k))));
    sends.push_back({p, out.back().data(), rows_between(me, p, k) * std::int64_t(sizeof(float))});
    recvs.push_back({p, in.back().data(), rows_between(p, me, k) * std::int64_t(sizeof(float))});
  }
  comm.exchange(sends, recvs);
  for (int p = 0; p < n; ++p) {
    auto const got = download(be, in[static_cast<std::size_t>(p)].data(), rows_between(p, me, k));
    for (std::size_t i = 0; i < got.size(); ++i)
      REQUIRE_MESSAGE(got[i] == payload(p, me, static_cast<std::int64_t>(i), k), "exchange round ", k, ": rank ", me, " row ", i,
                      " from rank ", p);
  }
  // allgather, of an odd size
  std::int64_t const m = 5;
  std::vector<float> mine(m);
  for (std::int64_t i = 0; i < m; ++i) mine[static_cast<std::size_t>(i)] = payload(me, 0, i, k);
  auto const send = upload(be, mine);
  auto gathered = upload(be, poisoned<float>(m * n));
  comm.allgather(send.data(), gathered.data(), m * std::int64_t(sizeof(float)));
  auto const all = download(be, gathered.data(), m * n);
  for (int q = 0; q < n; ++q)
    for (std::int64_t i = 0; i < m; ++i)
      REQUIRE_MESSAGE(all[static_cast<std::size_t>(q * m + i)] == payload(q, 0, i, k), "allgather round ", k, ": slot ", q, " element ", i);
  // allreduce in place: float sums bit for bit in ascending rank order; int64 max
  std::vector<float> values(7);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 1.0f / float(3 + me + int(i)) + float(k);
  auto sums = upload(be, values);
  comm.allreduce(sums.data(), sums.data(), 7, moecomm::reduce_op::sum);
  auto const got_sums = download(be, sums.data(), 7);
  for (std::size_t i = 0; i < values.size(); ++i) {
    float want = 1.0f / float(3 + int(i)) + float(k);
    for (int q = 1; q < n; ++q) want += 1.0f / float(3 + q + int(i)) + float(k);
    REQUIRE_MESSAGE(std::memcmp(&got_sums[i], &want, sizeof want) == 0, "allreduce round ", k, " element ", i, ": ", got_sums[i],
                    ", ascending-rank sum ", want);
  }
  auto const big = upload(be, std::vector<std::int64_t>{me * std::int64_t{1} << 40, -me});
  auto biggest = upload(be, std::vector<std::int64_t>{0, 0});
  comm.allreduce(big.data(), biggest.data(), 2, moecomm::reduce_op::max);
  CHECK(download(be, biggest.data(), 2) == std::vector<std::int64_t>{(n - 1) * std::int64_t{1} << 40, 0});
  // reduce to a root that moves with the round; others pass null
  int const root = k % n;
  auto const ones = upload(be, std::vector<std::int32_t>{me, 1});
  auto reduced = upload(be, std::vector<std::int32_t>{-7, -7});
  comm.reduce(ones.data(), me == root ? reduced.data() : static_cast<std::int32_t*>(nullptr), 2, moecomm::reduce_op::sum, root);
  if (me == root) CHECK(download(be, reduced.data(), 2) == std::vector<std::int32_t>{n * (n - 1) / 2, n});
  // broadcast from that root
  auto word = upload(be, std::vector<float>{me == root ? payload(root, 9, 0, k) : std::numeric_limits<float>::quiet_NaN()});
  comm.broadcast(word.data(), sizeof(float), root);
  CHECK(download(be, word.data(), 1)[0] == payload(root, 9, 0, k));
}

}  // namespace

TEST_CASE("intranode_communicator on one GPU: every collective, 40 rounds in a row, sub-groups and a lane's split") {
  for (int ranks : {1, 2, 3, 8}) {
    CAPTURE(ranks);
    run_ranks_on_one_gpu(ranks, [&](one_gpu_rank& rank) {
      for (int k = 0; k < 40; ++k) one_round(rank, rank.comm, k);
      // sub-groups of odd and even ranks, ordered by descending rank
      intranode_communicator sub = rank.comm.split(rank.comm.rank() % 2, -rank.comm.rank());
      CHECK(sub.size() == (ranks + 1 - rank.comm.rank() % 2) / 2);
      for (int k = 0; k < 3; ++k) one_round(rank, sub, k);
      // a lane's copy: another stream of the same device, ordered after this one's work
      cudaStream_t lane = nullptr;
      REQUIRE(cudaStreamCreateWithFlags(&lane, cudaStreamNonBlocking) == cudaSuccess);
      {
        intranode_communicator copy = rank.comm.split(0, rank.comm.rank(), lane);
        CHECK(copy.stream() == lane);
        rank.be.synchronize();
        moecomm::cuda_backend const on_lane(lane, std::chrono::seconds(30));
        one_gpu_rank lane_rank{0, on_lane, std::move(copy)};
        one_round(lane_rank, lane_rank.comm, 1);
        on_lane.synchronize();
      }
      (void)cudaStreamDestroy(lane);
    }, std::chrono::seconds(60));
    check_violations();
  }
}

TEST_CASE("intranode_communicator on one GPU: a bad argument or ranks that disagree stop every rank before any copy, by name") {
  run_ranks_on_one_gpu(3, [&](one_gpu_rank& rank) {
    intranode_communicator& comm = rank.comm;
    int const me = comm.rank();
    auto word = upload(rank.be, std::vector<float>{float(me)});
    std::vector<float> host_word{1.0f};
    // rank 1 passes host memory: it names the argument; the others name rank 1
    float* const data = me == 1 ? host_word.data() : word.data();
    if (me == 1)
      check_error([&] { comm.broadcast(data, sizeof(float), 0); }, moecomm::status::invalid_argument,
                  {"intranode_communicator::broadcast", "'data'", "host memory, not device memory"});
    else
      check_error([&] { comm.broadcast(data, sizeof(float), 0); }, moecomm::status::aborted,
                  {"intranode_communicator::broadcast", "rank 1 passed an invalid argument"});
    // rank 2 expects 8 bytes from rank 0, which sends 4
    std::vector<moecomm::send_block> sends;
    std::vector<moecomm::recv_block> recvs;
    auto inbox = upload(rank.be, poisoned<float>(2));
    if (me == 0) sends.push_back({2, word.data(), 4});
    if (me == 2) recvs.push_back({0, inbox.data(), 8});
    check_error([&] { comm.exchange(sends, recvs); }, moecomm::status::invalid_usage,
                {"intranode_communicator::exchange", "pair (0, 2): rank 0 sends 4 bytes but rank 2 expects 8"});
    // rank 0 calls allreduce, the others broadcast
    if (me == 0)
      check_error([&] { comm.allreduce(word.data(), word.data(), 1, moecomm::reduce_op::sum); }, moecomm::status::invalid_usage,
                  {"ranks disagree", "rank 0 called allreduce", "called broadcast"});
    else
      check_error([&] { comm.broadcast(word.data(), sizeof(float), 0); }, moecomm::status::invalid_usage,
                  {"ranks disagree", "rank 0 called allreduce", "called broadcast"});
    for (float v : download(rank.be, inbox.data(), 2)) CHECK_MESSAGE(std::isnan(v), "a refused exchange copied a row");
    // and the communicator still works
    comm.allreduce(word.data(), word.data(), 1, moecomm::reduce_op::sum);
    CHECK(download(rank.be, word.data(), 1)[0] == 3.0f);
  });
  check_violations();
}

}  // namespace test
