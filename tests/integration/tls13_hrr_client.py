"""A TLS 1.3 client that makes the server ask for a second ClientHello, for hostname pinning's
tests (test_pinning_tls.py): its first hello names SNI1 and offers no key share, so the server
answers with a HelloRetryRequest; its second names SNI2. Prints one JSON line: what the server
answers to b"sni?" once the handshake completes ({"step": "done", "answer": ...}), or where it
stopped. Stdlib and python3-cryptography (AES-GCM, X25519) only; SHA-256 suites only.

Usage: tls13_hrr_client.py ADDR PORT SNI1 SNI2 [MODE]
MODE: ccs     a dummy change_cipher_spec before the second hello (middlebox compatibility; default)
      noccs   the second hello alone
      split   the second hello cut into records of 40 bytes
      ahead   the second hello sent with the first, before the server's answer (the server reads
              it after its HelloRetryRequest)
      early   the first hello also offers early data (the early_data extension)
HOLD=1 in the environment: once the handshake is done, prints "HS" and waits for a line on stdin
before it asks "sni?" (a test switches phases in between)."""
import hashlib, hmac, json, os, socket, struct, sys
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives import serialization

HRR_RANDOM = hashlib.sha256(b"HelloRetryRequest").digest()


def u8(b): return bytes([len(b)]) + b
def u16(b): return struct.pack("!H", len(b)) + b
def u24(b): return struct.pack("!I", len(b))[1:] + b
def ext(t, b): return struct.pack("!H", t) + u16(b)


def client_hello(sni, sid, share, cookie=None, early=False):
    exts = ext(0, u16(b"\x00" + u16(sni.encode())))
    exts += ext(43, u8(b"\x03\x04"))
    exts += ext(10, u16(b"\x00\x1d"))
    exts += ext(13, u16(b"\x08\x04\x04\x03\x04\x01\x08\x05\x08\x06"))
    exts += ext(51, u16(b"" if share is None else b"\x00\x1d" + u16(share)))
    if cookie is not None:
        exts += ext(44, cookie)
    if early:
        exts += ext(42, b"")
    body = b"\x03\x03" + os.urandom(32) + u8(sid) + u16(b"\x13\x01") + b"\x01\x00" + u16(exts)
    return b"\x01" + u24(body)


def rec(t, b): return bytes([t]) + b"\x03\x03" + u16(b)


def hkdf_extract(salt, ikm): return hmac.new(salt, ikm, hashlib.sha256).digest()


def hkdf_expand_label(secret, label, ctx, n):
    info = struct.pack("!H", n) + u8(b"tls13 " + label) + u8(ctx)
    out, t, i = b"", b"", 1
    while len(out) < n:
        t = hmac.new(secret, t + info + bytes([i]), hashlib.sha256).digest()
        out += t
        i += 1
    return out[:n]


def derive(secret, label, th): return hkdf_expand_label(secret, label, th, 32)


class Conn:
    def __init__(self, s):
        self.s, self.buf = s, b""

    def record(self):
        while len(self.buf) < 5 or len(self.buf) < 5 + struct.unpack("!H", self.buf[3:5])[0]:
            d = self.s.recv(65536)
            if not d:
                raise EOFError("closed, buf=%r" % self.buf[:20])
            self.buf += d
        n = struct.unpack("!H", self.buf[3:5])[0]
        r, self.buf = self.buf[:5 + n], self.buf[5 + n:]
        return r[0], r[5:], r[:5]

    def handshake(self):
        """The next record that is not a change_cipher_spec: (type, body, header)."""
        t, body, hdr = self.record()
        while t == 20:
            t, body, hdr = self.record()
        return t, body, hdr


def hello_extensions(msg):
    """{type: data} of a ServerHello (or HelloRetryRequest) handshake message."""
    body = msg[4:]
    p = 2 + 32
    p += 1 + body[p] + 3
    exts, out = body[p + 2:], {}
    while exts:
        et, el = struct.unpack("!HH", exts[:4])
        out[et] = exts[4:4 + el]
        exts = exts[4 + el:]
    return out


class Keys:
    def __init__(self, secret):
        self.aead = AESGCM(hkdf_expand_label(secret, b"key", b"", 16))
        self.iv = hkdf_expand_label(secret, b"iv", b"", 12)
        self.seq = 0

    def nonce(self):
        n = bytes(a ^ b for a, b in zip(self.iv, self.seq.to_bytes(12, "big")))
        self.seq += 1
        return n

    def open(self, hdr, ct):
        pt = self.aead.decrypt(self.nonce(), ct, hdr).rstrip(b"\0")
        return pt[-1], pt[:-1]

    def seal(self, t, pt):
        inner = pt + bytes([t])
        hdr = b"\x17\x03\x03" + struct.pack("!H", len(inner) + 16)
        return hdr + self.aead.encrypt(self.nonce(), inner, hdr)


