"""A QUIC v1 client of its own for hostname pinning's tests (test_pinning_quic_hrr.py; written in
an attack review, 2026-12-06): HelloRetryRequest over QUIC. Stdlib and python3-cryptography only.

Its first Initial carries, in ONE CRYPTO stream starting at offset 0:
    CH1 (SNI = SNI1, an empty key_share list -> the server must answer HelloRetryRequest)
    CH2 (SNI = SNI2, an x25519 key share), right behind CH1 (offset len(CH1)).
egressd judges only the first handshake message of the CRYPTO stream (CH1).
The client then completes the QUIC/TLS handshake itself: it decrypts the server's Initial
(HRR, ServerHello) and Handshake packets, verifies the server's Finished over the transcript
  message_hash(CH1) + HRR + CH2 + SH + EE + Cert + CV
(so the server's handshake is the one of CH2, naming SNI2), sends its own Finished in a
Handshake packet and waits for HANDSHAKE_DONE in a 1-RTT packet.

Usage: quic_hrr_client.py ADDR PORT SNI1 SNI2 [MODE]
MODE: onepacket (default): CH1+CH2 in one CRYPTO frame of one Initial
      ahead: CH2 alone first (CRYPTO offset len(CH1), an Initial egressd holds as need_more),
             then CH1 at offset 0 in a second datagram
      sequential: a well-behaved client: CH1 alone, CH2 only after the server's HelloRetryRequest
      diverge: CH1 alone; after the HelloRetryRequest an Initial in a datagram under 1200 bytes
             with packet number 1000 (servers discard it), then one with a 1-byte packet number
             1 carrying, at offset 0, a hello naming SNI1 whose tail at len(CH1) is CH2
      evict: CH1 alone; after the HelloRetryRequest 300 other flows, each with an Initial naming
             SNI1 (each waited for until the server answers or the deadline), then the same
             hello-with-CH2-as-its-tail as `diverge` in an ordinary Initial
      retry_adopt: CH1 alone; after the HelloRetryRequest, from a new source port, a fresh
             connection whose longer hello names SNI1, then an Initial "after a Retry" under the
             first connection's ID carrying, where the server waits, a hello naming SNI2
             (attack review L)
      detour, detour_scid, detour_v2: CH1 alone; after the HelloRetryRequest another
             connection's first Initial on the four-tuple (a new Destination Connection ID with
             its own keys and a hello naming SNI1; or the server's own connection ID with keys
             derived from it; or a QUIC v2 Initial under a new ID), then, under the first
             connection's ID and keys, the hello-with-CH2-as-its-tail (found in a second review)
Prints READY, then one JSON line. HOLD=1 in the environment: once the handshake is done, prints
"HS <json>" and waits for a line on stdin (a test switches phases), then sends five 1-RTT PINGs
and reports how many the server acknowledged (after_switch_acks).
"""
import hashlib
import hmac
import json
import os
import select
import socket
import struct
import sys
import time

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SALT_V1 = bytes.fromhex("38762cf7f55934b34d179ae6a4c80cadccbb7f0a")
HRR_RANDOM = hashlib.sha256(b"HelloRetryRequest").digest()


def u8(b): return bytes([len(b)]) + b
def u16(b): return struct.pack("!H", len(b)) + b
def u24(b): return struct.pack("!I", len(b))[1:] + b
def ext(t, b): return struct.pack("!H", t) + u16(b)


def hkdf_extract(salt, ikm): return hmac.new(salt, ikm, hashlib.sha256).digest()


def hkdf_expand_label(secret, label, ctx, n):
    info = struct.pack("!H", n) + u8(b"tls13 " + label) + u8(ctx)
    out, t, i = b"", b"", 1
    while len(out) < n:
        t = hmac.new(secret, t + info + bytes([i]), hashlib.sha256).digest()
        out += t
        i += 1
    return out[:n]


def varint(v):
    if v < 64:
        return bytes([v])
    if v < 16384:
        return (0x4000 | v).to_bytes(2, "big")
    if v < 2**30:
        return (0x80000000 | v).to_bytes(4, "big")
    return (0xc000000000000000 | v).to_bytes(8, "big")


def read_varint(b, p):
    l = 1 << (b[p] >> 6)
    v = b[p] & 0x3f
    for i in range(1, l):
        v = v << 8 | b[p + i]
    return v, p + l


