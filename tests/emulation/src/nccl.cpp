// SPDX-License-Identifier: Apache-2.0
// The emulated NCCL: communicators over an in-process rendezvous, whose operations run as jobs on
// the emulated streams (device.cpp), so that they are ordered, and checked, like kernels.
//
// A collective is matched by its sequence number on the communicator (the k-th collective of every
// rank meets the others' k-th) and must agree in kind, size, type and root; point-to-point messages
// are matched in order per (sender, receiver), as NCCL matches them, and must agree in size. Every
// job reads its peers' buffers, then waits until all have read before it writes its own, so that
// in-place operations see the inputs. A disagreement or an abort fails the job: the communicator's
// asynchronous error says what happened, instead of the hang NCCL would give. Reductions combine the
// ranks' inputs in ascending rank order, rounded to the type at each step. A non-blocking
// communicator (config.blocking = 0) answers ncclInProgress where NCCL may, and its state says
// ncclInProgress until its initialization, split or launch is in place. A group whose stream
// captures a CUDA graph takes no collective numbers: it is a node of the graph, launched anew (and
// numbered then) at each launch of the graph.

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
#include <type_traits>
#include <utility>

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
  bool blocking = true;             // ncclConfig_t::blocking: false, its calls return ncclInProgress
  bool enqueueing = false;          // non-blocking: operations were launched, and the state not polled since
  bool split_pending = false;       // non-blocking: split `split_round` of its clique is not yet complete
  std::uint64_t split_round = 0;
  bool devices_checked = false;     // non-blocking init: the ranks' devices were checked
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
  int color = 0, key = 0, device = 0;  // device: the parent's
  ncclComm_t* out = nullptr;
  bool blocking = true;                // the child's mode
  std::shared_ptr<comm_state> shares_with;  // splitShare = 1: the communicator whose resources the child shares
};

struct split_round {
  std::vector<split_post> posts;
  std::vector<std::string> errors;  // per rank: why its child was not made (two members on one device)
  int arrived = 0;
  bool done = false;
};

struct clique {
  int nranks = 0;
  int joined = 0;
  std::vector<int> devices;  // per rank: its CUDA device (-1 until it joined)
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

// ---- reductions: NCCL's operations on each type, combined in ascending rank order ----------

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

//! IEEE binary16: exact to float, and from float rounded to nearest, ties to even (NaN: 0x7fff, as
//! CUDA's __float2half).
struct half_element {
  using compute = float;
  static float up(std::uint16_t h) {
    std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    std::uint32_t const e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return from_bits(sign | 0x7f800000u | (m << 13));
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
      float const v = static_cast<float>(m) * from_bits(0x33800000u);
      return sign != 0 ? -v : v;
    }
    return from_bits(sign | ((e + 112) << 23) | (m << 13));
  }
  static std::uint16_t down(float f) {
    std::uint32_t const x = to_bits(f);
    std::uint32_t const sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fffu;
    if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // from 65520 up: infinity
    std::uint32_t q, rem, half;
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
      if (ax < 0x33000000u) return static_cast<std::uint16_t>(sign);  // below 2^-25
      std::uint32_t const e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
      int const shift = 126 - static_cast<int>(e);  // 14 to 24
      q = m >> shift;
      rem = m & ((1u << shift) - 1);
      half = 1u << (shift - 1);
    } else {
      std::uint32_t const r = ax - 0x38000000u;  // the exponent rebiased from 127 to 15
      q = r >> 13;
      rem = r & 0x1fffu;
      half = 0x1000u;
    }
    if (rem > half || (rem == half && (q & 1u) != 0)) ++q;  // a carry moves into the exponent, as it should
    return static_cast<std::uint16_t>(sign | q);
  }
};

