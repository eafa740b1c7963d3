// SPDX-License-Identifier: Apache-2.0
// The emulation enforces CUDA's and NCCL's contracts: each broken rule fails loudly, naming the
// call and the buffer; the same code with the rule kept runs and moves the right bytes. These are
// the checks that stand in for a GPU: if one stopped catching its mistake, every emulated layer
// test would prove less.

#include "emulated_ranks.hpp"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
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

bool contains(std::string const& text, std::string const& part) { return text.find(part) != std::string::npos; }

// Polls `comm`'s state until it is no longer ncclInProgress (at most 20 s) and returns it;
// `in_progress` counts the polls that found it in progress.
ncclResult_t settle(ncclComm_t comm, int& in_progress) {
  auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
    if (state != ncclInProgress || std::chrono::steady_clock::now() > deadline) return state;
    ++in_progress;
    std::this_thread::yield();
  }
}

// Runs `body(rank)` on `ranks` threads, rank r with device `device_of(r)` current: raw NCCL and
// CUDA calls, without the harness's communicator.
template <class DeviceOf, class Body>
void run_threads(int ranks, DeviceOf const& device_of, Body const& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      REQUIRE(cudaSetDevice(device_of(r)) == cudaSuccess);
      body(r);
    });
  for (auto& t : threads) t.join();
}

// The allreduce (or the reduce to rank `root`, when it is not negative) of every rank's `mine` by
// the emulated NCCL, on the rank's (non-blocking) communicator.
template <class T>
std::vector<T> nccl_reduction(emulated_rank& rank, std::vector<T> const& mine, ncclDataType_t type, ncclRedOp_t op, int root = -1) {
  auto const send = upload(rank.be, mine);
  auto recv = upload(rank.be, std::vector<T>(mine.size(), T{}));
  ncclResult_t const r = root < 0 ? ncclAllReduce(send.data(), recv.data(), mine.size(), type, op, rank.comm.native_handle(), rank.comm.stream())
                                  : ncclReduce(send.data(), recv.data(), mine.size(), type, op, root, rank.comm.native_handle(), rank.comm.stream());
  CHECK_MESSAGE((r == ncclSuccess || r == ncclInProgress), ncclGetErrorString(r));
  rank.comm.wait();
  return download(rank.be, recv.data(), static_cast<std::int64_t>(mine.size()));
}

// 16-bit floats' bits as "3f80 40a0", for readable failures.
std::string hex(std::vector<std::uint16_t> const& bits) {
  std::string text;
  for (std::uint16_t b : bits) {
    char word[8];
    std::snprintf(word, sizeof word, "%s%04x", text.empty() ? "" : " ", static_cast<unsigned>(b));
    text += word;
  }
  return text;
}

// `y[i] = 2 * x[i] + 1`: a kernel to capture.
struct affine_kernel {
  float const* x;
  float* y;
  void operator()(std::int64_t i) const { y[i] = 2.0f * x[i] + 1.0f; }
};

cudaError_t launch_affine(cudaStream_t stream, float const* x, float* y, std::int64_t n) {
  return moecomm_emulation::launch(stream, "affine", affine_kernel{x, y}, [n](affine_kernel const& k) {
    for (std::int64_t i = 0; i < n; ++i) k(i);
  });
}

template <class T>
T* device_array(std::size_t n) {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, n * sizeof(T)) == cudaSuccess);
  return static_cast<T*>(p);
}

template <class T>
T* pinned_array(std::size_t n) {
  void* p = nullptr;
  REQUIRE(cudaMallocHost(&p, n * sizeof(T)) == cudaSuccess);
  return static_cast<T*>(p);
}

cudaStreamCaptureStatus capture_status(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CHECK(cudaStreamIsCapturing(stream, &status) == cudaSuccess);
  return status;
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

TEST_CASE("a kernel given a pointer to pageable host memory is refused, naming the kernel") {
  moecomm_emulation::clear_violations();
  run_emulated_ranks(1, [](emulated_rank& rank) {
    std::vector<float> host(8, 0.0f);
    check_error([&] { rank.be.for_each_index(8, fill_kernel{host.data(), 1.0f}); }, moecomm::status::cuda_error,
                {"kernel 'for_each_index' launched on stream", "(device 0) is given", "(its pointer argument 1 of 1), which is pageable host memory"});
    CHECK(host == std::vector<float>(8, 0.0f));  // it never ran
    // Pinned host memory is what a kernel may read and write on the host's side.
    void* pinned = nullptr;
    REQUIRE(cudaMallocHost(&pinned, 8 * sizeof(float)) == cudaSuccess);
    rank.be.for_each_index(8, fill_kernel{static_cast<float*>(pinned), 2.0f});
    rank.be.synchronize();
    std::vector<float> got(8);
    std::memcpy(got.data(), pinned, 8 * sizeof(float));
    CHECK(got == std::vector<float>(8, 2.0f));
    REQUIRE(cudaFreeHost(pinned) == cudaSuccess);
  });
  CHECK(any_violation_mentions("which is pageable host memory"));
  moecomm_emulation::clear_violations();
}

// A functor that is no aggregate, so that the emulation reads its words as possible pointers.
struct opaque_word {
  explicit opaque_word(std::uintptr_t w) : word(w) {}
  std::uintptr_t word;
};

TEST_CASE("a word of an opaque kernel functor that lies in memory cudaFreeAsync released is not taken for a use of it") {
  moecomm_emulation::clear_violations();
  cudaStream_t held = nullptr, freeing = nullptr, other = nullptr;
  for (cudaStream_t* s : {&held, &freeing, &other}) REQUIRE(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking) == cudaSuccess);
  int* go = nullptr;  // pinned: the held stream's job spins until the host sets it
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&go), sizeof(int)) == cudaSuccess);
  __atomic_store_n(go, 0, __ATOMIC_RELEASE);
  void* freed = nullptr;
  REQUIRE(cudaMallocAsync(&freed, 4096, freeing) == cudaSuccess);
  REQUIRE(moecomm_emulation::enqueue(held, "spin", {}, [go] { while (__atomic_load_n(go, __ATOMIC_ACQUIRE) == 0) std::this_thread::yield(); }) ==
          cudaSuccess);
  cudaEvent_t after_spin = nullptr;
  REQUIRE(cudaEventCreate(&after_spin) == cudaSuccess);
  REQUIRE(cudaEventRecord(after_spin, held) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(freeing, after_spin, 0) == cudaSuccess);
  REQUIRE(cudaFreeAsync(freed, freeing) == cudaSuccess);  // released; freed once the spin ends
  opaque_word const word{reinterpret_cast<std::uintptr_t>(freed) + 64};  // any integer may look like that
  CHECK(moecomm_emulation::launch(other, "opaque", word, [](opaque_word const&) {}) == cudaSuccess);
  __atomic_store_n(go, 1, __ATOMIC_RELEASE);
  for (cudaStream_t s : {held, freeing, other}) REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  auto const seen = moecomm_emulation::violations();
  CHECK_MESSAGE(seen.empty(), "the emulation took a word for a use: ", seen.empty() ? "" : seen.front());
  (void)cudaEventDestroy(after_spin);
  for (cudaStream_t s : {held, freeing, other}) (void)cudaStreamDestroy(s);
  (void)cudaFreeHost(go);
  moecomm_emulation::clear_violations();
}

