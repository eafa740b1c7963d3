// SPDX-License-Identifier: Apache-2.0
// The emulation enforces CUDA's and NCCL's contracts: each broken rule fails loudly, naming the
// call and the buffer; the same code with the rule kept runs and moves the right bytes. These are
// the checks that stand in for a GPU: if one stopped catching its mistake, every emulated layer
// test would prove less.

#include "emulated_ranks.hpp"

#include <string>
#include <thread>
#include <vector>

namespace test {

using moecomm::nccl_communicator;

namespace {

bool any_violation_mentions(std::string const& fragment) {
  for (std::string const& v : moecomm_emulation::violations())
    if (v.find(fragment) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("NCCL refuses host memory: the call and the buffer are named (F1's mistake)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    std::vector<std::int64_t> mine{rank.comm.rank(), 7}, all(4);
    std::string const device = "device " + std::to_string(rank.comm.rank());
    // The emulated NCCL itself, called as the library called it before allgather_host existed.
    CHECK(ncclAllGather(mine.data(), all.data(), 16, ncclChar, rank.comm.native_handle(), rank.comm.stream()) ==
          ncclInvalidArgument);
    std::string const said = ncclGetLastError(rank.comm.native_handle());
    CHECK_MESSAGE(said.find("ncclAllGather on the communicator of rank " + std::to_string(rank.comm.rank())) != std::string::npos, said);
    CHECK_MESSAGE(said.find("'sendbuff' (16 bytes at ") != std::string::npos, said);
    CHECK_MESSAGE(said.find("is not device memory of " + device + ": it is pageable host memory") != std::string::npos, said);
    // nccl_communicator refuses it first, naming its own argument.
    check_error([&] { rank.comm.allgather(mine.data(), all.data(), 16); }, moecomm::status::invalid_argument,
                {"nccl_communicator::allgather: 'send' (16 bytes at", "is host memory, not device memory of " + device});
    // Host values go through allgather_host; device memory goes through allgather.
    moecomm::allgather_host(rank.comm, mine.data(), all.data(), 16);
    CHECK(all == std::vector<std::int64_t>{0, 7, 1, 7});
    auto const send = upload(rank.be, mine);
    auto recv = rank.be.allocate<std::int64_t>(4);
    rank.comm.allgather(send.data(), recv.data(), 16);
    CHECK(download(rank.be, recv.data(), 4) == std::vector<std::int64_t>{0, 7, 1, 7});
  });
  CHECK(any_violation_mentions("is not device memory"));
  moecomm_emulation::clear_violations();
}

TEST_CASE("a buffer written on one stream and sent on another without an event is caught (F2's mistake)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    cudaStream_t other = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess);
    cudaEvent_t written = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&written, cudaEventDisableTiming) == cudaSuccess);
    {
    moecomm::cuda_backend const producer(other);
    auto rows = producer.allocate<float>(64);
    auto got = rank.be.allocate<float>(64);
    producer.for_each_index(64, fill_kernel{rows.data(), float(rank.comm.rank() + 1)});
    std::vector<moecomm::send_block> const sends{{1 - rank.comm.rank(), rows.data(), 256}};
    std::vector<moecomm::recv_block> const recvs{{1 - rank.comm.rank(), got.data(), 256}};
    check_error([&] { rank.comm.exchange(sends, recvs); }, moecomm::status::invalid_argument,
                {"ncclSend/ncclRecv on stream", "reads 'sendbuff'", "for_each_index on stream", "is not ordered before it"});
    // An event recorded after the write and waited for on the communicator's stream orders them.
    REQUIRE(cudaEventRecord(written, other) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(rank.comm.stream(), written, 0) == cudaSuccess);
    rank.comm.exchange(sends, recvs);
    CHECK(download(rank.be, got.data(), 64) == std::vector<float>(64, float(2 - rank.comm.rank())));
    }  // `rows` is freed on `other`: ordered after the send, which the host waited for
    REQUIRE(cudaStreamSynchronize(other) == cudaSuccess);
    (void)cudaEventDestroy(written);
    (void)cudaStreamDestroy(other);
  });
  moecomm_emulation::clear_violations();
}

