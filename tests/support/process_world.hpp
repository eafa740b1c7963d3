// SPDX-License-Identifier: Apache-2.0
#pragma once
// A world of N processes without a launcher, as torch.multiprocessing.spawn makes one: the test
// program started with `--processes N` starts N copies of itself (MOECOMM_TEST_RANK = 0..N-1,
// MOECOMM_TEST_STORE = a fresh directory for their rendezvous), waits for them within a deadline,
// kills them all if it passes, and exits with the worst exit code. Each copy runs the test cases.

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace test {

struct process_rank {
  int rank = -1;  // -1: this is the launcher
  int size = 0;
  std::string store;  // the rendezvous directory every process shares
};

inline process_rank this_process() {
  process_rank p;
  if (char const* r = std::getenv("MOECOMM_TEST_RANK")) {
    p.rank = std::atoi(r);
    p.size = std::atoi(std::getenv("MOECOMM_TEST_SIZE"));
    p.store = std::getenv("MOECOMM_TEST_STORE");
  }
  return p;
}

// Starts `processes` copies of /proc/self/exe with `args`, and returns the worst exit code (a copy
// killed by a signal, or still running at the deadline, counts as 1).
inline int run_processes(int processes, std::vector<std::string> const& args, std::chrono::seconds deadline) {
  char dir_template[] = "/tmp/moecomm-world-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  std::string const store = dir_template;
  std::vector<pid_t> children;
  for (int r = 0; r < processes; ++r) {
    std::vector<std::string> env{"MOECOMM_TEST_RANK=" + std::to_string(r), "MOECOMM_TEST_SIZE=" + std::to_string(processes),
                                 "MOECOMM_TEST_STORE=" + store};
    for (char** e = environ; *e != nullptr; ++e)
      if (std::strncmp(*e, "MOECOMM_TEST_", 13) != 0) env.emplace_back(*e);
    std::vector<char*> envp, argv{const_cast<char*>("/proc/self/exe")};
    for (auto& e : env) envp.push_back(e.data());
    for (auto const& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    envp.push_back(nullptr);
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()) != 0) {
      std::perror("posix_spawn");
      for (pid_t c : children) kill(c, SIGKILL);
      return 1;
    }
    children.push_back(pid);
  }
  int worst = 0, running = processes;
  auto const end = std::chrono::steady_clock::now() + deadline;
  std::vector<bool> done(children.size(), false);
  while (running > 0) {
    for (std::size_t i = 0; i < children.size(); ++i) {
      int status = 0;
      if (done[i] || waitpid(children[i], &status, WNOHANG) != children[i]) continue;
      done[i] = true;
      --running;
      int const code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
      if (code != 0) std::fprintf(stderr, "process %zu of %d exited with %d\n", i, processes, code);
      worst = code > worst ? code : worst;
    }
    if (running > 0 && std::chrono::steady_clock::now() > end) {
      std::fprintf(stderr, "%d of %d processes still running after %lld s: killed\n", running, processes,
                   static_cast<long long>(deadline.count()));
      for (std::size_t i = 0; i < children.size(); ++i)
        if (!done[i]) kill(children[i], SIGKILL);
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string const clean = "rm -rf '" + store + "'";
  if (std::system(clean.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", store.c_str());
  return worst;
}

}  // namespace test
