// bench/transport, the gossip side: two forked ranks drive a
// gossip::ucx_transport directly (transfers) or through an engine (step
// cost), each answering the driver's commands over a pipe.
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "gossip/bootstrap.hpp"
#include "gossip/gossip.hpp"
#include "gossip/transports/ucx/ucx.hpp"
#include "tests/harness.hpp"
#include "transport_bench.hpp"

namespace transport_bench {

using namespace gossip;

namespace {

std::uint64_t splitmix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Payload of send buffer `b`: 8-byte words of a hash of (b, word index); the
// first and last words are stamped per message (step, step ^ stamp_key), so a
// stale or misplaced buffer is caught too.
constexpr std::uint64_t stamp_key = 0x5a5a'1234'abcd'0f0full;
std::uint64_t pattern(std::uint64_t b, std::uint64_t i) noexcept { return splitmix((b << 40) ^ i); }

// How the bench's own loops wait for the transport (a free send buffer, the
// next message). `backoff` is gossip::detail::wait_for's: spin 64 times, yield
// until 256, then sleep 20 µs per try — it leaves the core to the transport's
// progress thread, which shares it when the ranks are pinned.
class waiter {
 public:
  explicit waiter(const std::string& mode) : m_mode(mode == "spin" ? 0 : mode == "yield" ? 1 : mode == "sleep" ? 2 : 3) {}
  void operator()() {
    switch (m_mode) {
      case 0: return;
      case 1: std::this_thread::yield(); return;
      case 2: std::this_thread::sleep_for(std::chrono::microseconds(20)); return;
      default:
        if (++m_tries < 64) return;
        if (m_tries < 256)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  void reset() noexcept { m_tries = 0; }

 private:
  int m_mode;
  unsigned m_tries = 0;
};

struct rank_process {
  int rank;
  const settings& s;
  std::shared_ptr<bootstrap> boot;
  std::size_t max_payload = 0, message_bytes = 0;
  model_layout layout;
  std::uint64_t layout_fp = 0;
  inbox in;
  std::vector<std::unique_ptr<std::byte[]>> bufs;
  std::optional<ucx_transport> t;
  std::uint64_t seq = 0;  // messages posted (rank 0) or consumed (rank 1) so far
  std::vector<received> got;

  rank_process(int r, std::uint16_t port, const settings& st) : rank(r), s(st) {
    boot = std::make_shared<bootstrap>(r, 2, "127.0.0.1", port, std::chrono::duration<double>(s.timeout_s));
    max_payload = *std::max_element(s.sizes.begin(), s.sizes.end());
    message_bytes = (sizeof(wire_header) + max_payload + 63) / 64 * 64;
    layout = {{"payload", max_payload / sizeof(float), dtype::f32}};
    layout_fp = fingerprint(layout);
    std::vector<int> sources;
    if (r == 1) sources.push_back(0);
    in = inbox(sources, static_cast<std::size_t>(s.depth), message_bytes);
    if (r == 0)
      for (int b = 0; b < s.send_buffers; ++b) {
        bufs.push_back(std::make_unique<std::byte[]>(message_bytes));
        std::memset(bufs.back().get(), 0, message_bytes);  // touch every page before any timing
      }
    got.resize(static_cast<std::size_t>(s.depth) + 1);
    ucx_options o;
    o.backlog = s.backlog;
    o.connect = s.connect == "worker" ? ucx_connect::worker_address : s.connect == "listener" ? ucx_connect::listener : ucx_connect::automatic;
    t.emplace(boot, o);
    transport_setup ts;
    ts.rank = r;
    ts.world = 2;
    ts.layout = layout;
    ts.layout_fingerprint = layout_fp;
    ts.config_fingerprint = 0x7472616e73706f72ull;  // "transpor"
    ts.sources = sources;
    if (r == 0) ts.targets = {1};
    ts.message_bytes = message_bytes;
    ts.inbox = &in;
    ts.timeout = std::chrono::duration<double>(s.timeout_s);
    t->attach(ts);
  }

  clock_type::time_point deadline() const {
    return clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s.timeout_s));
  }

