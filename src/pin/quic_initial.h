// QUIC Initial packets a sandbox sends to UDP 443 (RFC 9000, RFC 9001 §5,
// RFC 9369 for version 2): removes Initial protection with the keys anyone
// can derive from the client's Destination Connection ID, gathers the CRYPTO
// stream across packets and datagrams, and judges the ClientHello in it
// (pin/tls_hello.h). Crypto is nettle's (HKDF-SHA256, AES-128, GCM); nothing
// here is hand-written crypto. No I/O; memory is fixed per assembler.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <nettle/aes.h>
#include <nettle/gcm.h>

#include "pin/verdict.h"

namespace egressd::pin {

enum class QuicVersion : std::uint32_t { v1 = 0x00000001, v2 = 0x6b3343cf };

// The version a long header's version field names, if egressd can read its
// Initials (v1, v2); nullopt for any other (drafts, negotiation, unknown).
std::optional<QuicVersion> quic_version(std::uint32_t wire);

struct QuicInitialKeys {
  std::array<std::uint8_t, 32> secret{};  // client_initial_secret
  std::array<std::uint8_t, 16> key{};     // AEAD_AES_128_GCM key
  std::array<std::uint8_t, 12> iv{};
  std::array<std::uint8_t, 16> hp{};      // AES-128 header protection key
};

// The keys protecting the client's Initial packets for `dcid` (the
// Destination Connection ID of the client's first Initial), RFC 9001 §5.2 /
// RFC 9369 §3.3: version-specific salt and labels.
QuicInitialKeys quic_client_initial_keys(QuicVersion version, Bytes dcid);

// What a datagram of an admitted QUIC flow is (QuicInitialAssembler::follow).
struct QuicFollow {
  enum class Kind {
    same,     // nothing new: 0-RTT/Handshake packets, Initials of the judged
              // connection whose CRYPTO data repeats the judged ClientHello
    other,    // its first packet is not this connection's (another
              // Destination Connection ID's keys, another version): a new
              // connection on the same four-tuple. (The client's Initial
              // after a server's Retry is this connection's: under the
              // Retry's ID and keys, with its token, repeating the judged
              // hello, it is followed as `same`, or `hello`, once.)
    hello,    // a second ClientHello, whole, after the judged one (as a
              // client sends after a HelloRetryRequest): judge `hello`
    invalid,  // this connection's Initial with CRYPTO data that contradicts
              // what was sent or follows a second hello, an Initial under
              // this connection's Destination Connection ID that does not
              // open, a datagram under 1200 bytes, a bad frame, a client Retry
  };
  QuicFollow() = default;
  QuicFollow(Kind k, std::string why) : kind(k), reason(std::move(why)) {}
  Kind kind = Kind::invalid;
  std::string reason;  // invalid: why (fixed text)
  Parse hello;         // hello: as parse_client_hello_message says
};

// Whether any packet of `datagram` is an Initial, or may be one (a header
// that does not parse counts: the caller judges it rather than let it by).
bool quic_datagram_has_initial(Bytes datagram);

// One per UDP flow to a pinned address: feed it the client's datagrams in
// the order they were sent. Not thread-safe.
class QuicInitialAssembler {
 public:
  // Initial packets bigger than this are refused (clients send 1200-1500).
  static constexpr std::size_t kMaxPacket = 8192;
  // Datagrams looked at before giving up on a ClientHello.
  static constexpr std::size_t kMaxDatagrams = 16;
  // Disjoint pieces of CRYPTO data held at once (clients that scramble
  // their CRYPTO frames, as Chrome does, make a handful).
  static constexpr std::size_t kMaxPieces = 64;

  // Reads the long-header packets of one datagram (coalesced ones
  // included; Initials are opened, 0-RTT/Handshake packets skipped, a short
  // header packet ends the datagram) and returns
  //   complete: the CRYPTO stream from offset 0 holds a whole ClientHello;
  //     name / ech as parse_client_hello_message says;
  //   need_more: not yet (buffered = datagram bytes fed so far);
  //   invalid: the first packet is not a v1/v2 Initial, a Destination
  //     Connection ID under 8 bytes in the first Initial, an Initial in a
  //     datagram under 1200 bytes, CRYPTO data after the whole ClientHello
  //     (a second hello the server would also read), malformed headers,
  //     an authentication failure, reserved bits set, a frame other than
  //     PADDING/PING/ACK/CRYPTO, CRYPTO data beyond kMaxInspect bytes or
  //     contradicting earlier data, a ClientHello the TLS parser refuses, or
  //     kMaxDatagrams datagrams without a whole ClientHello.
  // Once complete or invalid, every later call returns the same verdict.
  Parse feed(Bytes datagram);

  // After feed() said complete (the flow was admitted): a later datagram of
  // the flow. Its Initials are opened with the judged connection's keys; the
  // server must never get a ClientHello egressd did not judge, so a second
  // connection on the four-tuple, or an Initial resent after the first one
  // never reached the server, is caught here.
  QuicFollow follow(Bytes datagram);

  // The first Initial's Destination Connection ID (empty before one was
  // read), or the one a server's Retry chose once the client used it: what
  // the server knows the connection by, whatever the four-tuple.
  Bytes dcid() const { return {dcid_.data(), dcid_len_}; }

  // The CRYPTO bytes received contiguously from offset 0 (for tests).
  Bytes crypto_prefix() const { return {crypto_.data(), contiguous_}; }

 private:
  Parse open_initial(Bytes packet, std::size_t pn_offset);
  Parse frames(Bytes plaintext);
  Parse judge();
  bool original_dcid(Bytes dcid) const;
  QuicFollow after_retry(Bytes datagram, Bytes dcid, std::size_t token_len);

  std::optional<Parse> final_;
  bool following_ = false;    // add_crypto: only repeats of held bytes
  bool auth_failed_ = false;  // open_initial: the AEAD tag did not verify
  bool retried_ = false;      // follow() moved to the keys of a server's Retry
  std::optional<QuicVersion> version_;
  std::array<std::uint8_t, 20> dcid_{};  // the first Initial's Destination Connection ID
  std::size_t dcid_len_ = 0;
  std::size_t hello_end_ = 0;   // where the judged ClientHello ends in the CRYPTO stream
  std::size_t second_end_ = 0;  // where a second one ends, once whole (follow())
  QuicInitialKeys keys_{};
  // keys_ scheduled once per flow, not once per packet.
  aes128_ctx hp_{};
  gcm_aes128_ctx gcm_{};
  std::int64_t largest_pn_ = -1;
  std::size_t datagrams_ = 0;
  std::size_t fed_ = 0;
  Parse add_crypto(std::size_t offset, Bytes data);

  std::array<std::uint8_t, kMaxInspect> crypto_{};
  // The CRYPTO ranges held, [begin, end), sorted, disjoint, not adjacent.
  struct Piece {
    std::size_t begin, end;
  };
  std::array<Piece, kMaxPieces> pieces_{};
  std::size_t npieces_ = 0;
  std::size_t contiguous_ = 0;
  std::array<std::uint8_t, kMaxPacket> scratch_{};
};

}  // namespace egressd::pin
