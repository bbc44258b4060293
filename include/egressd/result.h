// Errors as values. An Error carries a message that already names the culprit
// (the entry, the file:line:col, the netlink object); callers add context with
// Error::wrap rather than replacing the message.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace egressd {

// Exit/reply classes: invalid input (exit 2) vs runtime failure (exit 1).
enum class ErrorKind { invalid, runtime };

struct Error {
  ErrorKind kind = ErrorKind::runtime;
  std::string message;

  static Error invalid(std::string msg) { return {ErrorKind::invalid, std::move(msg)}; }
  static Error runtime(std::string msg) { return {ErrorKind::runtime, std::move(msg)}; }
  // Returns "context: message" keeping the kind.
  Error wrap(const std::string& context) const { return {kind, context + ": " + message}; }
};

// The text of an errno value ("No such file or directory"). The one place errno
// becomes text: every message and log line that reports an errno goes through it.
std::string errno_text(int err);
// A runtime Error reading "what: errno_text(err)".
Error errno_error(const std::string& what, int err);

// Result<T>: a T or an Error. Accessing the wrong side is a bug (assert).
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Error error) : v_(std::move(error)) {}

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { assert(ok()); return std::get<0>(v_); }
  const T& value() const& { assert(ok()); return std::get<0>(v_); }
  T&& value() && { assert(ok()); return std::get<0>(std::move(v_)); }
  const Error& error() const { assert(!ok()); return std::get<1>(v_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Error> v_;
};

// Status: success or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : err_(std::move(error)), ok_(false) {}
  static Status success() { return {}; }
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { assert(!ok_); return err_; }

 private:
  Error err_;
  bool ok_ = true;
};

}  // namespace egressd
