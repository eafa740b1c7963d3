// SPDX-License-Identifier: Apache-2.0
// The NCCL communicator on every visible device of one process: one thread and one communicator
// per device (rank = device), like ncclCommInitAll. Checks each collective's result across the
// devices, sub-groups, large messages in chunks, the library's non-blocking communicator against a
// blocking one, the host-side argument errors (which leave the communicator usable), non-owning
// handles, moves, and a rank that does not join (a timeout, not a hang). Without a device the binary reports the suite as skipped (exit code 77), never as passed.

#define DOCTEST_CONFIG_IMPLEMENT
#include "device_runner.hpp"
#include "../support/test_support.hpp"

#include <moecomm/backend/cuda.cuh>
#include <moecomm/comm/nccl.cuh>
#include <moecomm/collectives/gradient_reduce.hpp>
#include <moecomm/collectives/replica_broadcast.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace test {

using moecomm::nccl_communicator;
using moecomm::nccl_options;
using moecomm::recv_block;
using moecomm::reduce_op;
using moecomm::send_block;
using moecomm::status;
using std::int32_t;
using std::int64_t;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
}

// Runs `body(r, stream)` for every device r on its own thread, with r current and a stream of its
// own. A rank's exception is reported after all threads end; bodies use CHECK (not REQUIRE) so
// every rank reaches the same collectives.
template <class Body>
void run_on_each_device(Body const& body) {
  int const ranks = device_count();
  REQUIRE(ranks > 0);
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      cudaStream_t stream = nullptr;
      try {
        moecomm::detail::cuda_check(cudaSetDevice(r), "cudaSetDevice");
        moecomm::detail::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        body(r, stream);
      } catch (std::exception const& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        failures[static_cast<std::size_t>(r)] = "a non-standard exception (a failed REQUIRE?)";
      }
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) CHECK_MESSAGE(failures[static_cast<std::size_t>(r)].empty(), "rank ", r, ": ", failures[static_cast<std::size_t>(r)]);
}

// Runs `body(comm)` for every device, with a communicator over all devices (rank r on device r) on
// the rank's stream.
template <class Body>
void run_on_all_devices(Body const& body, nccl_options options = {}) {
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  run_on_each_device([&](int r, cudaStream_t stream) {
    nccl_communicator comm = nccl_communicator::create(device_count(), id, r, stream, options);
    body(comm);
  });
}

// Device memory of the communicator's device, filled from / read back to the host on its stream.
template <class T>
struct device_vector {
  moecomm::cuda_backend backend;
  moecomm::cuda_backend::buffer_type<T> buf;

  device_vector(nccl_communicator const& comm, std::vector<T> const& host)
      : backend(comm.stream()), buf(backend.allocate<T>(static_cast<int64_t>(host.size()))) {
    backend.copy(buf.data(), host.data(), static_cast<int64_t>(host.size()));
    backend.synchronize();
  }
  T* data() { return buf.data(); }
  std::vector<T> read() const {
    std::vector<T> host(static_cast<std::size_t>(buf.size()));
    backend.copy(host.data(), buf.data(), buf.size());
    backend.synchronize();
    return host;
  }
};

// exchange: rank i sends i + 1 values of (i * 100 + j) to every j, itself included; what arrived,
// by source rank.
std::vector<std::vector<int32_t>> exchange_every_pair(nccl_communicator& comm) {
  int const n = comm.size(), me = comm.rank();
  std::vector<device_vector<int32_t>> out, in;
  std::vector<send_block> sends;
  std::vector<recv_block> recvs;
  for (int peer = 0; peer < n; ++peer) {
    out.emplace_back(comm, std::vector<int32_t>(static_cast<std::size_t>(me + 1), me * 100 + peer));
    in.emplace_back(comm, std::vector<int32_t>(static_cast<std::size_t>(peer + 1), -1));
  }
  for (int peer = 0; peer < n; ++peer) {
    sends.push_back({peer, out[peer].data(), static_cast<int64_t>((me + 1) * sizeof(int32_t))});
    recvs.push_back({peer, in[peer].data(), static_cast<int64_t>((peer + 1) * sizeof(int32_t))});
  }
  comm.exchange(sends, recvs);
  std::vector<std::vector<int32_t>> got;
  for (auto const& v : in) got.push_back(v.read());
  return got;
}

bool contains(std::string const& text, std::string const& part) { return text.find(part) != std::string::npos; }

