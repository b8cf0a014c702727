#!/bin/bash
# run-two.sh CMD_A CMD_B
#   Two guests (run.sh each) joined by a virtual Ethernet link: QEMU socket netdevs sending UDP
#   to each other on 127.0.0.1, nothing beyond this machine. Guest A is 192.0.2.1, guest B
#   192.0.2.2, each with its own rxe0 on its virtio NIC (SOFTROCE_NETDEV inside). CMD_B starts
#   first and is expected to serve until it is powered off; exits with CMD_A's code.
#   Guest A asks for guest B to be powered off by creating $SOFTROCE_TWO_CTL/poweroff-b: B's
#   QEMU is killed (kill -9: no shutdown, its NIC just goes silent), then B is booted again
#   with CMD_B. SOFTROCE_TWO_CTL (default $PWD/build/softroce-two) must be under $PWD (shared
#   read-write); B's output goes to b.log there. Knobs as for run.sh; SOFTROCE_CPUS and SOFTROCE_MEM are per guest (1, 2048).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
[ $# -eq 2 ] || { echo "usage: $0 CMD_A CMD_B" >&2; exit 2; }
CMD_A=$1 CMD_B=$2
export SOFTROCE_TWO_CTL=${SOFTROCE_TWO_CTL:-$PWD/build/softroce-two}
export SOFTROCE_CPUS=${SOFTROCE_CPUS:-1} SOFTROCE_MEM=${SOFTROCE_MEM:-2048}
rm -rf "$SOFTROCE_TWO_CTL"; mkdir -p "$SOFTROCE_TWO_CTL"
PA=$((20000 + RANDOM % 20000)); PB=$((PA + 1))  # UDP ports of the link's two ends
BPID=
start_b() {
  rm -f "$SOFTROCE_TWO_CTL/b.pid"
  SOFTROCE_ADDR=192.0.2.2 SOFTROCE_LINK=$PB:$PA SOFTROCE_PIDFILE=$SOFTROCE_TWO_CTL/b.pid \
    "$HERE/run.sh" "$CMD_B" >> "$SOFTROCE_TWO_CTL/b.log" 2>&1 &
  BPID=$!
}
kill_b() {  # the pid file is written once QEMU has started
  for _ in $(seq 600); do [ -s "$SOFTROCE_TWO_CTL/b.pid" ] && break; sleep 0.1; done
  kill -9 "$(cat "$SOFTROCE_TWO_CTL/b.pid")" 2>/dev/null
  wait "$BPID" 2>/dev/null
}
start_b
SOFTROCE_ADDR=192.0.2.1 SOFTROCE_LINK=$PA:$PB "$HERE/run.sh" "$CMD_A" &
APID=$!
while kill -0 "$APID" 2>/dev/null; do
  if [ -e "$SOFTROCE_TWO_CTL/poweroff-b" ]; then
    kill_b
    echo "[two] guest B powered off (kill -9 of its QEMU) at $(date +%T.%N); booting it again" >&2
    rm -f "$SOFTROCE_TWO_CTL/poweroff-b"
    start_b
  fi
  sleep 0.1
done
wait "$APID"; rc=$?
kill_b
# B's output (its console, and run.sh's note that its QEMU was killed) when something failed
[ $rc -eq 0 ] && [ -z "${SOFTROCE_VERBOSE:-}" ] || sed 's/^/[B] /' "$SOFTROCE_TWO_CTL/b.log" >&2
exit $rc
