// Gate: the bounded front door of a Server's listener (lumen/transport/gate.h).
#include "lumen/transport/gate.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "lumen/transport/worker.h"

namespace lumen::transport {
namespace {

// Bytes relayed per read; the setup messages UCX sends are a few KiB.
constexpr size_t kRelayChunkBytes = 64 << 10;
// How often the thread wakes to apply deadlines when nothing happens.
constexpr int kPollMs = 50;
// Connections accepted per wake, so that relays are served between bursts.
constexpr int kMaxAcceptsPerWake = 64;

uint16_t local_port(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  return address.ss_family == AF_INET6
             ? ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port)
             : ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
}

// Reads what `from` has into buffer once it is drained; false on EOF or an error.
bool fill(int from, std::vector<uint8_t>* buffer, size_t* offset) {
  if (*offset != buffer->size()) return true;  // drain first: bounded memory per relay
  buffer->resize(kRelayChunkBytes);
  const ssize_t got = recv(from, buffer->data(), buffer->size(), 0);
  if (got > 0) {
    buffer->resize(static_cast<size_t>(got));
    *offset = 0;
    return true;
  }
  buffer->clear();
  *offset = 0;
  return got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
}

// Writes what buffer holds from offset on to `to`; false on an error.
bool drain(int to, std::vector<uint8_t>* buffer, size_t* offset) {
  while (*offset < buffer->size()) {
    const ssize_t put = send(to, buffer->data() + *offset, buffer->size() - *offset, MSG_NOSIGNAL);
    if (put < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    *offset += static_cast<size_t>(put);
  }
  return true;
}

}  // namespace

Gate::Gate(const GateOptions& options) : options_(options) {
  check_timeout("handshake_timeout_s", options_.deadline_s);
  if (options_.max_pending == 0) {
    throw std::invalid_argument("max_unauthenticated must be >= 1, got 0");
  }
  socklen_t length = 0;
  const sockaddr_storage address = resolve_address(options_.address, options_.port, &length);
  listen_fd_ = socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int on = 1;
  if (listen_fd_ < 0 || setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0 ||
      bind(listen_fd_, reinterpret_cast<const sockaddr*>(&address), length) != 0 ||
      listen(listen_fd_, SOMAXCONN) != 0) {
    const std::string why = std::strerror(errno);
    if (listen_fd_ >= 0) ::close(listen_fd_);
    throw std::runtime_error("listen on " + options_.address + ":" + std::to_string(options_.port) +
                             ": " + why);
  }
  port_ = local_port(listen_fd_);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(listen_fd_);
    throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { loop(); });
}

Gate::~Gate() { stop(); }

void Gate::stop() {
  if (stopping_.exchange(true)) return;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // The thread still sees stopping_ within kPollMs.
  }
  if (thread_.joinable()) thread_.join();
  for (Relay& relay : relays_) close_relay(&relay);
  relays_.clear();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

bool Gate::relays(uint16_t relay_port) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return relay_ports_.count(relay_port) > 0;
}

void Gate::authenticated(uint16_t relay_port) {
  std::lock_guard<std::mutex> lock(mutex_);
  authenticated_ports_.insert(relay_port);
}

GateStats Gate::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Gate::close_relay(Relay* relay) {
  if (relay->relay_port != 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    relay_ports_.erase(relay->relay_port);
  }
  if (relay->outside >= 0) ::close(relay->outside);
  if (relay->inside >= 0) ::close(relay->inside);
  relay->outside = relay->inside = -1;
}

bool Gate::accept_waiting() {
  for (int i = 0; i < kMaxAcceptsPerWake; ++i) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return !(errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM);
    admit(fd);
  }
  return true;
}