TEST_CASE("a kernel given another device's memory needs peer access, and its use is then ordered like a local one") {
  moecomm_emulation::clear_violations();
  int can = -1;
  REQUIRE(cudaDeviceCanAccessPeer(&can, 0, 1) == cudaSuccess);
  CHECK(can == 1);
  REQUIRE(cudaDeviceCanAccessPeer(&can, 1, 1) == cudaSuccess);
  CHECK(can == 0);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  float* theirs = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&theirs), 64 * sizeof(float)) == cudaSuccess);
  cudaStream_t on_1 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&on_1, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t written = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&written, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t on_0 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&on_0, cudaStreamNonBlocking) == cudaSuccess);
  {
    moecomm::cuda_backend const be(on_0);  // device 0's
    check_error([&] { be.for_each_index(64, fill_kernel{theirs, 1.0f}); }, moecomm::status::cuda_error,
                {"kernel 'for_each_index' launched on stream", "(device 0) is given",
                 "in a 256-byte device allocation of cudaMalloc on device 1, without peer access from device 0 to device 1",
                 "cudaDeviceEnablePeerAccess(1, 0) with device 0 current"});
    REQUIRE(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
    CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
    CHECK(cudaDeviceEnablePeerAccess(0, 0) == cudaErrorInvalidDevice);  // itself
    (void)cudaGetLastError();
    // With peer access the kernel runs, and its use of device 1's memory is ordered like a local one.
    REQUIRE(cudaMemsetAsync(theirs, 0, 64 * sizeof(float), on_1) == cudaSuccess);
    check_error([&] { be.for_each_index(64, fill_kernel{theirs, 2.0f}); }, moecomm::status::cuda_error,
                {"for_each_index on stream", "writes 'for_each_index' (bytes 0 to 256 of a 256-byte device allocation of cudaMalloc on device 1)",
                 "while cudaMemsetAsync on stream", "is not ordered before it"});
    REQUIRE(cudaEventRecord(written, on_1) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(on_0, written, 0) == cudaSuccess);
    be.for_each_index(64, fill_kernel{theirs, 2.0f});
    CHECK(download(be, theirs, 64) == std::vector<float>(64, 2.0f));
    // Disabled again, the launch is refused again.
    REQUIRE(cudaDeviceDisablePeerAccess(1) == cudaSuccess);
    CHECK(cudaDeviceDisablePeerAccess(1) == cudaErrorPeerAccessNotEnabled);
    (void)cudaGetLastError();
    check_error([&] { be.for_each_index(64, fill_kernel{theirs, 3.0f}); }, moecomm::status::cuda_error,
                {"without peer access from device 0 to device 1"});
  }
  REQUIRE(cudaFree(theirs) == cudaSuccess);
  (void)cudaEventDestroy(written);
  (void)cudaStreamDestroy(on_0);
  (void)cudaStreamDestroy(on_1);
  CHECK(any_violation_mentions("without peer access from device 0 to device 1"));
  moecomm_emulation::clear_violations();
}

TEST_CASE("an event is recorded on streams of the device it was created on, and waited for on any device's") {
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  cudaEvent_t of_1 = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&of_1, cudaEventDisableTiming) == cudaSuccess);
  cudaStream_t on_1 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&on_1, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t on_0 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&on_0, cudaStreamNonBlocking) == cudaSuccess);
  CHECK(cudaEventRecord(of_1, on_0) == cudaErrorInvalidResourceHandle);  // CUDA's answer
  std::string const said = cudaGetErrorString(cudaErrorInvalidResourceHandle);
  CHECK_MESSAGE(contains(said, "cudaEventRecord of an event created on device 1 on stream"), said);
  CHECK_MESSAGE(contains(said, "(device 0): an event belongs to the device current when it was created"), said);
  (void)cudaGetLastError();
  CHECK(cudaEventRecord(of_1, on_1) == cudaSuccess);      // its own device's stream, from a thread on device 0
  CHECK(cudaStreamWaitEvent(on_0, of_1, 0) == cudaSuccess);  // a stream may wait on another device's event
  CHECK(cudaStreamSynchronize(on_0) == cudaSuccess);
  (void)cudaEventDestroy(of_1);
  (void)cudaStreamDestroy(on_0);
  (void)cudaStreamDestroy(on_1);
  moecomm_emulation::clear_violations();
}

