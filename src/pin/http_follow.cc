#include "pin/http_follow.h"

#include <algorithm>
#include <cctype>

namespace egressd::pin {
namespace {

// A chunk-size line: hex digits, then nothing or a chunk extension (RFC 9112
// §7.1.1). nullopt when malformed.
std::optional<std::uint64_t> chunk_size(std::string_view line) {
  std::size_t i = 0;
  std::uint64_t v = 0;
  while (i < line.size() && std::isxdigit(static_cast<unsigned char>(line[i])) != 0) {
    if (i == 15) return std::nullopt;  // 2^60 bytes is no chunk
    const char c = line[i];
    v = v * 16 + static_cast<std::uint64_t>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    ++i;
  }
  if (i == 0) return std::nullopt;
  // Whitespace before ';' is tolerated by servers (BWS); anything but an
  // extension after the size is not a chunk line.
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  if (i < line.size() && line[i] != ';') return std::nullopt;
  for (; i < line.size(); ++i) {
    const auto c = static_cast<unsigned char>(line[i]);
    if (c < 0x20 && c != '\t') return std::nullopt;
    if (c == 0x7f) return std::nullopt;
  }
  return v;
}

constexpr std::size_t kMaxLine = 4096;

// The request line of an incomplete head, once whole, judged as the head's
// first line is (read_http_head on the line and an empty one).
std::optional<std::string> request_line_error(std::string_view buf) {
  std::size_t pos = 0;
  while (pos < buf.size() && (buf[pos] == '\r' || buf[pos] == '\n')) ++pos;
  const auto lf = buf.find('\n', pos);
  if (lf == std::string_view::npos) return std::nullopt;
  std::string line(buf.substr(0, lf + 1));
  line += "\r\n";
  const HttpHead h = read_http_head(as_bytes(line));
  if (h.parse.verdict == Verdict::invalid) return h.parse.reason;
  return std::nullopt;
}

}  // namespace

std::optional<std::string> HttpRequestStream::line_byte(std::uint8_t c) {
  if (state_ == State::chunk_end) {
    // Exactly CRLF after a chunk's data.
    buf_.push_back(static_cast<char>(c));
    if (buf_ == "\r") return std::nullopt;
    if (buf_ != "\r\n") return "no CRLF after an http chunk";
    buf_.clear();
    state_ = State::chunk_size;
    return std::nullopt;
  }
  if (state_ == State::trailer && ++trailer_ > kMaxInspect) return "http trailers larger than 16384 bytes";
  if (buf_.size() >= kMaxLine) return "http chunk line longer than 4096 bytes";
  buf_.push_back(static_cast<char>(c));
  if (c != '\n') return std::nullopt;
  // Lines end with CRLF only: a bare LF or CR is where servers disagree.
  if (buf_.size() < 2 || buf_[buf_.size() - 2] != '\r') return "http chunk line without CRLF";
  const std::string_view line(buf_.data(), buf_.size() - 2);
  if (line.find('\r') != std::string_view::npos) return "bare CR in an http chunk line";
  if (state_ == State::chunk_size) {
    const auto n = chunk_size(line);
    if (!n) return "malformed http chunk size";
    buf_.clear();
    if (*n == 0) {
      state_ = State::trailer;
      trailer_ = 0;
    } else {
      left_ = *n;
      state_ = State::chunk_data;
    }
    return std::nullopt;
  }
  // A trailer line; the empty one ends the request.
  const bool end = line.empty();
  if (!end && (line.front() == ' ' || line.front() == '\t' || line.find(':') == std::string_view::npos)) {
    return "malformed http trailer line";
  }
  buf_.clear();
  if (end) state_ = State::head;
  return std::nullopt;
}

HttpRequestStream::Step HttpRequestStream::feed(Bytes bytes) {
  Step step;
  std::size_t i = 0;
  while (i < bytes.size()) {
    const std::size_t at = i;
    const bool framing = state_ != State::body && state_ != State::chunk_data;
    switch (state_) {
      case State::head: {
        // Bytes up to the empty line; the head is read whole, from its
        // first byte, each time a line ends (as parse_http_head is run on a
        // flow's first bytes).
        const std::size_t room = kMaxInspect - buf_.size();
        const std::size_t take = std::min(room, bytes.size() - i);
        const std::size_t before = buf_.size();
        buf_.append(reinterpret_cast<const char*>(bytes.data() + i), take);
        const HttpHead h = read_http_head(Bytes(reinterpret_cast<const std::uint8_t*>(buf_.data()), buf_.size()));
        if (h.parse.verdict == Verdict::invalid) {
          step.invalid = where() + h.parse.reason;
          return step;
        }
        if (h.parse.verdict == Verdict::need_more) {
          // Bytes of an incomplete head pass (a server acts on no request
          // before its head ends), but not a request line a server could act
          // on alone: HTTP/0.9's `GET http://other.test/` has no head to end.
          if (auto bad = request_line_error(buf_); bad) {
            step.invalid = where() + *bad;
            return step;
          }
          if (take < bytes.size() - i) {
            step.invalid = where() + "request head larger than 16384 bytes";
            return step;
          }
          i += take;
          break;
        }
        // Complete: the head ends inside what was just appended.
        i += h.size - before;
        buf_.clear();
        first_ = false;
        step.heads.push_back(h.parse.name);
        if (h.body == HttpHead::Body::length) {
          left_ = h.length;
          state_ = State::body;
        } else if (h.body == HttpHead::Body::chunked) {
          state_ = State::chunk_size;
        }
        break;
      }
      case State::body:
      case State::chunk_data: {
        const std::uint64_t take = std::min<std::uint64_t>(left_, bytes.size() - i);
        i += static_cast<std::size_t>(take);
        left_ -= take;
        if (left_ == 0) state_ = state_ == State::body ? State::head : State::chunk_end;
        break;
      }
      case State::chunk_size:
      case State::chunk_end:
      case State::trailer:
        if (auto bad = line_byte(bytes[i]); bad) {
          step.invalid = std::move(*bad);
          return step;
        }
        ++i;
        break;
    }
    if (framing && i > at) {
      if (!step.framing.empty() && step.framing.back().second == at) {
        step.framing.back().second = i;
      } else {
        step.framing.emplace_back(at, i);
      }
    }
  }
  return step;
}

std::optional<std::string> HttpRequestStream::skip(std::uint64_t n) {
  if (n == 0) return std::nullopt;
  if ((state_ != State::body && state_ != State::chunk_data) || n > left_) {
    return "http bytes let through unread beyond a body of known length";
  }
  left_ -= n;
  if (left_ == 0) state_ = state_ == State::body ? State::head : State::chunk_end;
  return std::nullopt;
}

}  // namespace egressd::pin