  // Rank 0: W + N posts of `bytes` payload, then flush. Reply: "ok HELD LISTENING" (bytes the transport holds per
  // peer; 1 when its endpoints go through listeners, ucx_connect).
  std::string send(std::size_t bytes, std::uint64_t count) {
    const std::size_t words = bytes / 8;
    for (std::size_t b = 0; b < bufs.size(); ++b) {  // untimed
      auto* w = reinterpret_cast<std::uint64_t*>(bufs[b].get() + sizeof(wire_header));
      for (std::size_t i = 0; i < words; ++i) w[i] = pattern(b, i);
    }
    const auto end = deadline();
    waiter wait(s.wait);
    for (std::uint64_t k = 0; k < count; ++k, ++seq) {
      std::byte* buf = bufs[seq % bufs.size()].get();
      for (wait.reset(); t->busy(buf); wait())
        if (clock_type::now() > end) return fmt::format("fail rank 0: send buffer {} still busy after {} s", seq % bufs.size(), s.timeout_s);
      wire_header h;
      h.sender = 0;
      h.step = seq;
      h.weight = 1.0;
      h.payload_bytes = bytes;
      h.layout_fingerprint = layout_fp;
      std::memcpy(buf, &h, sizeof h);
      auto* w = reinterpret_cast<std::uint64_t*>(buf + sizeof h);
      w[0] = seq;
      w[words - 1] = seq ^ stamp_key;
      for (wait.reset();; wait()) {
        const post_status st = t->post(1, {buf, sizeof h + bytes}, seq);
        if (st == post_status::ok) break;
        if (st == post_status::peer_dead) return "fail rank 0: rank 1 is dead";
        if (clock_type::now() > end) return "fail rank 0: post() stayed busy";
      }
    }
    t->flush(std::chrono::duration<double>(s.timeout_s));
    return fmt::format("ok {} {}", t->held_bytes_per_peer(), t->listening() ? 1 : 0);
  }

  // Rank 1: consumes W + N messages. Reply: "ok SECONDS HELD" (last warm-up to last timed message consumed; bytes
  // the transport holds per peer).
  std::string receive(std::size_t bytes, std::uint64_t warmup, std::uint64_t count) {
    const std::size_t words = bytes / 8;
    const std::uint64_t first = seq, last = seq + warmup + count - 1, t0_at = seq + warmup - 1;
    clock_type::time_point t0{}, t1{};
    const auto end = deadline();
    waiter wait(s.wait);
    while (seq <= last) {
      const std::size_t n = t->collect(0, got);
      if (n == 0) {
        if (clock_type::now() > end)
          return fmt::format("fail rank 1: consumed {} of {} messages in {} s (dropped {})", seq - first, last + 1 - first, s.timeout_s,
                             t->counters().dropped);
        wait();
        continue;
      }
      wait.reset();
      const auto now = clock_type::now();
      for (std::size_t i = 0; i < n; ++i, ++seq) {
        const auto& m = got[i];
        if (m.sender != 0 || m.step != seq || m.elements * sizeof(float) != bytes)
          return fmt::format("fail rank 1: message {} came as sender {} step {} with {} bytes (expected sender 0, {} bytes): lost or "
                             "reordered{}",
                             seq, m.sender, m.step, m.elements * sizeof(float), bytes,
                             t->counters().dropped > 0 ? fmt::format(" ({} dropped when the backlog of --backlog {} messages overflowed: "
                                                                     "raise --backlog or --depth)",
                                                                     t->counters().dropped, s.backlog)
                                                       : std::string());
        const auto* w = reinterpret_cast<const std::uint64_t*>(m.data);
        if (w[0] != seq || w[words - 1] != (seq ^ stamp_key))
          return fmt::format("fail rank 1: message {} carries the stamps of message {} / {}", seq, w[0], w[words - 1] ^ stamp_key);
        if (seq == t0_at) t0 = now;
        if (seq == last) {
          t1 = now;
          const std::uint64_t b = seq % static_cast<std::uint64_t>(s.send_buffers);
          for (std::size_t k = 1; k + 1 < words; ++k)
            if (w[k] != pattern(b, k))
              return fmt::format("fail rank 1: payload word {} of message {} is {:#x}, expected {:#x}", k, seq, w[k], pattern(b, k));
        }
      }
      t->release(0);
    }
    if (const auto c = t->counters(); c.dropped != 0) return fmt::format("fail rank 1: the transport dropped {} messages", c.dropped);
    return fmt::format("ok {:.9f} {}", std::chrono::duration<double>(t1 - t0).count(), t->held_bytes_per_peer());
  }