TEST_CASE("NCCL reduces half and bfloat16 in float, rounded at each step, and computes ncclAvg as NCCL does") {
  run_emulated_ranks(4, [](emulated_rank& rank) {
    int const me = rank.comm.rank();
    // bfloat16 bits: 1.0 = 0x3f80, 2^-8 = 0x3b80 (half an ulp of 1.0: 1 + 2^-8 rounds to 1.0, to
    // even), 0.5 * (me + 1) sums to 5.0 = 0x40a0. Ascending rank order, rounded at each step: 1.0.
    std::vector<std::uint16_t> const bf16{me == 0 ? std::uint16_t{0x3f80} : std::uint16_t{0x3b80},
                                          std::vector<std::uint16_t>{0x3f00, 0x3f80, 0x3fc0, 0x4000}[static_cast<std::size_t>(me)]};
    CHECK(hex(nccl_reduction(rank, bf16, ncclBfloat16, ncclSum)) == "3f80 40a0");
    // binary16: 1.0 = 0x3c00, 2^-11 = 0x1000 (half an ulp of 1.0), 0.5, 1, 1.5, 2 sum to 5.0 = 0x4500.
    std::vector<std::uint16_t> const f16{me == 0 ? std::uint16_t{0x3c00} : std::uint16_t{0x1000},
                                         std::vector<std::uint16_t>{0x3800, 0x3c00, 0x3e00, 0x4000}[static_cast<std::size_t>(me)]};
    CHECK(hex(nccl_reduction(rank, f16, ncclFloat16, ncclSum)) == "3c00 4500");
    CHECK(hex(nccl_reduction(rank, f16, ncclFloat16, ncclMax)) == "3c00 4000");
    // ncclReduce: the root only.
    CHECK(hex(nccl_reduction(rank, f16, ncclFloat16, ncclSum, 3)) == (me == 3 ? "3c00 4500" : "0000 0000"));
    // ncclAvg: floating types multiply each input by 1/4 first (1, 2, 3, 4 -> 2.5 = 0x4020 in bf16),
    // integers divide the sum, rounding towards zero (10 / 4 = 2, -11 / 4 = -2).
    std::vector<std::uint16_t> const bf16_avg{std::vector<std::uint16_t>{0x3f80, 0x4000, 0x4040, 0x4080}[static_cast<std::size_t>(me)]};
    CHECK(hex(nccl_reduction(rank, bf16_avg, ncclBfloat16, ncclAvg)) == "4020");
    CHECK(nccl_reduction(rank, std::vector<float>{float(me + 1)}, ncclFloat32, ncclAvg) == std::vector<float>{2.5f});
    CHECK(nccl_reduction(rank, std::vector<std::int32_t>{me + 1, -(me + 1) - (me == 0 ? 1 : 0)}, ncclInt32, ncclAvg) ==
          std::vector<std::int32_t>{2, -2});
  });
  moecomm_emulation::clear_violations();
}

TEST_CASE("NCCL refuses two ranks of one communicator on one GPU (Duplicate GPU detected)") {
  moecomm_emulation::clear_violations();
  auto on_device_2 = [](int) { return 2; };
  // Blocking: the call fails on every rank once all have joined, and leaves no communicator.
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<ncclResult_t> results(2, ncclSuccess);
  std::vector<std::string> said(2);
  std::vector<ncclComm_t> comms(2, nullptr);
  run_threads(2, on_device_2, [&](int r) {
    results[static_cast<std::size_t>(r)] = ncclCommInitRank(&comms[static_cast<std::size_t>(r)], 2, id, r);
    said[static_cast<std::size_t>(r)] = ncclGetLastError(nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(results[static_cast<std::size_t>(r)] == ncclInvalidUsage);
    CHECK(comms[static_cast<std::size_t>(r)] == nullptr);
    std::string const expected = "ncclCommInitRank: Duplicate GPU detected : rank " + std::to_string(r) + " and rank " +
                                 std::to_string(1 - r) + " both on CUDA device 2";
    CHECK_MESSAGE(contains(said[static_cast<std::size_t>(r)], expected), said[static_cast<std::size_t>(r)]);
  }
  // Non-blocking: the call is in progress, then the communicator's asynchronous error says it.
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<ncclResult_t> states(2, ncclSuccess);
  run_threads(2, on_device_2, [&](int r) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    results[static_cast<std::size_t>(r)] = ncclCommInitRankConfig(&comm, 2, id, r, &config);
    int in_progress = 0;
    if (comm != nullptr) states[static_cast<std::size_t>(r)] = settle(comm, in_progress);
    said[static_cast<std::size_t>(r)] = ncclGetLastError(comm);
    if (comm != nullptr) (void)ncclCommAbort(comm);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(results[static_cast<std::size_t>(r)] == ncclInProgress);
    CHECK(states[static_cast<std::size_t>(r)] == ncclInvalidUsage);
    CHECK_MESSAGE(contains(said[static_cast<std::size_t>(r)], "Duplicate GPU detected : rank " + std::to_string(r)), said[static_cast<std::size_t>(r)]);
  }
  // nccl_communicator::create reports it.
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  run_threads(2, on_device_2, [&](int r) {
    check_error([&] { (void)nccl_communicator::create(2, id, r, nullptr); }, moecomm::status::nccl_error,
                {"nccl_communicator::create", "ncclInvalidUsage", "Duplicate GPU detected"});
  });
  CHECK(any_violation_mentions("Duplicate GPU detected"));
  moecomm_emulation::clear_violations();
}

TEST_CASE("CUB's calls, like a kernel, are launched from a thread whose current device is the stream's") {
  moecomm_emulation::clear_violations();
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  cudaStream_t on_1 = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&on_1, cudaStreamNonBlocking) == cudaSuccess);
  int const n = 16;
  void* buffers[5] = {};
  for (void*& b : buffers) {
    REQUIRE(cudaMalloc(&b, 4096) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(b, 0, 4096, on_1) == cudaSuccess);
  }
  auto* const keys = static_cast<std::uint32_t*>(buffers[0]);
  auto* const sorted_keys = static_cast<std::uint32_t*>(buffers[1]);
  auto* const values = static_cast<std::int32_t*>(buffers[2]);
  auto* const sorted_values = static_cast<std::int32_t*>(buffers[3]);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  std::size_t scan_bytes = 0, sort_bytes = 0;  // the size queries launch nothing
  REQUIRE(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, values, sorted_values, n, on_1) == cudaSuccess);
  REQUIRE(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, sorted_keys, values, sorted_values, n, 0, 32, on_1) == cudaSuccess);
  REQUIRE((scan_bytes <= 4096 && sort_bytes <= 4096));
  CHECK(cub::DeviceScan::ExclusiveSum(buffers[4], scan_bytes, values, sorted_values, n, on_1) == cudaErrorNotPermitted);
  std::string said = cudaGetErrorString(cudaErrorNotPermitted);
  CHECK_MESSAGE(contains(said, "kernel 'cub::DeviceScan::ExclusiveSum' launched on stream"), said);
  CHECK_MESSAGE(contains(said, "(device 1) from a thread whose current device is 0: call cudaSetDevice(1)"), said);
  CHECK(cub::DeviceRadixSort::SortPairs(buffers[4], sort_bytes, keys, sorted_keys, values, sorted_values, n, 0, 32, on_1) ==
        cudaErrorNotPermitted);
  said = cudaGetErrorString(cudaErrorNotPermitted);
  CHECK_MESSAGE(contains(said, "kernel 'cub::DeviceRadixSort::SortPairs' launched on stream"), said);
  (void)cudaGetLastError();
  REQUIRE(cudaSetDevice(1) == cudaSuccess);  // from the stream's device they run
  CHECK(cub::DeviceScan::ExclusiveSum(buffers[4], scan_bytes, values, sorted_values, n, on_1) == cudaSuccess);
  CHECK(cub::DeviceRadixSort::SortPairs(buffers[4], sort_bytes, keys, sorted_keys, values, sorted_values, n, 0, 32, on_1) ==
        cudaSuccess);
  REQUIRE(cudaStreamSynchronize(on_1) == cudaSuccess);
  for (void* b : buffers) REQUIRE(cudaFree(b) == cudaSuccess);
  (void)cudaStreamDestroy(on_1);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  moecomm_emulation::clear_violations();
}