TEST_CASE("a launch from a thread whose current device is not the stream's is caught (F5's mistake)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    auto rows = rank.be.allocate<float>(8);
    std::string failure;
    std::thread lane([&] {  // a new thread starts on device 0
      try {
        rank.be.for_each_index(8, fill_kernel{rows.data(), 1.0f});
        rank.be.synchronize();
      } catch (moecomm::error const& e) {
        failure = e.what();
      }
    });
    lane.join();
    if (rank.comm.rank() == 0) CHECK(failure.empty());
    else CHECK_MESSAGE(failure.find("from a thread whose current device is 0: call cudaSetDevice(1)") != std::string::npos, failure);
  });
  moecomm_emulation::clear_violations();
}

TEST_CASE("a second host thread issuing on one NCCL communicator is caught (F4's mistake)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    auto word = rank.be.allocate<std::int32_t>(2);
    rank.comm.barrier();  // this thread now issues on the communicator
    std::string failure;
    std::thread other([&] {
      try {
        moecomm::detail::cuda_check(cudaSetDevice(rank.device), "cudaSetDevice");
        rank.comm.allgather(word.data(), word.data(), 4);
      } catch (moecomm::error const& e) {
        failure = e.what();
      }
    });
    other.join();
    CHECK_MESSAGE(failure.find("from a second host thread") != std::string::npos, failure);
  });
  moecomm_emulation::clear_violations();
}

TEST_CASE("a sub-group split on the parent's stream shares its resources and thread, a lane's split on its own stream does not (F12)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    auto word = rank.be.allocate<std::int32_t>(2);
    moecomm::nccl_communicator shared = rank.comm.split(0, rank.comm.rank());  // splitShare = 1
    cudaStream_t lane_stream = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&lane_stream, cudaStreamNonBlocking) == cudaSuccess);
    {
      moecomm::nccl_communicator own = rank.comm.split(0, rank.comm.rank(), lane_stream);  // splitShare = 0
      rank.comm.barrier();  // this thread now issues on the parent
      std::string shared_failure, own_failure;
      std::thread other([&] {
        moecomm::detail::cuda_check(cudaSetDevice(rank.device), "cudaSetDevice");
        try {
          own.barrier();
        } catch (moecomm::error const& e) {
          own_failure = e.what();
        }
        try {
          shared.allgather(word.data(), word.data(), 4);
        } catch (moecomm::error const& e) {
          shared_failure = e.what();
        }
      });
      other.join();
      CHECK_MESSAGE(own_failure.empty(), own_failure);
      CHECK_MESSAGE(shared_failure.find("split with splitShare = 1") != std::string::npos, shared_failure);
    }
    REQUIRE(cudaStreamDestroy(lane_stream) == cudaSuccess);
  });
  moecomm_emulation::clear_violations();
}

TEST_CASE("an NCCL group left open when its thread ends is reported") {
  moecomm_emulation::clear_violations();
  std::thread([] { (void)ncclGroupStart(); }).join();
  CHECK(any_violation_mentions("a thread ended inside ncclGroupStart"));
  moecomm_emulation::clear_violations();
}

TEST_CASE("the host reading device memory stops the process, naming the allocation") {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 1000) == cudaSuccess);
  bool stopped = false;
  std::string const said = child_stderr(
      [&] {
        volatile char const c = static_cast<char const*>(p)[100];  // what a host loop over device rows would do
        (void)c;
      },
      stopped);
  CHECK(stopped);
  CHECK_MESSAGE(said.find("the host touched device memory at byte 100 of a 1000-byte device allocation of cudaMalloc") !=
                    std::string::npos,
                said);
  REQUIRE(cudaFree(p) == cudaSuccess);
}

TEST_CASE("a copy into pageable memory waits, and the wait is counted") {
  run_emulated_ranks(1, [](emulated_rank& rank) {
    auto rows = rank.be.allocate<float>(16);
    rank.be.for_each_index(16, fill_kernel{rows.data(), 3.0f});
    std::int64_t const before = moecomm_emulation::host_waits();
    std::vector<float> host(16);
    rank.be.copy(host.data(), rows.data(), 16);  // pageable: CUDA returns once the copy is done
    CHECK(moecomm_emulation::host_waits() == before + 1);
    CHECK(host == std::vector<float>(16, 3.0f));
  });
}

}  // namespace test
