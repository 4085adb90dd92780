// The one exception type of the transport; the binding maps each Status to a Python class
// (PeerGone, Timeout, Rejected, Conflict, StaleEpoch, ...).
#pragma once
#include <stdexcept>
#include <string>

#include "lumen/transport/wire.h"

namespace lumen::transport {

class TransportError : public std::runtime_error {
 public:
  TransportError(Status status, const std::string& what)
      : std::runtime_error(what), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

}  // namespace lumen::transport
