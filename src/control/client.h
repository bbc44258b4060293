// A blocking client for the control socket, used by egressctl and tests.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "egressd/result.h"
#include "egressd/unique_fd.h"

namespace egressd::control {

class Client {
 public:
  // Connects to the filesystem socket at `path`. Runtime error naming the path
  // ("cannot connect to /run/egressd/egressd.sock: No such file or directory").
  static Result<Client> connect(const std::string& path);
  Client(Client&&) noexcept = default;
  Client& operator=(Client&&) noexcept = default;
  Client(const Client&) = delete;
  ~Client() = default;

  // Sends one request line and reads one reply line, within `timeout`.
  // After a timeout or I/O error the connection is closed (a late reply would
  // be mistaken for the next one): later calls fail at once.
  Result<nlohmann::json> call(const nlohmann::json& request,
                              std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Reads one more line (for streaming replies such as `denied --follow`).
  Result<nlohmann::json> read_line(std::chrono::milliseconds timeout);

 private:
  explicit Client(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
  std::string buf_;
};

// Default socket path: $EGRESSD_SOCKET, else /run/egressd/egressd.sock.
std::string default_socket_path();

}  // namespace egressd::control
