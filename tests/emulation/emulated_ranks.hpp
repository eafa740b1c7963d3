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
struct gpu_per_rank {};      // rank r on device r, NCCL between them
struct ranks_on_one_gpu {};  // every rank on device 0 with a stream of its own, intranode copies

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

// Runs `body(rank)` on `ranks` threads, rank r on device r, over NCCL. A rank's exception is reported after
// every thread ended; bodies use CHECK so that every rank reaches the same collectives. With fewer
// devices than ranks (a real machine), the case says so and is not run.
template <class Body>
void run_emulated_ranks(int ranks, Body const& body, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  if (ranks > visible_devices()) {
    MESSAGE("NOT RUN: this case needs ", ranks, " GPUs, the machine has ", visible_devices());
    return;
  }
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      cudaStream_t stream = nullptr;
      try {
        moecomm::detail::cuda_check(cudaSetDevice(r), "cudaSetDevice");
        moecomm::detail::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        moecomm::nccl_options options;
        options.timeout = timeout;
        emulated_rank rank{r, moecomm::cuda_backend(stream, timeout), moecomm::nccl_communicator::create(ranks, id, r, stream, options)};
        body(rank);
        rank.be.synchronize();
      } catch (std::exception const& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        failures[static_cast<std::size_t>(r)] = "a non-standard exception (a failed REQUIRE?)";
      }
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r)
    CHECK_MESSAGE(failures[static_cast<std::size_t>(r)].empty(), "rank ", r, ": ", failures[static_cast<std::size_t>(r)]);
}

// Runs `body(rank)` on `ranks` in-process ranks, all on device 0, each with a stream of its own and
// an intranode_communicator; reports each rank's exception after all ended, as run_emulated_ranks.
template <class Body>
void run_ranks_on_one_gpu(int ranks, Body const& body, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  if (visible_devices() < 1) {
    MESSAGE("NOT RUN: this case needs a GPU, the machine has none");
    return;
  }
  std::vector<std::string> failures(static_cast<std::size_t>(ranks));
  moecomm::inproc_world const world(ranks, timeout);
  world.run([&](moecomm::inproc_communicator host) {
    int const r = host.rank();
    cudaStream_t stream = nullptr;
    try {
      moecomm::detail::cuda_check(cudaSetDevice(0), "cudaSetDevice");
      moecomm::detail::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
      moecomm::cuda_backend const be(stream, timeout);
      device_rank<moecomm::intranode_communicator> rank{0, be, moecomm::intranode_communicator(host, be)};
      body(rank);
      rank.be.synchronize();
    } catch (std::exception const& e) {
      failures[static_cast<std::size_t>(r)] = e.what();
    } catch (...) {
      failures[static_cast<std::size_t>(r)] = "a non-standard exception (a failed REQUIRE?)";
    }
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  });
  for (int r = 0; r < ranks; ++r)
    CHECK_MESSAGE(failures[static_cast<std::size_t>(r)].empty(), "rank ", r, ": ", failures[static_cast<std::size_t>(r)]);
}

// `body(rank)` on `ranks` ranks placed as `Placement` says.
template <class Placement, class Body>
void run_device_ranks(int ranks, Body const& body, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  if constexpr (std::is_same_v<Placement, gpu_per_rank>) run_emulated_ranks(ranks, body, timeout);
  else run_ranks_on_one_gpu(ranks, body, timeout);
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
