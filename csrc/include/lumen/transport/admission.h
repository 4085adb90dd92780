// Admission: the bound on sockets UCX's listener accepted that have not authenticated.
//
// UCX's listener keeps every TCP connection it accepts until that connection sends a complete
// connection request, with no deadline and no bound, and offers no hook before it: a few
// hundred sockets that never speak would use up the holder's file descriptors and lock every
// client out. The listener cannot sit behind a relay either: UCX takes the client's network
// address for its data lanes from the peer address of the socket it accepted (and its own
// device from the local one), so a relayed client is wired to the relay's address and a
// client on another host never connects (docs/security.md).
//
// So the server finds, on each sweep, the sockets of this process that are connected on the
// listener's local address and port (each file descriptor duplicated first, and a shutdown
// only after its socket's inode is checked again on a fresh duplicate, so that a number UCX
// closed and reused meanwhile is left alone),
// and shuts down (SHUT_RDWR) each whose peer has not authenticated once it has waited
// deadline_s since the sweep first saw it, or at once when max_pending older ones are waiting.
// UCX then sees its peer gone and closes the socket itself. A socket with a UCX connection
// request (the server holds a connection for it) is counted but left to the server's own
// handshake deadline. Not thread-safe: the server's progress thread calls it.
//
// Closing: UCX (1.22) frees its listener while sockets it accepted may still deliver their
// connection request, whose callback then reads the freed listener (a server closed while
// clients connected crashed its process). close_gate() makes the kernel drop every new
// handshake on the listening socket (a socket filter that passes nothing; sockets accepted
// before keep working), and from then on each sweep shuts down at once every socket without
// a connection request; the server destroys the listener once a sweep finds none left,
// counting the listener's accept queue (connections the kernel completed before the gate).
#pragma once
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace lumen::transport {

struct AdmissionOptions {
  double deadline_s = 10.0;   // from first seen to authenticated
  uint32_t max_pending = 64;  // sockets accepted and not yet authenticated
};

struct AdmissionStats {
  uint64_t refused = 0;  // shut down at once: max_pending older ones were waiting
  uint64_t expired = 0;  // shut down at their deadline, no connection request yet
  uint64_t pending = 0;  // accepted, not yet authenticated (at the last sweep)
  // Open without a connection request, shut down or not, at the last sweep (once the gate
  // is closed, with the connections in the listener's accept queue).
  uint64_t unrequested = 0;
};

// "address:port" ("[address]:port" for IPv6) of an IPv4 or IPv6 socket address; "" for
// another family. How admission and the server name a peer.
std::string endpoint_name(const sockaddr_storage& address);

// The port of an IPv4 or IPv6 socket address, in host order.
uint16_t port_of(const sockaddr_storage& address);

class Admission {
 public:
  // listener: the address UCX's listener is bound to (a wildcard address matches every local
  // address on its port). Throws std::invalid_argument for a bad deadline or max_pending 0.
  Admission(const sockaddr_storage& listener, const AdmissionOptions& options);
  ~Admission();
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // One sweep (see above). authenticated: endpoint_name of each peer whose connection proved
  // the secret (never shut down); requested: of each peer with a connection request still
  // in its handshake (counted as pending; the server times it).
  void sweep(const std::unordered_set<std::string>& authenticated,
             const std::unordered_set<std::string>& requested);
  const AdmissionStats& stats() const { return stats_; }
  // Refuses every new connection from now on (see above); false if the listening socket
  // could not be found or filtered (sweeps still shut every socket without a request).
  bool close_gate();

 private:
  using Clock = std::chrono::steady_clock;
  struct Seen {
    uint64_t order = 0;  // first-seen order, to tell older from newer within a sweep
    Clock::time_point first_seen;
    bool shut = false;  // shut down; UCX has not closed it yet
  };
  // Whether a socket bound to `local` was accepted on the listener.
  bool on_listener(const sockaddr_storage& local) const;
  // Whether `fd` is a socket bound to the listener's address (the listener itself or one it
  // accepted); fills `info` (its inode) either way fstat succeeds.
  bool bound_on_listener(int fd, struct stat* info) const;

  sockaddr_storage listener_{};
  AdmissionOptions options_;
  uint64_t next_order_ = 0;
  int spare_fd_ = -1;                     // /dev/null, closed during a sweep (see sweep())
  bool closing_ = false;                  // close_gate() was called
  int gate_number_ = -1;                  // then: the listening socket's descriptor number
  ino_t gate_inode_ = 0;                  // and inode (the number is checked against it)
  std::unordered_map<ino_t, Seen> seen_;  // by socket inode: stable while the socket lives
  AdmissionStats stats_;
};

}  // namespace lumen::transport
