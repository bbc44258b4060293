// The TLS ClientHello a sandbox sends first on a TCP flow, or inside QUIC's
// CRYPTO frames: its server_name and whether it carries
// encrypted_client_hello. Pure functions over the bytes received so far (the
// caller re-runs them as segments arrive); nothing is allocated in
// proportion to the input.
#pragma once

#include "pin/verdict.h"

namespace egressd::pin {

// encrypted_client_hello (draft-ietf-tls-esni, codepoint 0xfe0d).
inline constexpr std::uint16_t kExtEch = 0xfe0d;
// early_data (RFC 8446 §4.2.10).
inline constexpr std::uint16_t kExtEarlyData = 42;

// `stream`: the first client bytes of a TCP flow, in order. TLS records
// (possibly several, a hello split across them) carrying a handshake message
// that must be a ClientHello.
//   complete: the hello is whole; name = its host_name (nullopt: no
//     server_name extension), ech = encrypted_client_hello present.
//   need_more: the hello is not whole yet (buffered = stream.size()).
//   invalid: not a TLS handshake record, not a ClientHello, malformed
//     (length fields, duplicate extensions, a server_name that is not one
//     valid host_name), an SSLv2-format hello, or a hello that cannot fit in
//     kMaxInspect bytes of stream.
// Bytes after the hello (early data) are not looked at.
Parse parse_tls_client_hello(Bytes stream);

// The same for handshake-layer bytes without records (QUIC's CRYPTO stream
// from offset 0): a ClientHello handshake message (type 1, 24-bit length).
Parse parse_client_hello_message(Bytes handshake);

}  // namespace egressd::pin