// Every element type and reduction of allreduce, in place and not.
template <class T>
void check_allreduce(nccl_communicator& comm) {
  int const n = comm.size(), me = comm.rank();
  std::vector<T> const mine{T(me), T(2 * me + 1), T(-me), T(7)};
  device_vector<T> send(comm, mine), recv(comm, std::vector<T>(mine.size(), T(-99)));
  comm.allreduce(send.data(), recv.data(), 4, reduce_op::sum);
  T const ranks_sum = T(int64_t{n} * (n - 1) / 2);
  CHECK(recv.read() == std::vector<T>{ranks_sum, T(2 * ranks_sum + n), T(-ranks_sum), T(7 * n)});
  comm.allreduce(send.data(), recv.data(), 4, reduce_op::max);
  CHECK(recv.read() == std::vector<T>{T(n - 1), T(2 * (n - 1) + 1), T(0), T(7)});
  comm.allreduce(send.data(), send.data(), 4, reduce_op::min);  // in place
  CHECK(send.read() == std::vector<T>{T(0), T(1), T(-(n - 1)), T(7)});
  device_vector<T> to_root(comm, std::vector<T>(mine.size(), T(-99)));  // send holds the min of every rank now
  comm.reduce(send.data(), me == n - 1 ? to_root.data() : nullptr, 4, reduce_op::max, n - 1);
  CHECK(to_root.read() == (me == n - 1 ? std::vector<T>{T(0), T(1), T(-(n - 1)), T(7)} : std::vector<T>(4, T(-99))));
}

TEST_CASE("nccl collectives compute what they promise across all devices") {
  run_on_all_devices([](nccl_communicator& comm) {
    int const n = comm.size(), me = comm.rank();
    CHECK(n == device_count());
    CHECK(comm.device() == me);
    CHECK(comm.owning());
    CHECK_FALSE(comm.failed());

    // allgather
    device_vector<int64_t> mine(comm, {me, 100 + me}), all(comm, std::vector<int64_t>(2 * static_cast<std::size_t>(n), -1));
    comm.allgather(mine.data(), all.data(), 2 * sizeof(int64_t));
    std::vector<int64_t> expected_all;
    for (int r = 0; r < n; ++r) expected_all.insert(expected_all.end(), {r, 100 + r});
    CHECK(all.read() == expected_all);

    check_allreduce<int32_t>(comm);
    check_allreduce<int64_t>(comm);
    check_allreduce<float>(comm);
    check_allreduce<double>(comm);

    // broadcast from the last rank, and from rank 0
    device_vector<int32_t> word(comm, {me == n - 1 ? 4242 : -1, me == n - 1 ? 4343 : -2});
    comm.broadcast(word.data(), 2 * sizeof(int32_t), n - 1);
    CHECK(word.read() == std::vector<int32_t>{4242, 4343});
    device_vector<int32_t> zero(comm, {me == 0 ? 17 : 0});
    comm.broadcast(zero.data(), sizeof(int32_t), 0);
    CHECK(zero.read() == std::vector<int32_t>{17});

    std::vector<std::vector<int32_t>> const got = exchange_every_pair(comm);
    for (int peer = 0; peer < n; ++peer)
      CHECK(got[peer] == std::vector<int32_t>(static_cast<std::size_t>(peer + 1), peer * 100 + me));

    // zero-byte blocks and an empty exchange are fine
    comm.exchange({}, {});
    comm.exchange({{(me + 1) % n, nullptr, 0}}, {{(me + n - 1) % n, nullptr, 0}});

    comm.barrier();
    comm.wait();
  });
}

// Replica broadcast and gradient reduction on device memory, both paths, several chunks: integer
// valued floats, so every order gives the same sum.
template <class Path>
void check_replicas(nccl_communicator& comm, Path const& path) {
  int const n = comm.size(), me = comm.rank();
  moecomm::replica_set const set = moecomm::replica_set::everyone(n - 1, n);
  device_vector<float> params(comm, std::vector<float>(1000, me == n - 1 ? 3.0f : -1.0f));
  moecomm::replica_broadcast(comm, set, 1000, moecomm::array_view<float>{params.data(), 1000}, path);
  CHECK(params.read() == std::vector<float>(1000, 3.0f));
  device_vector<float> grads(comm, std::vector<float>(1000, float(me + 1)));
  moecomm::workspace<decltype(params.backend)> scratch;
  moecomm::gradient_reduce(params.backend, comm, set, 1000, moecomm::array_view<float>{grads.data(), 1000}, scratch, path);
  CHECK(grads.read() == std::vector<float>(1000, me == n - 1 ? float(n * (n + 1) / 2) : float(me + 1)));
}