  // Both ranks: an engine with the `never` policy over a fresh ucx_transport.
  // Reply: "ok STEP_US DRIFT_US" (medians).
  std::string step_cost(std::size_t elements, int steps) {
    std::vector<float> x(elements);
    for (std::size_t i = 0; i < elements; ++i)
      x[i] = static_cast<float>(static_cast<double>(splitmix(i + static_cast<std::size_t>(rank) * 7919) >> 11) * 0x1p-53 - 0.5);
    model_view view;
    view.add("w", std::span<float>(x));
    engine_spec spec;
    spec.policy = any_policy(policies::never{}, "never");
    spec.topology.name = "exponential";
    spec.protocol.name = "push-sum";
    spec.settings.timeout = std::chrono::duration<double>(s.timeout_s);
    engine e(view, rank, 2, std::move(spec), ucx_transport(boot));
    // x̂ = the model at construction; move x a little so the drift is not zero.
    for (std::size_t i = 0; i < elements; i += 7) x[i] += 1e-3f;
    const float* hat = e.snapshot().data();
    volatile double sink = 0;
    // A step may wait for the other rank ([engine] max_lead paces the faster
    // one to the slower); that wait is timed too, and also subtracted
    // (unpaced: what the step itself costs).
    // Steps that did not wait at all (quiet) are also kept apart: a wait lets
    // the other rank's passes evict this rank's model from a shared cache,
    // which the pass after it then pays for, and subtracting the wait's time
    // does not undo that.
    std::vector<double> step_us, drift_us, unpaced_us, quiet_step_us, quiet_drift_us;
    double waited_s = e.stats().lead_wait_seconds;
    std::uint64_t waits = e.stats().lead_waits;
    const int warm = std::max(2, steps / 10);
    for (int k = 0; k < warm + steps; ++k) {
      // Alternate which goes first, so neither always runs right after the other.
      double ts = 0, td = 0;
      for (int half = 0; half < 2; ++half) {
        const bool do_step = (half == 0) == (k % 2 == 0);
        const auto a = clock_type::now();
        if (do_step) {
          const auto r = e.step();
          sink = sink + r.relative_drift;
          if (r.sent) return "fail: the never policy sent";
        } else {
          sink = sink + drift_pass(x.data(), hat, nullptr, elements).diff_sq;
        }
        const double us = std::chrono::duration<double, std::micro>(clock_type::now() - a).count();
        (do_step ? ts : td) = us;
      }
      const auto st = e.stats();
      const double wait_us = (st.lead_wait_seconds - waited_s) * 1e6;
      const bool quiet = st.lead_waits == waits;
      waited_s = st.lead_wait_seconds;
      waits = st.lead_waits;
      if (k >= warm) {
        step_us.push_back(ts);
        drift_us.push_back(td);
        unpaced_us.push_back(ts - wait_us);
        if (quiet) {
          quiet_step_us.push_back(ts);
          quiet_drift_us.push_back(td);
        }
      }
    }
    const auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    };
    const auto st = e.stats();
    e.finish(0);
    return fmt::format("ok {:.3f} {:.3f} {:.3f} {} {} {:.3f} {:.3f} {}", median(step_us), median(drift_us), median(unpaced_us), st.lead_waits,
                       st.step_beacons, median(quiet_step_us), median(quiet_drift_us), quiet_step_us.size());
  }

  // Rank 0 serves the rendezvous, so it leaves last.
  void final_barrier() {
    boot->put(fmt::format("bench/end/arrive/{}", rank), {});
    boot->get(fmt::format("bench/end/arrive/{}", 1 - rank), fmt::format("rank {} at the end", 1 - rank));
    boot->put(fmt::format("bench/end/ack/{}", rank), {});
    if (rank == 0) boot->get("bench/end/ack/1", "rank 1 to acknowledge the end");
  }
};

int rank_main(int rank, std::uint16_t port, const settings& s, int cmd_fd, int res_fd) {
  try {
    rank_process p(rank, port, s);
    write_line(res_fd, "ready");
    line_reader cmds(cmd_fd);
    for (;;) {
      const auto line = cmds.next(clock_type::now() + std::chrono::seconds(600));
      if (!line || *line == "quit") break;
      std::istringstream in(*line);
      std::string op;
      in >> op;
      std::string reply;
      if (op == "xfer") {
        std::size_t bytes = 0;
        std::uint64_t warmup = 0, count = 0;
        in >> bytes >> warmup >> count;
        reply = rank == 0 ? p.send(bytes, warmup + count) : p.receive(bytes, warmup, count);
      } else if (op == "step") {
        std::size_t elements = 0;
        int steps = 0;
        in >> elements >> steps;
        reply = p.step_cost(elements, steps);
      } else {
        reply = "fail unknown command " + *line;
      }
      write_line(res_fd, reply);
      if (reply.rfind("ok", 0) != 0) return 1;
    }
    p.final_barrier();
    // The drain handshake first, as engine::finish does: the goodbye each rank
    // then sends tells the other it left, rather than failed.
    detail::wait_for([&] { return p.t->drained(); }, std::chrono::duration<double>(s.timeout_s),
                     [&] { return fmt::format("rank {}'s drain handshake (waiting on {})", rank, p.t->waiting_on()); });
    // Rank 0 serves the rendezvous: it leaves once rank 1 has read its drain record.
    if (rank == 1) p.boot->put("bench/drained/1", {});
    else p.boot->get("bench/drained/1", "rank 1's drain handshake");
    p.t->leave();
    return 0;
  } catch (const std::exception& e) {
    try {
      write_line(res_fd, fmt::format("fail rank {}: {}", rank, e.what()));
    } catch (...) {
    }
    return 100;
  }
}

}  // namespace

