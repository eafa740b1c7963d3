// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `simgrid_communicator`: ranks as S4U actors on the hosts of a simulated platform, made by a
//! `simgrid_world`. The library's code runs for real and the data really moves; time is SimGrid's.
//!
//! Each collective is a rendezvous, checked exactly as in-process (`<moecomm/comm/detail/posted_calls.hpp>`:
//! a bad argument, ranks that disagree, an exchange pair whose sizes differ throw on every rank; the
//! rendezvous itself costs no simulated time), followed by the point-to-point messages a real
//! implementation sends, which SimGrid prices with latency, bandwidth and contention:
//!
//! | operation | messages (n ranks) |
//! |---|---|
//! | `exchange` | every non-empty block at once, as NCCL's grouped send/recv; a rank's block to itself is a device copy |
//! | `allgather` | ring: n − 1 steps, each rank forwards one block to the next rank |
//! | `broadcast` | pipelined chain from the root, in chunks of ≤ 1 MiB simulated (at most 64) |
//! | `reduce` | pipelined chain towards the root, same chunks |
//! | `allreduce` | ring: reduce-scatter then all-gather, 2(n − 1) steps of `count / n` elements |
//! | `barrier` | dissemination: ⌈log2 n⌉ rounds of empty messages |
//! | `split` | a ring all-gather of each rank's (color, key) |
//!
//! Every collective but `barrier` and `split` (host-side agreements, no device kernel) is a device
//! kernel: it first costs the platform's `collective_overhead_s`, and with device contention on it
//! holds `comm_sm_share` of its GPU's FLOP rate while its messages move
//! (`detail::communication_kernel`, `<moecomm/simulation/device_time.hpp>`).
//!
//! Payloads travel by pointer (SimGrid's messages carry a pointer and a simulated size): a receiver
//! copies from the sender's buffer when its message has arrived, and every rank waits for all at
//! the end of the collective, so no buffer changes while a peer still reads it. Reductions are
//! priced as above but computed in ascending rank order, as in-process, so their bits are
//! `inproc_communicator`'s. Message sizes are multiplied by the payload scale of the calling actor
//! (`<moecomm/core/simulation_hooks.hpp>`).
//!
//! Failures: a rank that throws aborts the world, so every rank waiting in a collective throws
//! `aborted`; every wait is bounded by the world's timeout in simulated seconds. Ranks that wait
//! where no one will come (different groups, a rank that returned) are found by SimGrid's deadlock
//! detection: the engine stops them, and `simgrid_world::run` throws `invalid_usage` naming where
//! each waited.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/detail/posted_calls.hpp>
#include <moecomm/comm/detail/rendezvous_communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/simulation/device_time.hpp>
#include <moecomm/simulation/platform.hpp>
#include <moecomm/simulation/timeline.hpp>

#include <simgrid/Exception.hpp>
#include <simgrid/s4u/Actor.hpp>
#include <simgrid/s4u/Comm.hpp>
#include <simgrid/s4u/ConditionVariable.hpp>
#include <simgrid/s4u/Engine.hpp>
#include <simgrid/s4u/Host.hpp>
#include <simgrid/s4u/Mailbox.hpp>
#include <simgrid/s4u/Mutex.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! A group's rendezvous, with the SimGrid objects its ranks wait on and send through.
struct simgrid_group : rendezvous_group {
  simgrid::s4u::MutexPtr mutex = simgrid::s4u::Mutex::create();
  simgrid::s4u::ConditionVariablePtr wake = simgrid::s4u::ConditionVariable::create();
  std::vector<simgrid::s4u::Mailbox*> mailboxes;  //!< [from][to], made on first use

