#!/usr/bin/env python3
"""Writes tls_hellos.txt: real ClientHellos from Python's ssl (OpenSSL),
captured through a MemoryBIO, one per line as "<label> <hex>", for
tests/unit/pin_tls_test.cc and the fuzz seeds. Run from anywhere:
    tests/unit/data/make_tls_hellos.py
The hellos carry random values, so each run writes different bytes; the
tests only rely on their structure."""
import os
import ssl


def hello(server_hostname=None, alpn=None, max_version=None):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if max_version:
        ctx.maximum_version = max_version
    if alpn:
        ctx.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def with_extension(record, ext_type, body):
    """Appends an extension to a single-record ClientHello, fixing the record,
    handshake and extensions lengths."""
    assert record[0] == 22
    hs = bytearray(record[5:])
    assert hs[0] == 1
    body_start = 4
    p = body_start + 2 + 32
    p += 1 + hs[p]
    p += 2 + int.from_bytes(hs[p:p + 2], "big")
    p += 1 + hs[p]
    ext_len_at = p
    ext_len = int.from_bytes(hs[p:p + 2], "big")
    ext = ext_type.to_bytes(2, "big") + len(body).to_bytes(2, "big") + body
    hs += ext
    hs[ext_len_at:ext_len_at + 2] = (ext_len + len(ext)).to_bytes(2, "big")
    hs[1:4] = (len(hs) - 4).to_bytes(3, "big")
    return bytes(record[:3]) + len(hs).to_bytes(2, "big") + bytes(hs)


def main():
    out = []
    out.append(("sni_allowed", hello("allowed.test")))
    out.append(("sni_upper_trailing_dot", hello("Allowed.Test.")))
    out.append(("no_sni", hello(None)))
    out.append(("tls12_sni", hello("allowed.test", max_version=ssl.TLSVersion.TLSv1_2)))
    # ~1.8 KB, the size post-quantum key shares give hellos today: inflated
    # with ALPN protocol names.
    alpn = ["h2", "http/1.1"] + ["proto-%02d-%s" % (i, "x" * 40) for i in range(30)]
    big = hello("allowed.test", alpn=alpn)
    out.append(("big_sni_allowed", big))
    # An ECH-shaped ClientHelloOuter: public name as SNI plus an
    # encrypted_client_hello extension (0xfe0d) with an opaque payload (Python's
    # ssl cannot make real ECH; the parser only notes the extension).
    ech_body = bytes([0]) + bytes.fromhex("00010001") + bytes([7]) + (32).to_bytes(2, "big") + os.urandom(32) + \
        (144).to_bytes(2, "big") + os.urandom(144)
    out.append(("ech_outer", with_extension(hello("public.example"), 0xfe0d, ech_body)))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tls_hellos.txt")
    with open(path, "w") as f:
        f.write("# Written by make_tls_hellos.py (Python %s ssl, %s): label hex\n" %
                (".".join(map(str, __import__("sys").version_info[:3])), ssl.OPENSSL_VERSION))
        for label, data in out:
            f.write("%s %s\n" % (label, data.hex()))
    for label, data in out:
        print(label, len(data))


main()
