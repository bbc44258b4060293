// The requests after the first on a cleartext HTTP/1.x connection. Hostname
// pinning judges a TCP flow by its first bytes and then lets it through the
// kernel unread; on HTTP/1.1 every later request of a keep-alive connection
// names its own host, and a CDN routes each by it. So a connection admitted
// for an HTTP request stays followed: each request head is found (after the
// body of the one before it) and its host judged like the first one's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pin/http_head.h"

namespace egressd::pin {

class HttpRequestStream {
 public:
  struct Step {
    // The names of the request heads these bytes completed, in order
    // (nullopt: a head with no Host, which the caller judges as the first).
    std::vector<std::optional<std::string>> heads;
    // Set when the stream cannot be read as HTTP/1.x requests any more (a
    // malformed head or chunk, a tunnel's or an upgraded protocol's bytes):
    // fixed text, never the sandbox's bytes.
    std::optional<std::string> invalid;
    // Where these bytes are the requests' framing (request heads, chunk
    // lines, trailers: what decides where a request starts) rather than body
    // data, as [from, to) offsets into them, in order.
    std::vector<std::pair<std::size_t, std::size_t>> framing;
  };
  // The client's next bytes, in order, without gaps.
  Step feed(Bytes bytes);
  // `n` client bytes that were let through without being read (beyond what
  // the reader keeps of a first write). Fine inside a body of known length;
  // anything else: the invalid reason.
  std::optional<std::string> skip(std::uint64_t n);
  // Bytes held for an incomplete head or chunk line (at most kMaxInspect).
  std::size_t held() const { return buf_.size(); }
  // The next head is the connection's first (its errors are not "a later
  // request"'s): a first head still incomplete when the reader starts to
  // follow the connection.
  void first_request() { first_ = true; }

 private:
  enum class State { head, body, chunk_size, chunk_data, chunk_end, trailer };
  State state_ = State::head;
  std::string buf_;          // the head or line so far
  std::uint64_t left_ = 0;   // body / chunk bytes still to come
  std::size_t trailer_ = 0;  // trailer bytes so far
  bool first_ = false;
  std::string where() const { return first_ ? "" : "a later request on the connection: "; }
  // One byte of a chunk line, the CRLF after a chunk, or a trailer line.
  std::optional<std::string> line_byte(std::uint8_t c);
};

}  // namespace egressd::pin