  //! The mailbox of messages from group rank `from` to group rank `to`.
  simgrid::s4u::Mailbox* mailbox(int from, int to) {
    std::size_t const n = members.size();
    if (mailboxes.empty()) mailboxes.assign(n * n, nullptr);
    simgrid::s4u::Mailbox*& box = mailboxes[static_cast<std::size_t>(from) * n + static_cast<std::size_t>(to)];
    if (box == nullptr) box = simgrid::s4u::Mailbox::by_name(concat("moecomm:g", id, ":", from, ">", to));
    return box;
  }
};

//! Shared by every group of one world. Actors run one at a time, so no lock guards it.
struct simgrid_state : rendezvous_world<simgrid_group> {
  std::vector<simgrid::s4u::Host*> hosts;  //!< per world rank
  double timeout_seconds = 3600;           //!< simulated
  std::vector<std::shared_ptr<simgrid_group>> groups;  //!< to wake them all on abort
  //! Where a world rank waits: a collective of a group (described only when a deadlock is reported).
  struct wait_site {
    char const* op = nullptr;  //!< null: not in a collective
    simgrid_group const* group = nullptr;
    [[nodiscard]] std::string describe() const {
      if (op == nullptr) return "something outside a collective";
      return concat(op, " on ", group->id == world_group_id ? std::string("the world") : describe_group(group->id, group->members));
    }
  };
  std::vector<wait_site> waiting_in;  //!< per world rank
  std::vector<char> returned;         //!< per world rank: its function in `run` returned

  std::shared_ptr<simgrid_group> make_group(std::vector<int> members) {
    std::shared_ptr<simgrid_group> g = new_group(std::move(members));
    groups.push_back(g);
    return g;
  }

  void abort(std::string reason) {
    mark_aborted(std::move(reason));
    wake_all();
  }

  void wake_all() const {
    for (auto const& g : groups) g->wake->notify_all();
  }

  //! Whether group rank `r` of `g` returned from `run` without arriving for the current phase.
  [[nodiscard]] bool left(simgrid_group const& g, std::size_t r) const {
    return returned[static_cast<std::size_t>(g.members[r])] && g.arrived_for[r] != g.phase + 1;
  }

  //! The world ranks of `g` that `left` (on a failure only).
  [[nodiscard]] std::vector<int> returned_from(simgrid_group const& g) const {
    std::vector<int> gone;
    for (std::size_t r = 0; r < g.members.size(); ++r)
      if (left(g, r)) gone.push_back(g.members[r]);
    return gone;
  }

  //! Whether any rank of `g` `left` (checked at every wake-up, so it allocates nothing).
  [[nodiscard]] bool any_returned_from(simgrid_group const& g) const {
    for (std::size_t r = 0; r < g.members.size(); ++r)
      if (left(g, r)) return true;
    return false;
  }
};

//! The link class of a message between two hosts, for the timeline: hosts of one node share
//! their innermost zone; nodes of one domain share their parent zone.
inline char const* link_class(simgrid::s4u::Host const* a, simgrid::s4u::Host const* b) {
  auto const* za = a->get_englobing_zone();
  auto const* zb = b->get_englobing_zone();
  if (za == zb) return "intra-node";
  if (za->get_parent() == zb->get_parent()) return "inter-node";
  return "inter-domain";
}

}  // namespace detail

class simgrid_world;

