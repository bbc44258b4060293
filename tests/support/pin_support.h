// Test support for src/pin: hex, the captured ClientHellos of
// data/tls_hellos.txt, and the client side of QUIC Initial protection (to
// build Initials the parser must open). Shared by tests/unit and
// tests/fuzz/quic_initial_fuzz.cc. Uses nettle, like the code under test,
// but the RFC vectors in pin_quic_test.cc check both against the RFCs.
#pragma once

#include <nettle/aes.h>
#include <nettle/gcm.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "pin/quic_initial.h"

namespace pintest {

using Buf = std::vector<std::uint8_t>;

// Hex to bytes; spaces and newlines are ignored.
inline Buf hex(std::string_view s) {
  Buf out;
  int hi = -1;
  for (char c : s) {
    int v;
    if (c >= '0' && c <= '9') v = c - '0';
    else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
    else continue;
    if (hi < 0) {
      hi = v;
    } else {
      out.push_back(static_cast<std::uint8_t>(hi << 4 | v));
      hi = -1;
    }
  }
  return out;
}

inline Buf bytes(std::string_view s) { return Buf(s.begin(), s.end()); }

// label -> bytes of tests/unit/data/tls_hellos.txt, read from `root`.
inline std::map<std::string, Buf> load_hellos(const std::string& root) {
  std::ifstream f(root + "/tests/unit/data/tls_hellos.txt");
  if (!f) throw std::runtime_error("cannot open " + root + "/tests/unit/data/tls_hellos.txt");
  std::map<std::string, Buf> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    std::string label, h;
    in >> label >> h;
    out[label] = hex(h);
  }
  return out;
}

inline void put_varint(Buf& b, std::uint64_t v) {
  if (v < 64) {
    b.push_back(static_cast<std::uint8_t>(v));
  } else if (v < 16384) {
    b.push_back(static_cast<std::uint8_t>(0x40 | v >> 8));
    b.push_back(static_cast<std::uint8_t>(v));
  } else {
    b.push_back(static_cast<std::uint8_t>(0x80 | v >> 24));
    b.push_back(static_cast<std::uint8_t>(v >> 16));
    b.push_back(static_cast<std::uint8_t>(v >> 8));
    b.push_back(static_cast<std::uint8_t>(v));
  }
}

inline Buf crypto_frame(std::uint64_t offset, const Buf& data) {
  Buf f{0x06};
  put_varint(f, offset);
  put_varint(f, data.size());
  f.insert(f.end(), data.begin(), data.end());
  return f;
}

// Appends to `out` a client Initial of `version` to `dcid` with packet
// number `pn` (4-byte encoding) carrying `frames`, padded with PADDING frames
// to a `min_size` packet, protected as RFC 9001 §5 says. `reserved`: the
// header's reserved bits (0x0c), which a valid packet leaves 0.
// `precomputed`: the keys for (version, dcid), to save deriving them again
// (the fuzz target). `pn_len`: the packet number's encoded length (1-4
// bytes: its low bytes). Encrypts in place: one buffer, few allocations.
inline void seal_initial_into(Buf& out, egressd::pin::QuicVersion version, const Buf& dcid, const Buf& scid,
                              std::uint32_t pn, const std::uint8_t* frames, std::size_t frames_len,
                              std::size_t min_size = 1200, const Buf& token = {}, std::uint8_t reserved = 0,
                              const egressd::pin::QuicInitialKeys* precomputed = nullptr, std::size_t pn_len = 4) {
  using egressd::pin::QuicVersion;
  const auto keys = precomputed ? *precomputed : egressd::pin::quic_client_initial_keys(version, dcid);
  const std::size_t start = out.size();
  const std::uint8_t type_bits = version == QuicVersion::v2 ? 1 : 0;
  out.push_back(static_cast<std::uint8_t>(0xc0 | type_bits << 4 | (reserved & 0x0c) | (pn_len - 1)));
  const auto v = static_cast<std::uint32_t>(version);
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  out.push_back(static_cast<std::uint8_t>(dcid.size()));
  out.insert(out.end(), dcid.begin(), dcid.end());
  out.push_back(static_cast<std::uint8_t>(scid.size()));
  out.insert(out.end(), scid.begin(), scid.end());
  put_varint(out, token.size());
  out.insert(out.end(), token.begin(), token.end());
  // Length (2-byte varint) + packet number + frames + 16-byte tag. The
  // header protection sample starts 4 bytes into the packet number field
  // whatever its length: a short packet number needs that much payload.
  const std::size_t fixed = out.size() - start + 2 + pn_len + 16;
  std::size_t payload = fixed + frames_len < min_size ? min_size - fixed : frames_len;
  payload = std::max(payload, std::size_t{4} - pn_len);
  const std::size_t length = pn_len + payload + 16;
  out.push_back(static_cast<std::uint8_t>(0x40 | length >> 8));
  out.push_back(static_cast<std::uint8_t>(length));
  const std::size_t pn_offset = out.size() - start;
  for (int i = static_cast<int>(pn_len) - 1; i >= 0; --i) out.push_back(static_cast<std::uint8_t>(pn >> (8 * i)));
  const std::size_t header_len = out.size() - start;
  out.insert(out.end(), frames, frames + frames_len);
  out.resize(start + header_len + payload + 16, 0x00);  // PADDING, then room for the tag

  std::uint8_t* p = out.data() + start;
  std::array<std::uint8_t, 12> nonce = keys.iv;
  for (int i = 0; i < 4; ++i) nonce[11 - i] ^= static_cast<std::uint8_t>(pn >> (8 * i));
  gcm_aes128_ctx gcm;
  gcm_aes128_set_key(&gcm, keys.key.data());
  gcm_aes128_set_iv(&gcm, nonce.size(), nonce.data());
  gcm_aes128_update(&gcm, header_len, p);
  gcm_aes128_encrypt(&gcm, payload, p + header_len, p + header_len);
  gcm_aes128_digest(&gcm, 16, p + header_len + payload);

  aes128_ctx hp;
  aes128_set_encrypt_key(&hp, keys.hp.data());
  std::uint8_t mask[16];
  aes128_encrypt(&hp, 16, mask, p + pn_offset + 4);
  p[0] ^= mask[0] & 0x0f;
  for (std::size_t i = 0; i < pn_len; ++i) p[pn_offset + i] ^= mask[1 + i];
}

// The same as a new buffer (a `min_size` datagram of one packet).
inline Buf seal_initial(egressd::pin::QuicVersion version, const Buf& dcid, const Buf& scid, std::uint32_t pn,
                        const Buf& frames, std::size_t min_size = 1200, const Buf& token = {},
                        std::uint8_t reserved = 0) {
  Buf out;
  out.reserve(std::max(min_size, frames.size() + 128));
  seal_initial_into(out, version, dcid, scid, pn, frames.data(), frames.size(), min_size, token, reserved);
  return out;
}

// The handshake message inside a single-record TLS stream (drops the 5-byte
// record header): what QUIC carries in CRYPTO frames.
inline Buf handshake_of(const Buf& record) { return Buf(record.begin() + 5, record.end()); }

}  // namespace pintest