TEST_CASE("a host wait or an allocation for a rank's device is counted whichever thread makes it (a lane's)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    auto rows = rank.be.allocate<float>(16);
    rank.be.for_each_index(16, fill_kernel{rows.data(), 1.0f});
    std::int64_t const waits = moecomm_emulation::host_waits();
    std::int64_t const allocations = moecomm_emulation::device_allocations();
    CHECK(waits == moecomm_emulation::host_waits(rank.device));  // the current device's
    std::thread lane([&] {  // a new thread starts on device 0: the wait counts for the stream's device
      CHECK(cudaStreamSynchronize(rank.be.stream()) == cudaSuccess);
      REQUIRE(cudaSetDevice(rank.device) == cudaSuccess);
      void* p = nullptr;
      REQUIRE(cudaMalloc(&p, 64) == cudaSuccess);
      REQUIRE(cudaFree(p) == cudaSuccess);
    });
    lane.join();
    CHECK(moecomm_emulation::host_waits() == waits + 1);
    CHECK(moecomm_emulation::host_waits(rank.device) == waits + 1);
    CHECK(moecomm_emulation::device_allocations() == allocations + 1);
  });
}

TEST_CASE("ncclCommSplit puts the child on the parent's device, whatever the calling thread's current device") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    REQUIRE(cudaSetDevice(1 - rank.device) == cudaSuccess);
    ncclComm_t child = nullptr;
    ncclResult_t const r = ncclCommSplit(rank.comm.native_handle(), 0, rank.comm.rank(), &child, nullptr);
    CHECK_MESSAGE((r == ncclSuccess || r == ncclInProgress), ncclGetErrorString(r));
    int in_progress = 0;
    CHECK(settle(rank.comm.native_handle(), in_progress) == ncclSuccess);
    REQUIRE(child != nullptr);
    int device = -1;
    REQUIRE(ncclCommCuDevice(child, &device) == ncclSuccess);
    CHECK(device == rank.device);
    (void)ncclCommDestroy(child);
    REQUIRE(cudaSetDevice(rank.device) == cudaSuccess);
  });
  moecomm_emulation::clear_violations();
}

