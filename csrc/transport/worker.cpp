// Worker: UCP context, worker and progress thread (lumen/transport/worker.h).
#include "lumen/transport/worker.h"

#include <netdb.h>
#include <sched.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <string>

#include "lumen/transport/wire.h"

namespace lumen::transport {
namespace {

using Clock = std::chrono::steady_clock;
// How long the thread keeps polling after the last event before it sleeps in epoll: polling
// keeps bulk transfers at full speed, sleeping keeps an idle endpoint off the CPU.
constexpr auto kSpinAfterActivity = std::chrono::microseconds(200);
constexpr const char* kTcpSegmentSize = "256k";

}  // namespace

sockaddr_storage resolve_address(const std::string& address, uint16_t port, socklen_t* length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw std::invalid_argument("address must be a host name or IP address, got '" + address +
                                "' (" + gai_strerror(rc) + ")");
  }
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  *length = found->ai_addrlen;
  freeaddrinfo(found);
  return out;
}

void check_timeout(const char* name, double seconds) {
  if (!(seconds > 0.0 && seconds <= kMaxTimeoutS)) {
    std::ostringstream message;
    message << name << " must be in (0, " << std::fixed << std::setprecision(1) << kMaxTimeoutS
            << "] seconds, got " << std::defaultfloat << seconds;
    throw std::invalid_argument(message.str());
  }
}

void throw_ucs(const std::string& what, ucs_status_t status) {
  throw std::runtime_error(what + ": " + ucs_status_string(status));
}

Worker::Worker(const WorkerOptions& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) throw_ucs("ucp_config_read", status);
  if (!options.tls.empty()) {
    status = ucp_config_modify(config, "TLS", options.tls.c_str());
    if (status != UCS_OK) {
      ucp_config_release(config);
      throw_ucs("UCX_TLS=" + options.tls, status);
    }
  }
  // Shared-memory transports take part in endpoints with peer error handling only when
  // their error handling is on; without it UCX silently falls back to tcp on one machine.
  status = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
  if (status != UCS_OK) {
    ucp_config_release(config);
    throw_ucs("UCX_MM_ERROR_HANDLING=y", status);
  }
  // A holder restarted on its port must listen again while the last one's connections are
  // in TIME_WAIT. The environment wins.
  if (std::getenv("UCX_TCP_CM_REUSEADDR") == nullptr) {
    status = ucp_config_modify(config, "TCP_CM_REUSEADDR", "y");
    if (status != UCS_OK) {
      ucp_config_release(config);
      throw_ucs("UCX_TCP_CM_REUSEADDR=y", status);
    }
  }
  // Peer error handling costs UCX its zero-copy rendezvous over tcp: bulk data goes through
  // tcp segments, and at UCX's default segment size the syscalls bound the transfer (1.2-1.6
  // GB/s here). 256 KiB segments moved 6.7 GB/s (bench/RESULTS.md). The environment wins.
  for (const char* name : {"TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"}) {
    if (std::getenv((std::string("UCX_") + name).c_str()) != nullptr) continue;
    status = ucp_config_modify(config, name, kTcpSegmentSize);
    if (status != UCS_OK) {
      ucp_config_release(config);
      throw_ucs(std::string("UCX_") + name + "=" + kTcpSegmentSize, status);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (status != UCS_OK) throw_ucs("ucp_init", status);

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread calls UCX
  status = ucp_worker_create(context_, &worker_params, &worker_);
  if (status != UCS_OK) {
    ucp_cleanup(context_);
    throw_ucs("ucp_worker_create", status);
  }
  status = ucp_worker_get_efd(worker_, &event_fd_);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    throw_ucs("ucp_worker_get_efd", status);
  }
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = event_fd_;
  if (epoll_fd_ < 0 || epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd_, &event) != 0) {
    if (epoll_fd_ >= 0) close(epoll_fd_);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    throw std::runtime_error("epoll setup for the UCX worker failed");
  }
}

void Worker::set_message_handler(ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = kAmId;
  handler.cb = cb;
  handler.arg = arg;
  const ucs_status_t status = ucp_worker_set_am_recv_handler(worker_, &handler);
  if (status != UCS_OK) throw_ucs("ucp_worker_set_am_recv_handler", status);
}

void Worker::close_endpoint(ucp_ep_h ep, bool force) {
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  param.cb.send = [](void* request, ucs_status_t /*status*/, void* user_data) {
    --static_cast<Worker*>(user_data)->closing_;
    ucp_request_free(request);
  };
  param.user_data = this;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (UCS_PTR_IS_PTR(request)) ++closing_;
}

Worker::~Worker() {
  stop();
  close(epoll_fd_);
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

bool Worker::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_.load()) return false;
    posted_.push_back(std::move(fn));
  }
  ucp_worker_signal(worker_);  // thread-safe by UCX's contract
  return true;
}

void Worker::call(const std::function<void()>& fn) {
  if (!thread_.joinable() || on_progress_thread()) {
    fn();
    return;
  }
  std::mutex done_mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::exception_ptr error;
  const bool posted = post([&] {
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(done_mutex);
    done = true;
    done_cv.notify_all();
  });
  if (!posted) throw std::runtime_error("the UCX worker is stopped");
  std::unique_lock<std::mutex> lock(done_mutex);
  done_cv.wait(lock, [&] { return done; });
  if (error) std::rethrow_exception(error);
}

void Worker::start(std::function<void()> on_stop, std::function<bool()> busy,
                   std::function<void()> tick) {
  on_stop_ = std::move(on_stop);
  busy_ = std::move(busy);
  tick_ = std::move(tick);
  thread_ = std::thread([this] { loop(); });
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true);
  }
  if (!thread_.joinable()) return;
  ucp_worker_signal(worker_);
  thread_.join();
}

bool Worker::run_posted() {
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
  return !batch.empty();
}

bool Worker::progress_until(const std::function<bool()>& pred, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    ucp_worker_progress(worker_);
  }
  return true;
}

void Worker::loop() {
  auto last_activity = Clock::now();
  auto last_tick = last_activity;
  while (!stopping_.load()) {
    bool active = run_posted();
    while (ucp_worker_progress(worker_) != 0) active = true;
    const auto now = Clock::now();
    if (tick_ && now - last_tick >= std::chrono::milliseconds(kTickMs)) {
      last_tick = now;
      tick_();
    }
    if (active) {
      last_activity = now;
      continue;
    }
    if (busy_()) {
      // Transfers are outstanding: keep polling, but give way to the threads that feed us
      // (the caller, the peer) when they are runnable on the same cores.
      last_activity = now;
      sched_yield();
      continue;
    }
    if (now - last_activity < kSpinAfterActivity) continue;
    const ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_ERR_BUSY) continue;  // events arrived meanwhile
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!posted_.empty()) continue;
    }
    epoll_event event{};
    epoll_wait(epoll_fd_, &event, 1, kTickMs);
  }
  run_posted();
  if (on_stop_) on_stop_();
}

}  // namespace lumen::transport
