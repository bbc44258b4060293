// The HTTP/1.x request head a sandbox sends first on a TCP flow: the host it
// names. Pure function over the bytes received so far; the caller re-runs it
// as segments arrive.
#pragma once

#include "pin/verdict.h"

namespace egressd::pin {

// `stream`: the first client bytes of a TCP flow, in order.
//   complete: the head (through the empty line) is whole. name = the host of
//     an absolute-form or authority-form (CONNECT) target, else of the Host
//     header; its port is dropped; IPv6 literals lose their brackets.
//     nullopt: no Host and no authority in the target (or an empty Host).
//   need_more: the head is not whole yet.
//   invalid: the HTTP/2 cleartext preface ("h2c preface"); a head over
//     kMaxInspect bytes; a malformed request line or header line; a version
//     other than HTTP/1.x (HTTP/0.9 included); whitespace before the request
//     line (only empty lines are tolerated, as servers do); any obs-fold
//     (continuation) line; a duplicate Host; whitespace between a field name
//     and its colon; a Host or authority that is not host[:port]; userinfo
//     in the target; a target authority and Host that name different hosts.
Parse parse_http_head(Bytes stream);

// The head as parse_http_head reads it, and where the request's body ends
// (RFC 9112 §6.3), for reading the requests after it on the same connection
// (HttpRequestStream). Framing that servers could read differently is
// invalid: Transfer-Encoding other than exactly "chunked", Transfer-Encoding
// and Content-Length together, more than one of either, a Content-Length
// that is not 1-18 digits, and a body on GET, HEAD, TRACE or CONNECT (RFC
// 9110 §9.3.1: such content has no meaning and servers disagree on it).
struct HttpHead {
  Parse parse;
  std::size_t size = 0;  // complete: the head's bytes, leading empty lines included
  enum class Body { none, length, chunked } body = Body::none;
  std::uint64_t length = 0;  // Body::length
};
HttpHead read_http_head(Bytes stream);

}  // namespace egressd::pin
