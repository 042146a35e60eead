#!/usr/bin/env bash
# ext_proc streams that never send a message (issue 35, finding 3): one picker (release build)
# in front of a simulated engine, then CONNS raw HTTP/2 connections that each try to open
# STREAMS gRPC ext_proc streams and send nothing on them, ignoring the picker's advertised
# stream limit (a hostile client, not a gateway). While they are held, PICKS legitimate
# bodyless picks go over a connection of their own. Prints how many streams the picker let
# open and refused, the answers of the legitimate picks, the picker's resident memory, and
# what became of the idle streams after headerReadTimeout (HOLD_S seconds held in all).
#
#   scripts/idle-streams.sh                      # one connection trying 33,000 streams
#   CONNS=40 STREAMS=1024 SKIP_BUILD=1 scripts/idle-streams.sh
#   FROM=127.0.0.1 CONNS=70 STREAMS=1024 scripts/idle-streams.sh   # the stranger on the gateway's address
#
# The idle connections come from FROM (default 127.0.0.2), the legitimate picks from
# 127.0.0.1, as a gateway and a stranger on the pod network have addresses of their own (the
# picker shares the opening room per peer address).
#
# Needs python3 with the h2 package (pip install h2). Everything binds 127.0.0.1; every
# process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
CONNS=${CONNS:-1}
STREAMS=${STREAMS:-33000}
PICKS=${PICKS:-20}
HOLD_S=${HOLD_S:-15}
FROM=${FROM:-127.0.0.2}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release}
if [[ -z ${SKIP_BUILD:-} ]]; then
  cargo build --release -q -p kvroute-picker --bin kvroute-picker -p kvroute-sim --bin kvroute-sim
fi
ulimit -n $((CONNS + 4096)) 2>/dev/null || true
source scripts/lib/local-picker.sh
start_sim 1
cat >"$TMP/picker.yaml" <<YAML
listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0, extProc: 127.0.0.1:0}
modelConfigs:
  - {name: sim, model: sim, port: ${SIM_PORTS[0]}}
endpoints:
  - {address: 127.0.0.1, modelConfig: sim}
YAML
start_picker "$TMP/picker.yaml"
EXT=$(picker_addr ext_proc)
METRICS=$(picker_addr metrics)
sleep 2
echo "picker RSS before: $(rss) kB"

python3 - "$EXT" "$CONNS" "$STREAMS" "$PICKS" "$HOLD_S" "$PICKER" "$METRICS" "$FROM" <<'PY'
import socket, sys, time, threading, urllib.request
import h2.connection, h2.config, h2.events, h2.settings

host, port = sys.argv[1].rsplit(":", 1)
conns, streams, picks, hold = (int(x) for x in sys.argv[2:6])
picker_pid, metrics, source = sys.argv[6], sys.argv[7], sys.argv[8]
PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

def rss():
    for line in open(f"/proc/{picker_pid}/status"):
        if line.startswith("VmRSS"):
            return line.split()[1] + " kB"

def connect(source="127.0.0.1"):
    s = socket.create_connection((host, int(port)), source_address=(source, 0))
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    c.initiate_connection()
    s.sendall(c.data_to_send())
    return s, c

def grpc_headers():
    return [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "picker"),
            ("content-type", "application/grpc"), ("te", "trailers")]

def pump(s, c, timeout=0.2):
    """Read what has arrived; return the events."""
    s.settimeout(timeout)
    events = []
    try:
        while True:
            data = s.recv(1 << 20)
            if not data:
                break
            events += c.receive_data(data)
            out = c.data_to_send()
            if out:
                s.sendall(out)
    except (socket.timeout, BlockingIOError):
        pass
    return events

# hostile connections: open streams and send nothing on them
held = []
opened = refused = answered = 0
codes = {}
for _ in range(conns):
    s, c = connect(source)
    pump(s, c)
    # a hostile client ignores the advertised SETTINGS_MAX_CONCURRENT_STREAMS
    c.remote_settings = h2.settings.Settings(
        client=False,
        initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1})
    for _ in range(streams):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, grpc_headers())
        s.sendall(c.data_to_send())
    for e in pump(s, c, 1.0):
        if isinstance(e, h2.events.StreamReset):
            refused += 1
            codes[str(e.error_code)] = codes.get(str(e.error_code), 0) + 1
        if isinstance(e, h2.events.ResponseReceived):
            answered += 1
    opened += streams
    held.append((s, c))
refused_total = refused
print(f"idle streams attempted: {opened} on {conns} connection(s); answered (open): {answered}; reset: {refused_total} {codes}")
print(f"picker RSS with them held: {rss()}")

# legitimate bodyless picks over a connection of their own: a ProcessingRequest with
# request_headers (field 2) = HttpHeaders{headers (1): HeaderMap{headers (1): HeaderValue{key 1,
# raw_value 3}}, end_of_stream (3): true}
def hv(k, v):
    kb, vb = k.encode(), v.encode()
    inner = b"\x0a" + bytes([len(kb)]) + kb + b"\x1a" + bytes([len(vb)]) + vb
    return b"\x0a" + bytes([len(inner)]) + inner
hmap = b"".join(hv(k, v) for k, v in [(":method", "GET"), (":path", "/v1/models"), (":authority", "gw")])
http_headers = b"\x0a" + bytes([len(hmap)]) + hmap + b"\x18\x01"
msg = b"\x12" + bytes([len(http_headers)]) + http_headers
frame = b"\x00" + len(msg).to_bytes(4, "big") + msg
s, c = connect()
pump(s, c)
answers = {}
for _ in range(picks):
    sid = c.get_next_available_stream_id()
    c.send_headers(sid, grpc_headers())
    c.send_data(sid, frame)
    s.sendall(c.data_to_send())
    deadline = time.time() + 5
    body = b""
    while time.time() < deadline and len(body) < 6:
        for e in pump(s, c, 0.1):
            if isinstance(e, h2.events.DataReceived) and e.stream_id == sid:
                body += e.data
                c.acknowledge_received_data(e.flow_controlled_length, sid)
            if isinstance(e, h2.events.StreamReset) and e.stream_id == sid:
                body = b"reset"
    # ProcessingResponse: request_headers is field 1 (0x0a), immediate_response field 7 (0x3a)
    kind = {0x0a: "routed", 0x3a: "refused (immediate response)"}.get(body[5] if len(body) > 5 else -1, f"other {body[:8]!r}")
    answers[kind] = answers.get(kind, 0) + 1
    c.reset_stream(sid)
    s.sendall(c.data_to_send())
print(f"legitimate picks while held: {answers}")

# after headerReadTimeout (10 s by default) the silent streams are ended
time.sleep(max(0, hold - 3))
ended = 0
for s2, c2 in held:
    for e in pump(s2, c2, 1.0):
        if isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)):
            ended += 1
print(f"idle streams ended by the picker after {hold} s: {ended}; picker RSS: {rss()}")
text = urllib.request.urlopen(f"http://{metrics}/metrics").read().decode()
for line in text.splitlines():
    if line.startswith("kvroute_picker_errors_total") and any(k in line for k in ("silent_stream", "opening_limit", "stream_limit")):
        print(" ", line)
PY