class PKeys:
    """QUIC packet protection keys from a traffic secret."""
    def __init__(self, secret):
        self.aead = AESGCM(hkdf_expand_label(secret, b"quic key", b"", 16))
        self.iv = hkdf_expand_label(secret, b"quic iv", b"", 12)
        self.hp = hkdf_expand_label(secret, b"quic hp", b"", 16)

    def mask(self, sample):
        e = Cipher(algorithms.AES(self.hp), modes.ECB()).encryptor()
        return e.update(sample) + e.finalize()

    def nonce(self, pn):
        return bytes(a ^ b for a, b in zip(self.iv, pn.to_bytes(12, "big")))


def initial_secrets(dcid):
    init = hkdf_extract(SALT_V1, dcid)
    return (hkdf_expand_label(init, b"client in", b"", 32), hkdf_expand_label(init, b"server in", b"", 32))


def seal_long(keys, ptype, dcid, scid, pn, payload, pad_to=0, token=b"", version=1):
    """A long-header packet (ptype: the version's type bits; v1: 0 Initial, 2 Handshake; v2:
    1 Initial), 4-byte pn."""
    first = 0xc0 | (ptype << 4) | 0x03
    head = bytes([first]) + version.to_bytes(4, "big") + u8(dcid) + u8(scid)
    if (version, ptype) in ((1, 0), (V2, 1)):  # an Initial: its token
        head += varint(len(token)) + token
    if pad_to:
        need = pad_to - (len(head) + 2 + 4 + len(payload) + 16)
        if need > 0:
            payload = payload + b"\x00" * need
    length = 4 + len(payload) + 16
    head += (0x4000 | length).to_bytes(2, "big") + pn.to_bytes(4, "big")
    sealed = keys.aead.encrypt(keys.nonce(pn), payload, head)
    out = bytearray(head + sealed)
    pn_at = len(head) - 4
    m = keys.mask(bytes(out[pn_at + 4:pn_at + 20]))
    out[0] ^= m[0] & 0x0f
    for i in range(4):
        out[pn_at + i] ^= m[1 + i]
    return bytes(out)


V2 = 0x6b3343cf
SALT_V2 = bytes.fromhex("0dede3def700a6db819381be6e269dcbf9bd2ed9")


class PKeysV2(PKeys):
    def __init__(self, dcid):
        init = hkdf_extract(SALT_V2, dcid)
        secret = hkdf_expand_label(init, b"client in", b"", 32)
        self.aead = AESGCM(hkdf_expand_label(secret, b"quicv2 key", b"", 16))
        self.iv = hkdf_expand_label(secret, b"quicv2 iv", b"", 12)
        self.hp = hkdf_expand_label(secret, b"quicv2 hp", b"", 16)


def seal_initial_v2(keys, dcid, scid, pn, payload, pad_to=1200):
    """A QUIC v2 Initial (type bits 01), 4-byte pn."""
    return seal_long(keys, 1, dcid, scid, pn, payload, pad_to=pad_to, version=V2)


def seal_initial_pn1(keys, dcid, scid, pn, payload, pad_to=1200):
    """An Initial whose packet number is encoded in ONE byte (pn & 0xff)."""
    head = bytes([0xc0]) + (1).to_bytes(4, "big") + u8(dcid) + u8(scid) + varint(0)
    need = pad_to - (len(head) + 2 + 1 + len(payload) + 16)
    if need > 0:
        payload = payload + b"\x00" * need
    length = 1 + len(payload) + 16
    head += (0x4000 | length).to_bytes(2, "big") + bytes([pn & 0xff])
    sealed = keys.aead.encrypt(keys.nonce(pn), payload, head)
    out = bytearray(head + sealed)
    pn_at = len(head) - 1
    m = keys.mask(bytes(out[pn_at + 4:pn_at + 20]))
    out[0] ^= m[0] & 0x0f
    out[pn_at] ^= m[1]
    return bytes(out)


def hello_embedding(sni, rnd, tp, prefix_len, tail):
    """A ClientHello naming `sni` whose last extension (an unknown type) carries `tail` so that
    `tail` starts exactly at byte `prefix_len` of the handshake message and ends it."""
    base = ext(0, u16(b"\x00" + u16(sni.encode())))
    base += ext(43, u8(b"\x03\x04"))
    base += ext(10, u16(b"\x00\x1d"))
    base += ext(13, u16(b"\x04\x03\x08\x04"))
    base += ext(51, u16(b""))
    base += ext(16, u16(u8(b"h3")))
    base += ext(0x39, tp)
    head_len = 4 + 2 + 32 + 1 + 4 + 2 + 2  # msg header .. extensions length
    start = head_len + len(base) + 4        # where the unknown extension's data starts
    pad = prefix_len - start
    assert pad >= 0, (prefix_len, start)
    exts = base + ext(0x7a7a, b"\x00" * pad + tail)
    body = b"\x03\x03" + rnd + u8(b"") + u16(b"\x13\x01") + b"\x01\x00" + u16(exts)
    msg = b"\x01" + u24(body)
    assert msg[prefix_len:] == tail
    return msg


