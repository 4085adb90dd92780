// One UCP context and worker driven by its own progress thread. Every UCX call of a server or
// client runs on that thread; other threads hand it work with post(), which wakes it through
// ucp_worker_signal. The thread polls while transfers are outstanding (or briefly after the
// last event) and sleeps in epoll otherwise.
#pragma once
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lumen::transport {

struct WorkerOptions {
  std::string tls;  // UCX_TLS for this context ("" = UCX's choice / the environment)
};

class Worker {
 public:
  explicit Worker(const WorkerOptions& options);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ucp_worker_h handle() const { return worker_; }
  // Routes every lumen active message (kAmId) to cb(arg, ...); throws std::runtime_error.
  void set_message_handler(ucp_am_recv_callback_t cb, void* arg);
  // Runs fn on the progress thread (soon; in post order); false, without running it, once
  // stop() was asked.
  bool post(std::function<void()> fn);
  // Runs fn on the progress thread and waits for it; rethrows what fn threw.
  void call(const std::function<void()>& fn);
  // Starts the progress thread; on_stop runs on it once stop() is asked, before it exits,
  // and must leave no UCX request outstanding (it may progress the worker itself). While
  // busy() (called on the thread) holds, the thread polls instead of sleeping. tick runs on
  // the thread about every kTickMs, busy or idle.
  void start(std::function<void()> on_stop, std::function<bool()> busy, std::function<void()> tick);
  static constexpr int kTickMs = 50;
  // Stops and joins the progress thread (idempotent).
  void stop();
  bool on_progress_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Starts closing ep (force: without flushing what is queued); closing_endpoints() counts
  // the closes UCX has not finished.
  void close_endpoint(ucp_ep_h ep, bool force);
  int closing_endpoints() const { return closing_.load(); }
  // Progresses the worker until pred() holds or timeout_s passes (progress thread only).
  bool progress_until(const std::function<bool()>& pred, double timeout_s);

 private:
  void loop();
  bool run_posted();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;
  std::function<void()> on_stop_;
  std::function<bool()> busy_;
  std::function<void()> tick_;
  std::atomic<int> closing_{0};
  std::atomic<bool> stopping_{false};  // set under mutex_, so no post() slips past the end
  std::mutex mutex_;
  std::vector<std::function<void()>> posted_;
};

// The longest deadline any call takes, in seconds (about 11.6 days). Deadlines are finite: a
// steady_clock deadline holds about 9.2e9 s, and inf would overflow it into the past.
constexpr double kMaxTimeoutS = 1e6;

// Throws std::invalid_argument "<name> must be in (0, kMaxTimeoutS] seconds, got <seconds>"
// unless 0 < seconds <= kMaxTimeoutS (so nan and inf are refused).
void check_timeout(const char* name, double seconds);

// address:port as a socket address (numeric or by name); throws std::invalid_argument.
sockaddr_storage resolve_address(const std::string& address, uint16_t port, socklen_t* length);

// "<what>: <UCX's message>" as a std::runtime_error.
[[noreturn]] void throw_ucs(const std::string& what, ucs_status_t status);

}  // namespace lumen::transport