//! One rank's handle on a group of simulated ranks. Use it only on that rank's actor (or a lane of
//! it). See the file comment for the messages each operation sends.
class simgrid_communicator
    : public detail::rendezvous_communicator<simgrid_communicator, detail::simgrid_state, detail::simgrid_group> {
 public:
  [[nodiscard]] simgrid_communicator split(int color, int key) {
    std::int32_t const mine[2] = {color, key};
    int const split = splits_made_++;
    collective(post("split", 0, 0, mine, [&](char const* here) { detail::validate_split(here, color); }), [&] {
      price_ring(size() - 1, sizeof mine);
      // Group rank 0 makes every group of this split while the others wait at the collective's end:
      // making one yields to other actors (SimGrid makes its lock), so only one rank may.
      if (rank_ != 0) return detail::call_problem{};
      for (auto& [c, members] : split_members())  // ids in ascending color, so messages name groups the same every run
        state_->splits[split_key(split, c)] = state_->make_group(std::move(members));
      return detail::call_problem{};
    });
    return on_group(state_->splits.at(split_key(split, color)));
  }

 private:
  friend base;
  friend class simgrid_world;
  static constexpr char name[] = "simgrid_communicator";

  using base::base;

  //! Whether `op` runs as a device kernel (NCCL's collectives), not as a host-side agreement.
  [[nodiscard]] static bool is_device_kernel(char const* op) {
    return std::strcmp(op, "barrier") != 0 && std::strcmp(op, "split") != 0;
  }

  //! Posts (`post()`) and waits; actors run one at a time, so nothing is locked.
  template <class Post>
  void rendezvous(char const* op, bool after_reading, Post&& post) {
    post();
    wait_for_all(op, after_reading);
  }

  //! Runs `transfer` (the messages), inside a communication kernel for a device collective.
  template <class Transfer>
  detail::call_problem run_transfer(char const* op, Transfer&& transfer) {
    if (!is_device_kernel(op)) return transfer();
    detail::communication_kernel const kernel;
    return transfer();
  }

  //! Waits, in simulated time bounded by the world's timeout, until every rank of the group has
  //! arrived for this phase. `after_reading` (a collective's second wait): an abort does not end
  //! the wait, because a peer may still copy from this rank's buffers (S4U passes pointers); the
  //! peers' transfers are all within the group, so they arrive (the timeout still bounds the wait).
  void wait_for_all(char const* op, bool after_reading) {
    detail::simgrid_state& s = *state_;
    detail::simgrid_group& g = *group_;
    std::uint64_t const phase = g.phase;
    if (arrive(op, after_reading)) {
      g.wake->notify_all();
      return;
    }
    char const* const here = where(op);
    bool const ends_on_abort = !after_reading;
    auto const me = static_cast<std::size_t>(world_rank());
    s.waiting_in[me] = {op, &g};
    double const deadline = simgrid::s4u::Engine::get_clock() + s.timeout_seconds;
    {
      std::unique_lock<simgrid::s4u::Mutex> lock(*g.mutex);
      while (g.phase == phase && !(s.aborted && ends_on_abort) && !s.any_returned_from(g))
        if (g.wake->wait_until(lock, deadline) == std::cv_status::timeout) break;
    }
    s.waiting_in[me] = {};
    if (g.phase != phase) return;
    if (s.aborted && ends_on_abort) detail::fail(status::aborted, here, s.abort_reason);
    if (std::vector<int> const gone = s.returned_from(g); !gone.empty()) {
      g.withdraw(rank_);
      detail::fail(status::invalid_usage, here, "world rank ", world_rank(), " waits in ", op, site(op).suffix(),
                   gone.size() > 1 ? " for world ranks " : " for world rank ", detail::rank_ranges(gone),
                   gone.size() > 1 ? ", which have" : ", which has", " returned from run");
    }
    std::string const reason = timeout_reason(op, s.timeout_seconds, " simulated seconds");
    s.abort(reason);
    detail::fail(status::timeout, here, reason);
  }

  [[nodiscard]] simgrid::s4u::Host* host_of(int group_rank) const {
    return state_->hosts[static_cast<std::size_t>(group_->members[static_cast<std::size_t>(group_rank)])];
  }

  //! Simulated bytes of `bytes` real ones sent now.
  [[nodiscard]] static double simulated(std::int64_t bytes) {
    return detail::current_payload_scale() * static_cast<double>(bytes);
  }

  //! Starts sending `bytes` at `data` (null: priced only) to group rank `to`.
  simgrid::s4u::CommPtr start_send(int to, char const* data, std::int64_t bytes) const {
    static char priced_only;  // SimGrid refuses a null payload
    char* const payload = data != nullptr ? const_cast<char*>(data) : &priced_only;
    return group_->mailbox(rank_, to)->put_async(payload, static_cast<std::uint64_t>(simulated(bytes)));
  }

  //! One message to `to` and one from `from`, both waited for; the received payload pointer goes
  //! to `*received` (if given). The receive is recorded on the timeline.
  void send_and_receive(int to, int from, char const* data, std::int64_t bytes, char** received) {
    char* payload = nullptr;
    double const start = simgrid::s4u::Engine::get_clock();
    simgrid::s4u::CommPtr const out = start_send(to, data, bytes);
    simgrid::s4u::CommPtr const in = group_->mailbox(from, rank_)->get_async<char>(&payload);
    in->wait();
    record_message(from, start, bytes);
    out->wait();
    if (received != nullptr) *received = payload;
  }

  void record_message(int from, double start, std::int64_t bytes) const {
    detail::record_event(world_rank(), detail::link_class(host_of(from), host_of(rank_)), start,
                         simgrid::s4u::Engine::get_clock(), simulated(bytes));
  }

  //! The exchange: every block at once; the own block is a device copy.
  void transfer_exchange(std::vector<send_block> const& sends, std::vector<recv_block> const& recvs) {
    comms_.clear();
    payloads_.assign(recvs.size(), nullptr);
    double const start = simgrid::s4u::Engine::get_clock();
    for (send_block const& b : sends)
      if (b.peer != rank_ && b.bytes > 0) comms_.push_back(start_send(b.peer, static_cast<char const*>(b.data), b.bytes));
    for (std::size_t i = 0; i < recvs.size(); ++i)
      if (recvs[i].peer != rank_ && recvs[i].bytes > 0)
        comms_.push_back(group_->mailbox(recvs[i].peer, rank_)->get_async<char>(&payloads_[i]));
    for (recv_block const& r : recvs)
      if (r.peer == rank_ && r.bytes > 0) {
        for (send_block const& s : sends)
          if (s.peer == rank_) std::memcpy(r.data, s.data, static_cast<std::size_t>(r.bytes));
        detail::charge_memory(2 * simulated(r.bytes));
      }
    simgrid::s4u::Comm::wait_all(comms_);
    for (std::size_t i = 0; i < recvs.size(); ++i) {
      recv_block const& r = recvs[i];
      if (r.peer == rank_ || r.bytes <= 0) continue;
      std::memcpy(r.data, payloads_[i], static_cast<std::size_t>(r.bytes));
      record_message(r.peer, start, r.bytes);
    }
    comms_.clear();
  }

  //! Ring all-gather: at step s a rank forwards block (rank − s) to the next rank and receives
  //! block (rank − s − 1) from the previous one, from that rank's own copy.
  void transfer_allgather(void const* send, char* recv, std::int64_t bytes) {
    int const n = size();
    if (bytes > 0) std::memcpy(recv + rank_ * bytes, send, static_cast<std::size_t>(bytes));
    for (int step = 0; step + 1 < n; ++step) {
      int const forwarded = (rank_ - step + n) % n, arriving = (rank_ - step - 1 + 2 * n) % n;
      char* payload = nullptr;
      send_and_receive((rank_ + 1) % n, (rank_ - 1 + n) % n, recv + forwarded * bytes, bytes, &payload);
      if (bytes > 0) std::memcpy(recv + arriving * bytes, payload, static_cast<std::size_t>(bytes));
    }
  }

  void transfer_broadcast(char* data, std::int64_t bytes, int root) { chain(root, bytes, data, true); }

  //! Dissemination: ⌈log2 n⌉ rounds of empty messages.
  void transfer_barrier() {
    for (int distance = 1; distance < size(); distance *= 2)
      send_and_receive((rank_ + distance) % size(), (rank_ - distance + size()) % size(), nullptr, 0, nullptr);
  }

  //! The price of a reduction of `bytes`: a ring (reduce-scatter, then all-gather) for `allreduce`, a
  //! chain towards the root for `reduce`. The result is computed from the posted sends.
  void transfer_reduction(std::int64_t bytes, bool all, int root) {
    if (all) price_ring(2 * (size() - 1), bytes / size());
    else chain(root, bytes, nullptr, false);
  }

  //! `steps` ring steps of `bytes` each, priced only (the data is read at the end).
  void price_ring(int steps, std::int64_t bytes) {
    int const n = size();
    for (int step = 0; step < steps; ++step) send_and_receive((rank_ + 1) % n, (rank_ - 1 + n) % n, nullptr, bytes, nullptr);
  }

  //! A pipelined chain through the ranks in order from `root` (broadcast: data flows away from the
  //! root, copied chunk by chunk) or towards it (reduce: priced only).
  void chain(int root, std::int64_t bytes, char* data, bool from_root) {
    int const n = size();
    if (n == 1) return;
    int const position = (rank_ - root + n) % n;  // 0: the root
    int const previous = from_root ? (rank_ - 1 + n) % n : (rank_ + 1) % n;
    int const next = from_root ? (rank_ + 1) % n : (rank_ - 1 + n) % n;
    bool const first = position == (from_root ? 0 : n - 1), last = position == (from_root ? n - 1 : 0);
    std::int64_t const chunks = std::clamp<std::int64_t>(
        static_cast<std::int64_t>(std::ceil(simulated(bytes) / static_cast<double>(1 << 20))), 1, 64);
    comms_.clear();
    for (std::int64_t c = 0; c < chunks; ++c) {
      std::int64_t const begin = bytes * c / chunks, length = bytes * (c + 1) / chunks - begin;
      if (!first) {
        char* payload = nullptr;
        double const start = simgrid::s4u::Engine::get_clock();
        group_->mailbox(previous, rank_)->get_async<char>(&payload)->wait();
        record_message(previous, start, length);
        if (from_root && length > 0) std::memcpy(data + begin, payload, static_cast<std::size_t>(length));
      }
      if (!last) comms_.push_back(start_send(next, from_root ? data + begin : nullptr, length));
    }
    simgrid::s4u::Comm::wait_all(comms_);
    comms_.clear();
  }

  std::vector<simgrid::s4u::CommPtr> comms_;
  std::vector<char*> payloads_;
};

