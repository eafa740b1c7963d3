// SPDX-License-Identifier: Apache-2.0
// The emulated NCCL: communicators over an in-process rendezvous, whose operations run as jobs on
// the emulated streams (device.cpp), so that they are ordered, and checked, like kernels.
//
// A collective is matched by its sequence number on the communicator (the k-th collective of every
// rank meets the others' k-th) and must agree in kind, size, type and root; point-to-point messages
// are matched in order per (sender, receiver), as NCCL matches them, and must agree in size. Every
// job reads its peers' buffers, then waits until all have read before it writes its own, so that
// in-place operations see the inputs. A disagreement or an abort fails the job: the communicator's
// asynchronous error says what happened, instead of the hang NCCL would give.

#include "core.hpp"

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

using moecomm_emulation::access;
using moecomm_emulation::buffer_use;
namespace emu = moecomm_emulation::detail;

namespace {

struct clique;

struct comm_state {
  std::shared_ptr<clique> group;
  int rank = 0;
  int device = 0;
  std::mutex lock;                  // the fields below
  ncclResult_t async = ncclSuccess;
  std::string async_message;
  std::thread::id owner;            // the thread that issues its operations
  bool has_owner = false;
  // Split with splitShare: the communicator whose resources it shares (the root of the chain), and
  // whose owner thread it therefore has (NCCL: no operations on both from two threads at once).
  std::shared_ptr<comm_state> shares_with;
  bool finalizing = false;          // ncclCommFinalize was called: in progress until `pending` is 0
  std::atomic<int> pending{0};      // jobs enqueued and not yet done
  std::uint64_t next_collective = 0, next_split = 0;
};

//! One collective as a rank posted it.
struct posted {
  char const* kind = "";
  std::size_t count = 0;
  ncclDataType_t type = ncclChar;
  ncclRedOp_t op = ncclSum;
  int root = 0;
  char const* send = nullptr;
  char* recv = nullptr;
};

struct round_state {
  std::vector<posted> posts;
  int arrived = 0, read = 0, left = 0;
};

struct ticket {  // a send waiting for its receive
  char const* data = nullptr;
  std::size_t bytes = 0;
  bool consumed = false;
  std::string error;
};

struct split_post {
  int color = 0, key = 0, device = 0;
  ncclComm_t* out = nullptr;
  std::shared_ptr<comm_state> shares_with;  // splitShare = 1: the communicator whose resources the child shares
};

struct split_round {
  std::vector<split_post> posts;
  int arrived = 0;
  bool done = false;
};

struct clique {
  int nranks = 0;
  int joined = 0;
  std::mutex lock;
  std::condition_variable changed;
  std::map<std::uint64_t, round_state> rounds;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<ticket>>> channels;  // (from, to)
  std::map<std::uint64_t, split_round> splits;
  bool aborted = false;
  std::string abort_reason;
  std::vector<int> departed;  // ranks that destroyed their communicator: a wait on one fails
};

struct registry_t {
  std::mutex lock;
  std::uint64_t next_id = 1;
  std::map<std::uint64_t, std::shared_ptr<clique>> forming;  // by unique id, until every rank joined
  std::map<comm_state*, std::shared_ptr<comm_state>> comms;
  std::map<int, std::thread::id> stream_issuers;  // by stream id: the thread that enqueues NCCL work on it
};
registry_t& registry() {
  static registry_t* const r = new registry_t;
  return *r;
}

thread_local std::string last_error;

//! The operations of this thread's open group.
struct pending {
  std::shared_ptr<comm_state> comm;
  cudaStream_t stream;
  bool p2p;
  bool is_send;
  int peer;
  void const* send;
  void* recv;
  std::size_t bytes;
  posted collective;
};
struct group_state {
  int depth = 0;
  std::vector<pending> ops;
  ~group_state() {
    if (depth > 0)
      emu::violation("a thread ended inside ncclGroupStart (depth " + std::to_string(depth) + ", " +
                     std::to_string(ops.size()) + " operations never launched): every ncclGroupStart needs its ncclGroupEnd");
  }
};
thread_local group_state group;

std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

std::shared_ptr<comm_state> find_comm(ncclComm_t comm) {
  std::lock_guard<std::mutex> hold(registry().lock);
  auto it = registry().comms.find(reinterpret_cast<comm_state*>(comm));
  return it == registry().comms.end() ? nullptr : it->second;
}

std::string label(comm_state const& c) {
  return "rank " + std::to_string(c.rank) + " of " + std::to_string(c.group->nranks) + " (device " + std::to_string(c.device) + ")";
}

ncclResult_t reject(ncclResult_t r, std::string message, bool contract) {
  last_error = message;
  if (contract) emu::violation(std::move(message));
  return r;
}

//! A job's failure: the communicator's asynchronous error.
void fail_async(comm_state& c, ncclResult_t r, std::string message) {
  std::lock_guard<std::mutex> hold(c.lock);
  if (c.async == ncclSuccess) {
    c.async = r;
    c.async_message = std::move(message);
  }
}

//! Waits on the clique until `ready()`; false (and the communicator failed) on an abort, when
//! `waits_on(rank)` is true for a rank that destroyed its communicator, or on a timeout.
template <class Ready, class WaitsOn>
bool await(comm_state& c, std::unique_lock<std::mutex>& hold, char const* what, Ready ready, WaitsOn waits_on) {
  clique& g = *c.group;
  auto gone = [&] {
    for (int r : g.departed)
      if (waits_on(r)) return r;
    return -1;
  };
  bool const ok = g.changed.wait_for(hold, emu::peer_wait, [&] { return g.aborted || ready() || gone() >= 0; });
  if (ready()) return true;  // what it waited for happened, whatever the peers did since
  if (g.aborted || gone() >= 0) {
    std::string const why = g.aborted ? g.abort_reason : "rank " + std::to_string(gone()) + " destroyed its communicator";
    hold.unlock();
    fail_async(c, ncclRemoteError, std::string(what) + ": " + why);
    hold.lock();
    return false;
  }
  if (!ok) {
    hold.unlock();
    fail_async(c, ncclSystemError, std::string(what) + ": the peers did not take part within the emulation's wait");
    hold.lock();
    return false;
  }
  return true;
}

//! Checks the calling thread, the stream (unless `stream_work` is false: a split) and the buffers
//! of an operation of `c`.
ncclResult_t check_call(comm_state& c, char const* call, bool stream_work, cudaStream_t stream,
                        std::initializer_list<std::pair<void const*, char const*>> buffers, std::size_t bytes) {
  {
    comm_state& o = c.shares_with ? *c.shares_with : c;
    std::lock_guard<std::mutex> hold(o.lock);
    if (!o.has_owner) {
      o.owner = std::this_thread::get_id();
      o.has_owner = true;
    } else if (o.owner != std::this_thread::get_id()) {
      std::ostringstream out;
      out << call << " on the communicator of " << label(c) << " from a second host thread: an NCCL communicator is "
          << "used by one thread (give each thread its own communicator, split at construction)";
      if (c.shares_with)
        out << "; this one was split with splitShare = 1, so it shares its parent's resources and thread (NCCL forbids "
            << "operations on a parent and such a child from two threads: split a lane's communicator with splitShare = 0)";
      return reject(ncclInvalidUsage, out.str(), true);
    }
  }
  if (!stream_work) return ncclSuccess;
  {
    std::lock_guard<std::mutex> hold(registry().lock);
    auto const [it, first] = registry().stream_issuers.emplace(emu::stream_id(stream), std::this_thread::get_id());
    if (!first && it->second != std::this_thread::get_id()) {
      std::ostringstream out;
      out << call << " on the communicator of " << label(c) << " enqueues on a stream that another host thread enqueues NCCL "
          << "work on: the two threads' operations may reach the stream in a different order on each rank and deadlock "
          << "(give each thread its own stream and communicator)";
      return reject(ncclInvalidUsage, out.str(), true);
    }
  }
  int const device = emu::stream_device(stream);
  if (device != c.device) {
    std::ostringstream out;
    out << call << " on the communicator of " << label(c) << " with a stream of device " << device;
    return reject(ncclInvalidArgument, out.str(), true);
  }
  for (auto const& [p, role] : buffers) {
    if (bytes == 0 || p == nullptr) continue;
    emu::memory_info const m = emu::describe(p, bytes);
    if (m.kind != emu::memory_info::device_memory || m.device != c.device || !m.whole) {
      std::ostringstream out;
      out << call << " on the communicator of " << label(c) << ": '" << role << "' (" << bytes << " bytes at " << p << ") is "
          << (m.kind == emu::memory_info::device_memory && m.device == c.device ? "not inside one allocation of "
                                                                                 : "not device memory of ")
          << "device " << c.device << ": it is " << m.description;
      return reject(ncclInvalidArgument, out.str(), true);
    }
  }
  return ncclSuccess;
}

template <class T>
void combine(T* acc, T const* in, std::size_t n, ncclRedOp_t op) {
  for (std::size_t i = 0; i < n; ++i) {
    switch (op) {
      case ncclSum: acc[i] = static_cast<T>(acc[i] + in[i]); break;
      case ncclProd: acc[i] = static_cast<T>(acc[i] * in[i]); break;
      case ncclMax: acc[i] = acc[i] < in[i] ? in[i] : acc[i]; break;
      case ncclMin: acc[i] = in[i] < acc[i] ? in[i] : acc[i]; break;
      default: break;
    }
  }
}

void reduce_into(char* acc, char const* in, posted const& p) {
  switch (p.type) {
    case ncclInt8: combine(reinterpret_cast<std::int8_t*>(acc), reinterpret_cast<std::int8_t const*>(in), p.count, p.op); break;
    case ncclUint8: combine(reinterpret_cast<std::uint8_t*>(acc), reinterpret_cast<std::uint8_t const*>(in), p.count, p.op); break;
    case ncclInt32: combine(reinterpret_cast<std::int32_t*>(acc), reinterpret_cast<std::int32_t const*>(in), p.count, p.op); break;
    case ncclUint32: combine(reinterpret_cast<std::uint32_t*>(acc), reinterpret_cast<std::uint32_t const*>(in), p.count, p.op); break;
    case ncclInt64: combine(reinterpret_cast<std::int64_t*>(acc), reinterpret_cast<std::int64_t const*>(in), p.count, p.op); break;
    case ncclUint64: combine(reinterpret_cast<std::uint64_t*>(acc), reinterpret_cast<std::uint64_t const*>(in), p.count, p.op); break;
    case ncclFloat32: combine(reinterpret_cast<float*>(acc), reinterpret_cast<float const*>(in), p.count, p.op); break;
    case ncclFloat64: combine(reinterpret_cast<double*>(acc), reinterpret_cast<double const*>(in), p.count, p.op); break;
    default: break;
  }
}

//! The k-th collective of rank `c.rank`, on its stream's worker: meet, read, wait, write.
void run_collective(std::shared_ptr<comm_state> const& c, std::uint64_t k, posted const& mine) {
  clique& g = *c->group;
  std::unique_lock<std::mutex> hold(g.lock);
  round_state& r = g.rounds[k];
  r.posts.resize(static_cast<std::size_t>(g.nranks));
  r.posts[static_cast<std::size_t>(c->rank)] = mine;
  ++r.arrived;
  g.changed.notify_all();
  if (!await(*c, hold, mine.kind, [&] { return r.arrived == g.nranks; },
             [&](int q) { return q != c->rank && r.posts[static_cast<std::size_t>(q)].kind[0] == '\0'; }))
    return;
  for (int q = 0; q < g.nranks; ++q) {
    posted const& p = r.posts[static_cast<std::size_t>(q)];
    if (std::strcmp(p.kind, mine.kind) != 0 || p.count != mine.count || p.type != mine.type || p.root != mine.root ||
        p.op != mine.op) {
      std::ostringstream out;
      out << "collective " << k << " of the communicator: rank " << c->rank << " called " << mine.kind << " (count "
          << mine.count << ", root " << mine.root << ") but rank " << q << " called " << p.kind << " (count " << p.count
          << ", root " << p.root << ")";
      ++r.read;
      ++r.left;
      hold.unlock();
      fail_async(*c, ncclInvalidUsage, out.str());
      g.changed.notify_all();
      return;
    }
  }
  std::size_t const bytes = mine.count * type_size(mine.type);
  std::string const kind = mine.kind;
  std::vector<char> result;
  bool writes = true;
  if (kind == "ncclAllGather") {
    result.resize(bytes * static_cast<std::size_t>(g.nranks));
    for (int q = 0; q < g.nranks; ++q)
      std::memcpy(result.data() + bytes * static_cast<std::size_t>(q), r.posts[static_cast<std::size_t>(q)].send, bytes);
  } else if (kind == "ncclBroadcast") {
    writes = c->rank != mine.root;
    if (writes) result.assign(r.posts[static_cast<std::size_t>(mine.root)].send, r.posts[static_cast<std::size_t>(mine.root)].send + bytes);
  } else {  // ncclAllReduce, ncclReduce: ascending rank order
    writes = kind == "ncclAllReduce" || c->rank == mine.root;
    if (writes) {
      result.assign(r.posts[0].send, r.posts[0].send + bytes);
      for (int q = 1; q < g.nranks; ++q) reduce_into(result.data(), r.posts[static_cast<std::size_t>(q)].send, mine);
    }
  }
  ++r.read;
  g.changed.notify_all();
  // Every rank has arrived, so every one reads and counts promptly: no abort ends this wait, or a
  // rank could free a buffer a peer still reads.
  g.changed.wait(hold, [&] { return r.read == g.nranks; });
  if (writes && !result.empty()) std::memcpy(mine.recv, result.data(), result.size());
  if (++r.left == g.nranks) g.rounds.erase(k);
}

//! A group's sends and receives of one communicator, on its stream's worker: post every send,
//! take every receive in order, then wait until every send was taken.
void run_p2p(std::shared_ptr<comm_state> const& c, std::vector<pending> const& ops) {
  clique& g = *c->group;
  std::unique_lock<std::mutex> hold(g.lock);
  std::vector<std::shared_ptr<ticket>> sent;
  std::vector<int> sent_to;
  for (pending const& op : ops)
    if (op.is_send) {
      auto t = std::make_shared<ticket>();
      t->data = static_cast<char const*>(op.send);
      t->bytes = op.bytes;
      g.channels[{c->rank, op.peer}].push_back(t);
      sent.push_back(t);
      sent_to.push_back(op.peer);
    }
  g.changed.notify_all();
  auto withdraw = [&] {  // returning early: no peer may read these buffers any more
    for (auto const& w : sent)
      if (!w->consumed) {
        w->data = nullptr;
        w->error = "the sender's communicator failed before this message was taken";
      }
  };
  for (pending const& op : ops) {
    if (op.is_send) continue;
    auto& channel = g.channels[{op.peer, c->rank}];
    if (!await(*c, hold, "ncclRecv", [&] { return !channel.empty(); }, [&](int q) { return q == op.peer; })) return withdraw();
    std::shared_ptr<ticket> t = channel.front();
    channel.pop_front();
    if (t->data == nullptr && t->bytes > 0) {  // withdrawn by a failed sender
      hold.unlock();
      fail_async(*c, ncclRemoteError, "ncclRecv on rank " + std::to_string(c->rank) + ": " + t->error);
      hold.lock();
      return withdraw();
    }
    if (t->bytes != op.bytes) {
      std::ostringstream out;
      out << "ncclRecv of " << op.bytes << " bytes on rank " << c->rank << " from rank " << op.peer << " met an ncclSend of "
          << t->bytes << " bytes: a send and its receive must have the same size";
      t->error = out.str();
      t->consumed = true;
      g.changed.notify_all();
      hold.unlock();
      fail_async(*c, ncclInvalidUsage, out.str());
      hold.lock();
      return withdraw();
    }
    std::memcpy(op.recv, t->data, t->bytes);
    t->consumed = true;
    g.changed.notify_all();
  }
  for (std::size_t i = 0; i < sent.size(); ++i) {
    auto const& t = sent[i];
    int const to = sent_to[i];
    if (!await(*c, hold, "ncclSend", [&] { return t->consumed; }, [&](int q) { return q == to; })) return withdraw();
    if (!t->error.empty()) {
      hold.unlock();
      fail_async(*c, ncclInvalidUsage, t->error);
      return;
    }
  }
}

//! Enqueues one group's operations: one job per communicator for its messages, one per collective.
ncclResult_t launch(std::vector<pending> ops) {
  std::vector<std::shared_ptr<comm_state>> comms;
  for (pending const& op : ops)
    if (op.p2p && std::find(comms.begin(), comms.end(), op.comm) == comms.end()) comms.push_back(op.comm);
  for (auto const& c : comms) {
    std::vector<pending> mine;
    std::vector<buffer_use> uses;
    for (pending const& op : ops)
      if (op.p2p && op.comm == c) {
        mine.push_back(op);
        uses.push_back(op.is_send ? buffer_use{op.send, op.bytes, access::read, "sendbuff"}
                                  : buffer_use{op.recv, op.bytes, access::write, "recvbuff"});
      }
    ++c->pending;
    cudaError_t const e = moecomm_emulation::enqueue(mine.front().stream, "ncclSend/ncclRecv", uses, [c, mine] {
      run_p2p(c, mine);
      --c->pending;
    });
    if (e != cudaSuccess) --c->pending;
    if (e != cudaSuccess) return reject(ncclInvalidUsage, cudaGetErrorString(e), false);
  }
  for (pending const& op : ops) {
    if (op.p2p) continue;
    std::uint64_t k;
    {
      std::lock_guard<std::mutex> hold(op.comm->lock);
      k = op.comm->next_collective++;
    }
    posted p = op.collective;
    std::size_t const in_bytes = p.count * type_size(p.type);
    std::size_t const out_bytes = std::strcmp(p.kind, "ncclAllGather") == 0 ? in_bytes * static_cast<std::size_t>(op.comm->group->nranks) : in_bytes;
    std::vector<buffer_use> uses;
    if (op.send != nullptr) uses.push_back({op.send, in_bytes, access::read, "sendbuff"});
    if (op.recv != nullptr && op.recv != op.send) uses.push_back({op.recv, out_bytes, access::write, "recvbuff"});
    if (op.recv != nullptr && op.recv == op.send) uses.back().mode = access::read_write;
    p.send = static_cast<char const*>(op.send);
    p.recv = static_cast<char*>(op.recv);
    auto const c = op.comm;
    ++c->pending;
    cudaError_t const e = moecomm_emulation::enqueue(op.stream, p.kind, uses, [c, k, p] {
      run_collective(c, k, p);
      --c->pending;
    });
    if (e != cudaSuccess) --c->pending;
    if (e != cudaSuccess) return reject(ncclInvalidUsage, cudaGetErrorString(e), false);
  }
  return ncclSuccess;
}

ncclResult_t submit(pending op) {
  if (group.depth > 0) {
    group.ops.push_back(std::move(op));
    return ncclSuccess;
  }
  return launch({std::move(op)});
}

ncclResult_t collective(char const* kind, void const* send, void* recv, std::size_t count, ncclDataType_t type,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  auto c = find_comm(comm);
  if (!c) return reject(ncclInvalidArgument, std::string(kind) + ": not a live communicator", false);
  std::size_t const bytes = count * type_size(type);
  if (type_size(type) == 0) return reject(ncclInvalidArgument, std::string(kind) + ": unsupported data type", false);
  std::size_t const recv_bytes = std::strcmp(kind, "ncclAllGather") == 0 ? bytes * static_cast<std::size_t>(c->group->nranks) : bytes;
  bool const root_only = std::strcmp(kind, "ncclReduce") == 0;
  if (ncclResult_t r = check_call(*c, kind, true, stream, {{send, "sendbuff"}}, bytes); r != ncclSuccess) return r;
  if (!root_only || c->rank == root)
    if (ncclResult_t r = check_call(*c, kind, true, stream, {{recv, "recvbuff"}}, recv_bytes); r != ncclSuccess) return r;
  pending p{c, stream, false, false, 0, send, root_only && c->rank != root ? nullptr : recv, bytes, {}};
  p.collective = posted{kind, count, type, op, root, nullptr, nullptr};
  return submit(std::move(p));
}

std::shared_ptr<comm_state> new_comm(std::shared_ptr<clique> g, int rank, int device) {
  auto c = std::make_shared<comm_state>();
  c->group = std::move(g);
  c->rank = rank;
  c->device = device;
  std::lock_guard<std::mutex> hold(registry().lock);
  registry().comms[c.get()] = c;
  return c;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) { return last_error.c_str(); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  std::memset(uniqueId, 0, sizeof *uniqueId);
  std::lock_guard<std::mutex> hold(registry().lock);
  std::uint64_t const id = registry().next_id++;
  std::memcpy(uniqueId->internal, &id, sizeof id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
  *comm = nullptr;
  if (nranks <= 0 || rank < 0 || rank >= nranks) return reject(ncclInvalidArgument, "ncclCommInitRank: bad nranks or rank", false);
  std::uint64_t id;
  std::memcpy(&id, commId.internal, sizeof id);
  std::shared_ptr<clique> g;
  {
    std::lock_guard<std::mutex> hold(registry().lock);
    auto& slot = registry().forming[id];
    if (!slot) {
      slot = std::make_shared<clique>();
      slot->nranks = nranks;
    }
    g = slot;
  }
  if (g->nranks != nranks) return reject(ncclInvalidArgument, "ncclCommInitRank: ranks disagree on nranks", false);
  auto c = new_comm(g, rank, emu::current_device());
  {
    std::lock_guard<std::mutex> hold(g->lock);
    if (++g->joined == nranks) {
      std::lock_guard<std::mutex> reg(registry().lock);
      registry().forming.erase(id);
    }
  }
  g->changed.notify_all();
  *comm = reinterpret_cast<ncclComm_t>(c.get());
  bool const blocking = config == nullptr || config->blocking != 0;
  if (!blocking) return ncclInProgress;
  std::unique_lock<std::mutex> hold(g->lock);
  if (!g->changed.wait_for(hold, emu::peer_wait, [&] { return g->joined == g->nranks; }))
    return reject(ncclSystemError, "ncclCommInitRank: the other ranks did not join", false);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return ncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  auto c = find_comm(comm);
  if (!c) return reject(ncclInvalidArgument, "ncclCommSplit: not a live communicator", false);
  if (ncclResult_t r = check_call(*c, "ncclCommSplit", false, nullptr, {}, 0); r != ncclSuccess) return r;
  std::uint64_t k;
  {
    std::lock_guard<std::mutex> hold(c->lock);
    k = c->next_split++;
  }
  clique& g = *c->group;
  std::unique_lock<std::mutex> hold(g.lock);
  split_round& s = g.splits[k];
  s.posts.resize(static_cast<std::size_t>(g.nranks));
  bool const share = config != nullptr && config->splitShare == 1;
  s.posts[static_cast<std::size_t>(c->rank)] = {color, key, emu::current_device(), newcomm,
                                               share ? (c->shares_with ? c->shares_with : c) : nullptr};
  if (++s.arrived == g.nranks) {
    std::map<int, std::vector<int>> members;  // color -> ranks ordered by (key, rank)
    for (int q = 0; q < g.nranks; ++q)
      if (s.posts[static_cast<std::size_t>(q)].color >= 0) members[s.posts[static_cast<std::size_t>(q)].color].push_back(q);
    for (auto& [col, ranks] : members) {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return s.posts[static_cast<std::size_t>(a)].key < s.posts[static_cast<std::size_t>(b)].key; });
      auto child = std::make_shared<clique>();
      child->nranks = static_cast<int>(ranks.size());
      child->joined = child->nranks;
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        split_post const& p = s.posts[static_cast<std::size_t>(ranks[i])];
        auto made = new_comm(child, static_cast<int>(i), p.device);
        made->shares_with = p.shares_with;
        __atomic_store_n(p.out, reinterpret_cast<ncclComm_t>(made.get()), __ATOMIC_RELEASE);
      }
    }
    for (split_post const& p : s.posts)
      if (p.color < 0) *p.out = nullptr;
    s.done = true;
    g.changed.notify_all();
  }
  if (!await(*c, hold, "ncclCommSplit", [&] { return s.done; },
             [&](int q) { return s.posts[static_cast<std::size_t>(q)].out == nullptr; }))
    return ncclSystemError;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  *count = c->group->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  *device = c->device;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  for (pending const& op : group.ops)
    if (op.comm == c) {
      emu::violation("ncclCommGetAsyncError polled the communicator of " + label(*c) +
                     " while its operations wait inside an open ncclGroupStart: they are never launched (missing ncclGroupEnd)");
      break;
    }
  {
    std::lock_guard<std::mutex> hold(c->group->lock);
    if (c->group->joined < c->group->nranks) {
      *asyncError = ncclInProgress;
      return ncclSuccess;
    }
  }
  std::lock_guard<std::mutex> hold(c->lock);
  *asyncError = c->async;
  if (c->async != ncclSuccess) last_error = c->async_message;
  else if (c->finalizing && c->pending > 0) *asyncError = ncclInProgress;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {  // in progress until its enqueued work is done
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  std::lock_guard<std::mutex> hold(c->lock);
  c->finalizing = true;
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  {  // a peer waiting for this rank would wait in vain: that wait fails now (NCCL would hang)
    std::lock_guard<std::mutex> hold(c->group->lock);
    c->group->departed.push_back(c->rank);
  }
  c->group->changed.notify_all();
  std::lock_guard<std::mutex> hold(registry().lock);
  return registry().comms.erase(c.get()) == 1 ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  auto c = find_comm(comm);
  if (!c) return ncclInvalidArgument;
  {
    std::lock_guard<std::mutex> hold(c->group->lock);
    c->group->aborted = true;
    c->group->abort_reason = "rank " + std::to_string(c->rank) + " aborted the communicator";
  }
  c->group->changed.notify_all();
  std::lock_guard<std::mutex> hold(registry().lock);
  registry().comms.erase(c.get());
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++group.depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (group.depth == 0) return reject(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart", true);
  if (--group.depth > 0) return ncclSuccess;
  std::vector<pending> ops = std::move(group.ops);
  group.ops.clear();
  return ops.empty() ? ncclSuccess : launch(std::move(ops));
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  auto c = find_comm(comm);
  if (!c) return reject(ncclInvalidArgument, "ncclSend: not a live communicator", false);
  if (peer < 0 || peer >= c->group->nranks) return reject(ncclInvalidArgument, "ncclSend: peer out of range", false);
  std::size_t const bytes = count * type_size(datatype);
  if (ncclResult_t r = check_call(*c, "ncclSend", true, stream, {{sendbuff, "sendbuff"}}, bytes); r != ncclSuccess) return r;
  return submit({c, stream, true, true, peer, sendbuff, nullptr, bytes, {}});
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
  auto c = find_comm(comm);
  if (!c) return reject(ncclInvalidArgument, "ncclRecv: not a live communicator", false);
  if (peer < 0 || peer >= c->group->nranks) return reject(ncclInvalidArgument, "ncclRecv: peer out of range", false);
  std::size_t const bytes = count * type_size(datatype);
  if (ncclResult_t r = check_call(*c, "ncclRecv", true, stream, {{recvbuff, "recvbuff"}}, bytes); r != ncclSuccess) return r;
  return submit({c, stream, true, false, peer, nullptr, recvbuff, bytes, {}});
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective("ncclAllGather", sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm, stream);
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclAllReduce", sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclReduce", sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  auto c = find_comm(comm);
  void const* send = c && c->rank == root ? sendbuff : nullptr;  // only the root's send buffer is read
  return collective("ncclBroadcast", send, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

}  // extern "C"

extern "C" ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}