//! bfloat16: the top half of a float, rounded to nearest, ties to even (NaN: 0x7fff, as CUDA).
struct bfloat16_element {
  using compute = float;
  static float up(std::uint16_t h) { return from_bits(static_cast<std::uint32_t>(h) << 16); }
  static std::uint16_t down(float f) {
    std::uint32_t const u = to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

//! Integers and float/double: computed as themselves.
template <class T>
struct plain_element {
  using compute = T;
  static T up(T v) { return v; }
  static T down(T v) { return v; }
};

//! `out[i]` = the reduction `op` of `ins[0][i]`, `ins[1][i]`, ... in that order, each step rounded
//! to the element type (16-bit floats are computed in float, then rounded). ncclAvg is NCCL's: for
//! floating types every input is first multiplied by 1/n rounded to the type (NCCL's PreMulSum),
//! for integers the sum (wrapping) is divided by n, rounding towards zero (NCCL's SumPostDiv).
template <class S, class E>
void reduce_elements(char* out, std::vector<char const*> const& ins, std::size_t count, ncclRedOp_t op) {
  using C = typename E::compute;
  constexpr bool integral = std::is_integral_v<C>;
  int const ranks = static_cast<int>(ins.size());
  S scale{};
  if constexpr (!integral) scale = E::down(static_cast<C>(1.0 / ranks));
  auto load = [](char const* p, std::size_t i) {
    S v;
    std::memcpy(&v, p + i * sizeof(S), sizeof(S));
    return v;
  };
  auto input = [&](int q, std::size_t i) -> S {
    S const v = load(ins[static_cast<std::size_t>(q)], i);
    if constexpr (!integral)
      if (op == ncclAvg) return E::down(static_cast<C>(E::up(v) * E::up(scale)));
    return v;
  };
  auto combine = [&](S a, S b) -> S {
    if constexpr (integral) {
      using U = std::make_unsigned_t<S>;
      switch (op) {
        case ncclSum: case ncclAvg: return static_cast<S>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
        case ncclProd: return static_cast<S>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
        case ncclMax: return a < b ? b : a;
        default: return b < a ? b : a;  // ncclMin
      }
    } else {
      C const x = E::up(a), y = E::up(b);
      switch (op) {
        case ncclSum: case ncclAvg: return E::down(static_cast<C>(x + y));
        case ncclProd: return E::down(static_cast<C>(x * y));
        case ncclMax: return x < y ? b : a;
        default: return y < x ? b : a;  // ncclMin
      }
    }
  };
  for (std::size_t i = 0; i < count; ++i) {
    S acc = input(0, i);
    for (int q = 1; q < ranks; ++q) acc = combine(acc, input(q, i));
    if constexpr (integral)
      if (op == ncclAvg) acc = static_cast<S>(acc / static_cast<S>(ranks));
    std::memcpy(out + i * sizeof(S), &acc, sizeof(S));
  }
}

//! The reduction of the ranks' send buffers `ins` (in rank order) into `out`.
void reduce_all(char* out, std::vector<char const*> const& ins, posted const& p) {
  switch (p.type) {
    case ncclInt8: return reduce_elements<std::int8_t, plain_element<std::int8_t>>(out, ins, p.count, p.op);
    case ncclUint8: return reduce_elements<std::uint8_t, plain_element<std::uint8_t>>(out, ins, p.count, p.op);
    case ncclInt32: return reduce_elements<std::int32_t, plain_element<std::int32_t>>(out, ins, p.count, p.op);
    case ncclUint32: return reduce_elements<std::uint32_t, plain_element<std::uint32_t>>(out, ins, p.count, p.op);
    case ncclInt64: return reduce_elements<std::int64_t, plain_element<std::int64_t>>(out, ins, p.count, p.op);
    case ncclUint64: return reduce_elements<std::uint64_t, plain_element<std::uint64_t>>(out, ins, p.count, p.op);
    case ncclFloat16: return reduce_elements<std::uint16_t, half_element>(out, ins, p.count, p.op);
    case ncclBfloat16: return reduce_elements<std::uint16_t, bfloat16_element>(out, ins, p.count, p.op);
    case ncclFloat32: return reduce_elements<float, plain_element<float>>(out, ins, p.count, p.op);
    case ncclFloat64: return reduce_elements<double, plain_element<double>>(out, ins, p.count, p.op);
    default: return;  // refused by `collective`
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
      std::vector<char const*> ins;
      for (posted const& p : r.posts) ins.push_back(p.send);
      result.resize(bytes);
      reduce_all(result.data(), ins, mine);
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

//! Enqueues one group's operations: one job per communicator for its messages, one per collective,
//! which takes the communicator's next collective number.
ncclResult_t enqueue_group(std::vector<pending> const& ops) {
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

ncclResult_t launch(std::vector<pending> ops);

//! Records a group whose stream captures a CUDA graph as one node: each launch of the graph
//! launches the same operations (communicators, buffers, counts) on the launch's stream, new
//! collectives of their communicators, so that the ranks' replays match as eager calls do.
ncclResult_t capture_group(std::vector<pending> const& ops) {
  cudaStream_t const stream = ops.front().stream;
  for (pending const& op : ops)
    if (op.stream != stream)
      return reject(ncclInvalidUsage,
                    "ncclGroupEnd: a captured group's operations are on several streams; the emulation captures a group whose "
                    "operations are all on one stream",
                    true);
  char const* const call = ops.size() == 1 && !ops.front().p2p ? ops.front().collective.kind : "an NCCL group";
  cudaError_t const e = emu::capture_node(stream, call, [ops](cudaStream_t on) {
    std::vector<pending> again = ops;
    for (pending& op : again) op.stream = on;
    ncclResult_t const r = launch(std::move(again));
    return r == ncclSuccess || r == ncclInProgress ? cudaSuccess : cudaPeekAtLastError();  // the enqueue's error
  });
  return e == cudaSuccess ? ncclSuccess : reject(ncclUnhandledCudaError, cudaGetErrorString(e), false);
}

//! Launches one group: enqueued, or recorded when its stream captures a CUDA graph. A group of
//! non-blocking communicators returns ncclInProgress: their state is in progress until it is next
//! polled (the enqueueing is done by then).
ncclResult_t launch(std::vector<pending> ops) {
  std::vector<std::shared_ptr<comm_state>> all;
  for (pending const& op : ops)
    if (std::find(all.begin(), all.end(), op.comm) == all.end()) all.push_back(op.comm);
  bool const blocking = all.front()->blocking;
  for (auto const& c : all)
    if (c->blocking != blocking)
      return reject(ncclInvalidArgument,
                    "ncclGroupEnd: the group holds operations of blocking and of non-blocking communicators (" + label(*c) +
                        " is " + (c->blocking ? "blocking" : "non-blocking") + "): NCCL allows one mode per group",
                    true);
  bool const captured = std::any_of(ops.begin(), ops.end(), [](pending const& op) { return emu::capturing(op.stream); });
  if (ncclResult_t const r = captured ? capture_group(ops) : enqueue_group(ops); r != ncclSuccess) return r;
  if (blocking) return ncclSuccess;
  for (auto const& c : all) {
    std::lock_guard<std::mutex> hold(c->lock);
    c->enqueueing = true;
  }
  return ncclInProgress;
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
  bool const reduces = std::strcmp(kind, "ncclAllReduce") == 0 || std::strcmp(kind, "ncclReduce") == 0;
  if (reduces && (op < ncclSum || op > ncclAvg))
    return reject(ncclInvalidArgument, std::string(kind) + ": the emulation computes ncclSum, ncclProd, ncclMax, ncclMin and ncclAvg only", false);
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

//! NCCL (up to 2.29) refuses two ranks of one communicator on one GPU: the message for rank `rank`
//! of ranks on `devices` (its own duplicate, else the first), or "" when every device differs.
std::string duplicate_gpu(std::vector<int> const& devices, int rank, char const* call) {
  auto message = [&](int a, int b) {
    return std::string(call) + ": Duplicate GPU detected : rank " + std::to_string(a) + " and rank " + std::to_string(b) +
           " both on CUDA device " + std::to_string(devices[static_cast<std::size_t>(a)]) +
           " (the ranks of one NCCL communicator are on different GPUs)";
  };
  int const n = static_cast<int>(devices.size());
  for (int q = 0; q < n; ++q)
    if (q != rank && devices[static_cast<std::size_t>(q)] == devices[static_cast<std::size_t>(rank)]) return message(rank, q);
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b)
      if (devices[static_cast<std::size_t>(a)] == devices[static_cast<std::size_t>(b)]) return message(a, b);
  return "";
}

//! The non-blocking split `c` posted: ncclInProgress until every rank posted, then its result
//! (c->lock not held).
ncclResult_t split_state(comm_state& c) {
  clique& g = *c.group;
  std::unique_lock<std::mutex> hold(g.lock);
  split_round const& s = g.splits[c.split_round];
  std::string error;
  ncclResult_t result = ncclInProgress;
  if (s.done) {
    error = s.errors.empty() ? "" : s.errors[static_cast<std::size_t>(c.rank)];
    result = error.empty() ? ncclSuccess : ncclInvalidUsage;
  } else if (g.aborted) {
    error = "ncclCommSplit: " + g.abort_reason;
    result = ncclRemoteError;
  } else {
    for (int q : g.departed)
      if (s.posts[static_cast<std::size_t>(q)].out == nullptr) {
        error = "ncclCommSplit: rank " + std::to_string(q) + " destroyed its communicator";
        result = ncclRemoteError;
      }
  }
  hold.unlock();
  if (result == ncclInProgress) return result;
  {
    std::lock_guard<std::mutex> mine(c.lock);
    c.split_pending = false;
  }
  if (result == ncclInvalidUsage) emu::violation(error);
  if (result != ncclSuccess) fail_async(c, result, error);
  return result;
}

// ncclSend (`send`, from `buffer`) or ncclRecv (into it): checked as NCCL does, then queued.
ncclResult_t point_to_point(bool send, void const* buffer, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                            cudaStream_t stream) {
  std::string const op = send ? "ncclSend" : "ncclRecv";
  auto c = find_comm(comm);
  if (!c) return reject(ncclInvalidArgument, op + ": not a live communicator", false);
  if (peer < 0 || peer >= c->group->nranks) return reject(ncclInvalidArgument, op + ": peer out of range", false);
  std::size_t const bytes = count * type_size(datatype);
  char const* const name = send ? "sendbuff" : "recvbuff";
  if (ncclResult_t r = check_call(*c, op.c_str(), true, stream, {{buffer, name}}, bytes); r != ncclSuccess) return r;
  return submit({c, stream, true, send, peer, send ? buffer : nullptr, send ? nullptr : const_cast<void*>(buffer), bytes, {}});
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
      slot->devices.assign(static_cast<std::size_t>(nranks), -1);
    }
    g = slot;
  }
  if (g->nranks != nranks) return reject(ncclInvalidArgument, "ncclCommInitRank: ranks disagree on nranks", false);
  auto c = new_comm(g, rank, emu::current_device());
  bool const blocking = config == nullptr || config->blocking != 0;
  c->blocking = blocking;
  {
    std::lock_guard<std::mutex> hold(g->lock);
    g->devices[static_cast<std::size_t>(rank)] = c->device;
    if (++g->joined == nranks) {
      std::lock_guard<std::mutex> reg(registry().lock);
      registry().forming.erase(id);
    }
  }
  g->changed.notify_all();
  *comm = reinterpret_cast<ncclComm_t>(c.get());
  if (!blocking) return ncclInProgress;  // ncclCommGetAsyncError reports the rest
  std::unique_lock<std::mutex> hold(g->lock);
  if (!g->changed.wait_for(hold, emu::peer_wait, [&] { return g->joined == g->nranks; }))
    return reject(ncclSystemError, "ncclCommInitRank: the other ranks did not join", false);
  std::string const duplicate = duplicate_gpu(g->devices, rank, config == nullptr ? "ncclCommInitRank" : "ncclCommInitRankConfig");
  hold.unlock();
  if (!duplicate.empty()) {  // NCCL frees the communicator of a failed blocking init
    *comm = nullptr;
    {
      std::lock_guard<std::mutex> held(g->lock);
      g->departed.push_back(rank);
    }
    {
      std::lock_guard<std::mutex> reg(registry().lock);
      registry().comms.erase(c.get());
    }
    return reject(ncclInvalidUsage, duplicate, true);
  }
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return ncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

// The split runs in the parent's mode (NCCL: the parent's config.blocking); the child takes its
// device from the parent, and its mode from `config` (NCCL's default, blocking, where `config`
// leaves it undefined), or the parent's when `config` is null.
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  auto c = find_comm(comm);
  if (!c) return reject(ncclInvalidArgument, "ncclCommSplit: not a live communicator", false);
  if (ncclResult_t r = check_call(*c, "ncclCommSplit", false, nullptr, {}, 0); r != ncclSuccess) return r;
  std::uint64_t k;
  {
    std::lock_guard<std::mutex> hold(c->lock);
    if (c->async != ncclSuccess)  // NCCL: a communicator in an error state splits into nothing
      return reject(c->async, "ncclCommSplit on the communicator of " + label(*c) + ", which failed: " + c->async_message, false);
    k = c->next_split++;
  }
  bool const child_blocking = config == nullptr ? c->blocking
                              : config->blocking == NCCL_CONFIG_UNDEF_INT ? true
                                                                           : config->blocking != 0;
  *newcomm = nullptr;  // NCCL: null until the split is complete
  clique& g = *c->group;
  std::unique_lock<std::mutex> hold(g.lock);
  split_round& s = g.splits[k];
  s.posts.resize(static_cast<std::size_t>(g.nranks));
  bool const share = config != nullptr && config->splitShare == 1;
  s.posts[static_cast<std::size_t>(c->rank)] = {color, key, c->device, newcomm, child_blocking,
                                               share ? (c->shares_with ? c->shares_with : c) : nullptr};
  if (++s.arrived == g.nranks) {
    std::map<int, std::vector<int>> members;  // color -> ranks ordered by (key, rank)
    for (int q = 0; q < g.nranks; ++q)
      if (s.posts[static_cast<std::size_t>(q)].color >= 0) members[s.posts[static_cast<std::size_t>(q)].color].push_back(q);
    s.errors.assign(static_cast<std::size_t>(g.nranks), "");
    for (auto& [col, ranks] : members) {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return s.posts[static_cast<std::size_t>(a)].key < s.posts[static_cast<std::size_t>(b)].key; });
      std::vector<int> devices;
      for (int q : ranks) devices.push_back(s.posts[static_cast<std::size_t>(q)].device);
      if (!duplicate_gpu(devices, 0, "").empty()) {  // NCCL's child init refuses it: no child
        for (std::size_t i = 0; i < ranks.size(); ++i)
          s.errors[static_cast<std::size_t>(ranks[i])] =
              duplicate_gpu(devices, static_cast<int>(i), "ncclCommSplit") + " (child color " + std::to_string(col) + ")";
        continue;
      }
      auto child = std::make_shared<clique>();
      child->nranks = static_cast<int>(ranks.size());
      child->joined = child->nranks;
      child->devices = devices;
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        split_post const& p = s.posts[static_cast<std::size_t>(ranks[i])];
        auto made = new_comm(child, static_cast<int>(i), p.device);
        made->shares_with = p.shares_with;
        made->blocking = p.blocking;
        __atomic_store_n(p.out, reinterpret_cast<ncclComm_t>(made.get()), __ATOMIC_RELEASE);
      }
    }
    s.done = true;
    g.changed.notify_all();
  }
  if (!c->blocking) {  // ncclCommGetAsyncError on the parent reports the split
    hold.unlock();
    std::lock_guard<std::mutex> mine(c->lock);
    c->split_pending = true;
    c->split_round = k;
    return ncclInProgress;
  }
  if (!await(*c, hold, "ncclCommSplit", [&] { return s.done; },
             [&](int q) { return s.posts[static_cast<std::size_t>(q)].out == nullptr; }))
    return ncclSystemError;
  std::string const error = s.errors[static_cast<std::size_t>(c->rank)];
  hold.unlock();
  if (!error.empty()) return reject(ncclInvalidUsage, error, true);
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
  std::string duplicate;
  {
    std::lock_guard<std::mutex> hold(c->group->lock);
    if (c->group->joined < c->group->nranks) {
      *asyncError = ncclInProgress;
      return ncclSuccess;
    }
    if (!c->devices_checked) {  // a non-blocking init: its ranks' devices, once all joined
      c->devices_checked = true;
      duplicate = duplicate_gpu(c->group->devices, c->rank, "ncclCommInitRankConfig");
    }
  }
  if (!duplicate.empty()) {
    emu::violation(duplicate);
    fail_async(*c, ncclInvalidUsage, duplicate);
  }
  bool split_pending;
  {
    std::lock_guard<std::mutex> hold(c->lock);
    split_pending = c->split_pending && c->async == ncclSuccess;
  }
  if (split_pending && split_state(*c) == ncclInProgress) {
    *asyncError = ncclInProgress;
    return ncclSuccess;
  }
  std::lock_guard<std::mutex> hold(c->lock);
  *asyncError = c->async;
  if (c->async != ncclSuccess) last_error = c->async_message;
  else if (std::exchange(c->enqueueing, false)) *asyncError = ncclInProgress;
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
  return point_to_point(true, sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
  return point_to_point(false, recvbuff, count, datatype, peer, comm, stream);
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
