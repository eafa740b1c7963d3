// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! A torch.distributed world for a C++ program, under torchrun's contract: each process reads
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (`launch_environment::from_env`), connects
//! to the `TCPStore` rank 0 serves (`connect_store`), and makes a Gloo group and its
//! `c10d_communicator` over it (`gloo_communicator`, where Gloo's headers are: `MOECOMM_HAS_GLOO()`). So the program runs under
//! `torchrun --no-python --nproc-per-node N ./program`, or under `spawn_local_processes`, which
//! starts N copies of the program on this machine with that environment, as
//! `torch.multiprocessing.spawn` does for Python.

#include <moecomm/comm/c10d.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

MOECOMM_NAMESPACE_BEGIN
namespace libtorch {

//! This process's place in a world, as torchrun passes it.
struct launch_environment {
  int rank = 0;
  int size = 1;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;

  //! The environment's world, or none when `RANK` is not set (the program was not launched as one).
  //! @throws error (invalid_argument) naming the variable that is missing or out of range.
  [[nodiscard]] static std::optional<launch_environment> from_env() {
    char const* const op = "libtorch::launch_environment::from_env";
    if (std::getenv("RANK") == nullptr) return std::nullopt;
    auto const number = [&](char const* name, long lo, long hi) {
      char const* text = std::getenv(name);
      moecomm::detail::require(text != nullptr, op, "RANK is set but ", name, " is not");
      char* end = nullptr;
      long const v = std::strtol(text, &end, 10);
      moecomm::detail::require(*text != '\0' && *end == '\0' && v >= lo && v <= hi, op, name, " = '", text,
                               "' is not an integer in [", lo, ", ", hi, "]");
      return v;
    };
    launch_environment e;
    e.size = static_cast<int>(number("WORLD_SIZE", 1, 1 << 20));
    e.rank = static_cast<int>(number("RANK", 0, e.size - 1));
    e.master_port = static_cast<std::uint16_t>(number("MASTER_PORT", 1, 65535));
    char const* addr = std::getenv("MASTER_ADDR");
    moecomm::detail::require(addr != nullptr && *addr != '\0', op, "RANK is set but MASTER_ADDR is not");
    e.master_addr = addr;
    return e;
  }
};

//! The world's key-value store: a `TCPStore` at MASTER_ADDR:MASTER_PORT that rank 0 serves.
[[nodiscard]] inline c10::intrusive_ptr<c10d::Store> connect_store(launch_environment const& e, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = e.master_port;
  o.isServer = e.rank == 0;
  o.numWorkers = static_cast<std::size_t>(e.size);
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(e.master_addr, o);
}

#if MOECOMM_HAS_GLOO()
//! A Gloo group of the world's `size` processes over `store`, as a `c10d_communicator` named
//! `options.name` (each communicator made on one store needs its own name), with splits made the
//! same way. Gloo's device: the interface `GLOO_SOCKET_IFNAME` names, else the host's own address.
[[nodiscard]] inline c10d_communicator gloo_communicator(c10::intrusive_ptr<c10d::Store> const& store, int rank, int size,
                                                         c10d_options options = {}) {
  auto gloo = c10d::ProcessGroupGloo::Options::create(options.timeout);
  char const* interface = std::getenv("GLOO_SOCKET_IFNAME");
  gloo->devices.push_back(interface != nullptr ? c10d::ProcessGroupGloo::createDeviceForInterface(interface)
                                               : c10d::ProcessGroupGloo::createDefaultDevice());
  auto const make = gloo_group_factory(store, gloo);
  return c10d_communicator(make(options.name, rank, size), make, options);
}
#endif

//! Starts `processes` copies of this program (`/proc/self/exe`) with `args` and torchrun's
//! environment (MASTER_ADDR 127.0.0.1, a free port), waits for them until `deadline`, and returns
//! the worst exit code (a copy killed by a signal counts as 1). At the deadline it kills the copies
//! still running and returns 1.
[[nodiscard]] inline int spawn_local_processes(int processes, std::vector<std::string> const& args, std::chrono::seconds deadline) {
  int port = 0;  // a port the kernel says is free now (another program may take it before rank 0 binds it)
  {
    int const s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof a;
    if (s >= 0 && bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        getsockname(s, reinterpret_cast<sockaddr*>(&a), &length) == 0)
      port = ntohs(a.sin_port);
    if (s >= 0) close(s);
    if (port == 0) {
      std::perror("spawn_local_processes: finding a free port");
      return 1;
    }
  }
  std::vector<pid_t> children;
  std::vector<bool> done;
  auto const kill_all = [&] {
    for (std::size_t i = 0; i < children.size(); ++i)
      if (!done[i]) kill(children[i], SIGKILL);
  };
  auto const is_launch_variable = [](char const* e) {
    for (char const* own : {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="})
      if (std::strncmp(e, own, std::strlen(own)) == 0) return true;
    return false;
  };
  for (int r = 0; r < processes; ++r) {
    std::vector<std::string> env{"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
                                 "WORLD_SIZE=" + std::to_string(processes), "MASTER_ADDR=127.0.0.1",
                                 "MASTER_PORT=" + std::to_string(port)};
    for (char** e = environ; *e != nullptr; ++e)
      if (!is_launch_variable(*e)) env.emplace_back(*e);
    std::vector<char*> envp, argv{const_cast<char*>("/proc/self/exe")};
    for (auto& e : env) envp.push_back(e.data());
    for (auto const& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    envp.push_back(nullptr);
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()) != 0) {
      std::perror("spawn_local_processes: posix_spawn");
      kill_all();
      return 1;
    }
    children.push_back(pid);
    done.push_back(false);
  }
  int worst = 0, running = processes;
  auto const end = std::chrono::steady_clock::now() + deadline;
  while (running > 0) {
    for (std::size_t i = 0; i < children.size(); ++i) {
      int status = 0;
      if (done[i] || waitpid(children[i], &status, WNOHANG) != children[i]) continue;
      done[i] = true;
      --running;
      int const code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
      if (code != 0) std::fprintf(stderr, "spawn_local_processes: rank %zu of %d exited with %d\n", i, processes, code);
      worst = code > worst ? code : worst;
    }
    if (running > 0 && std::chrono::steady_clock::now() > end) {
      std::fprintf(stderr, "spawn_local_processes: %d of %d ranks still running after %lld s: killed\n", running, processes,
                   static_cast<long long>(deadline.count()));
      kill_all();
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return worst;
}

}  // namespace libtorch
MOECOMM_NAMESPACE_END
