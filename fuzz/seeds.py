#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/ (run from anywhere; idempotent).

Seeds are small valid inputs, so the fuzzers start from inputs that reach the
handlers rather than the first length check. Regression inputs for fixed bugs
live beside them under names starting with "crash-" and are not rewritten.
"""
import gzip
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# config: the shipped configs, one per component, and overrides after a NUL.
for src in ("examples/01_fashion_mnist/fashion_mnist.toml", "bench/traffic/traffic.toml"):
    put("config", os.path.basename(src), open(os.path.join(ROOT, src), "rb").read())
put("config", "readme.toml", b"""[policy]
name = "drift"
threshold = 0.05
max_interval = 100
[topology]
name = "exponential"
[protocol]
name = "push-sum"
[transport]
name = "loopback"
bandwidth_gbps = 1.0
latency_us = 50
[engine]
timeout_s = 60
stats = "stats-{rank}.json"
trace = "trace-{rank}.json"
""")
put("config", "edges.toml", b"""[policy]
name = "periodic"
every = 4
[topology]
name = "edges"
edges = [[0, 1], [1, 2], [2, 0]]
directed = true
[protocol]
name = "stale-copy"
gamma = 0.5
[engine]
send_buffers = 4
finish_rounds = 2
wait_when_busy = true
""")
put("config", "switch.toml", b"""[policy]
name = "drift-lr"
[topology]
name = "random"
seed = 7
[protocol]
name = "switch-aggregate"
mode = "auto"
[train]
epochs = 2
lr = 0.05
layers = [64, 32]
""")
put("config", "budget.toml", b"[policy]\nname = \"budget\"\n[engine]\ntrace_capacity = 1000\ntrace_skips_every = 10\n")
put("config", "consensus.toml", b"[policy]\nname = \"consensus\"\nlr_exponent = 0.5\nbalance = 1.0\n[engine]\nmomentum = \"local\"\nmomentum_beta = 0.9\n")
put("config", "adacomm.toml", b"[policy]\nname = \"adacomm\"\n[topology]\nname = \"complete\"\n")
put("config", "history.toml", b"[policy]\nname = \"drift-history\"\n[topology]\nname = \"ring\"\n[protocol]\nname = \"pairwise\"\n")
put("config", "overrides", b"[policy]\nname = \"never\"\n\0policy.name=periodic\npolicy.every=3\nengine.timeout_s=5\ntrain.epochs=2\ntopology.edges=[[0,1]]\n")

# switch_aggregator: datagrams (16-bit length + bytes) for the three groups of
# fuzz_switch_aggregator.cpp: 1 sync any size (3 members, chunk 4, 2 slots),
# 2 sync 20 elements (2 members, chunk 8, 4 slots), 3 async 10 elements (3 members, chunk 4).
MAGIC, VERSION = 0x31575347, 2
SYNC, RESULT, DELTA, REPLY, LEAVE = 1, 2, 3, 4, 5


def packet(type_, group, worker, slot, chunk, values, flags=0, sequence=0, session=0, elements=None):
    n = len(values) if elements is None else elements
    h = struct.pack("<IBBBBHHHHIIII", MAGIC, VERSION, type_, flags, 0, group, worker, slot, n, chunk, 0, sequence, session)
    return h + struct.pack("<%df" % len(values), *values)


def datagrams(*pkts):
    return b"".join(struct.pack("<H", len(p)) + p for p in pkts)


ones = [1.0] * 4
put("switch_aggregator", "sync-allreduce", datagrams(*[packet(SYNC, 1, w, 0, 0, ones, session=10 + w) for w in range(3)]))
put("switch_aggregator", "sync-shadow", datagrams(
    *[packet(SYNC, 1, w, c % 2, c, ones, flags=(c // 2) & 1, session=5) for c in range(4) for w in range(3)]))
put("switch_aggregator", "sync-sized", datagrams(
    *[packet(SYNC, 2, w, c % 4, c, [2.0] * (8 if c < 2 else 4), session=1) for c in range(3) for w in range(2)]))
put("switch_aggregator", "sync-retransmit", datagrams(
    packet(SYNC, 1, 0, 1, 1, ones, session=3), packet(SYNC, 1, 0, 1, 1, ones, session=3),
    packet(SYNC, 1, 1, 1, 1, ones, session=4), packet(SYNC, 1, 0, 1, 1, ones, session=9)))
put("switch_aggregator", "async", datagrams(
    *[packet(DELTA, 3, w, 0, c, [0.5] * (4 if c < 2 else 2), sequence=s, session=20 + w)
      for s in (1, 2) for w in range(3) for c in range(3)],
    packet(LEAVE, 3, 1, 0, 0, [], session=21), packet(DELTA, 3, 1, 0, 0, [1.0] * 4, sequence=1, session=99)))
put("switch_aggregator", "malformed", datagrams(
    b"GSW1", packet(SYNC, 9, 0, 0, 0, ones), packet(SYNC, 1, 7, 0, 0, ones), packet(SYNC, 1, 0, 1, 0, ones),
    packet(DELTA, 3, 0, 0, 5, ones, sequence=1), packet(DELTA, 3, 0, 0, 0, ones, sequence=3),
    packet(SYNC, 1, 0, 0, 0, ones)[:-2], packet(SYNC, 1, 0, 0, 0, ones) + b"xx", packet(RESULT, 1, 0, 0, 0, ones)))

# switch_group: --group texts.
for i, g in enumerate(["id=1,mode=sync,members=4,chunk=256,slots=128", "id=2,mode=async,members=4,elements=1000000",
                       "mode=async,elements=5000,chunk=360,members=64,id=65535", "id=3", "members=0", "elements=4294967296"]):
    put("switch_group", "group-%d" % i, g.encode())

# ucx_header: 8 bytes of payload length, then a wire_header from rank 1 (source 0)
# with the fuzzer's layout fingerprint.
FP = 0x0123456789ABCDEF


def wire(sender, payload, magic=0x31505347, version=1):
    return struct.pack("<QIHHiIQdQQ", payload, magic, version, 0, sender, 0, 42, 0.5, payload, FP)


put("ucx_header", "valid", wire(1, 4096))
put("ucx_header", "small", wire(4, 16))
put("ucx_header", "unknown-sender", wire(3, 16))
put("ucx_header", "too-long", wire(2, 4100))

# codec: byte 0 bit 0 picks the mode (fuzz_codec.cpp). Mode 0: payloads for
# tensors of 120 and 7 values (bit 1: primed); mode 1: a codec pick and the
# floats of two models.
def segment(kind, body, param=0, flags=0, index_mode=0):
    size = (16 + len(body) + 7) // 8 * 8
    return struct.pack("<BBHIQ", kind, index_mode, flags, param, size) + body + bytes(size - 16 - len(body))


def payload(*segments):
    return struct.pack("<IIQ", 0x43445347, 2, 127) + b"".join(segments)


f32 = lambda n, v=0.25: struct.pack("<%df" % n, *[v * (i % 5 - 2) for i in range(n)])
put("codec", "fp32", b"\0" + payload(segment(0, f32(120)), segment(0, f32(7))))
put("codec", "fp16-reset", b"\0" + payload(segment(1, struct.pack("<120e", *[0.5] * 120), flags=1), segment(1, struct.pack("<7e", *[1.0] * 7), flags=1)))
put("codec", "int8", b"\2" + payload(segment(2, struct.pack("<8f", *[0.01] * 8) + bytes(range(120)), param=16),
                                      segment(2, struct.pack("<f", 0.1) + bytes(7), param=16)))
put("codec", "topk-gaps", b"\2" + payload(segment(3, f32(3) + bytes([4, 50, 60]), param=3, index_mode=1), segment(0, f32(7))))
put("codec", "randomk-bitmap", b"\2" + payload(segment(4, f32(2) + bytes([1] + [0] * 13 + [0x80]), param=2), segment(0, f32(7))))
put("codec", "topk-fp16-gaps", b"\2" + payload(segment(3, struct.pack("<3e", 0.5, -0.25, 2.0) + bytes([4, 50, 60]), param=3, flags=2, index_mode=1),
                                                segment(0, f32(7))))
put("codec", "lowrank", b"\2" + payload(segment(5, struct.pack("<II", 10, 12) + f32(44), param=2), segment(1, struct.pack("<7e", *[1.0] * 7))))
for pick in list(range(6)) + [9, 10]:  # 9, 10: topk and randomk with fp16 values
    put("codec", "round-trip-%d" % pick, bytes([1, pick]) + f32(127, 0.5) + f32(127, 0.75))

# idx: a 16-bit length of the images file, the images file, the labels file.
def idx_pair(n, rows, cols, gz=False):
    images = struct.pack(">IIII", 0x803, n, rows, cols) + bytes((i * 37) % 256 for i in range(n * rows * cols))
    labels = struct.pack(">II", 0x801, n) + bytes(i % 10 for i in range(n))
    if gz:
        images, labels = gzip.compress(images, mtime=0), gzip.compress(labels, mtime=0)
    return struct.pack("<H", len(images)) + images + labels


put("idx", "raw-3x4x5", idx_pair(3, 4, 5))
put("idx", "gz-2x28x28", idx_pair(2, 28, 28, gz=True))
put("idx", "empty", idx_pair(0, 1, 1))

# bootstrap: connections (16-bit length + bytes) to one rendezvous store of
# identity 0x5354 (fuzz_bootstrap.cpp): requests as bootstrap::request sends them.
STORE = 0x5354


def rv_request(op, key, value=None, joined=0, magic=b"GRV5"):
    r = magic + op + struct.pack("<QI", joined, len(key)) + key
    if value is not None:
        r += struct.pack("<Q", len(value)) + value
    return r


def connections(*reqs):
    return b"".join(struct.pack("<H", len(r)) + r for r in reqs)


ranks = struct.pack("<3i", 2, 4, 9)
put("bootstrap", "put-get", connections(rv_request(b"P", b"gossip/ucx/1/0", b"address"), rv_request(b"G", b"gossip/ucx/1/0", joined=STORE),
                                        rv_request(b"G", b"gossip/ucx/1/1", joined=STORE)))
put("bootstrap", "put-once", connections(rv_request(b"O", b"gossip/ucx/1/2", b"a"), rv_request(b"O", b"gossip/ucx/1/2", b"a", joined=STORE),
                                         rv_request(b"O", b"gossip/ucx/1/2", b"b", joined=STORE)))
put("bootstrap", "barrier", connections(rv_request(b"P", b"end/arrive/1", ranks), rv_request(b"P", b"end/arrive/2", b""),
                                        rv_request(b"G", b"end/done"), rv_request(b"P", b"end/ack/1", b"", joined=STORE)))
put("bootstrap", "stranger", connections(rv_request(b"P", b"k", b"v"), rv_request(b"P", b"k", b"w", joined=7), rv_request(b"G", b"k", joined=7),
                                         rv_request(b"O", b"k", b"w", joined=7)))
put("bootstrap", "other-version", connections(rv_request(b"G", b"k", magic=b"GRV3"), rv_request(b"G", b"k", magic=b"HTTP")))
put("bootstrap", "cut-short", connections(rv_request(b"P", b"k", b"value")[:-2], rv_request(b"P", b"k", b"")[:20],
                                          rv_request(b"Q", b"k"), rv_request(b"P", b"big", b"")[:-8] + struct.pack("<Q", 64 << 20)))
put("bootstrap", "erase-full", connections(rv_request(b"P", b"model/1/1", b"x" * 3000), rv_request(b"P", b"model/1/2", b"y" * 3000, joined=STORE),
                                           rv_request(b"D", b"model/1/1", joined=STORE), rv_request(b"D", b"model/1/1", joined=STORE),
                                           rv_request(b"P", b"model/2/1", b"z" * 1000, joined=STORE)))
put("bootstrap", "refused-value", connections(rv_request(b"P", b"k", b"v" * 5000), rv_request(b"O", b"k", b"w" * 100, joined=7),
                                              rv_request(b"P", b"k", b"v" * 100), rv_request(b"O", b"k", b"u" * 5000, joined=STORE)))
# Reply heads as a client reads them.
put("bootstrap", "replies", connections(b"GRV5Y" + struct.pack("<QQ", STORE, 3) + b"abc", b"GRV5S" + struct.pack("<QQ", STORE, 0),
                                        b"GRV3N", b"GRV5N" + struct.pack("<QQ", STORE, (64 << 20) + 1)))

# ucx_blob: byte 0 even, then a rendezvous entry as transports/ucx/peer_blob.hpp
# encodes it; byte 0 odd, then bytes a FuzzedDataProvider turns into a setup.
def ucx_entry(rank, world, sources, targets, layout, address, listener, host, settings):
    def field(b):
        return struct.pack("<Q", len(b)) + b
    e = struct.pack("<IiiQQQQ", 0x35435547, rank, world, 0x1111, 0x2222, 0x3333, 4096)
    e += field(struct.pack("<%di" % len(sources), *sources)) + field(struct.pack("<%di" % len(targets), *targets))
    e += struct.pack("<Q", len(layout))
    for name, count, dtype, rows in layout:
        e += field(name) + struct.pack("<QBQ", count, dtype, rows)
    return e + field(address) + field(listener) + field(host) + field(settings)


sockaddr_in = struct.pack("<HH4s8x", 2, 0x1234, bytes([127, 0, 0, 1]))
put("ucx_blob", "listener", b"\0" + ucx_entry(1, 4, [0, 2], [0, 2], [(b"fc1.weight", 512, 0, 16), (b"fc1.bias", 16, 2, 0)],
                                                bytes(range(40)), sockaddr_in, b"node-1", b"policy.name=\"drift\"\n"))
put("ucx_blob", "no-listener", b"\0" + ucx_entry(0, 2, [1], [1], [(b"w", 10, 1, 0)], bytes(20), b"", b"?", b""))
# Rank lists of 5 and 3 bytes (a partial int each), and bytes behind the entry.
put("ucx_blob", "odd-lists", b"\0" + struct.pack("<IiiQQQQ", 0x35435547, 2, 3, 1, 2, 3, 64) + struct.pack("<Q", 5) + bytes(5)
    + struct.pack("<Q", 3) + bytes(3) + struct.pack("<Q", 0) * 5 + b"tail")
put("ucx_blob", "setup", b"\1" + bytes(range(256)))

# switch_client: 5 bytes of setup (fuzz_switch_client.cpp), then datagrams
# (16-bit length + bytes) to worker 2 of group 1, session 0x5E55.
SESSION = 0x5E55
RESULT_, ASYNC_REPLY, REJOIN, REFUSED = 2, 4, 6, 7
two = [2.0] * 4
# sync, chunk 4, window 2, 10 floats, sequence 1: chunks 0 and 1 in slots 0 and 1, then chunk 2 in slot 0 (shadow bit 1).
put("switch_client", "sync", bytes([1, 3, 1, 10, 1]) + datagrams(
    packet(RESULT_, 1, 2, 0, 0, two, sequence=1, session=SESSION), packet(RESULT_, 1, 2, 1, 1, two, sequence=1, session=SESSION),
    packet(RESULT_, 1, 2, 0, 0, two, sequence=1, session=SESSION), packet(RESULT_, 1, 2, 0, 2, two[:2], flags=1, sequence=1, session=SESSION),
    packet(RESULT_, 1, 2, 1, 1, two, sequence=0, session=SESSION)))
# async, chunk 4, window 2, 10 floats, sequence 2: replies out of order, a rejoin of another operation and of this one.
put("switch_client", "async", bytes([0, 3, 1, 10, 2]) + datagrams(
    packet(ASYNC_REPLY, 1, 2, 0, 1, two, sequence=2, session=SESSION), packet(ASYNC_REPLY, 1, 2, 0, 0, two, sequence=2, session=SESSION),
    packet(ASYNC_REPLY, 1, 2, 0, 2, two[:2], sequence=2, session=SESSION), packet(REJOIN, 1, 2, 0, 0, [], sequence=1, session=SESSION),
    packet(REJOIN, 1, 2, 0, 0, [], sequence=2, session=SESSION), packet(ASYNC_REPLY, 1, 2, 0, 0, [], session=SESSION)))
# Refusals: bad_worker of a sync group, another session's, bad_elements of a sized sync group, another version.
put("switch_client", "refused", bytes([1, 3, 1, 1, 1]) + datagrams(
    packet(REFUSED, 1, 2, 4, 7, [], flags=6, sequence=100, session=SESSION, elements=8)[:7] + b"\x01"
    + packet(REFUSED, 1, 2, 4, 7, [], flags=6, sequence=100, session=SESSION, elements=8)[8:],
    packet(REFUSED, 1, 2, 0, 0, [], flags=5, session=SESSION + 1),
    packet(REFUSED, 1, 2, 0, 0, [], flags=7, sequence=20, session=SESSION)[:7] + b"\x01" + packet(REFUSED, 1, 2, 0, 0, [], flags=7, sequence=20, session=SESSION)[8:],
    packet(REFUSED, 1, 2, 0, 0, [], flags=25, session=SESSION),
    struct.pack("<IBB", MAGIC, 1, REFUSED) + bytes(26)))

# switch_frame: byte 0 of setup (how many bytes of padding, and which, the
# padding check appends), then an Ethernet frame to gossip-switch at
# 10.77.0.1, UDP port 47000 (fuzz_switch_frame.cpp).
SWITCH_IP, WORKER_IP = bytes([10, 77, 0, 1]), bytes([10, 77, 0, 10])
WORKER_MAC, BROADCAST = bytes([2, 0, 0, 0, 0, 1]), b"\xff" * 6


def ipv4_checksum(header):
    s = sum(struct.unpack(">%dH" % (len(header) // 2), header))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def udp_frame(payload, dport=47000, sport=40000, ihl=5, proto=17, frag=0x4000, dst=SWITCH_IP, pad=0):
    options = bytes(4 * (ihl - 5))
    total = 4 * ihl + 8 + len(payload)
    ip = struct.pack(">BBHHHBBH4s4s", 0x40 | ihl, 0, total, 0x1234, frag, 64, proto, 0, WORKER_IP, dst) + options
    ip = ip[:10] + struct.pack(">H", ipv4_checksum(ip)) + ip[12:]
    udp = struct.pack(">HHHH", sport, dport, 8 + len(payload), 0)
    return BROADCAST + WORKER_MAC + b"\x08\x00" + ip + udp + payload + bytes(pad)


def arp_frame(op, target, sender_ip=WORKER_IP):
    arp = struct.pack(">HHBBH6s4s6s4s", 1, 0x0800, 6, 4, op, WORKER_MAC, sender_ip, bytes(6), target)
    return BROADCAST + WORKER_MAC + b"\x08\x06" + arp + bytes(18)


delta = packet(DELTA, 2, 0, 0, 1, [1.0, 1.0], sequence=1, session=10)
put("switch_frame", "udp", b"\x46" + udp_frame(delta))
put("switch_frame", "udp-options-padded", b"\x86" + udp_frame(packet(SYNC, 1, 1, 0, 0, ones, session=7), ihl=7, pad=16))
put("switch_frame", "udp-empty", b"\x00" + udp_frame(b"", pad=18))
put("switch_frame", "arp-request", b"\x06" + arp_frame(1, SWITCH_IP))
put("switch_frame", "arp-other", b"\x06" + arp_frame(1, bytes([10, 77, 0, 99])))
put("switch_frame", "arp-reply", b"\x06" + arp_frame(2, SWITCH_IP))
put("switch_frame", "wrong-port", b"\x06" + udp_frame(delta, dport=47001))
put("switch_frame", "fragment", b"\x06" + udp_frame(delta, frag=0x2000))
put("switch_frame", "tcp", b"\x06" + udp_frame(delta, proto=6))
put("switch_frame", "bad-checksum", b"\x06" + (lambda f: f[:24] + bytes([f[24] ^ 0x10]) + f[25:])(udp_frame(delta)))
put("switch_frame", "vlan", b"\x06" + BROADCAST + WORKER_MAC + b"\x81\x00\x00\x01" + udp_frame(delta)[12:])
