"""QUIC v1 client Initial datagrams for the pinning attack tests (RFC 9000 §17.2.2, RFC 9001
§5): a ClientHello in a CRYPTO frame, padded to 1200 bytes, protected with the keys anyone can
derive from the Destination Connection ID. The cryptography comes from python3-cryptography
(HKDF, AES-128-GCM, AES for header protection); this file only lays out the packet.

    initial(dcid, client_hello_handshake, pn=0) -> bytes
    client_hello(sni) -> the ClientHello handshake message Python's ssl writes for `sni`
"""
import ssl

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hmac import HMAC
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

SALT_V1 = bytes.fromhex("38762cf7f55934b34d179ae6a4c80cadccbb7f0a")


def _extract(salt: bytes, ikm: bytes) -> bytes:
    h = HMAC(salt, hashes.SHA256())  # HKDF-Extract is HMAC(salt, ikm) (RFC 5869 §2.2)
    h.update(ikm)
    return h.finalize()


def _expand_label(secret: bytes, label: str, n: int) -> bytes:
    full = b"tls13 " + label.encode()
    info = n.to_bytes(2, "big") + bytes([len(full)]) + full + b"\x00"
    return HKDFExpand(hashes.SHA256(), n, info).derive(secret)


def keys(dcid: bytes) -> tuple[bytes, bytes, bytes]:
    secret = _expand_label(_extract(SALT_V1, dcid), "client in", 32)
    return (_expand_label(secret, "quic key", 16), _expand_label(secret, "quic iv", 12),
            _expand_label(secret, "quic hp", 16))


def _varint(v: int) -> bytes:
    if v < 64:
        return bytes([v])
    if v < 16384:
        return (0x4000 | v).to_bytes(2, "big")
    return (0x80000000 | v).to_bytes(4, "big")


def initial(dcid: bytes, hello: bytes, pn: int = 0, size: int = 1200, offset: int = 0) -> bytes:
    """A client Initial whose CRYPTO frame carries `hello` at `offset` of the stream."""
    key, iv, hp = keys(dcid)
    frames = b"\x06" + _varint(offset) + _varint(len(hello)) + hello
    head_len = 1 + 4 + 1 + len(dcid) + 1 + 1 + 2 + 4  # first, version, dcid, scid, token, length, pn
    frames += b"\x00" * max(0, size - head_len - len(frames) - 16)
    length = 4 + len(frames) + 16
    header = bytes([0xc3]) + (1).to_bytes(4, "big") + bytes([len(dcid)]) + dcid + b"\x00" + b"\x00"
    header += (0x4000 | length).to_bytes(2, "big") + pn.to_bytes(4, "big")
    nonce = bytes(a ^ b for a, b in zip(iv, pn.to_bytes(12, "big")))
    sealed = AESGCM(key).encrypt(nonce, frames, header)
    enc = Cipher(algorithms.AES(hp), modes.ECB()).encryptor()
    mask = enc.update(sealed[:16]) + enc.finalize()  # the sample starts 4 bytes after the pn
    out = bytearray(header + sealed)
    out[0] ^= mask[0] & 0x0f
    pn_at = len(header) - 4
    for i in range(4):
        out[pn_at + i] ^= mask[1 + i]
    return bytes(out)


def client_hello(sni: str) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    record = out.read()
    return record[5:]  # the handshake message, without the TLS record header