rank_pair::rank_pair(const std::string& tls, const settings& s) : m_s(s), m_tls(tls) {
  const std::uint16_t port = harness::free_port();
  try {
    start(port);
    for (int r = 0; r < 2; ++r) expect_ok(r, read(r), "attach");
  } catch (...) {
    stop_now();
    throw;
  }
}

rank_pair::~rank_pair() { stop(); }

std::array<std::string, 2> rank_pair::both(const std::string& cmd, const std::string& what) {
  for (int r = 0; r < 2; ++r) write_line(m_cmd[r], cmd);
  std::array<std::string, 2> out;
  for (int r = 0; r < 2; ++r) out[static_cast<std::size_t>(r)] = read(r);
  // When both failed, the rank that only saw the other one die is named last:
  // the other one says why.
  const bool first_saw_death = out[0].find(" is dead") != std::string::npos && out[1].find(" is dead") == std::string::npos;
  for (const int r : first_saw_death ? std::array{1, 0} : std::array{0, 1}) expect_ok(r, out[static_cast<std::size_t>(r)], what);
  return out;
}

void rank_pair::start(std::uint16_t port) {
  const auto& s = m_s;
  for (int r = 0; r < 2; ++r) {
    int cmd[2], res[2];
    if (::pipe(cmd) != 0 || ::pipe(res) != 0) throw error(fmt::format("bench/transport: pipe: {}", std::strerror(errno)));
    const harness::child_options o{.env = {{"UCX_TLS", m_tls}, {"UCX_NET_DEVICES", "lo"}},
                                   .alarm_s = static_cast<unsigned>(std::max(120.0, 20 * s.timeout_s)),  // never outlive a crashed driver
                                   .cpu = s.cpus.empty() ? -1 : s.cpus[static_cast<std::size_t>(r)],
                                   .label = fmt::format("bench/transport rank {}", r)};
    const pid_t pid = harness::fork_child(o, [&] {
      ::close(cmd[1]);
      ::close(res[0]);
      for (int k = 0; k < r; ++k) {  // the other rank's pipe ends
        ::close(m_cmd[static_cast<std::size_t>(k)]);
        ::close(m_res_fd[static_cast<std::size_t>(k)]);
      }
      return rank_main(r, port, s, cmd[0], res[1]);
    });
    ::close(cmd[0]);
    ::close(res[1]);
    m_pid[static_cast<std::size_t>(r)] = pid;
    m_cmd[static_cast<std::size_t>(r)] = cmd[1];
    m_res_fd[static_cast<std::size_t>(r)] = res[0];
    m_res[static_cast<std::size_t>(r)] = std::make_unique<line_reader>(res[0]);
  }
}

// Asks both ranks to leave, then kills (by PID) what has not exited in 15 s.
void rank_pair::stop() {
  for (int r = 0; r < 2; ++r) {
    if (m_cmd[r] >= 0) {
      try {
        write_line(m_cmd[r], "quit");
      } catch (...) {
      }
      ::close(m_cmd[r]);
    }
  }
  const auto end = clock_type::now() + std::chrono::seconds(15);
  for (int r = 0; r < 2; ++r)
    if (m_pid[r] > 0) harness::reap(m_pid[r], end);
  for (int r = 0; r < 2; ++r)
    if (m_res_fd[r] >= 0) ::close(m_res_fd[r]);
  m_cmd[0] = m_cmd[1] = m_res_fd[0] = m_res_fd[1] = -1;
  m_pid[0] = m_pid[1] = -1;
}

// A rank failed to start: no orderly goodbye.
void rank_pair::stop_now() {
  for (int r = 0; r < 2; ++r)
    if (m_pid[r] > 0) ::kill(m_pid[r], SIGKILL);
  stop();
}

std::string rank_pair::read(int r) {
  const auto deadline = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(3 * m_s.timeout_s));
  auto l = m_res[static_cast<std::size_t>(r)]->next(deadline);
  return l ? *l : std::string("fail: no reply (the rank exited or timed out)");
}

void rank_pair::expect_ok(int r, const std::string& reply, const std::string& what) {
  if (reply.rfind("ok", 0) == 0 || reply == "ready") return;
  throw error(fmt::format("bench/transport: UCX_TLS={}, {}: rank {}: {}", m_tls, what, r, reply));
}

}  // namespace transport_bench
