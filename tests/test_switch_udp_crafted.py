#!/usr/bin/env python3
"""Crafted datagrams at a running gossip-switch-udp (plain sockets, 127.0.0.1).

Every malformed or unwelcome packet (truncated, oversized, wrong magic,
version, type, group, worker, element count, slot, chunk, mode, sequence,
session, slot conflict) must be dropped and counted under its own reason, with
the well-formed traffic around it still aggregated exactly: sync results are
the exact sums, duplicates get the stored result again (or, while their set
waits, a sync_pending naming the members it holds), async replies are the
exact averages. A packet at odds with its group's configuration, or from a
second live session on one member (two jobs on one group), or of another
version of the wire format, is answered with
one `refused` header to its sender, naming the reason and the group as the
switch has it; no other drop is answered. The switch's --stats-json
(written on SIGUSR1) must list exactly the expected drops.

Usage: test_switch_udp_crafted.py PATH/TO/gossip-switch-udp
"""
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

MAGIC, VERSION = 0x31575347, 2
SYNC, RESULT, DELTA, REPLY, LEAVE, REJOIN, REFUSED, PENDING = 1, 2, 3, 4, 5, 6, 7, 8
# drop_reason codes (packet.hpp) of the drops the switch answers with REFUSED
REFUSABLE = {"bad_version": 3, "unknown_group": 5, "bad_worker": 6, "bad_elements": 7, "bad_length": 8, "bad_chunk": 9, "bad_slot": 10,
             "wrong_mode": 11, "session_conflict": 25}
HDR = struct.Struct("<IBBBBHHHHIIII")


def packet(type_, group, worker, values=(), slot=0, chunk=0, flags=0, sequence=0, session=0, elements=None,
           magic=MAGIC, version=VERSION):
    n = len(values) if elements is None else elements
    return HDR.pack(magic, version, type_, flags, 0, group, worker, slot, n, chunk, 0, sequence, session) + \
        struct.pack("<%df" % len(values), *values)


def parse(data):
    f = HDR.unpack_from(data)
    n = f[8]
    return {"type": f[2], "flags": f[3], "reserved": f[4], "group": f[5], "worker": f[6], "slot": f[7], "elements": n,
            "chunk": f[9], "count": f[10], "sequence": f[11], "session": f[12], "length": len(data),
            "values": list(struct.unpack_from("<%df" % n, data, HDR.size)) if f[2] != REFUSED else []}


failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def main():
    exe = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="gsw-crafted.")
    stats = os.path.join(tmp, "stats.json")
    # Refused at start, with the option named: an empty --group, an unwritable --stats-json.
    for args, says in ((["--group", ""], "--group: group '': is empty"),
                       (["--group", "id=1,members=2", "--stats-json", os.path.join(tmp, "no-such-dir", "s.json")],
                        "--stats-json: cannot write")):
        r = subprocess.run([exe, "--bind", "127.0.0.1", "--port", "0", "--duration", "5"] + args,
                           stderr=subprocess.PIPE, text=True, timeout=30)
        check(r.returncode == 2 and says in r.stderr, "%s: exit 2 saying '%s' (got %d: %s)" % (args, says, r.returncode, r.stderr.strip()))
    # --port 0: the switch takes a free port and names it when it serves.
    sw = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", "0", "--stats-json", stats,
                           "--group", "id=1,mode=sync,members=2,chunk=4,slots=2",
                           "--group", "id=2,mode=async,members=2,chunk=4,elements=6",
                           "--group", "id=3,mode=async,members=2,chunk=4,elements=4,idle_s=1",
                           "--group", "id=4,mode=sync,members=2,chunk=4,slots=2"],
                          stderr=subprocess.PIPE, text=True)
    try:
        line = sw.stderr.readline()
        served = re.search(r"serving .* on 127\.0\.0\.1:(\d+)", line)
        if not served or served.group(1) == "0":
            print("FAIL: gossip-switch-udp did not start on a port of its own: " + line)
            return 1
        port = int(served.group(1))
        check(os.path.exists(stats), "--stats-json is written when the switch starts (so an unwritable path fails then)")
        addr = ("127.0.0.1", port)
        w = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
        for s in w:
            s.bind(("127.0.0.1", 0))
            s.settimeout(5)
        expected = {}

        def reply(sender):
            return parse(w[sender].recvfrom(4096)[0])

        # The switch's view of each group, as a refusal carries it: mode, members, chunk, slots, model size.
        groups = {1: (1, 2, 4, 2, 0), 2: (2, 2, 4, 0, 6), 4: (1, 2, 4, 2, 0)}

        def drop(reason, data, sender=0, refused=True):
            w[sender].sendto(data, addr)
            expected[reason] = expected.get(reason, 0) + 1
            if reason not in REFUSABLE or not refused:
                return
            sent = HDR.unpack_from(data)
            r = reply(sender)
            if reason == "bad_version":  # another version's header may be laid out otherwise past byte 8: nothing echoed
                check(r["type"] == REFUSED and r["length"] == HDR.size and r["flags"] == REFUSABLE[reason] and
                      all(r[k] == 0 for k in ("reserved", "group", "worker", "slot", "elements", "chunk", "count", "sequence", "session")),
                      "bad_version is refused to its sender with the reason alone (got %s)" % r)
                return
            view = groups.get(sent[5], (0, 0, 0, 0, 0))
            check(r["type"] == REFUSED and r["length"] == HDR.size and r["flags"] == REFUSABLE[reason] and
                  (r["group"], r["worker"], r["chunk"], r["session"]) == (sent[5], sent[6], sent[9], sent[12]) and
                  (r["reserved"], r["count"], r["elements"], r["slot"], r["sequence"]) == view,
                  "%s is refused to its sender with the reason, its fields and the group's view (got %s)" % (reason, r))

        def quiet(sender):  # nothing more for this worker
            w[sender].settimeout(0.3)
            try:
                w[sender].recvfrom(4096)
                return False
            except socket.timeout:
                return True
            finally:
                w[sender].settimeout(5)

        a = [0.5, 1.25, -2.0, 3.0]
        b = [1.5, 0.25, 4.0, -1.0]
        ab = [x + y for x, y in zip(a, b)]

        # Sync all-reduce on chunk 0, malformed packets in between.
        w[0].sendto(packet(SYNC, 1, 0, a, session=7), addr)
        w[0].sendto(packet(SYNC, 1, 0, a, session=7), addr)  # again, while the set waits for worker 1
        raw = w[0].recvfrom(4096)[0]
        r = parse(raw)
        check(r["type"] == PENDING and r["length"] == HDR.size + 8 and r["elements"] == 0 and r["count"] == 1 and
              (r["group"], r["worker"], r["chunk"], r["session"]) == (1, 0, 0, 7) and struct.unpack_from("<Q", raw, HDR.size)[0] == 0b01,
              "a share sent again while its set waits is answered sync_pending, with the members the set holds (got %s)" % r)
        drop("too_short", b"GSW1\x02\x01")
        drop("bad_magic", packet(SYNC, 1, 0, a, session=7, magic=0x31575348))
        drop("bad_version", packet(SYNC, 1, 0, a, session=7, version=1))
        # Another version's refusal is not answered: no ping-pong between switches of two versions.
        drop("bad_version", packet(REFUSED, 1, 0, [], session=7, version=3, flags=3), refused=False)
        drop("bad_type", packet(RESULT, 1, 0, a, session=7))
        drop("unknown_group", packet(SYNC, 9, 0, a, session=7))
        drop("bad_worker", packet(SYNC, 1, 2, a, session=7))
        drop("bad_length", packet(SYNC, 1, 1, a, session=8)[:-4])  # truncated: header says 4 values, 3 follow
        drop("bad_length", packet(SYNC, 1, 1, a, session=8) + b"\0\0\0\0")  # oversized by one value
        drop("bad_length", packet(SYNC, 1, 1, a, session=8) + bytes(2000), refused=False)  # cut by the kernel: unread
        drop("bad_elements", packet(SYNC, 1, 1, a + [9.0], session=8))  # above the chunk size
        drop("bad_elements", packet(SYNC, 1, 1, [], session=8))
        drop("bad_slot", packet(SYNC, 1, 1, b, slot=1, chunk=0, session=8))  # slot != chunk % slots
        drop("bad_slot", packet(SYNC, 1, 1, b, slot=3, chunk=3, session=8))  # slot out of range
        drop("bad_slot", packet(SYNC, 1, 1, b, flags=2, session=8))
        drop("wrong_mode", packet(DELTA, 1, 1, b, sequence=1, session=8))
        w[1].sendto(packet(SYNC, 1, 1, b, session=8), addr)
        r0, r1 = reply(0), reply(1)
        check(r0["type"] == RESULT and r0["values"] == ab and r0["count"] == 2 and r0["session"] == 7,
              "sync result to worker 0 is the exact sum, with its session")
        check(r1["values"] == ab and r1["session"] == 8, "sync result to worker 1 is the exact sum, with its session")
        w[0].sendto(packet(SYNC, 1, 0, a, session=7), addr)  # duplicate after completion: stored result again
        check(reply(0)["values"] == ab and quiet(1), "a duplicate gets the stored result, to its sender only")

        # Slot conflict: the shadow set of slot 0 now holds chunk 2 of worker 0; chunk 4 of worker 1 cannot use it.
        w[0].sendto(packet(SYNC, 1, 0, a, chunk=2, slot=0, flags=1, sequence=1, session=7), addr)
        drop("slot_conflict", packet(SYNC, 1, 1, b, chunk=4, slot=0, flags=1, sequence=1, session=8), sender=1)
        w[1].sendto(packet(SYNC, 1, 1, b, chunk=2, slot=0, flags=1, sequence=1, session=8), addr)
        check(reply(0)["values"] == ab and reply(1)["values"] == ab, "the slot's all-reduce completes exactly after the conflict")

        # Async: 6 elements in chunks of 4 and 2.
        d0 = [1.0, 2.0, 3.0, 4.0]
        w[0].sendto(packet(DELTA, 2, 0, d0, sequence=1, session=100), addr)
        r = reply(0)
        check(r["type"] == REPLY and r["values"] == d0 and r["count"] == 1, "async reply after one member is its delta")
        drop("bad_chunk", packet(DELTA, 2, 0, [1.0, 1.0], chunk=2, sequence=1, session=100))
        drop("bad_elements", packet(DELTA, 2, 0, d0, chunk=1, sequence=1, session=100))  # chunk 1 holds 2 values
        drop("bad_slot", packet(DELTA, 2, 0, d0, slot=1, sequence=2, session=100))
        drop("sequence_gap", packet(DELTA, 2, 0, d0, sequence=0, session=100))
        drop("sequence_gap", packet(DELTA, 2, 0, d0, sequence=3, session=100))
        # A member the switch holds no session for, with sequence > 1 (as after a switch restart): asked to rejoin.
        drop("unknown_session", packet(DELTA, 2, 1, d0, sequence=2, session=200), sender=1)
        r = reply(1)
        check(r["type"] == REJOIN and r["values"] == [] and r["session"] == 200 and quiet(1),
              "a delta of a session the switch never saw (sequence 2) is answered async_rejoin, once")
        drop("wrong_mode", packet(SYNC, 2, 0, d0, session=100))
        w[0].sendto(packet(DELTA, 2, 0, d0, sequence=1, session=100), addr)  # duplicate: answered, not applied
        check(reply(0)["values"] == d0, "an async duplicate is answered and not applied again")
        d1 = [3.0, 0.0, -3.0, 2.0]
        w[1].sendto(packet(DELTA, 2, 1, d1, sequence=1, session=200), addr)
        avg = [(x + y) / 2 for x, y in zip(d0, d1)]
        r = reply(1)
        check(r["values"] == avg and r["count"] == 2, "async reply is the exact average of both members")
        w[0].sendto(packet(LEAVE, 2, 0, session=100), addr)
        r = reply(0)
        check(r["type"] == REPLY and r["values"] == [] and r["count"] == 1, "a leave is answered with the members still joined")
        drop("stale_session", packet(DELTA, 2, 0, d0, sequence=2, session=100))  # a late packet of the session that left
        w[1].sendto(packet(DELTA, 2, 1, [0.0] * 4, sequence=2, session=200), addr)
        r = reply(1)
        check(r["values"] == d1 and r["count"] == 1, "after the leave S holds only the remaining member")

        # Two jobs on group 4: worker 0 of one (session 400, socket 0) is taken by another's (401, socket 1).
        # Within a second 400 is a late packet; after it (the eviction below takes over a second) both are alive.
        w[0].sendto(packet(SYNC, 4, 0, a, session=400), addr)
        w[1].sendto(packet(SYNC, 4, 0, a, session=401), addr)
        drop("stale_session", packet(SYNC, 4, 0, a, session=400))
        check(quiet(0) and quiet(1), "group 4: the displaced session's packet within the grace is dropped, unanswered")
        conflict_from = time.time()

        # Eviction: in group 3 (idle_s = 1) member 1 falls silent while member 0 goes on; after a second the
        # switch takes member 1's part out, and asks its session to rejoin at its next delta.
        e0, e1 = [1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]
        w[0].sendto(packet(DELTA, 3, 0, e0, sequence=1, session=300), addr)
        reply(0)
        w[1].sendto(packet(DELTA, 3, 1, e1, sequence=1, session=301), addr)
        check(reply(1)["values"] == [2.0] * 4, "group 3: the average of both members")
        seq, r, start = 1, None, time.time()
        while time.time() - start < 8:
            time.sleep(0.1)
            seq += 1
            w[0].sendto(packet(DELTA, 3, 0, [0.0] * 4, sequence=seq, session=300), addr)
            r = reply(0)
            if r["count"] == 1:
                break
        evicted_after = time.time() - start
        check(r["count"] == 1 and r["values"] == e0 and 0.9 < evicted_after < 5,
              "member 1 silent for idle_s is evicted after %.1f s: member 0 gets its own part back (%s)" % (evicted_after, r))
        drop("evicted", packet(DELTA, 3, 1, [0.0] * 4, sequence=2, session=301), sender=1)
        r = reply(1)
        check(r["type"] == REJOIN and r["session"] == 301 and quiet(1), "the evicted session's next delta is answered async_rejoin")
        w[1].sendto(packet(DELTA, 3, 1, e1, sequence=1, session=302), addr)
        r = reply(1)
        check(r["values"] == [2.0] * 4 and r["count"] == 2, "rejoined with everything it had sent: the average is exact again")

        while time.time() - conflict_from < 1.3:
            time.sleep(0.05)
        drop("session_conflict", packet(SYNC, 4, 0, a, session=400))  # the displaced session, alive: refused
        drop("session_conflict", packet(SYNC, 4, 0, a, session=401), sender=1)  # and the current one, once
        w[1].sendto(packet(SYNC, 4, 0, a, session=401), addr)
        r = reply(1)
        check(r["type"] == PENDING and r["session"] == 401 and r["count"] == 1 and quiet(1),
              "after its one refusal the current session is served again (its share is held, the set needs worker 1: got %s)" % r)

        os.remove(stats)  # the switch wrote it when it started; SIGUSR1 writes it again
        os.kill(sw.pid, signal.SIGUSR1)
        deadline = time.time() + 10
        while time.time() < deadline and not os.path.exists(stats):
            time.sleep(0.05)
        time.sleep(0.2)
        s = json.load(open(stats))
        got = {k: v for k, v in s["drops"].items() if v}
        check(got == expected, "drops by reason: got %s, expected %s" % (sorted(got.items()), sorted(expected.items())))
        check(s["accepted"] == 11 + seq + 2 + 3, "accepted %d packets, expected %d" % (s["accepted"], 11 + seq + 2 + 3))
        check(s["pending_answered"] == 2, "pending_answered %d (2)" % s["pending_answered"])
        check(s["deltas_applied"] == 3 + seq + 2 and s["aggregations_completed"] == 2 and s["results_resent"] == 1,
              "deltas_applied %d (%d), aggregations_completed %d (2), results_resent %d (1)" %
              (s["deltas_applied"], 3 + seq + 2, s["aggregations_completed"], s["results_resent"]))
        check(s["evictions"] == 1 and s["groups"][2]["idle_s"] == 1, "evictions %d (1), group 3's idle_s in the report" % s["evictions"])
    finally:
        sw.send_signal(signal.SIGTERM)
        try:
            sw.wait(10)
        except subprocess.TimeoutExpired:
            sw.kill()
            sw.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASS" if not failures else "FAILED: %d check(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