TEST_CASE("nccl: replica_broadcast and gradient_reduce move device buffers in chunks, both paths") {
  run_on_all_devices([](nccl_communicator& comm) {
    check_replicas(comm, moecomm::point_to_point_path{1024});
    check_replicas(comm, moecomm::collective_path{1024});
  });
}

TEST_CASE("nccl exchange posts messages above max_chunk_bytes as chunks, and both sides agree") {
  nccl_options options;
  options.max_chunk_bytes = 12;  // 40-byte messages go as 12 + 12 + 12 + 4
  run_on_all_devices(
      [](nccl_communicator& comm) {
        int const n = comm.size(), me = comm.rank();
        std::vector<device_vector<int32_t>> out, in;
        std::vector<send_block> sends;
        std::vector<recv_block> recvs;
        for (int peer = 0; peer < n; ++peer) {
          std::vector<int32_t> values(10);
          std::iota(values.begin(), values.end(), me * 1000 + peer * 10);
          out.emplace_back(comm, values);
          in.emplace_back(comm, std::vector<int32_t>(10, -1));
        }
        // send in reverse peer order, receive in forward order: the chunks still pair up per peer
        for (int peer = n - 1; peer >= 0; --peer) sends.push_back({peer, out[peer].data(), 10 * sizeof(int32_t)});
        for (int peer = 0; peer < n; ++peer) recvs.push_back({peer, in[peer].data(), 10 * sizeof(int32_t)});
        comm.exchange(sends, recvs);
        for (int peer = 0; peer < n; ++peer) {
          std::vector<int32_t> expected(10);
          std::iota(expected.begin(), expected.end(), peer * 1000 + me * 10);
          CHECK(in[peer].read() == expected);
        }
        // an odd size that is not a multiple of the element size or of the chunk
        device_vector<char> bytes_out(comm, std::vector<char>(13, static_cast<char>('a' + me)));
        device_vector<char> bytes_in(comm, std::vector<char>(13, '?'));
        int const to = (me + 1) % n, from = (me + n - 1) % n;
        comm.exchange({{to, bytes_out.data(), 13}}, {{from, bytes_in.data(), 13}});
        CHECK(bytes_in.read() == std::vector<char>(13, static_cast<char>('a' + from)));
      },
      options);
}

TEST_CASE("nccl split makes sub-groups ordered by (key, rank) that work on their own") {
  run_on_all_devices([](nccl_communicator& comm) {
    int const n = comm.size(), me = comm.rank();
    int const color = me % 2;
    nccl_communicator sub = comm.split(color, -me);  // descending world rank within a color
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r)
      if (r % 2 == color) members.push_back(r);
    CHECK(sub.size() == static_cast<int>(members.size()));
    REQUIRE((sub.rank() >= 0 && sub.rank() < static_cast<int>(members.size())));
    CHECK(members[static_cast<std::size_t>(sub.rank())] == me);
    CHECK(sub.device() == comm.device());
    CHECK(sub.stream() == comm.stream());

    device_vector<int64_t> value(comm, {me});
    sub.allreduce(value.data(), value.data(), 1, reduce_op::sum);
    CHECK(value.read() == std::vector<int64_t>{std::accumulate(members.begin(), members.end(), int64_t{0})});
    device_vector<int32_t> root_word(comm, {sub.rank() == 0 ? me : -1});
    sub.broadcast(root_word.data(), sizeof(int32_t), 0);
    CHECK(root_word.read() == std::vector<int32_t>{members[0]});
    sub.barrier();

    // one color, keys in rank order: the same group as the parent
    nccl_communicator same = comm.split(0, me);
    CHECK(same.size() == n);
    CHECK(same.rank() == me);
    same.barrier();
    comm.barrier();  // the parent still works
  });
}

