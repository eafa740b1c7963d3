// SPDX-License-Identifier: Apache-2.0
#pragma once
// Ranks on GPUs: one thread per rank, each with its own stream, a cuda_backend on it and a
// communicator over all ranks on the same stream (the device contract: the communicator enqueues on
// the back-end's stream). Two placements: `gpu_per_rank`, rank r on device r over NCCL, and
// `ranks_on_one_gpu`, every rank on device 0 over `intranode_communicator` (device-to-device copies
// ordered by events), which runs every layer on a machine with one GPU. The devices are the CUDA/NCCL
// emulation's under g++ (emulated.*), real GPUs under nvcc (cuda.*, scripts/gpu-check).

#include "../support/test_support.hpp"

#include <moecomm/backend/cuda.cuh>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/comm/intranode.cuh>
#include <moecomm/comm/nccl.cuh>
#include <moecomm/comm/staged.cuh>
#if MOECOMM_CUDA_EMULATION()
#  include <moecomm_emulation/emulation.hpp>
#endif

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace test {

template <class Comm>
struct device_rank {
  int device;
  moecomm::cuda_backend be;
  Comm comm;
};
using emulated_rank = device_rank<moecomm::nccl_communicator>;

// Where a case's ranks run; a templated case is named after its placement (doctest's TYPE_TO_STRING).
struct gpu_per_rank {};         // rank r on device r, NCCL between them
struct ranks_on_one_gpu {};     // every rank on device 0 with a stream of its own, intranode copies
struct staged_gpu_per_rank {};  // rank r on device r, in-process ranks staged through pinned memory (MPI's kind)
using staged_inproc = moecomm::staged_communicator<moecomm::inproc_communicator>;

// `data[i] = value`: a kernel.
struct fill_kernel {
  float* data;
  float value;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const { data[i] = value; }
};

inline int visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  (void)cudaGetLastError();
  return n;
}

// The broken contracts the emulation saw since the last call (a GPU reports none), forgotten.
inline std::vector<std::string> take_violations() {
#if MOECOMM_CUDA_EMULATION()
  std::vector<std::string> seen = moecomm_emulation::violations();
  moecomm_emulation::clear_violations();
  return seen;
#else
  return {};
#endif
}

// Rank `device`'s part of a run, on the calling thread: `device` current, a non-blocking stream of its
// own with a cuda_backend on it, `make_comm(be)` its communicator, then `body(rank)`. A failure is
// kept in `failure`, so that every rank's is reported after all ended; bodies use CHECK so that
// every rank reaches the same collectives.
template <class MakeComm, class Body>
void run_rank(int device, std::chrono::milliseconds timeout, std::string& failure, MakeComm const& make_comm, Body const& body) {
  cudaStream_t stream = nullptr;
  try {
    moecomm::detail::cuda_check(cudaSetDevice(device), "cudaSetDevice");
    moecomm::detail::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    moecomm::cuda_backend const be(stream, timeout);
    device_rank<decltype(make_comm(be))> rank{device, be, make_comm(be)};
    body(rank);
    rank.be.synchronize();
  } catch (std::exception const& e) {
    failure = e.what();
  } catch (...) {
    failure = "a non-standard exception (a failed REQUIRE?)";
  }
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
}

inline void check_rank_failures(std::vector<std::string> const& failures) {
  for (std::size_t r = 0; r < failures.size(); ++r) CHECK_MESSAGE(failures[r].empty(), "rank ", r, ": ", failures[r]);
}

// Says so and returns false when the machine has fewer than `needed` GPUs.
inline bool has_gpus(int needed) {
  if (visible_devices() >= needed) return true;
  MESSAGE("NOT RUN: this case needs ", needed, " GPUs, the machine has ", visible_devices());
  return false;
}

// Runs `body(rank)` on `ranks` threads, rank r on device r, over NCCL.
template <class Body>
void run_emulated_ranks(int ranks, Body const& body, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  if (!has_gpus(ranks)) return;
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      auto const nccl = [&](moecomm::cuda_backend const& be) {
        moecomm::nccl_options options;
        options.timeout = timeout;
        return moecomm::nccl_communicator::create(ranks, id, r, be.stream(), options);
      };
      run_rank(r, timeout, failures[static_cast<std::size_t>(r)], nccl, body);
    });
  for (auto& t : threads) t.join();
  check_rank_failures(failures);
}

// Runs `body(rank)` on the ranks of an in-process world, rank r on device `device_of(r)`, over
// `Comm(host, be)`: an intranode_communicator, or a staged in-process one.
template <class Comm, class Body, class DeviceOf>
void run_inproc_ranks(int ranks, Body const& body, std::chrono::milliseconds timeout, DeviceOf device_of) {
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  moecomm::inproc_world const world(ranks, timeout);
  world.run([&](moecomm::inproc_communicator host) {
    int const r = host.rank();
    run_rank(device_of(r), timeout, failures[static_cast<std::size_t>(r)], [&](moecomm::cuda_backend const& be) { return Comm(host, be); },
             body);
  });
  check_rank_failures(failures);
}

// Every rank on device 0, each with a stream of its own, over an intranode_communicator.
template <class Body>
void run_ranks_on_one_gpu(int ranks, Body const& body, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  if (has_gpus(1)) run_inproc_ranks<moecomm::intranode_communicator>(ranks, body, timeout, [](int) { return 0; });
}

// `body(rank)` on `ranks` ranks placed as `Placement` says.
template <class Placement, class Body>
void run_device_ranks(int ranks, Body const& body, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  if constexpr (std::is_same_v<Placement, gpu_per_rank>) {
    run_emulated_ranks(ranks, body, timeout);
  } else if constexpr (std::is_same_v<Placement, ranks_on_one_gpu>) {
    run_ranks_on_one_gpu(ranks, body, timeout);
  } else {
    static_assert(std::is_same_v<Placement, staged_gpu_per_rank>);
    if (has_gpus(ranks)) run_inproc_ranks<staged_inproc>(ranks, body, timeout, [](int r) { return r; });
  }
}

// Runs `body` in a child process and returns what it wrote to stderr, with `signalled` telling
// whether it was stopped by a signal (the emulation stops a process that touches device memory
// from the host). The child gets 60 s.
template <class Body>
std::string child_stderr(Body const& body, bool& signalled) {
  int ends[2];
  REQUIRE(pipe(ends) == 0);
  std::fflush(nullptr);
  pid_t const child = fork();
  if (child == 0) {
    dup2(ends[1], 2);
    alarm(60);
    body();
    _exit(0);
  }
  close(ends[1]);
  std::string text;
  char chunk[256];
  for (ssize_t n; (n = read(ends[0], chunk, sizeof chunk)) > 0;) text.append(chunk, static_cast<std::size_t>(n));
  close(ends[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  signalled = WIFSIGNALED(status) && WTERMSIG(status) != SIGALRM;
  return text;
}

}  // namespace test

TYPE_TO_STRING_AS("one GPU per rank", test::gpu_per_rank);
TYPE_TO_STRING_AS("ranks on one GPU", test::ranks_on_one_gpu);
