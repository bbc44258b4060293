// A pinned TLS flow's client bytes after its first ClientHello, until the
// handshake is over. The first hello is judged, but it need not be the last:
// a TLS 1.3 server that answers with a HelloRetryRequest takes a second
// ClientHello, and OpenSSL takes the server name from it again. So hostname
// pinning reads the client's records after the first hello as long as a
// ClientHello may still come, and judges every one.
//
// What may come, by record type (the client's side of RFC 8446 and 5246):
//   22 handshake, before any change_cipher_spec: plaintext handshake
//      messages (a second ClientHello; TLS 1.2's ClientKeyExchange,
//      Certificate, CertificateVerify): reassembled across records, every
//      ClientHello reported whole;
//   20 change_cipher_spec: TLS 1.2's switch to encryption, or TLS 1.3's dummy
//      one (middlebox compatibility), which may come before a second hello;
//   22 after it: TLS 1.2's encrypted Finished, or TLS 1.3's second hello. A
//      record that starts a handshake message of type 1 is read as a hello
//      (an encrypted Finished starts so by chance once in 256: its "message"
//      then never completes before the client's application data, and is
//      dropped); any other first byte is encrypted, and so is every type 22
//      record after it (a server waiting for a hello refuses anything else);
//   23 application data: encrypted. One that starts after the server
//      answered (the client acknowledged bytes of the server) ends the
//      handshake: a client sends encrypted records then only once the server
//      finished its part, which it does only with the last hello whole. (The
//      one exception, early data skipped after a HelloRetryRequest, needs the
//      early_data extension in the first hello; pinning refuses that hello.)
//   anything else (alerts): passed over.
// Bounds: a hello larger than kMaxInspect is invalid; a record longer than
// TLS allows (2^14 + 2048) is invalid.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pin/verdict.h"

namespace egressd::pin {

class TlsClientStream {
 public:
  struct Step {
    // The ClientHello handshake messages these bytes completed, whole (type,
    // 24-bit length, body: parse_client_hello_message's input), after the
    // stream's first one.
    std::vector<std::vector<std::uint8_t>> hellos;
    // Set when the bytes cannot be a client's TLS: fixed text, never the
    // sandbox's bytes.
    std::optional<std::string> invalid;
  };
  // The client's next bytes, in order, without gaps, from the stream's first
  // byte. `answered`: the segment they came in acknowledges bytes of the
  // server. Nothing is read after done() or an invalid step.
  Step feed(Bytes bytes, bool answered);
  // An application data record started after the server answered: no hello
  // can follow.
  bool done() const { return done_; }

 private:
  void handshake_bytes(Bytes b, Step& step);
  std::array<std::uint8_t, 5> rec_{};
  std::size_t rec_have_ = 0;  // header bytes of the current record so far
  std::size_t rec_left_ = 0;  // body bytes of the current record still to come
  bool rec_first_ = false;    // the next body byte is the record's first
  bool ccs_ = false;          // a change_cipher_spec record went by
  bool encrypted_ = false;    // type 22 records are encrypted from here on
  // The handshake message being reassembled.
  std::array<std::uint8_t, 4> hs_{};
  std::size_t hs_have_ = 0;   // header bytes so far
  std::size_t hs_left_ = 0;   // body bytes still to come
  bool hs_suspect_ = false;   // begun after change_cipher_spec: may be encrypted bytes
  std::vector<std::uint8_t> hello_;  // a ClientHello's bytes so far
  bool in_hello_ = false;
  std::size_t hellos_ = 0;    // ClientHellos completed
  bool done_ = false;
  bool invalid_ = false;
};

}  // namespace egressd::pin