//! The simulated clock, in seconds: a clock for `measure_*` and for timing steps.
struct simulated_seconds {
  double operator()() const { return simgrid::s4u::Engine::get_clock(); }
};

//! N simulated ranks on hosts of the loaded platform. `run(f)` runs `f(communicator)` on every rank
//! as an S4U actor and the simulation until all are done; worlds may run one after another.
class simgrid_world {
 public:
  //! @param hosts the host of each rank (ranks may share a host).
  //! @param timeout_seconds the longest any rank waits in a collective, in simulated seconds (> 0).
  explicit simgrid_world(std::vector<simgrid::s4u::Host*> hosts, double timeout_seconds = 3600) {
    detail::require(!hosts.empty(), "simgrid_world", "hosts is empty: give each rank a host");
    for (std::size_t r = 0; r < hosts.size(); ++r)
      detail::require(hosts[r] != nullptr, "simgrid_world", "hosts[", r, "] is null");
    detail::require(timeout_seconds > 0, "simgrid_world", "timeout_seconds = ", timeout_seconds, " must be positive");
    state_ = std::make_shared<detail::simgrid_state>();
    state_->hosts = std::move(hosts);
    state_->timeout_seconds = timeout_seconds;
    state_->waiting_in.resize(state_->hosts.size());
    state_->returned.assign(state_->hosts.size(), 0);
    group_ = state_->make_group(detail::every_rank(state_->hosts.size()));
  }