// Split, exchange and allreduce on `comm`: what this rank saw, in order.
std::vector<int64_t> split_exchange_allreduce(nccl_communicator& comm) {
  int const me = comm.rank();
  std::vector<int64_t> seen;
  nccl_communicator sub = comm.split(me % 2, -me);
  seen.insert(seen.end(), {sub.size(), sub.rank(), sub.device()});
  for (std::vector<int32_t> const& from : exchange_every_pair(comm)) seen.insert(seen.end(), from.begin(), from.end());
  device_vector<int64_t> value(comm, {me + 1, 2 * me});
  sub.allreduce(value.data(), value.data(), 2, reduce_op::sum);
  comm.allreduce(value.data(), value.data(), 2, reduce_op::max);
  for (int64_t x : value.read()) seen.push_back(x);
  return seen;
}

TEST_CASE("nccl: the library's non-blocking communicator computes what a blocking one does (init, split, exchange, allreduce)") {
  int const ranks = device_count();
  REQUIRE(ranks > 0);
  ncclUniqueId non_blocking_id, blocking_id;
  REQUIRE(ncclGetUniqueId(&non_blocking_id) == ncclSuccess);
  REQUIRE(ncclGetUniqueId(&blocking_id) == ncclSuccess);
  std::vector<std::vector<int64_t>> non_blocking(static_cast<std::size_t>(ranks)), blocking(static_cast<std::size_t>(ranks));
  run_on_each_device([&](int r, cudaStream_t stream) {
    {  // create: ncclCommInitRankConfig with blocking = 0, every call polled through ncclInProgress
      nccl_communicator comm = nccl_communicator::create(ranks, non_blocking_id, r, stream);
      non_blocking[static_cast<std::size_t>(r)] = split_exchange_allreduce(comm);
    }
    {  // a blocking communicator (NCCL's default), wrapped
      ncclComm_t raw = nullptr;
      ncclResult_t const made = ncclCommInitRank(&raw, ranks, blocking_id, r);
      if (made != ncclSuccess) throw std::runtime_error(std::string("ncclCommInitRank: ") + ncclGetErrorString(made));
      nccl_communicator comm = nccl_communicator::from_native_handle(raw, stream, {}, /*owning=*/true);
      blocking[static_cast<std::size_t>(r)] = split_exchange_allreduce(comm);
    }
  });
  for (int r = 0; r < ranks; ++r) {
    CHECK(non_blocking[static_cast<std::size_t>(r)] == blocking[static_cast<std::size_t>(r)]);
    CHECK(non_blocking[static_cast<std::size_t>(r)].size() == static_cast<std::size_t>(3 + ranks * (ranks + 1) / 2 + 2));
  }
}

TEST_CASE("nccl host-side argument errors name the argument and leave the communicator usable") {
  run_on_all_devices([](nccl_communicator& comm) {
    int const n = comm.size(), me = comm.rank();
    device_vector<int32_t> buf(comm, {me, me});

    auto const bad_root = thrown_error([&] { comm.broadcast(buf.data(), sizeof(int32_t), n); });
    CHECK(bad_root.first == status::invalid_argument);
    CHECK(contains(bad_root.second, "nccl_communicator::broadcast: root = "));
    CHECK(thrown_error([&] { comm.broadcast(buf.data(), sizeof(int32_t), -1); }).first == status::invalid_argument);
    CHECK(thrown_error([&] { comm.broadcast(buf.data(), -4, 0); }).first == status::invalid_argument);
    CHECK(thrown_error([&] { comm.broadcast(nullptr, 4, 0); }).first == status::invalid_argument);

    auto const bad_peer = thrown_error([&] { comm.exchange({{n, buf.data(), 4}}, {}); });
    CHECK(bad_peer.first == status::invalid_argument);
    CHECK(contains(bad_peer.second, "sends[0].peer = "));
    auto const twice = thrown_error([&] { comm.exchange({}, {{0, buf.data(), 4}, {0, buf.data(), 4}}); });
    CHECK(twice.first == status::invalid_argument);
    CHECK(contains(twice.second, "recvs[0] and recvs[1] both name peer 0"));
    CHECK(thrown_error([&] { comm.exchange({{0, buf.data(), -1}}, {}); }).first == status::invalid_argument);

    auto const bad_count = thrown_error([&] { comm.allreduce(buf.data(), buf.data(), -1, reduce_op::sum); });
    CHECK(bad_count.first == status::invalid_argument);
    CHECK(contains(bad_count.second, "count = -1"));
    CHECK(thrown_error([&] { comm.allgather(buf.data(), nullptr, 4); }).first == status::invalid_argument);
    CHECK(thrown_error([&] { (void)comm.split(-1, 0); }).first == status::invalid_argument);

    CHECK_FALSE(comm.failed());
    // still usable: a collective after the errors gives the right result
    comm.allreduce(buf.data(), buf.data(), 2, reduce_op::sum);
    int32_t const total = n * (n - 1) / 2;
    CHECK(buf.read() == std::vector<int32_t>{total, total});
    comm.barrier();
  });
}