TEST_CASE("non-blocking NCCL: init, split, a group and a collective return ncclInProgress, polled to ncclSuccess") {
  moecomm_emulation::clear_violations();
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  run_threads(2, [](int r) { return r; }, [&](int r) {
    cudaStream_t stream = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    moecomm::cuda_backend const be(stream);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    int in_progress = 0;
    CHECK(ncclCommInitRankConfig(&comm, 2, id, r, &config) == ncclInProgress);
    REQUIRE(settle(comm, in_progress) == ncclSuccess);
    // A split of a non-blocking communicator: in progress on the parent, the child published when done.
    ncclComm_t child = nullptr;
    CHECK(ncclCommSplit(comm, 0, -r, &child, nullptr) == ncclInProgress);  // the child inherits the mode
    REQUIRE(settle(comm, in_progress) == ncclSuccess);
    REQUIRE(child != nullptr);
    REQUIRE(settle(child, in_progress) == ncclSuccess);
    int child_rank = -1;
    REQUIRE(ncclCommUserRank(child, &child_rank) == ncclSuccess);
    CHECK(child_rank == 1 - r);
    // A group on the child: in progress until polled.
    auto const mine = upload(be, std::vector<std::int32_t>{10 * r + 1, 10 * r + 2});
    auto got = be.allocate<std::int32_t>(2);
    REQUIRE(ncclGroupStart() == ncclSuccess);
    CHECK(ncclSend(mine.data(), 8, ncclChar, 1 - child_rank, child, stream) == ncclSuccess);
    CHECK(ncclRecv(got.data(), 8, ncclChar, 1 - child_rank, child, stream) == ncclSuccess);
    CHECK(ncclGroupEnd() == ncclInProgress);
    int const before = in_progress;
    REQUIRE(settle(child, in_progress) == ncclSuccess);
    CHECK(in_progress > before);  // polled at least once while in progress
    CHECK(download(be, got.data(), 2) == std::vector<std::int32_t>{10 * (1 - r) + 1, 10 * (1 - r) + 2});
    // A collective outside a group is a group of its own.
    auto sum = be.allocate<std::int32_t>(2);
    CHECK(ncclAllReduce(mine.data(), sum.data(), 2, ncclInt32, ncclSum, comm, stream) == ncclInProgress);
    REQUIRE(settle(comm, in_progress) == ncclSuccess);
    CHECK(download(be, sum.data(), 2) == std::vector<std::int32_t>{12, 14});
    be.synchronize();
    (void)ncclCommDestroy(child);
    (void)ncclCommDestroy(comm);
    REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  });
  CHECK(moecomm_emulation::violations().empty());
  moecomm_emulation::clear_violations();
}

