"""What pin_insert.py and pin_overwrite.py share: reading their own connection's SYN-ACK off
the interface (AF_PACKET) and checksumming the segments they write with a raw socket."""
import struct
import time


def tcp_of(pkt, v6):
    """(source, destination, TCP header and payload) of an IPv4/IPv6 TCP packet, else None."""
    if not v6:
        if pkt[0] >> 4 != 4 or pkt[9] != 6:
            return None
        ihl = (pkt[0] & 15) * 4
        return pkt[12:16], pkt[16:20], pkt[ihl:]
    if pkt[0] >> 4 != 6 or pkt[6] != 6:
        return None
    return pkt[8:24], pkt[24:40], pkt[40:]


def syn_ack(sniff, v6, sa, da, port, sport, timeout=3.0):
    """The TCP header (and options) of the server's SYN-ACK to sa:sport, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "no SYN-ACK seen"
        t = tcp_of(sniff.recv(65535), v6)
        if not t:
            continue
        psrc, pdst, th = t
        sp, dp = struct.unpack("!HH", th[:4])
        if psrc == da and pdst == sa and sp == port and dp == sport and th[13] & 0x12 == 0x12:
            return th


def csum(data):
    """The Internet checksum (RFC 1071) of `data`."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xffff) + (total >> 16)
    return ~total & 0xffff