def open_packet(keys, pkt, pn_at, long_hdr):
    b = bytearray(pkt)
    m = keys.mask(bytes(b[pn_at + 4:pn_at + 20]))
    b[0] ^= m[0] & (0x0f if long_hdr else 0x1f)
    pn_len = (b[0] & 3) + 1
    pn = 0
    for i in range(pn_len):
        b[pn_at + i] ^= m[1 + i]
        pn = pn << 8 | b[pn_at + i]
    hl = pn_at + pn_len
    return keys.aead.decrypt(keys.nonce(pn), bytes(b[hl:]), bytes(b[:hl]))


def split_datagram(d, my_cid_len):
    """[(kind, packet, pn_at, scid)] kind: 'initial'|'handshake'|'0rtt'|'retry'|'short'."""
    out, p = [], 0
    while p < len(d):
        first = d[p]
        if not first & 0x80:
            out.append(("short", d[p:], 1 + my_cid_len, None))
            break
        ver = int.from_bytes(d[p + 1:p + 5], "big")
        q = p + 5
        dl = d[q]; q += 1 + dl
        sl = d[q]; scid = d[q + 1:q + 1 + sl]; q += 1 + sl
        typ = (first >> 4) & 3
        if ver == 0:
            out.append(("vn", d[p:], 0, scid)); break
        if typ == 3:
            out.append(("retry", d[p:], 0, scid)); break
        if typ == 0:
            tl, q = read_varint(d, q); q += tl
        ln, q = read_varint(d, q)
        out.append((["initial", "0rtt", "handshake"][typ], d[p:q + ln], q - p, scid))
        p = q + ln
    return out


def frames_crypto(pt):
    """CRYPTO frames [(offset, data)] and other frame types seen."""
    crypto, kinds, p = [], [], 0
    while p < len(pt):
        t, p = read_varint(pt, p)
        if t == 0:
            continue
        kinds.append(t)
        if t == 1 or t == 0x1e:
            continue
        if t in (2, 3):
            _, p = read_varint(pt, p); _, p = read_varint(pt, p)
            n, p = read_varint(pt, p); _, p = read_varint(pt, p)
            for _ in range(n):
                _, p = read_varint(pt, p); _, p = read_varint(pt, p)
            if t == 3:
                for _ in range(3):
                    _, p = read_varint(pt, p)
        elif t == 6:
            off, p = read_varint(pt, p); n, p = read_varint(pt, p)
            crypto.append((off, pt[p:p + n])); p += n
        elif t == 0x18:  # NEW_CONNECTION_ID
            _, p = read_varint(pt, p); _, p = read_varint(pt, p)
            l = pt[p]; p += 1 + l + 16
        elif t == 0x07:  # NEW_TOKEN
            n, p = read_varint(pt, p); p += n
        elif t in (0x1c, 0x1d):
            code, p = read_varint(pt, p)
            if t == 0x1c:
                _, p = read_varint(pt, p)
            n, p = read_varint(pt, p)
            kinds.append(("close", code, pt[p:p + n].decode(errors="replace"))); p += n
        else:
            break  # stream frames etc.: not needed
    return crypto, kinds


class Stream:
    def __init__(self):
        self.data, self.parts = b"", {}

    def add(self, off, d):
        self.parts[off] = d
        while True:
            got = False
            for o, dd in list(self.parts.items()):
                if o <= len(self.data) < o + len(dd) or (o <= len(self.data) and not dd):
                    self.data += dd[len(self.data) - o:]
                    got = True
                if o + len(dd) <= len(self.data):
                    del self.parts[o]
            if not got:
                break

    def messages(self, start):
        msgs, p = [], start
        while len(self.data) - p >= 4 and len(self.data) - p >= 4 + int.from_bytes(self.data[p + 1:p + 4], "big"):
            n = 4 + int.from_bytes(self.data[p + 1:p + 4], "big")
            msgs.append(self.data[p:p + n]); p += n
        return msgs, p


def hello_extensions(msg):
    body = msg[4:]
    p = 2 + 32
    p += 1 + body[p] + 3
    exts, out = body[p + 2:], {}
    while exts:
        et, el = struct.unpack("!HH", exts[:4])
        out[et] = exts[4:4 + el]
        exts = exts[4 + el:]
    return out