TEST_CASE("a captured kernel, device copy and memset run at each of 100 graph launches, not at capture, as eagerly, without host waits") {
  moecomm_emulation::clear_violations();
  int const device = 2;
  REQUIRE(cudaSetDevice(device) == cudaSuccess);
  constexpr std::size_t n = 64, bytes = n * sizeof(float);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  float* const x = device_array<float>(n);
  float* const y = device_array<float>(n);
  float* const z = device_array<float>(n);
  float* const eager_y = device_array<float>(n);
  float* const eager_z = device_array<float>(n);
  float* const in = pinned_array<float>(n);
  float* const out = pinned_array<float>(4 * n);
  // The step: y = 2x + 1, z = y, then y's first half zeroed.
  auto step = [&](float* step_y, float* step_z) {
    REQUIRE(launch_affine(stream, x, step_y, n) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(step_z, step_y, bytes, cudaMemcpyDeviceToDevice, stream) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(step_y, 0, bytes / 2, stream) == cudaSuccess);
  };
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  REQUIRE(cudaStreamGetCaptureInfo(stream, &status, &id) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusActive);
  CHECK(id != 0);
  step(y, z);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  REQUIRE(graph != nullptr);
  CHECK(capture_status(stream) == cudaStreamCaptureStatusNone);
  // Nothing ran at capture: y and z hold cudaMalloc's bytes (0xff) still.
  REQUIRE(cudaMemcpyAsync(out, y, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(out + n, z, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  auto const* const raw = reinterpret_cast<unsigned char const*>(out);
  CHECK(std::all_of(raw, raw + 2 * bytes, [](unsigned char b) { return b == 0xff; }));
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  std::int64_t const waits = moecomm_emulation::host_waits(device);
  std::int64_t const allocations = moecomm_emulation::device_allocations(device);
  std::int64_t const launches = moecomm_emulation::graph_launches(device);
  for (int round = 0; round < 100; ++round) {
    for (std::size_t i = 0; i < n; ++i) in[i] = float(round * 1000 + int(i));  // the last round's copies were waited for
    REQUIRE(cudaMemcpyAsync(x, in, bytes, cudaMemcpyHostToDevice, stream) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
    step(eager_y, eager_z);
    float* const results[] = {y, z, eager_y, eager_z};
    for (std::size_t k = 0; k < 4; ++k)
      REQUIRE(cudaMemcpyAsync(out + k * n, results[k], bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    std::vector<float> expected_y(n), expected_z(n);
    for (std::size_t i = 0; i < n; ++i) {
      expected_z[i] = 2.0f * in[i] + 1.0f;
      expected_y[i] = i < n / 2 ? 0.0f : expected_z[i];
    }
    std::vector<float> const replayed_y(out, out + n), replayed_z(out + n, out + 2 * n);
    CHECK(replayed_y == std::vector<float>(out + 2 * n, out + 3 * n));
    CHECK(replayed_z == std::vector<float>(out + 3 * n, out + 4 * n));
    CHECK(replayed_y == expected_y);
    CHECK(replayed_z == expected_z);
  }
  CHECK(moecomm_emulation::host_waits(device) == waits + 100);  // the test's own synchronisations
  CHECK(moecomm_emulation::device_allocations(device) == allocations);
  CHECK(moecomm_emulation::graph_launches(device) == launches + 100);
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaGraphExecDestroy(exec) == cudaErrorInvalidValue);
  CHECK(cudaGraphDestroy(graph) == cudaErrorInvalidValue);
  CHECK(cudaGraphLaunch(exec, stream) == cudaErrorInvalidValue);
  (void)cudaGetLastError();
  for (float* p : {x, y, z, eager_y, eager_z}) REQUIRE(cudaFree(p) == cudaSuccess);
  for (float* p : {in, out}) REQUIRE(cudaFreeHost(p) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK(moecomm_emulation::violations().empty());
}

TEST_CASE("captured NCCL calls, an all-reduce and a grouped send/receive ring, replay 100 times on four ranks as eager calls do") {
  moecomm_emulation::clear_violations();
  constexpr int ranks = 4;
  constexpr std::size_t n = 16, bytes = n * sizeof(float);
  ncclUniqueId nccl_id;
  REQUIRE(ncclGetUniqueId(&nccl_id) == ncclSuccess);
  std::vector<ncclResult_t> lone_replay(ranks, ncclSuccess);
  std::vector<std::string> lone_replay_said(ranks);
  run_threads(ranks, [](int r) { return r; }, [&](int r) {
    cudaStream_t stream = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    ncclComm_t comm = nullptr;
    REQUIRE(ncclCommInitRank(&comm, ranks, nccl_id, r) == ncclSuccess);
    float* const send = device_array<float>(n);
    float* const sum = device_array<float>(n);
    float* const got = device_array<float>(n);
    float* const eager_sum = device_array<float>(n);
    float* const eager_got = device_array<float>(n);
    float* const in = pinned_array<float>(n);
    float* const out = pinned_array<float>(4 * n);
    int const to = (r + 1) % ranks, from = (r + ranks - 1) % ranks;
    auto step = [&](float* step_sum, float* step_got) {
      REQUIRE(ncclAllReduce(send, step_sum, n, ncclFloat32, ncclSum, comm, stream) == ncclSuccess);
      REQUIRE(ncclGroupStart() == ncclSuccess);
      REQUIRE(ncclSend(send, n, ncclFloat32, to, comm, stream) == ncclSuccess);
      REQUIRE(ncclRecv(step_got, n, ncclFloat32, from, comm, stream) == ncclSuccess);
      REQUIRE(ncclGroupEnd() == ncclSuccess);
    };
    // Thread-local: a global capture would forbid the other ranks' allocations meanwhile.
    REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    step(sum, got);
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    for (int round = 0; round < 100; ++round) {
      for (std::size_t i = 0; i < n; ++i) in[i] = float(100 * r + round + int(i));
      REQUIRE(cudaMemcpyAsync(send, in, bytes, cudaMemcpyHostToDevice, stream) == cudaSuccess);
      REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
      step(eager_sum, eager_got);
      float* const results[] = {sum, got, eager_sum, eager_got};
      for (std::size_t k = 0; k < 4; ++k)
        REQUIRE(cudaMemcpyAsync(out + k * n, results[k], bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      std::vector<float> expected_sum(n), expected_got(n);
      for (std::size_t i = 0; i < n; ++i) {
        expected_sum[i] = float(100 * (0 + 1 + 2 + 3) + ranks * (round + int(i)));
        expected_got[i] = float(100 * from + round + int(i));
      }
      std::vector<float> const replayed_sum(out, out + n), replayed_got(out + n, out + 2 * n);
      CHECK(replayed_sum == std::vector<float>(out + 2 * n, out + 3 * n));
      CHECK(replayed_got == std::vector<float>(out + 3 * n, out + 4 * n));
      CHECK(replayed_sum == expected_sum);
      CHECK(replayed_got == expected_got);
    }
    // A rank that replays alone waits for peers that left: its communicator fails instead of hanging.
    if (r != 0) REQUIRE(ncclCommDestroy(comm) == ncclSuccess);
    if (r == 0) {
      REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      REQUIRE(ncclCommGetAsyncError(comm, &lone_replay[0]) == ncclSuccess);
      lone_replay_said[0] = ncclGetLastError(comm);
      REQUIRE(ncclCommDestroy(comm) == ncclSuccess);
    }
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    for (float* p : {send, sum, got, eager_sum, eager_got}) REQUIRE(cudaFree(p) == cudaSuccess);
    for (float* p : {in, out}) REQUIRE(cudaFreeHost(p) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  });
  CHECK(lone_replay[0] == ncclRemoteError);
  CHECK_MESSAGE(contains(lone_replay_said[0], "destroyed its communicator"), lone_replay_said[0]);
  CHECK(moecomm_emulation::violations().empty());
}

TEST_CASE("a call CUDA forbids during a capture fails, names the call and the stream, and invalidates the capture") {
  moecomm_emulation::clear_violations();
  REQUIRE(cudaSetDevice(3) == cudaSuccess);
  cudaStream_t stream = nullptr, blocking = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
  cudaEvent_t event = nullptr;
  REQUIRE(cudaEventCreate(&event) == cudaSuccess);
  float* const x = device_array<float>(64);
  float* const spare = device_array<float>(64);
  float* const spare_host = pinned_array<float>(64);
  std::vector<float> pageable(64);
  void* made = nullptr;
  struct forbidden {
    char const* call;
    cudaError_t error;
    std::function<cudaError_t()> make;
    char const* why;
  };
  char const* const unsafe = "captures a CUDA graph (begun with cudaStreamCaptureModeGlobal on this thread";
  char const* const host_wait = "while it captures a CUDA graph: a captured step may not wait on the host";
  char const* const captured_event = "during a CUDA graph's capture";
  char const* const stream_memory = "a captured step allocates and frees nothing";
  std::vector<forbidden> const cases{
      {"cudaMalloc", cudaErrorStreamCaptureUnsupported, [&] { return cudaMalloc(&made, 64); }, unsafe},
      {"cudaMallocHost", cudaErrorStreamCaptureUnsupported, [&] { return cudaMallocHost(&made, 64); }, unsafe},
      {"cudaHostAlloc", cudaErrorStreamCaptureUnsupported, [&] { return cudaHostAlloc(&made, 64, 0); }, unsafe},
      {"cudaFree", cudaErrorStreamCaptureUnsupported, [&] { return cudaFree(spare); }, unsafe},
      {"cudaFreeHost", cudaErrorStreamCaptureUnsupported, [&] { return cudaFreeHost(spare_host); }, unsafe},
      {"cudaMemcpy", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpy(pageable.data(), x, 256, cudaMemcpyDeviceToHost); }, unsafe},
      {"cudaMemset", cudaErrorStreamCaptureUnsupported, [&] { return cudaMemset(x, 0, 256); }, unsafe},
      {"cudaDeviceSynchronize", cudaErrorStreamCaptureUnsupported, [] { return cudaDeviceSynchronize(); }, unsafe},
      {"cudaStreamSynchronize", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamSynchronize(stream); }, host_wait},
      {"cudaStreamQuery", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamQuery(stream); }, host_wait},
      {"cudaEventSynchronize", cudaErrorCapturedEvent,
       [&] {
         REQUIRE(cudaEventRecord(event, stream) == cudaSuccess);
         return cudaEventSynchronize(event);
       },
       captured_event},
      {"cudaEventQuery", cudaErrorCapturedEvent,
       [&] {
         REQUIRE(cudaEventRecord(event, stream) == cudaSuccess);
         return cudaEventQuery(event);
       },
       captured_event},
      {"cudaMemcpyAsync", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpyAsync(x, pageable.data(), 256, cudaMemcpyHostToDevice, stream); }, "pageable host memory"},
      {"cudaMallocAsync", cudaErrorStreamCaptureUnsupported, [&] { return cudaMallocAsync(&made, 64, stream); }, stream_memory},
      {"cudaFreeAsync", cudaErrorStreamCaptureUnsupported, [&] { return cudaFreeAsync(spare, stream); }, stream_memory},
  };
  for (forbidden const& c : cases) {
    CAPTURE(c.call);
    REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(x, 0, 256, stream) == cudaSuccess);
    CHECK(c.make() == c.error);
    std::string const said = cudaGetErrorString(c.error);
    CHECK_MESSAGE(said.rfind(std::string(c.call) + " ", 0) == 0, said);
    CHECK_MESSAGE(contains(said, "stream "), said);
    CHECK_MESSAGE(contains(said, "(device 3)"), said);
    CHECK_MESSAGE(contains(said, c.why), said);
    CHECK(capture_status(stream) == cudaStreamCaptureStatusInvalidated);
    CHECK(cudaMemsetAsync(x, 0, 256, stream) == cudaErrorStreamCaptureInvalidated);
    cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(&made);  // not null: the call sets it
    CHECK(cudaStreamEndCapture(stream, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);
    CHECK_MESSAGE(contains(cudaGetErrorString(cudaErrorStreamCaptureInvalidated), said), cudaGetErrorString(cudaErrorStreamCaptureInvalidated));
    CHECK(capture_status(stream) == cudaStreamCaptureStatusNone);
    CHECK(any_violation_mentions(said));
  }
  // The legacy stream may not depend on a capturing blocking stream of its device.
  REQUIRE(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal) == cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CHECK(cudaStreamIsCapturing(nullptr, &status) == cudaErrorStreamCaptureImplicit);  // the capture goes on
  CHECK(capture_status(blocking) == cudaStreamCaptureStatusActive);
  CHECK(cudaMemsetAsync(x, 0, 256, nullptr) == cudaErrorStreamCaptureImplicit);
  std::string const said = cudaGetErrorString(cudaErrorStreamCaptureImplicit);
  CHECK_MESSAGE(contains(said, "cudaMemsetAsync on the legacy default stream of device 3 while stream"), said);
  CHECK_MESSAGE(contains(said, "(device 3), a blocking stream, captures a CUDA graph"), said);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking, &graph) == cudaErrorStreamCaptureInvalidated);
  CHECK(graph == nullptr);
  // Where the calls are allowed again, they work (the refused ones did nothing).
  REQUIRE(cudaMemset(x, 0, 256) == cudaSuccess);
  REQUIRE(cudaFree(spare) == cudaSuccess);
  REQUIRE(cudaFreeHost(spare_host) == cudaSuccess);
  REQUIRE(cudaFree(x) == cudaSuccess);
  (void)cudaEventDestroy(event);
  (void)cudaStreamDestroy(stream);
  (void)cudaStreamDestroy(blocking);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  moecomm_emulation::clear_violations();
}

TEST_CASE("the capture mode decides which threads a capture forbids potentially unsafe calls, as CUDA's rule says") {
  moecomm_emulation::clear_violations();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  // What cudaMalloc answers on a new thread in `mode` (cudaThreadExchangeStreamCaptureMode).
  auto malloc_on_thread = [](cudaStreamCaptureMode mode) {
    cudaError_t result = cudaSuccess;
    std::thread([&] {
      cudaStreamCaptureMode swapped = mode;
      REQUIRE(cudaThreadExchangeStreamCaptureMode(&swapped) == cudaSuccess);
      CHECK(swapped == cudaStreamCaptureModeGlobal);  // a thread's default
      void* p = nullptr;
      result = cudaMalloc(&p, 64);
      if (result == cudaSuccess) REQUIRE(cudaFree(p) == cudaSuccess);
    }).join();
    return result;
  };
  auto end = [&](cudaError_t expected) {
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(stream, &graph) == expected);
    CHECK((graph != nullptr) == (expected == cudaSuccess));
    if (graph != nullptr) REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  };
  // Relaxed: the capturing thread itself may allocate.
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  void* p = nullptr;
  CHECK(cudaMalloc(&p, 64) == cudaSuccess);
  CHECK(cudaFree(p) == cudaSuccess);
  CHECK(malloc_on_thread(cudaStreamCaptureModeGlobal) == cudaSuccess);
  end(cudaSuccess);
  // Thread-local: forbids the capturing thread's calls only.
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(malloc_on_thread(cudaStreamCaptureModeGlobal) == cudaSuccess);
  end(cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(cudaMalloc(&p, 64) == cudaErrorStreamCaptureUnsupported);
  end(cudaErrorStreamCaptureInvalidated);
  // Global: forbids every thread in global mode, not those that chose thread-local or relaxed.
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  CHECK(malloc_on_thread(cudaStreamCaptureModeRelaxed) == cudaSuccess);
  CHECK(malloc_on_thread(cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(malloc_on_thread(cudaStreamCaptureModeGlobal) == cudaErrorStreamCaptureUnsupported);
  CHECK(any_violation_mentions("cudaMalloc while stream"));
  CHECK(any_violation_mentions("captures a CUDA graph (begun with cudaStreamCaptureModeGlobal on another thread"));
  end(cudaErrorStreamCaptureInvalidated);
  // The capturing thread in relaxed mode may allocate during its own global capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  REQUIRE(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  CHECK(cudaMalloc(&p, 64) == cudaSuccess);
  CHECK(cudaFree(p) == cudaSuccess);
  end(cudaSuccess);
  REQUIRE(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess);
  CHECK(mode == cudaStreamCaptureModeRelaxed);
  (void)cudaStreamDestroy(stream);
  moecomm_emulation::clear_violations();
}

TEST_CASE("a capture forks to a second stream and joins back through events; an unjoined fork, an outside event, the wrong stream or thread fail as in CUDA") {
  moecomm_emulation::clear_violations();
  REQUIRE(cudaSetDevice(4) == cudaSuccess);
  constexpr std::size_t n = 32, bytes = n * sizeof(float);
  cudaStream_t a = nullptr, b = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t forked = nullptr, joined = nullptr, outside = nullptr;
  for (cudaEvent_t* e : {&forked, &joined, &outside}) REQUIRE(cudaEventCreateWithFlags(e, cudaEventDisableTiming) == cudaSuccess);
  float* const x = device_array<float>(n);
  float* const y = device_array<float>(n);
  float* const z = device_array<float>(n);
  float* const in = pinned_array<float>(n);
  float* const out = pinned_array<float>(n);
  cudaGraph_t graph = nullptr;
  // y = 2x + 1 on a; z = 2y + 1 on b, forked from a and joined back.
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(launch_affine(a, x, y, n) == cudaSuccess);
  REQUIRE(cudaEventRecord(forked, a) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(b, forked, 0) == cudaSuccess);
  CHECK(capture_status(b) == cudaStreamCaptureStatusActive);
  REQUIRE(launch_affine(b, y, z, n) == cudaSuccess);
  REQUIRE(cudaEventRecord(joined, b) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(a, joined, 0) == cudaSuccess);
  REQUIRE(cudaStreamEndCapture(a, &graph) == cudaSuccess);
  CHECK(capture_status(b) == cudaStreamCaptureStatusNone);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < n; ++i) in[i] = float(round * 10 + int(i));
    REQUIRE(cudaMemcpyAsync(x, in, bytes, cudaMemcpyHostToDevice, a) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, a) == cudaSuccess);  // b's work replays on a, after a's
    REQUIRE(cudaMemcpyAsync(out, z, bytes, cudaMemcpyDeviceToHost, a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);
    std::vector<float> expected(n);
    for (std::size_t i = 0; i < n; ++i) expected[i] = 4.0f * in[i] + 3.0f;
    CHECK(std::vector<float>(out, out + n) == expected);
  }
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(moecomm_emulation::violations().empty());
  CHECK(cudaEventQuery(forked) == cudaErrorCapturedEvent);  // its last record is a point of the graph
  // A fork whose last work the origin never waited for.
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaEventRecord(forked, a) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(b, forked, 0) == cudaSuccess);
  REQUIRE(launch_affine(b, x, y, n) == cudaSuccess);
  CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureUnjoined);
  CHECK(graph == nullptr);
  std::string said = cudaGetErrorString(cudaErrorStreamCaptureUnjoined);
  CHECK_MESSAGE(contains(said, "joined the capture and its last captured work is not waited for on the origin stream"), said);
  CHECK(capture_status(b) == cudaStreamCaptureStatusNone);
  // A capturing stream waiting for an event recorded outside the capture.
  REQUIRE(cudaEventRecord(outside, b) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  CHECK(cudaStreamWaitEvent(a, outside, 0) == cudaErrorStreamCaptureIsolation);
  said = cudaGetErrorString(cudaErrorStreamCaptureIsolation);
  CHECK_MESSAGE(contains(said, "of an event recorded outside the capture"), said);
  CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureInvalidated);
  // Ended on a stream that joined, not on the origin.
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaEventRecord(forked, a) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(b, forked, 0) == cudaSuccess);
  CHECK(cudaStreamEndCapture(b, &graph) == cudaErrorStreamCaptureUnmatched);
  CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureInvalidated);
  // Ended by another thread: refused unless the capture is relaxed.
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  cudaError_t ended = cudaSuccess;
  std::thread([&] { ended = cudaStreamEndCapture(a, &graph); }).join();
  CHECK(ended == cudaErrorStreamCaptureWrongThread);
  CHECK(cudaStreamEndCapture(a, &graph) == cudaErrorStreamCaptureInvalidated);
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  REQUIRE(launch_affine(a, x, y, n) == cudaSuccess);
  std::thread([&] { ended = cudaStreamEndCapture(a, &graph); }).join();
  CHECK(ended == cudaSuccess);
  REQUIRE(graph != nullptr);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  // Neither the legacy stream nor a capturing one begins a capture; a capture ends once.
  CHECK(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal) == cudaErrorStreamCaptureUnsupported);
  REQUIRE(cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  CHECK(cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaErrorIllegalState);
  REQUIRE(cudaStreamEndCapture(a, &graph) == cudaSuccess);
  cudaGraph_t none = nullptr;
  CHECK(cudaStreamEndCapture(a, &none) == cudaErrorIllegalState);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  (void)cudaGetLastError();
  REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);
  for (float* p : {x, y, z}) REQUIRE(cudaFree(p) == cudaSuccess);
  for (float* p : {in, out}) REQUIRE(cudaFreeHost(p) == cudaSuccess);
  for (cudaEvent_t e : {forked, joined, outside}) (void)cudaEventDestroy(e);
  (void)cudaStreamDestroy(a);
  (void)cudaStreamDestroy(b);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  moecomm_emulation::clear_violations();
}

}  // namespace test
