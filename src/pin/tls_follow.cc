#include "pin/tls_follow.h"

#include <algorithm>

namespace egressd::pin {
namespace {

constexpr std::uint8_t kChangeCipherSpec = 20, kHandshake = 22, kApplicationData = 23;
constexpr std::uint8_t kClientHello = 1;
// TLSCiphertext.length: at most 2^14 + 2048 (RFC 5246 6.2.3; TLS 1.3 allows less).
constexpr std::size_t kMaxCiphertextRecord = (1u << 14) + 2048;

}  // namespace

TlsClientStream::Step TlsClientStream::feed(Bytes bytes, bool answered) {
  Step step;
  std::size_t i = 0;
  while (i < bytes.size() && !done_ && !invalid_ && !step.invalid) {
    if (rec_have_ < rec_.size()) {
      rec_[rec_have_++] = bytes[i++];
      if (rec_have_ < rec_.size()) continue;
      rec_left_ = static_cast<std::size_t>(rec_[3] << 8 | rec_[4]);
      if (rec_left_ > kMaxCiphertextRecord) {
        step.invalid = "tls record longer than TLS allows";
        break;
      }
      switch (rec_[0]) {
        case kChangeCipherSpec: ccs_ = true; break;
        case kApplicationData:
          if (hs_have_ > 0) {
            // Application data inside a handshake message: a hello never
            // ends so; bytes taken for one after change_cipher_spec were
            // an encrypted Finished.
            if (!hs_suspect_) {
              step.invalid = "tls application data inside a handshake message";
              break;
            }
            hs_have_ = hs_left_ = 0;
            hello_.clear();
            in_hello_ = false;
            encrypted_ = true;
          }
          if (answered) done_ = true;
          break;
        default: break;
      }
      if (step.invalid) break;
      rec_first_ = true;
      if (rec_left_ == 0) rec_have_ = 0;
      continue;
    }
    const std::size_t take = std::min(rec_left_, bytes.size() - i);
    if (rec_[0] == kHandshake && !encrypted_) handshake_bytes(bytes.subspan(i, take), step);
    i += take;
    rec_left_ -= take;
    rec_first_ = false;
    if (rec_left_ == 0) rec_have_ = 0;
  }
  if (step.invalid) invalid_ = true;
  return step;
}

void TlsClientStream::handshake_bytes(Bytes b, Step& step) {
  std::size_t i = 0;
  while (i < b.size() && !step.invalid && !encrypted_) {
    if (hs_have_ < hs_.size()) {
      if (hs_have_ == 0) {
        // A message starts. After change_cipher_spec, at the start of a
        // record, only a ClientHello is read: anything else is TLS 1.2's
        // encrypted Finished, and so is every handshake record after it.
        const bool record_start = rec_first_ && i == 0;
        if (ccs_ && record_start && b[i] != kClientHello) {
          encrypted_ = true;
          return;
        }
        if (record_start || !ccs_) hs_suspect_ = ccs_;
      }
      hs_[hs_have_++] = b[i++];
      if (hs_have_ < hs_.size()) continue;
      hs_left_ = static_cast<std::size_t>(hs_[1]) << 16 | static_cast<std::size_t>(hs_[2]) << 8 | hs_[3];
      in_hello_ = hs_[0] == kClientHello;
      if (in_hello_) {
        // A plaintext hello too large is refused at once; bytes that may be
        // encrypted ones only once that many have come.
        if (!hs_suspect_ && hs_left_ + hs_.size() > kMaxInspect) {
          step.invalid = "tls ClientHello larger than 16384 bytes";
          return;
        }
        hello_.assign(hs_.begin(), hs_.end());
      }
    } else {
      const std::size_t take = std::min(hs_left_, b.size() - i);
      if (in_hello_) {
        if (hello_.size() + take > kMaxInspect) {
          step.invalid = "tls ClientHello larger than 16384 bytes";
          return;
        }
        hello_.insert(hello_.end(), b.begin() + static_cast<std::ptrdiff_t>(i),
                      b.begin() + static_cast<std::ptrdiff_t>(i + take));
      }
      i += take;
      hs_left_ -= take;
    }
    if (hs_have_ == hs_.size() && hs_left_ == 0) {
      if (in_hello_ && ++hellos_ > 1) step.hellos.push_back(std::move(hello_));
      hello_.clear();
      in_hello_ = false;
      hs_have_ = 0;
    }
  }
}

}  // namespace egressd::pin