  //! Ranks on the GPUs of `platform` (built now, if it is not yet): rank r on GPU `gpu_of_rank[r]`
  //! (indices into `platform.gpu_hosts()`); empty: one rank per GPU, in order.
  explicit simgrid_world(simulated_platform const& platform, std::vector<std::int32_t> const& gpu_of_rank = {},
                         double timeout_seconds = 3600)
      : simgrid_world(hosts_of(platform, gpu_of_rank), timeout_seconds) {}

  [[nodiscard]] int size() const { return static_cast<int>(state_->hosts.size()); }
  [[nodiscard]] simgrid::s4u::Host* host(int rank) const { return state_->hosts.at(static_cast<std::size_t>(rank)); }

  //! Runs `per_rank(communicator)` on every rank and the simulation to its end. A rank that throws
  //! aborts the world (the others stop with `aborted`); the first failure is rethrown, preferring
  //! a cause to an `aborted` consequence. Ranks the engine found deadlocked make it throw
  //! `invalid_usage` naming where each waited. A failed world stays failed (make a new one).
  template <class F>
  void run(F&& per_rank) {
    simgrid::s4u::Engine& engine = detail::simgrid_engine();
    detail::require(!state_->aborted, "simgrid_world::run", "this world failed before: ", state_->abort_reason);
    std::fill(state_->returned.begin(), state_->returned.end(), 0);  // ranks of an earlier run are back
    detail::first_failure first;
    std::vector<char> finished(state_->hosts.size(), 0);
    for (int r = 0; r < size(); ++r) {
      simgrid::s4u::Actor::create(detail::concat("rank ", r), host(r), [&, r] {
        detail::rank_of_actors()[simgrid::s4u::this_actor::get_pid()] = r;
        // A rank SimGrid kills (its deadlock handling) must unwind: the kill passes through.
        std::string failed =
            first.template run<simgrid::ForcefulKillException>("simgrid_world", r, [&] { per_rank(communicator(r)); });
        if (!failed.empty()) state_->abort(std::move(failed));
        finished[static_cast<std::size_t>(r)] = 1;
        state_->returned[static_cast<std::size_t>(r)] = 1;
        state_->wake_all();
      });
    }
    engine.run();
    first.rethrow();
    std::string stuck;
    for (int r = 0; r < size(); ++r)
      if (!finished[static_cast<std::size_t>(r)])
        stuck += detail::concat(stuck.empty() ? "" : "; ", "world rank ", r, " waits in ",
                                state_->waiting_in[static_cast<std::size_t>(r)].describe());
    if (!stuck.empty()) {
      state_->abort("the simulation deadlocked");
      detail::fail(status::invalid_usage, "simgrid_world::run", "the simulation deadlocked (no rank could go on): ", stuck);
    }
  }

