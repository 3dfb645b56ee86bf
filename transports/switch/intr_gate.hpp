#pragma once
/// Parks the EAL interrupt thread while the polling thread bursts on ports
/// whose driver changes them from that thread (net_memif).
///
///     gossip::sw::intr_gate gate("net_memif ports");  // after rte_eal_init
///     while (running) {
///       if (gate.hold() && poll_memif_ports() > 0) gate.busy();  // parked meanwhile
///       poll_other_ports();
///     }
///     gate.open();                             // before stopping the ports
///
/// Why. net_memif (DPDK 22.11, and upstream's main as of 2026-07) runs a
/// peer's connect and disconnect on the EAL interrupt thread. When the peer
/// leaves (closes the control socket, sends a disconnect message, or dies),
/// memif_disconnect() clears the port's CONNECTED flag and, in the same call,
/// munmap()s the shared-memory regions that hold the rings and buffers.
/// Nothing waits for the data path: eth_memif_rx/tx test the flag once, on
/// entry, so a burst that entered just before reads unmapped memory (SIGSEGV
/// in rte_eth_rx_burst, seen when the polling thread was preempted inside
/// it). An RTE_ETH_EVENT_INTR_LSC callback cannot close that window: memif
/// raises no ethdev event, and one raised from the same handler would come
/// after the munmap. Stopping the port first is not possible either: the peer
/// decides when it leaves, and a crashed peer tells nobody.
///
/// So the gate serialises the two threads: the polling thread asks, through an
/// eventfd registered as an EAL interrupt source, for the interrupt thread to
/// come and wait in this gate's callback. While it waits there no driver
/// callback runs, so no memif port can connect, disconnect or be unmapped, and
/// the polling thread may burst on them. Then the polling thread lets it go
/// and touches no gated port until the interrupt thread is back; in between,
/// the interrupt thread runs what the drivers have pending (a disconnect and
/// its munmap, a new peer's connect). The port stays configured and serves the
/// next peer that connects to it.
///
/// Each round trip costs the gated ports the time the interrupt thread takes
/// to be scheduled again. EAL puts it on the cores that are not lcores, where
/// anything else may run: on 2 cores under a load of 15 it took 15 ms on
/// average, 160 ms at worst. So the gate is held for `idle_slice` while the
/// gated ports are quiet and for up to `busy_slice` while they carry traffic
/// (busy()); a peer's arrival or departure waits at most that long, plus the
/// way back, per control message.
///
/// hold(), busy() and acquire() run on the polling thread, or on one that took
/// over after it stopped; open() too. The destructor opens the gate and
/// unregisters it.
#include <rte_cycles.h>
#include <rte_interrupts.h>

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>

namespace gossip::sw {

class intr_gate {
 public:
  /// `what` names the ports in messages; the slices are how long the polling
  /// thread keeps the interrupt thread parked at a time (see above).
  explicit intr_gate(std::string what, std::chrono::microseconds idle_slice = std::chrono::milliseconds(1),
                     std::chrono::microseconds busy_slice = std::chrono::milliseconds(20))
      : m_what(std::move(what)), m_idle_slice(cycles(idle_slice)), m_busy_slice(cycles(busy_slice)) {
    m_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (m_fd < 0) throw std::runtime_error(fmt::format("{}: eventfd for the interrupt gate: {}", m_what, std::strerror(errno)));
    m_handle = rte_intr_instance_alloc(RTE_INTR_INSTANCE_F_PRIVATE);
    if (!m_handle || rte_intr_type_set(m_handle, RTE_INTR_HANDLE_EXT) != 0 || rte_intr_fd_set(m_handle, m_fd) != 0) {
      release_resources();
      throw std::runtime_error(fmt::format("{}: cannot set up an EAL interrupt handle for the interrupt gate", m_what));
    }
    if (const int rc = rte_intr_callback_register(m_handle, &intr_gate::on_event, this); rc != 0) {
      release_resources();
      throw std::runtime_error(fmt::format("{}: cannot register the interrupt gate with EAL: {} (is EAL initialised?)", m_what, rte_strerror(-rc)));
    }
  }
  intr_gate(const intr_gate&) = delete;
  intr_gate& operator=(const intr_gate&) = delete;

