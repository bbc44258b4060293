// The control socket server: a filesystem Unix stream socket (never abstract:
// abstract names are shared with the whole network namespace, the sandbox
// included), mode 0600, peer credentials checked with SO_PEERCRED.
//
// Protocol (docs/protocol.md): one JSON object per line each way. Every request
// line gets exactly one reply line. The server owns framing, size bounds, JSON
// parsing and authentication; what a request *means* is the Handler's business.
#pragma once

#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "control/protocol.h"
#include "egressd/result.h"

namespace egressd::control {

// Longest request line accepted, newline excluded. A longer line gets an
// error reply ("request_too_large"), is discarded up to its newline, and the
// connection stays usable.
inline constexpr std::size_t kMaxRequestBytes = 1 << 20;

// Calls `reply` (control/protocol.h) exactly once with the reply object. May
// complete later (the handler owns any async work); `reply` is safe to call
// after the client left. `reply` may be called from any thread. Further calls
// are ignored; if every copy is dropped uncalled, or the handler throws, the
// client gets "internal".
using Handler = std::function<void(const nlohmann::json& request, Reply reply)>;

// Whether `path` can be a control socket as far as can be known before
// binding it: a usable path where nothing lives that listen() would refuse
// (a live server, something that is not a socket). For a caller that must
// refuse bad input before it changes anything; listen() checks again.
Status check_socket_path(const std::string& path);

struct ServerOptions {
  std::string path;               // filesystem path; created 0600, replaced if stale
  // Root (0) is always allowed. The lowest non-root uid here owns the socket
  // file (mode 0600), so it can connect; other uids are checked by SO_PEERCRED
  // but need their own way to the file (e.g. a bind mount).
  std::set<uid_t> allowed_uids;
  std::size_t max_clients = 128;  // beyond this, new connections are closed at once
  // How often the server checks that the socket file at `path` is still the
  // one it bound (0: never). When it is not, the server binds a new listening
  // socket there, with the same mode and owner, if the path is now free or
  // holds a socket; anything else at the path is left alone and logged
  // (docs/security.md, "The control socket file"). Connections already
  // accepted are not affected.
  std::chrono::milliseconds watch_interval{0};
};

// Runs on the io_context it was given (single-threaded): call close() and
// socket_file_intact() on that io_context's thread, or while it is not running,
// and destroy the Server before the io_context.
class Server {
 public:
  // Binds and listens. Fails (runtime) with the path in the message when the
  // socket cannot be created, or when another live daemon already serves it.
  static Result<std::unique_ptr<Server>> listen(boost::asio::io_context& io, ServerOptions opts, Handler handler);
  virtual ~Server() = default;
  // Stops accepting, closes every connection and removes the socket file.
  virtual void close() = 0;
  // True while the socket file at the path is still ours (same inode).
  virtual bool socket_file_intact() const = 0;
};

}  // namespace egressd::control