 private:
  static std::vector<simgrid::s4u::Host*> hosts_of(simulated_platform const& platform,
                                                   std::vector<std::int32_t> const& gpu_of_rank) {
    platform.build();
    auto const& names = platform.gpu_hosts();
    std::vector<simgrid::s4u::Host*> hosts;
    auto const gpus = static_cast<std::int32_t>(names.size());
    for (std::int32_t r = 0; r < (gpu_of_rank.empty() ? gpus : static_cast<std::int32_t>(gpu_of_rank.size())); ++r) {
      std::int32_t const gpu = gpu_of_rank.empty() ? r : gpu_of_rank[static_cast<std::size_t>(r)];
      detail::require(gpu >= 0 && gpu < gpus, "simgrid_world", "gpu_of_rank[", r, "] = ", gpu, " is not a GPU of platform '",
                      platform.name(), "' (it has ", gpus, ")");
      hosts.push_back(detail::simgrid_engine().host_by_name(names[static_cast<std::size_t>(gpu)]));
    }
    return hosts;
  }

  [[nodiscard]] simgrid_communicator communicator(int rank) const {
    return simgrid_communicator(state_, group_, rank);
  }

  std::shared_ptr<detail::simgrid_state> state_;
  std::shared_ptr<detail::simgrid_group> group_;
};

MOECOMM_NAMESPACE_END