  ~intr_gate() {
    open();
    // The callback may still be on its way out of the interrupt thread
    // (-EAGAIN while it runs); it only has to return, which open() allowed.
    int rc = -EAGAIN;
    for (int tries = 0; tries < 2000 && rc == -EAGAIN; ++tries) {
      rc = rte_intr_callback_unregister(m_handle, &intr_gate::on_event, this);
      if (rc == -EAGAIN) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (rc == -EAGAIN) {
      // Freeing what the interrupt thread still uses would be worse than a leak.
      fmt::print(stderr, "{}: the EAL interrupt thread did not leave the interrupt gate within 2 s; leaking it\n", m_what);
      return;
    }
    release_resources();
  }

  /// Polling thread, once per round. True while the interrupt thread is
  /// parked: gated ports may be touched until the next call. False while it
  /// is not (asked to come, if it was free): leave gated ports alone.
  bool hold() noexcept {
    switch (m_state.load(std::memory_order_acquire)) {
      case held: {
        const std::uint64_t now = rte_get_timer_cycles();
        if (!m_in_slice) {
          m_in_slice = true;
          m_since = now;
          return true;
        }
        const std::uint64_t held_for = now - m_since;
        if (held_for < m_idle_slice || (held_for < m_busy_slice && now - m_busy_at < m_idle_slice)) return true;
        m_in_slice = false;
        set_and_wake(released);  // our last burst on a gated port is behind this
        return false;
      }
      case idle:
        request();
        return false;
      case requested:
        if (!m_warned && rte_get_timer_cycles() - m_since > 2 * rte_get_timer_hz()) {
          m_warned = true;  // once per request; the ports just stay idle meanwhile
          fmt::print(stderr, "{}: the EAL interrupt thread has not come to the gate for 2 s; not polling them until it does\n", m_what);
        }
        return false;
      default:
        return false;  // released (on its way back), open for good, or exiting
    }
  }

  /// Waits up to `timeout` for the interrupt thread to be parked and keeps it
  /// there until let_go() or open(): to stop and close gated ports, whose
  /// driver would otherwise tear down a departing peer beside us. False on
  /// the timeout.
  bool acquire(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const int s = m_state.load(std::memory_order_acquire);
      if (s == held) return true;
      if (s == closed || std::chrono::steady_clock::now() > deadline) return false;
      if (s == idle) request();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  /// Polling thread: a gated port had traffic in this round (keeps the slice going).
  void busy() noexcept { m_busy_at = rte_get_timer_cycles(); }

  /// Lets a parked interrupt thread go until the next hold() or acquire().
  void let_go() noexcept {
    {
      std::lock_guard lk(m_mutex);
      int expected = held;
      m_state.compare_exchange_strong(expected, released, std::memory_order_acq_rel);
    }
    m_wake.notify_all();
  }

  /// Lets the interrupt thread go for good; hold() is false from now on.
  void open() noexcept { set_and_wake(closed); }

  /// At the end of the process, right before rte_eal_cleanup(): parks the
  /// interrupt thread (waiting up to `timeout`) until the process exits.
  /// DPDK 22.11's rte_eal_cleanup() unmaps EAL memory without stopping that
  /// thread, and the thread walks its interrupt sources, which live there,
  /// whenever a callback was unregistered, as closing a memif port does:
  /// SIGSEGV in rte_intr_fd_get() at exit. Parked it walks nothing. The gate
  /// is leaked on purpose, the thread waits in it; no EAL interrupt or alarm
  /// is served afterwards. False on the timeout (the gate is then closed).
  static bool park_for_exit(std::unique_ptr<intr_gate> gate, std::chrono::milliseconds timeout) {
    if (!gate->acquire(timeout)) return false;
    gate->set_and_wake(exiting);
    [[maybe_unused]] auto* leaked = gate.release();
    return true;
  }

 private:
  enum state : int { idle, requested, held, released, closed, exiting };

  static std::uint64_t cycles(std::chrono::microseconds d) noexcept {
    return static_cast<std::uint64_t>(std::chrono::duration<double>(d).count() * static_cast<double>(rte_get_timer_hz()));
  }

  void request() noexcept {
    // The state before the eventfd: the callback expects `requested`.
    m_state.store(requested, std::memory_order_release);
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto n = ::write(m_fd, &one, sizeof one);  // EAGAIN only at 2^64 - 2: already readable
    m_since = rte_get_timer_cycles();
    m_warned = false;
  }

  void set_and_wake(state s) noexcept {
    {
      std::lock_guard lk(m_mutex);
      m_state.store(s, std::memory_order_release);
    }
    m_wake.notify_all();
  }

  // On the EAL interrupt thread.
  static void on_event(void* arg) {
    auto& g = *static_cast<intr_gate*>(arg);
    std::uint64_t count;
    [[maybe_unused]] const auto n = ::read(g.m_fd, &count, sizeof count);  // level-triggered: drain it
    int expected = requested;
    if (!g.m_state.compare_exchange_strong(expected, held, std::memory_order_acq_rel)) return;  // opened meanwhile
    std::unique_lock lk(g.m_mutex);
    const auto start = std::chrono::steady_clock::now();
    bool warned = false;
    // Released by the polling thread after its slice, or by open(); never
    // when exiting. Waking up every 100 ms is only there to say when neither
    // comes.
    for (int s; (s = g.m_state.load(std::memory_order_acquire)) == held || s == exiting;) {
      g.m_wake.wait_for(lk, std::chrono::milliseconds(100));
      if (s == held && !warned && std::chrono::steady_clock::now() - start > std::chrono::seconds(2)) {
        warned = true;
        fmt::print(stderr, "{}: the polling thread has kept the EAL interrupt thread for 2 s; peers cannot connect or leave until it lets go\n",
                   g.m_what);
      }
    }
    expected = released;
    g.m_state.compare_exchange_strong(expected, idle, std::memory_order_acq_rel);
  }

  void release_resources() noexcept {
    if (m_handle) rte_intr_instance_free(m_handle);
    m_handle = nullptr;
    if (m_fd >= 0) ::close(m_fd);
    m_fd = -1;
  }

  std::string m_what;
  std::uint64_t m_idle_slice, m_busy_slice;  // timer cycles
  int m_fd = -1;
  rte_intr_handle* m_handle = nullptr;
  std::atomic<int> m_state{idle};
  std::mutex m_mutex;
  std::condition_variable m_wake;
  // Polling thread only.
  bool m_in_slice = false, m_warned = false;
  std::uint64_t m_since = 0, m_busy_at = 0;
};

}  // namespace gossip::sw
