// SPDX-License-Identifier: Apache-2.0
#pragma once
// Running a body on every rank of an in-process world and collecting what each rank ended with.

#include "../support/test_support.hpp"

#include <moecomm/comm/inproc.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace test {

// How one rank's body ended: success, or a moecomm::error's status and message.
struct outcome {
  moecomm::status code = moecomm::status::success;
  std::string message;
};

// Runs `body(communicator)` on every rank of `world`, each on a thread of its own (not `run`, so that
// a rank's error does not abort the world), and returns how each rank ended.
template <class F>
std::vector<outcome> on_every_rank(moecomm::inproc_world const& world, F body) {
  std::vector<outcome> outcomes(static_cast<std::size_t>(world.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < world.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        body(world.communicator(r));
      } catch (moecomm::error const& e) {
        outcomes[static_cast<std::size_t>(r)] = {e.code(), e.what()};
      }
    });
  for (auto& t : threads) t.join();
  return outcomes;
}

// Runs `body` on every rank of a fresh world and returns each rank's error message ("" if none).
template <class F>
std::vector<std::string> errors_on_every_rank(int ranks, std::chrono::milliseconds timeout, F body,
                                              std::vector<moecomm::status>* codes = nullptr) {
  moecomm::inproc_world const world(ranks, timeout);
  std::vector<std::string> messages;
  if (codes != nullptr) codes->clear();
  for (outcome const& o : on_every_rank(world, body)) {
    messages.push_back(o.message);
    if (codes != nullptr) codes->push_back(o.code);
  }
  return messages;
}

}  // namespace test
