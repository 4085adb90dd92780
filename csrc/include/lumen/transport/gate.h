// The front door of a Server's listener. UCX's listener keeps every TCP connection it accepts
// until that connection sends a UCX connection request, with no deadline and no bound, so a
// few hundred sockets that never speak use up the holder's file descriptors and lock every
// client out. The Gate accepts on the advertised address itself and relays each connection's
// bytes to the UCX listener on a loopback port; a connection not yet authenticated is bounded
// in number (past max_pending, new ones are closed at once) and in time (closed deadline_s
// after it was accepted, whatever it sent). UCX moves data on its own lanes once connected:
// the relayed socket carries connection setup and teardown only. One thread, poll(2).
#pragma once
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

namespace lumen::transport {

struct GateOptions {
  std::string address = "127.0.0.1";
  uint16_t port = 0;           // 0: any free port; port() tells which
  uint16_t upstream_port = 0;  // the UCX listener, on 127.0.0.1
  double deadline_s = 10.0;    // from accept to authenticated
  uint32_t max_pending = 64;   // connections accepted and not yet authenticated
};

struct GateStats {
  uint64_t refused = 0;  // closed at accept: max_pending were already waiting
  uint64_t expired = 0;  // closed at their deadline, not authenticated
  uint64_t pending = 0;  // accepted, not yet authenticated (now)
};

class Gate {
 public:
  // Listens and starts the relay thread; throws std::invalid_argument for a bad address and
  // std::runtime_error when it cannot listen.
  explicit Gate(const GateOptions& options);
  ~Gate();
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  uint16_t port() const { return port_; }
  // The connection the upstream listener saw from 127.0.0.1:relay_port proved the secret: it
  // is no longer pending and has no deadline. Thread-safe.
  void authenticated(uint16_t relay_port);
  // Whether 127.0.0.1:relay_port is one of the gate's relays to the upstream listener (a
  // connection that did not come through the gate is refused there). Thread-safe.
  bool relays(uint16_t relay_port) const;
  GateStats stats() const;
  // Closes the listener and every relayed connection and joins the thread (idempotent).
  void stop();

 private:
  using Clock = std::chrono::steady_clock;
  // One direction of a relay: bytes read from one socket and not yet written to the other.
  struct Pipe {
    std::vector<uint8_t> buffer;
    size_t offset = 0;
    bool empty() const { return offset == buffer.size(); }
  };
  struct Relay {
    int outside = -1;            // accepted from the client
    int inside = -1;             // to the upstream listener
    uint16_t relay_port = 0;     // inside's local port, as the upstream listener sees it
    bool connected = false;      // inside's connect() finished
    bool authenticated = false;  // no deadline, not pending
    Clock::time_point deadline;
    Pipe to_inside;
    Pipe to_outside;
  };

  void loop();
  // Accepts the connections waiting; false when out of descriptors.
  bool accept_waiting();
  // Relays fd upstream, or closes it when max_pending connections are already waiting.
  void admit(int fd);
  // Moves what is readable and writable between the two sockets; false once either closed.
  bool pump(Relay* relay, short outside_events, short inside_events);
  void close_relay(Relay* relay);

  GateOptions options_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: stop() wakes the thread
  uint16_t port_ = 0;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::vector<Relay> relays_;  // relay thread only
  mutable std::mutex mutex_;
  std::unordered_set<uint16_t> authenticated_ports_;  // guarded by mutex_; taken by the thread
  std::unordered_set<uint16_t> relay_ports_;          // guarded by mutex_: open relays' ports
  GateStats stats_;                                   // guarded by mutex_
};

}  // namespace lumen::transport
