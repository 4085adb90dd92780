// Admission: the bound on sockets UCX's listener accepted (lumen/transport/admission.h).
#include "lumen/transport/admission.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "lumen/transport/worker.h"

namespace lumen::transport {

uint16_t port_of(const sockaddr_storage& address) {
  return address.ss_family == AF_INET6
             ? ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port)
             : ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
}

namespace {

// The file descriptor numbers open in this process now.
std::vector<int> open_descriptors() {
  std::vector<int> out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  const int own = dirfd(dir);
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end != entry->d_name && *end == '\0' && fd != own) out.push_back(static_cast<int>(fd));
  }
  closedir(dir);
  return out;
}

// Shuts down the socket `number` refers to if it is still the socket `inode` (checked on a
// duplicate, which keeps it from changing under the check).
void shut_down(int number, ino_t inode) {
  const int fd = fcntl(number, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return;
  struct stat info{};
  if (fstat(fd, &info) == 0 && info.st_ino == inode) shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

// Connections the kernel completed on the listening socket `number` refers to (if it is still
// the socket `inode`) that no accept() took yet.
uint64_t accept_queue(int number, ino_t inode) {
  const int fd = fcntl(number, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return 0;
  struct stat stat_info{};
  tcp_info info{};
  socklen_t info_length = sizeof(info);
  // On a listening socket, tcpi_unacked is the accept queue's length.
  const bool read = fstat(fd, &stat_info) == 0 && stat_info.st_ino == inode &&
                    getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &info_length) == 0;
  ::close(fd);
  return read ? info.tcpi_unacked : 0;
}

}  // namespace

std::string endpoint_name(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    if (inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text)) == nullptr) return "";
    return std::string(text) + ":" + std::to_string(ntohs(v4->sin_port));
  }
  if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    if (inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text)) == nullptr) return "";
    return "[" + std::string(text) + "]:" + std::to_string(ntohs(v6->sin6_port));
  }
  return "";
}

Admission::Admission(const sockaddr_storage& listener, const AdmissionOptions& options)
    : listener_(listener), options_(options) {
  check_timeout("handshake_timeout_s", options_.deadline_s);
  if (options_.max_pending == 0) {
    throw std::invalid_argument("max_unauthenticated must be >= 1, got 0");
  }
  if (listener_.ss_family != AF_INET && listener_.ss_family != AF_INET6) {
    throw std::invalid_argument("listener must be an IPv4 or IPv6 address, got family " +
                                std::to_string(listener_.ss_family));
  }
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

bool Admission::on_listener(const sockaddr_storage& local) const {
  if (local.ss_family != listener_.ss_family || port_of(local) != port_of(listener_)) return false;
  if (local.ss_family == AF_INET) {
    const in_addr want = reinterpret_cast<const sockaddr_in*>(&listener_)->sin_addr;
    return want.s_addr == htonl(INADDR_ANY) ||
           want.s_addr == reinterpret_cast<const sockaddr_in*>(&local)->sin_addr.s_addr;
  }
  const in6_addr& want = reinterpret_cast<const sockaddr_in6*>(&listener_)->sin6_addr;
  return IN6_IS_ADDR_UNSPECIFIED(&want) ||
         std::memcmp(&want, &reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr,
                     sizeof(want)) == 0;
}

Admission::~Admission() {
  if (spare_fd_ >= 0) ::close(spare_fd_);
}

void Admission::sweep(const std::unordered_set<std::string>& authenticated,
                      const std::unordered_set<std::string>& requested) {
  struct Waiting {
    int number;
    ino_t inode;
    bool requested;
  };
  // The spare descriptor makes room for the listing and one duplicate at a time even when
  // silent sockets took every other one.
  if (spare_fd_ >= 0) ::close(spare_fd_);
  const auto now = Clock::now();
  std::unordered_map<ino_t, Seen> still;  // what seen_ becomes: the sockets there now
  std::vector<Waiting> waiting;
  // Read before the descriptors: a connection UCX accepts after this is in the listing.
  uint64_t unrequested = closing_ ? accept_queue(gate_number_, gate_inode_) : 0;
  for (const int number : open_descriptors()) {
    const int fd = fcntl(number, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) continue;  // closed meanwhile
    struct stat info{};
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    const bool accepted = bound_on_listener(fd, &info) &&
                          getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) == 0;
    ::close(fd);
    const std::string name = accepted ? endpoint_name(peer) : "";
    // The listener itself has no peer; a descriptor seen twice is one socket.
    if (name.empty() || authenticated.count(name) > 0 || still.count(info.st_ino) > 0) continue;
    auto it = seen_.find(info.st_ino);
    const Seen seen = it != seen_.end() ? it->second : Seen{next_order_++, now, false};
    still[info.st_ino] = seen;
    const bool has_request = requested.count(name) > 0;
    if (!has_request) ++unrequested;
    if (!seen.shut) waiting.push_back({number, info.st_ino, has_request});
  }
  std::sort(waiting.begin(), waiting.end(), [&](const Waiting& a, const Waiting& b) {
    return still[a.inode].order < still[b.inode].order;
  });
  const auto deadline = std::chrono::duration<double>(options_.deadline_s);
  uint64_t pending = 0;
  for (const Waiting& socket : waiting) {
    Seen& seen = still[socket.inode];
    if (pending >= options_.max_pending || (closing_ && !socket.requested)) {
      seen.shut = true;
      stats_.refused++;
    } else if (!socket.requested && now - seen.first_seen > deadline) {
      seen.shut = true;
      stats_.expired++;
    } else {
      ++pending;
    }
    if (seen.shut) shut_down(socket.number, socket.inode);
  }
  stats_.pending = pending;
  stats_.unrequested = unrequested;
  seen_.swap(still);
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

bool Admission::bound_on_listener(int fd, struct stat* info) const {
  sockaddr_storage local{};
  socklen_t local_length = sizeof(local);
  return fstat(fd, info) == 0 && S_ISSOCK(info->st_mode) &&
         getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) == 0 &&
         on_listener(local);
}

bool Admission::close_gate() {
  // One instruction: return 0, keep no byte of the packet. On a listening socket the kernel
  // runs it on each handshake's packets and drops them; accepted sockets do not inherit it.
  sock_filter pass_nothing[] = {BPF_STMT(BPF_RET | BPF_K, 0)};
  sock_fprog program{1, pass_nothing};
  bool filtered = false;
  for (const int number : open_descriptors()) {
    const int fd = fcntl(number, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) continue;
    struct stat info{};
    int listening = 0;
    socklen_t flag_length = sizeof(listening);
    if (bound_on_listener(fd, &info) &&
        getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &flag_length) == 0 && listening) {
      filtered = setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &program, sizeof(program)) == 0;
      gate_number_ = number;
      gate_inode_ = info.st_ino;
      ::close(fd);
      break;
    }
    ::close(fd);
  }
  closing_ = true;
  return filtered;
}

}  // namespace lumen::transport