TEST_CASE("nccl create rejects bad arguments before calling NCCL") {
  ncclUniqueId id{};
  auto const no_ranks = thrown_error([&] { (void)nccl_communicator::create(0, id, 0, nullptr); });
  CHECK(no_ranks.first == status::invalid_argument);
  CHECK(contains(no_ranks.second, "nranks = 0"));
  auto const bad_rank = thrown_error([&] { (void)nccl_communicator::create(2, id, 2, nullptr); });
  CHECK(bad_rank.first == status::invalid_argument);
  CHECK(contains(bad_rank.second, "rank = 2"));
  nccl_options no_time;
  no_time.timeout = std::chrono::milliseconds(0);
  CHECK(thrown_error([&] { (void)nccl_communicator::create(1, id, 0, nullptr, no_time); }).first == status::invalid_argument);
  nccl_options no_chunk;
  no_chunk.max_chunk_bytes = 0;
  CHECK(thrown_error([&] { (void)nccl_communicator::create(1, id, 0, nullptr, no_chunk); }).first == status::invalid_argument);
  CHECK(thrown_error([&] { (void)nccl_communicator::from_native_handle(nullptr, nullptr); }).first == status::invalid_argument);
}

TEST_CASE("nccl non-owning handles and moves") {
  run_on_all_devices([](nccl_communicator& comm) {
    int const n = comm.size(), me = comm.rank();
    {
      nccl_communicator view = nccl_communicator::from_native_handle(comm.native_handle(), comm.stream());
      CHECK_FALSE(view.owning());
      CHECK(view.rank() == me);
      CHECK(view.size() == n);
      device_vector<int32_t> x(comm, {1});
      view.allreduce(x.data(), x.data(), 1, reduce_op::sum);
      CHECK(x.read() == std::vector<int32_t>{n});
      view.barrier();
    }  // the view leaves the handle alone
    comm.barrier();

    nccl_communicator moved = std::move(comm);
    CHECK(moved.rank() == me);
    moved.barrier();
    auto const from_moved = thrown_error([&] { comm.barrier(); });  // NOLINT(bugprone-use-after-move)
    CHECK(from_moved.first == status::invalid_argument);
    CHECK(contains(from_moved.second, "moved from"));
    comm = std::move(moved);  // back, so that the harness destroys it
    comm.barrier();
  });
}

TEST_CASE("nccl: a rank that does not join a collective is a timeout and an abort, not a hang") {
  if (device_count() < 2) {
    MESSAGE("needs two devices; skipped");
    return;
  }
  nccl_options options;
  options.timeout = std::chrono::seconds(5);
  std::atomic<bool> rank0_done{false};
  run_on_all_devices(
      [&](nccl_communicator& comm) {
        if (comm.rank() != 0) {
          // never call barrier, but keep the communicator (and its buffers) alive until rank 0 is done
          while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        struct release_the_others {
          std::atomic<bool>& done;
          ~release_the_others() { done.store(true); }
        } const release{rank0_done};
        auto const start = std::chrono::steady_clock::now();
        auto const lonely = thrown_error([&] { comm.barrier(); });
        CHECK(lonely.first == status::timeout);
        CHECK(contains(lonely.second, "nccl_communicator::barrier"));
        CHECK(contains(lonely.second, "aborted"));
        CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
        CHECK(comm.failed());
        CHECK(comm.native_handle() == nullptr);
        auto const after = thrown_error([&] { comm.barrier(); });
        CHECK(after.first == status::aborted);
        CHECK(contains(after.second, "failed earlier"));
      },
      options);
}

}  // namespace test

int main(int argc, char** argv) {
  if (test::no_device_for("the NCCL communicator was")) return test::skipped_exit_code;
  int version = 0;
  (void)ncclGetVersion(&version);
  std::printf("NCCL %d (headers %d), %d device(s)\n", version, NCCL_VERSION_CODE, test::device_count());
  return test::run_doctest(argc, argv);
}