def transport_params(scid):
    tp = b""
    def param(i, v): return varint(i) + varint(len(v)) + v
    tp += param(0x0f, scid)                     # initial_source_connection_id
    tp += param(0x04, varint(1 << 20))          # initial_max_data
    tp += param(0x05, varint(1 << 18))
    tp += param(0x06, varint(1 << 18))
    tp += param(0x07, varint(1 << 18))
    tp += param(0x08, varint(100))
    tp += param(0x09, varint(100))
    tp += param(0x01, varint(30000))            # max_idle_timeout
    return tp


def client_hello(sni, rnd, share, tp):
    exts = ext(0, u16(b"\x00" + u16(sni.encode())))
    exts += ext(43, u8(b"\x03\x04"))
    exts += ext(10, u16(b"\x00\x1d"))
    exts += ext(13, u16(b"\x04\x03\x08\x04\x04\x01\x08\x05\x08\x06\x05\x03"))
    exts += ext(51, u16(b"" if share is None else b"\x00\x1d" + u16(share)))
    exts += ext(45, u8(b"\x01"))
    exts += ext(16, u16(u8(b"h3")))
    exts += ext(0x39, tp)
    body = b"\x03\x03" + rnd + u8(b"") + u16(b"\x13\x01") + b"\x01\x00" + u16(exts)
    return b"\x01" + u24(body)