void Gate::admit(int fd) {
  uint64_t pending = 0;
  for (const Relay& relay : relays_) pending += relay.authenticated ? 0 : 1;
  if (pending >= options_.max_pending) {
    ::close(fd);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.refused++;
    return;
  }
  Relay relay;
  relay.outside = fd;
  relay.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(options_.deadline_s));
  relay.inside = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_in upstream{};
  upstream.sin_family = AF_INET;
  upstream.sin_port = htons(options_.upstream_port);
  upstream.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int rc = relay.inside < 0 ? -1
                                  : connect(relay.inside, reinterpret_cast<sockaddr*>(&upstream),
                                            sizeof(upstream));
  if (rc != 0 && errno != EINPROGRESS) {
    close_relay(&relay);
    return;
  }
  relay.connected = rc == 0;
  relay.relay_port = local_port(relay.inside);
  {
    // Before any byte is relayed: the upstream listener asks about it at the connection
    // request, which comes through this relay.
    std::lock_guard<std::mutex> lock(mutex_);
    relay_ports_.insert(relay.relay_port);
  }
  relays_.push_back(std::move(relay));
}

bool Gate::pump(Relay* relay, short outside_events, short inside_events) {
  if ((outside_events | inside_events) & (POLLERR | POLLNVAL)) return false;
  if (!relay->connected) {
    if (!(inside_events & (POLLOUT | POLLHUP))) return !(outside_events & POLLHUP);
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(relay->inside, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) return false;
    relay->connected = true;
  }
  if ((outside_events & (POLLIN | POLLHUP)) &&
      !fill(relay->outside, &relay->to_inside.buffer, &relay->to_inside.offset)) {
    return false;
  }
  if ((inside_events & (POLLIN | POLLHUP)) &&
      !fill(relay->inside, &relay->to_outside.buffer, &relay->to_outside.offset)) {
    return false;
  }
  return drain(relay->inside, &relay->to_inside.buffer, &relay->to_inside.offset) &&
         drain(relay->outside, &relay->to_outside.buffer, &relay->to_outside.offset);
}

void Gate::loop() {
  std::vector<pollfd> fds;
  // Out of descriptors, the listener stays readable: it is left alone for a poll period
  // instead of spun on, while deadlines free descriptors.
  Clock::time_point accept_resume_at{};
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back(
        {listen_fd_, static_cast<short>(Clock::now() >= accept_resume_at ? POLLIN : 0), 0});
    fds.push_back({wake_fd_, POLLIN, 0});
    for (const Relay& relay : relays_) {
      // Read a side only once what it sent before is passed on (the client not before the
      // upstream connection is made); wait for writable while connecting or holding bytes.
      const short outside =
          static_cast<short>(!relay.connected ? 0
                                              : (relay.to_inside.empty() ? POLLIN : 0) |
                                                    (relay.to_outside.empty() ? 0 : POLLOUT));
      const short inside =
          static_cast<short>(!relay.connected ? POLLOUT
                                              : (relay.to_outside.empty() ? POLLIN : 0) |
                                                    (relay.to_inside.empty() ? 0 : POLLOUT));
      fds.push_back({relay.outside, outside, 0});
      fds.push_back({relay.inside, inside, 0});
    }
    poll(fds.data(), fds.size(), kPollMs);
    if (stopping_.load()) break;

    std::unordered_set<uint16_t> proven;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      proven.swap(authenticated_ports_);
    }
    const auto now = Clock::now();
    uint64_t expired = 0;
    std::vector<Relay> kept;
    kept.reserve(relays_.size());
    for (size_t i = 0; i < relays_.size(); ++i) {
      Relay& relay = relays_[i];
      if (proven.count(relay.relay_port) > 0) relay.authenticated = true;
      bool open = pump(&relay, fds[2 + 2 * i].revents, fds[3 + 2 * i].revents);
      if (open && !relay.authenticated && now > relay.deadline) {
        ++expired;
        open = false;
      }
      if (open) {
        kept.push_back(std::move(relay));
      } else {
        close_relay(&relay);
      }
    }
    relays_.swap(kept);
    if ((fds[0].revents & POLLIN) && !accept_waiting()) {
      accept_resume_at = now + std::chrono::milliseconds(kPollMs);
    }
    uint64_t pending = 0;
    for (const Relay& relay : relays_) pending += relay.authenticated ? 0 : 1;
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.expired += expired;
    stats_.pending = pending;
  }
}

}  // namespace lumen::transport