def main(addr, port, sni1, sni2, mode="ccs"):
    s = socket.create_connection((addr, port), timeout=3)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c = Conn(s)
    sid = os.urandom(32)
    ch1 = client_hello(sni1, sid, None, early=mode == "early")
    priv = X25519PrivateKey.generate()
    pub = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ch2 = client_hello(sni2, sid, pub)
    if mode == "ahead":
        s.sendall(rec(22, ch1) + rec(20, b"\x01") + rec(22, ch2))
    else:
        s.sendall(rec(22, ch1))
    t, hrr, _ = c.handshake()
    if t != 22 or hrr[0] != 2 or hrr[6:38] != HRR_RANDOM:
        return {"step": "hrr", "type": t, "data": hrr[:60].hex()}
    cookie = hello_extensions(hrr).get(44)
    if cookie is not None:
        if mode == "ahead":
            return {"step": "hrr", "error": "the server asked for a cookie"}
        ch2 = client_hello(sni2, sid, pub, cookie)
    if mode == "ccs":
        s.sendall(rec(20, b"\x01") + rec(22, ch2))
    elif mode == "noccs":
        s.sendall(rec(22, ch2))
    elif mode == "split":
        s.sendall(b"".join(rec(22, ch2[i:i + 40]) for i in range(0, len(ch2), 40)))
    transcript = b"\xfe\x00\x00\x20" + hashlib.sha256(ch1).digest() + hrr + ch2
    t, sh, _ = c.handshake()
    if t != 22 or sh[0] != 2:
        return {"step": "sh", "type": t, "data": sh[:60].hex()}
    return complete(s, c, priv, transcript + sh, sh)

def complete(s, c, priv, transcript, sh):
    """The TLS 1.3 handshake after the ServerHello `sh` (`transcript`: every handshake message
    up to and with it; `priv`: the X25519 key the hello offered): the server's flight read,
    the client's Finished sent, b"sni?" sent and the server's first answer returned."""
    spub = hello_extensions(sh)[51][4:]  # key_share: group (2), length (2), key
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    shared = priv.exchange(X25519PublicKey.from_public_bytes(spub))
    early = hkdf_extract(b"\0" * 32, b"\0" * 32)
    hs = hkdf_extract(derive(early, b"derived", hashlib.sha256(b"").digest()), shared)
    th = hashlib.sha256(transcript).digest()
    c_hs, s_hs = derive(hs, b"c hs traffic", th), derive(hs, b"s hs traffic", th)
    sk, ck = Keys(s_hs), Keys(c_hs)
    hsbuf = b""
    msgs = []
    while not any(m[0] == 20 for m in msgs):
        t, ct, hdr = c.record()
        if t == 20:
            continue
        it, pt = sk.open(hdr, ct)
        hsbuf += pt
        while len(hsbuf) >= 4 and len(hsbuf) >= 4 + int.from_bytes(hsbuf[1:4], "big"):
            n = 4 + int.from_bytes(hsbuf[1:4], "big")
            msgs.append(hsbuf[:n])
            hsbuf = hsbuf[n:]
    for m in msgs:
        transcript += m
    th = hashlib.sha256(transcript).digest()
    master = hkdf_extract(derive(hs, b"derived", hashlib.sha256(b"").digest()), b"\0" * 32)
    c_ap, s_ap = derive(master, b"c ap traffic", th), derive(master, b"s ap traffic", th)
    fk = hkdf_expand_label(c_hs, b"finished", b"", 32)
    fin = b"\x14" + u24(hmac.new(fk, th, hashlib.sha256).digest())
    s.sendall(ck.seal(22, fin))
    ak, sak = Keys(c_ap), Keys(s_ap)
    if os.environ.get("HOLD"):
        # The handshake is done: the caller switches phases, then says go.
        print("HS", flush=True)
        sys.stdin.readline()
    s.sendall(ak.seal(23, b"sni?"))
    while True:
        t, ct, hdr = c.record()
        it, pt = sak.open(hdr, ct)
        if it == 23:
            return {"step": "done", "answer": pt.decode(errors="replace")}

if __name__ == "__main__":
    try:
        print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], *sys.argv[5:6])))
    except Exception as e:
        print(json.dumps({"error": repr(e)}))