def main(addr, port, sni1, sni2, mode="onepacket"):
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.connect((addr, port))
    s.settimeout(3.0)
    dcid, scid = os.urandom(8), os.urandom(8)
    c_in, s_in = initial_secrets(dcid)
    cik, sik = PKeys(c_in), PKeys(s_in)
    rnd = os.urandom(32)
    tp = transport_params(scid)
    priv = X25519PrivateKey.generate()
    pub = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ch1 = client_hello(sni1, rnd, None, tp)
    ch2 = client_hello(sni2, rnd, pub, tp)
    print("READY", flush=True)
    sent = []
    if mode == "onepacket":
        pl = b"\x06" + varint(0) + varint(len(ch1 + ch2)) + ch1 + ch2
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    elif mode == "ahead":
        pl2 = b"\x06" + varint(len(ch1)) + varint(len(ch2)) + ch2
        pl1 = b"\x06" + varint(0) + varint(len(ch1)) + ch1
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl2, pad_to=1200))
        sent.append(seal_long(cik, 0, dcid, scid, 1, pl1, pad_to=1200))
    elif mode == "sequential":  # a well-behaved client: CH2 only after the server's HRR
        pl = b"\x06" + varint(0) + varint(len(ch1)) + ch1
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    elif mode == "diverge":  # CH1 alone; after the HRR: a small Initial, then a 1-byte-pn Initial
        pl = b"\x06" + varint(0) + varint(len(ch1)) + ch1
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    elif mode in ("detour", "detour_scid", "detour_v2"):
        pl = b"\x06" + varint(0) + varint(len(ch1)) + ch1
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    elif mode in ("migrate", "migrate_ack", "expire", "retry_adopt"):
        pl = b"\x06" + varint(0) + varint(len(ch1)) + ch1
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    elif mode == "evict":  # CH1 alone; after the HRR: 300 other admitted flows, then CHx
        pl = b"\x06" + varint(0) + varint(len(ch1)) + ch1
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    elif mode == "control":  # CH1 and CH2 both name SNI1... (sni2 == sni1 given by caller)
        pl = b"\x06" + varint(0) + varint(len(ch1 + ch2)) + ch1 + ch2
        sent.append(seal_long(cik, 0, dcid, scid, 0, pl, pad_to=1200))
    for d in sent:
        s.send(d)
    res = {"mode": mode, "sni1": sni1, "sni2": sni2, "sent": [len(d) for d in sent]}
    socks = [s]
    ini, hs = Stream(), Stream()
    server_cid = None
    pending_hs = []
    hsk = None
    transcript_base = None
    hs_secret = None
    msgs_hs = []
    got_done = False
    app_s = None
    sent_fin = False
    deadline = time.monotonic() + 8
    # A refusal (ICMP) may come before a later send: that send fails with it.
    try:
        while time.monotonic() < deadline and not got_done:
            try:
                r_, _, _ = select.select(socks, [], [], max(0.05, min(3.0, deadline - time.monotonic())))
                if not r_:
                    raise socket.timeout()
                d = r_[0].recv(65536)
                res.setdefault("recv_on", []).append(socks.index(r_[0]))
            except socket.timeout:
                res["step"] = res.get("step", "timeout")
                break
            except OSError as e:
                res["step"] = "refused"
                res["errno"] = e.errno
                break
            for kind, pkt, pn_at, pscid in split_datagram(d, len(scid)):
                if kind == "initial":
                    try:
                        pt = open_packet(sik, pkt, pn_at, True)
                    except Exception:
                        res["foreign_packets"] = res.get("foreign_packets", 0) + 1
                        continue
                    server_cid = pscid
                    cr, kinds = frames_crypto(pt)
                    res.setdefault("server_initial_frames", []).append([str(k) for k in kinds])
                    for off, dd in cr:
                        ini.add(off, dd)
                elif kind == "handshake":
                    pending_hs.append((pkt, pn_at))
                elif kind == "short":
                    if app_s is None:
                        continue
                    try:
                        pt = open_packet(app_s, pkt, pn_at, False)
                    except Exception as e:
                        res.setdefault("short_errors", []).append(repr(e)); continue
                    _, kinds = frames_crypto(pt)
                    res.setdefault("server_1rtt_frames", []).append([str(k) for k in kinds])
                    if 0x1e in kinds:
                        got_done = True
                else:
                    res.setdefault("other_packets", []).append(kind)
            msgs, _ = ini.messages(0)
            if msgs and transcript_base is None:
                hrr = msgs[0]
                res["hrr"] = hrr[0] == 2 and hrr[6:38] == HRR_RANDOM
                if not res["hrr"]:
                    res["step"] = "no-hrr"; break
                if mode == "diverge" and not res.get("ch2_sent"):
                    # (a) an Initial the server discards (datagram under 1200 bytes, RFC 9000
                    # 14.1) but egressd opens: its packet number 1000 moves egressd's expected pn.
                    small = seal_long(cik, 0, server_cid, scid, 1000, b"\x01", pad_to=0)
                    s.send(small)
                    # (b) pn 1 in one byte: the server (largest 0) reads 1, egressd (largest
                    # 1000) reads 1025 and cannot open it -> "another connection", judged afresh
                    # by a new assembler, which reads pn 1 and sees CHx (allowed.test) at offset 0.
                    # The server already holds [0, len(CH1)) and takes only CHx's tail: CH2.
                    chx = hello_embedding(sni1, os.urandom(32), tp, len(ch1), ch2)
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)
                    pl += b"\x06" + varint(0) + varint(len(chx)) + chx
                    s.send(seal_initial_pn1(cik, dcid, scid, 1, pl))  # the original DCID: its keys
                    res["ch2_sent"] = True
                    res["small_initial_len"] = len(small)
                if mode in ("detour", "detour_scid", "detour_v2") and not res.get("ch2_sent"):
                    # (a) another connection's first Initial on the same four-tuple (a fresh DCID
                    # D1, its own keys, a whole hello naming sni1): egressd's follow() cannot open
                    # it with D0's keys, takes it for "other", drops the D0 assembler and admits a
                    # new one keyed on D1.
                    oh = client_hello(sni1, os.urandom(32), pub, transport_params(os.urandom(8)))
                    if mode == "detour":
                        d1 = os.urandom(8)
                        s.send(seal_long(PKeys(initial_secrets(d1)[0]), 0, d1, os.urandom(8), 0,
                                         b"\x06" + varint(0) + varint(len(oh)) + oh, pad_to=1200))
                    elif mode == "detour_scid":
                        # DCID = the server's own SCID for this connection, sealed with keys derived
                        # from that SCID: the server routes it to the real connection and cannot
                        # open it (drops it); egressd takes it for another connection.
                        d1 = server_cid
                        s.send(seal_long(PKeys(initial_secrets(d1)[0]), 0, d1, scid, 0,
                                         b"\x06" + varint(0) + varint(len(oh)) + oh, pad_to=1200))
                    elif mode == "detour_v2":
                        # A QUIC v2 Initial under a fresh DCID (the server, ngtcp2 0.12, has no
                        # final v2 and answers Version Negotiation / drops it): egressd's follow()
                        # sees a version change under a DCID not the original -> "other".
                        d1 = os.urandom(8)
                        s.send(seal_initial_v2(PKeysV2(d1), d1, os.urandom(8), 0,
                                               b"\x06" + varint(0) + varint(len(oh)) + oh))
                    res["detour_dcid"] = d1.hex()
                    # (b) an Initial of the REAL connection (D0's keys, D0 as DCID, pn 1): follow() on
                    # the D1 assembler cannot open it, D0 is not D1 -> "other" again -> a fresh D0
                    # assembler with no memory of CH1 judges CHx (allowed.test) at offset 0. The
                    # server already holds [0, len(CH1)) and reads only CHx's tail: CH2.
                    chx = hello_embedding(sni1, os.urandom(32), tp, len(ch1), ch2)
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)
                    pl += b"\x06" + varint(0) + varint(len(chx)) + chx
                    s.send(seal_long(cik, 0, dcid, scid, 1, pl, pad_to=1200))
                    res["ch2_sent"] = True
                if mode == "retry_adopt" and not res.get("ch2_sent"):
                    # Attack review L: the old socket ACKs the server's Initial; from a NEW socket,
                    # (1) a fresh connection D2 whose longer hello A2 names sni1 (admitted: D2 is
                    # new; the server's answer to it is awaited), then (2) on that flow an Initial
                    # "after a Retry": the FIRST connection's ID and keys, a token, CRYPTO from
                    # len(CH1) = A2[len(CH1):] + X, where X is a whole hello naming sni1 (what a
                    # reader that kept A2 as the stream judges as a second hello) and
                    # A2[len(CH1):] + X is HB, a hello naming sni2 (what the server reads).
                    s.send(seal_long(cik, 0, dcid, scid, 1, b"\x02" + varint(0) + varint(0) + varint(0) + varint(0),
                                     pad_to=1200))
                    x = client_hello(sni1, os.urandom(32), pub, tp)
                    hb_exts = ext(0, u16(b"\x00" + u16(sni2.encode())))
                    hb_exts += ext(43, u8(b"\x03\x04"))
                    hb_exts += ext(10, u16(b"\x00\x1d"))
                    hb_exts += ext(13, u16(b"\x04\x03\x08\x04\x04\x01\x08\x05\x08\x06\x05\x03"))
                    hb_exts += ext(51, u16(b"\x00\x1d" + u16(pub)))
                    hb_exts += ext(45, u8(b"\x01"))
                    hb_exts += ext(16, u16(u8(b"h3")))
                    hb_exts += ext(0x39, tp)
                    hb_exts += ext(0x7a7a, x)
                    hb = b"\x01" + u24(b"\x03\x03" + rnd + u8(b"") + u16(b"\x13\x01") + b"\x01\x00" + u16(hb_exts))
                    a2 = hello_embedding(sni1, os.urandom(32), tp, len(ch1), hb[:-len(x)])
                    s2 = socket.socket(fam, socket.SOCK_DGRAM)
                    s2.connect((addr, port))
                    socks.append(s2)
                    res["new_sport"] = s2.getsockname()[1]
                    res["old_sport"] = s.getsockname()[1]
                    d2 = os.urandom(8)
                    s2.send(seal_long(PKeys(initial_secrets(d2)[0]), 0, d2, os.urandom(8), 0,
                                      b"\x06" + varint(0) + varint(len(a2)) + a2, pad_to=1200))
                    s2.settimeout(5.0)
                    try:
                        s2.recv(65536)  # the server answered D2: egressd admitted it
                        res["d2_answered"] = True
                    except OSError as e:
                        res["d2_answered"] = repr(e)
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)
                    pl += b"\x06" + varint(len(ch1)) + varint(len(hb)) + hb
                    try:
                        s2.send(seal_long(cik, 0, dcid, scid, 2, pl, pad_to=1200, token=os.urandom(16)))
                    except OSError as e:
                        res["retry_send"] = e.errno
                    ch2 = hb
                    res["ch2_sent"] = True
                if mode in ("migrate", "migrate_ack") and not res.get("ch2_sent"):
                    # The first connection's next Initial (its DCID and keys) from a NEW socket (a
                    # new source port): a new four-tuple for egressd, judged afresh from offset 0
                    # (CHx naming sni1, whose tail at len(CH1) is CH2); the server finds the
                    # connection by its DCID and reads only what extends its stream: CH2.
                    if mode == "migrate_ack":
                        # the old socket ACKs the server's Initial first (a well-behaved client would)
                        s.send(seal_long(cik, 0, dcid, scid, 1, b"\x02" + varint(0) + varint(0) + varint(0) + varint(0), pad_to=1200))
                    s2 = socket.socket(fam, socket.SOCK_DGRAM)
                    s2.connect((addr, port))
                    socks.append(s2)
                    res["new_sport"] = s2.getsockname()[1]
                    res["old_sport"] = s.getsockname()[1]
                    chx = hello_embedding(sni1, os.urandom(32), tp, len(ch1), ch2)
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)
                    pl += b"\x06" + varint(0) + varint(len(chx)) + chx
                    s2.send(seal_long(cik, 0, dcid, scid, 2, pl, pad_to=1200))
                    res["ch2_sent"] = True
                if mode == "expire" and not res.get("ch2_sent"):
                    # ACK the server's Initial (no retransmissions), then stay silent until the
                    # flow's conntrack entry (30 s, all packets within 2 s) and egressd's followed
                    # assembler (30 s) are gone; then, on the SAME four-tuple, under the first
                    # connection's DCID and keys, the hello-with-CH2-as-its-tail.
                    s.send(seal_long(cik, 0, dcid, scid, 1, b"\x02" + varint(0) + varint(0) + varint(0) + varint(0), pad_to=1200))
                    wait = float(os.environ.get("QUIC_EXPIRE_WAIT", "34"))
                    time.sleep(wait)
                    # Any datagram through the reader makes it run its expiry (flush): a junk one
                    # to UDP 443 from another socket drops the stale followed entry. egressd refuses
                    # it (ICMP admin-prohibited): that error is the sign its reader has run.
                    k = socket.socket(fam, socket.SOCK_DGRAM)
                    k.connect((addr, port))
                    kick_deadline = time.monotonic() + 10
                    while "kick" not in res and time.monotonic() < kick_deadline:
                        k.settimeout(1.0)
                        try:
                            k.send(b"kick")
                            k.recv(65536)
                            res["kick"] = "answered"  # not refused: the reader ran all the same
                        except (ConnectionRefusedError, OSError) as e:
                            if not isinstance(e, TimeoutError):
                                res["kick"] = e.__class__.__name__ + ": " + str(e)
                    k.close()
                    chx = hello_embedding(sni1, os.urandom(32), tp, len(ch1), ch2)
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)
                    pl += b"\x06" + varint(0) + varint(len(chx)) + chx
                    s.send(seal_long(cik, 0, dcid, scid, 2, pl, pad_to=1200))
                    res["ch2_sent"] = True
                    res["waited"] = wait
                    deadline = time.monotonic() + 8
                if mode == "evict" and not res.get("ch2_sent"):
                    # Push this flow out of egressd's followed QUIC flows (256 at most): other
                    # sockets, each admitted for an Initial naming sni1.
                    others = []
                    for i in range(300):
                        o = socket.socket(fam, socket.SOCK_DGRAM)
                        o.connect((addr, port))
                        od = os.urandom(8)
                        oh = client_hello(sni1, os.urandom(32), pub, transport_params(os.urandom(8)))
                        o.send(seal_long(PKeys(initial_secrets(od)[0]), 0, od, os.urandom(8), 0,
                                         b"\x06" + varint(0) + varint(len(oh)) + oh, pad_to=1200))
                        others.append(o)
                    # Each admitted one gets the server's first flight: a condition, with a deadline
                    # of its own (on a loaded machine 300 handshakes take seconds).
                    others_deadline = time.monotonic() + 30
                    for o in others:
                        o.settimeout(max(0.1, others_deadline - time.monotonic()))
                        try:
                            o.recv(65536)
                        except OSError:
                            pass  # not admitted, or no answer: the flow below is judged all the same
                        o.close()
                    chx = hello_embedding(sni1, os.urandom(32), tp, len(ch1), ch2)
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)
                    pl += b"\x06" + varint(0) + varint(len(chx)) + chx
                    s.send(seal_long(cik, 0, dcid, scid, 1, pl, pad_to=1200))
                    res["ch2_sent"] = True
                    deadline = time.monotonic() + 8  # for the answer to this one
                if mode == "sequential" and not res.get("ch2_sent"):
                    pl = b"\x02" + varint(0) + varint(0) + varint(0) + varint(0)  # ACK 0
                    pl += b"\x06" + varint(len(ch1)) + varint(len(ch2)) + ch2
                    s.send(seal_long(cik, 0, server_cid, scid, 1, pl, pad_to=1200))
                    res["ch2_sent"] = True
                if len(msgs) >= 2:
                    sh = msgs[1]
                    if sh[0] != 2:
                        res["step"] = "no-sh"; break
                    spub = hello_extensions(sh)[51][4:]
                    shared = priv.exchange(X25519PublicKey.from_public_bytes(spub))
                    transcript_base = b"\xfe\x00\x00\x20" + hashlib.sha256(ch1).digest() + hrr + ch2 + sh
                    early = hkdf_extract(b"\0" * 32, b"\0" * 32)
                    derived = hkdf_expand_label(early, b"derived", hashlib.sha256(b"").digest(), 32)
                    hs_secret = hkdf_extract(derived, shared)
                    th = hashlib.sha256(transcript_base).digest()
                    c_hs = hkdf_expand_label(hs_secret, b"c hs traffic", th, 32)
                    s_hs = hkdf_expand_label(hs_secret, b"s hs traffic", th, 32)
                    hsk = (PKeys(c_hs), PKeys(s_hs), c_hs, s_hs)
                    res["step"] = "server-hello"
            if hsk is not None and pending_hs:
                for pkt, pn_at in pending_hs:
                    try:
                        pt = open_packet(hsk[1], pkt, pn_at, True)
                    except Exception:
                        res["foreign_packets"] = res.get("foreign_packets", 0) + 1
                        continue
                    cr, kinds = frames_crypto(pt)
                    for off, dd in cr:
                        hs.add(off, dd)
                pending_hs = []
                msgs_hs, _ = hs.messages(0)
                if any(m[0] == 20 for m in msgs_hs) and not sent_fin:
                    tr = transcript_base
                    for m in msgs_hs:
                        if m[0] == 20:
                            fk = hkdf_expand_label(hsk[3], b"finished", b"", 32)
                            want = hmac.new(fk, hashlib.sha256(tr).digest(), hashlib.sha256).digest()
                            res["server_finished_verifies_over_ch2_transcript"] = (m[4:] == want)
                        tr += m
                    res["server_messages"] = [m[0] for m in msgs_hs]
                    th = hashlib.sha256(tr).digest()
                    derived = hkdf_expand_label(hs_secret, b"derived", hashlib.sha256(b"").digest(), 32)
                    master = hkdf_extract(derived, b"\0" * 32)
                    s_ap = hkdf_expand_label(master, b"s ap traffic", th, 32)
                    app_s = PKeys(s_ap)
                    app_c = PKeys(hkdf_expand_label(master, b"c ap traffic", th, 32))
                    fk = hkdf_expand_label(hsk[2], b"finished", b"", 32)
                    fin = b"\x14" + u24(hmac.new(fk, th, hashlib.sha256).digest())
                    pl = b"\x06" + varint(0) + varint(len(fin)) + fin
                    for so in socks:
                        try:
                            so.send(seal_long(hsk[0], 2, server_cid, scid, 0, pl))
                        except OSError as e:
                            res.setdefault("fin_send_errors", []).append(e.errno)
                    sent_fin = True
                    res["step"] = "client-finished-sent"
    except OSError as e:
        res["step"] = "refused"
        res["errno"] = e.errno
    if got_done:
        res["step"] = "handshake-done"
    if got_done and os.environ.get("HOLD"):
        # The handshake is done: the caller switches phases, says go, and counts what the server
        # acknowledges of five 1-RTT PINGs sent then.
        print("HS " + json.dumps(res), flush=True)
        sys.stdin.readline()
        s.settimeout(0.5)
        acks, errs = 0, []
        for pn in range(5):
            head = bytes([0x43]) + server_cid + pn.to_bytes(4, "big")
            out = bytearray(head + app_c.aead.encrypt(app_c.nonce(pn), b"\x01" + b"\x00" * 40, head))
            pn_at = 1 + len(server_cid)
            m = app_c.mask(bytes(out[pn_at + 4:pn_at + 20]))
            out[0] ^= m[0] & 0x1f
            for i in range(4):
                out[pn_at + i] ^= m[1 + i]
            try:
                s.send(bytes(out))
            except OSError as e:
                errs.append(e.errno)
                continue
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                try:
                    d = s.recv(65536)
                except socket.timeout:
                    break
                except OSError as e:
                    errs.append(e.errno)
                    break
                for kind, pkt, at, _ in split_datagram(d, len(scid)):
                    if kind != "short":
                        continue
                    try:
                        pt = open_packet(app_s, pkt, at, False)
                    except Exception:
                        continue
                    if {2, 3} & set(frames_crypto(pt)[1]):
                        acks += 1
        res["after_switch_acks"], res["after_switch_errs"] = acks, errs
    return res


if __name__ == "__main__":
    try:
        print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], *sys.argv[5:6])), flush=True)
    except Exception as e:
        import traceback
        print(json.dumps({"error": repr(e), "tb": traceback.format_exc()}), flush=True)
