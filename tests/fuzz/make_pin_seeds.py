#!/usr/bin/env python3
"""Writes the seeds of tls_hello_fuzz, http_head_fuzz and quic_initial_fuzz
into corpus/<target>/ from the captured hellos (tests/unit/data/tls_hellos.txt)
and the RFC 9001 / RFC 9369 client Initials
(tests/unit/data/quic_rfc_vectors.h). Run: tests/fuzz/make_pin_seeds.py"""
import os
import re

here = os.path.dirname(os.path.abspath(__file__))
unit = os.path.join(here, "..", "unit", "data")


def write(target, name, data):
    with open(os.path.join(here, "corpus", target, name), "wb") as f:
        f.write(data)


hellos = {}
for line in open(os.path.join(unit, "tls_hellos.txt")):
    if line.startswith("#") or not line.strip():
        continue
    label, h = line.split()
    hellos[label] = bytes.fromhex(h)

for label, data in hellos.items():
    write("tls_hello", label, data)
# The big hello over two records.
hs = hellos["big_sni_allowed"][5:]
k = 700
write("tls_hello", "big_two_records",
      b"\x16\x03\x01" + k.to_bytes(2, "big") + hs[:k] + b"\x16\x03\x01" + (len(hs) - k).to_bytes(2, "big") + hs[k:])

for name, req in {
    "get": b"GET / HTTP/1.1\r\nHost: allowed.test\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n",
    "leading_crlf": b"\r\n\r\nGET /x HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n",
    "absolute_form": b"GET http://allowed.test:80/p?q HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    "connect": b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n",
    "ipv6_host_lf": b"POST /upload HTTP/1.0\nHost: [2001:db8::1]:80\nContent-Length: 3\n\nabc",
    "h2c": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "duplicate_host": b"GET / HTTP/1.1\r\nHost: a.test\r\nhost: b.test\r\n\r\n",
}.items():
    write("http_head", name, req)

text = open(os.path.join(unit, "quic_rfc_vectors.h")).read()
for v in ("V1", "V2"):
    m = re.search(r"k%sProtectedPacket =\n((?:\s+\"[0-9a-f ]+\"\n?)+);" % v, text)
    packet = bytes.fromhex("".join(re.findall(r'"([0-9a-f ]+)"', m.group(1))).replace(" ", ""))
    assert len(packet) == 1200
    # Mode 0 (even first byte): datagrams with 2-byte lengths.
    write("quic_initial", "rfc_%s_raw" % v.lower(), b"\x00" + len(packet).to_bytes(2, "big") + packet)


def varint(n):
    if n < 64:
        return bytes([n])
    if n < 16384:
        return (0x4000 | n).to_bytes(2, "big")
    return (0x80000000 | n).to_bytes(4, "big")


def crypto(off, data):
    return b"\x06" + varint(off) + varint(len(data)) + data


# Mode 1 (odd first byte): packets the harness seals. Flags: bit 0 v2,
# bit 1 new datagram, bits 2-7 packet number.
for v2 in (0, 1):
    f1 = crypto(0, hs[:900]) + b"\x01"
    f2 = b"\x02\x00\x00\x00\x00" + crypto(900, hs[900:])
    seed = b"\x01" + bytes([v2 | 2 | 0 << 2]) + len(f1).to_bytes(2, "big") + f1 + \
        bytes([v2 | 2 | 1 << 2]) + len(f2).to_bytes(2, "big") + f2
    write("quic_initial", "sealed_two_datagrams_%s" % ("v2" if v2 else "v1"), seed)
f = crypto(0, hellos["ech_outer"][5:])
write("quic_initial", "sealed_ech_one_packet", b"\x01\x02" + len(f).to_bytes(2, "big") + f)

# tls_follow_fuzz: a first byte (piece size, answered) and a client's TLS records.
os.makedirs(os.path.join(here, "corpus", "tls_follow"), exist_ok=True)


def record(t, body):
    return bytes([t, 3, 3]) + len(body).to_bytes(2, "big") + body


ch = hellos["sni_allowed"][5:]
ccs = record(20, b"\x01")
write("tls_follow", "tls13", b"\x13" + hellos["sni_allowed"] + ccs + record(23, b"x" * 40))
write("tls_follow", "hrr_ccs_second_hello", b"\x17" + hellos["sni_allowed"] + ccs + record(22, ch) + record(23, b"f" * 30))
write("tls_follow", "second_hello_in_records", b"\x04" + hellos["sni_allowed"] +
      b"".join(record(22, ch[i:i + 200]) for i in range(0, len(ch), 200)))
write("tls_follow", "tls12", b"\x15" + hellos["tls12_sni"] + record(22, b"\x10\x00\x00\x03abc") + ccs +
      record(22, b"\x01\xff\xff\xff" + b"e" * 36) + record(23, b"GET /"))
