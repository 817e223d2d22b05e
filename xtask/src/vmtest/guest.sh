#!/bin/busybox sh
# /init of a `cargo xtask vmtest` guest: PID 1 of a throwaway VM. Runs connreap's smoke scenario
# against this kernel and prints what the host checks on the serial console, then powers off.
# Protocol (parsed by xtask/src/vmtest/check.rs):
#   @@fact NAME VALUE...          one fact
#   @@begin NAME ... @@end NAME rc=N   a block of output and the exit status that made it
# The guest only records; every verdict is made on the host.

/bin/busybox mkdir -p /proc /sys /dev /tmp /run
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /run/lock /var/lib/connreap
mount -t securityfs securityfs /sys/kernel/security 2>/dev/null
# What a systemd host has mounted (connreap would mount them itself otherwise).
mount -t bpf bpf /sys/fs/bpf
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
hostname vmtest
ip link set lo up
export RUST_LOG=connreap=info

fact() { echo "@@fact $*"; }

# mark NAME: the guest's uptime (s) when NAME was reached, for the timings.
mark() { fact "t_$1" "$(cut -d' ' -f1 /proc/uptime)"; }

# block NAME FILE RC
block() {
    echo "@@begin $1"
    cat "$2" 2>/dev/null
    echo
    echo "@@end $1 rc=$3"
}

# step NAME CMD...: run CMD, print its stdout as NAME.out and stderr as NAME.err.
step() {
    name=$1
    shift
    "$@" >"/tmp/$name.out" 2>"/tmp/$name.err"
    rc=$?
    block "$name.out" "/tmp/$name.out" $rc
    block "$name.err" "/tmp/$name.err" $rc
    return $rc
}

# wait_for FILE PATTERN SECONDS
wait_for() {
    i=0
    while ! grep -q "$2" "$1" 2>/dev/null; do
        i=$((i + 1))
        [ $i -gt $(($3 * 5)) ] && return 1
        sleep 0.2
    done
}

PEERS=""
# peer NAME ARGS...: a connreap-testpeer in the background; waits for its `ready` line.
peer() {
    name=$1
    shift
    connreap-testpeer "$@" >"/tmp/peer-$name.out" 2>&1 &
    PEERS="$PEERS $!"
    wait_for "/tmp/peer-$name.out" '^ready' 60 || fact peer_not_ready "$name" "$(cat /tmp/peer-$name.out)"
}

kill_peers() {
    for p in $PEERS; do kill "$p" 2>/dev/null; done
    for p in $PEERS; do wait "$p" 2>/dev/null; done
    PEERS=""
}

# fds: "PID FD socket:[INODE] COMM" for every socket descriptor of every process.
fds() {
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        c=$(cat "$d/comm" 2>/dev/null)
        for f in "$d"/fd/*; do
            l=$(readlink "$f" 2>/dev/null)
            case "$l" in socket:*) echo "$p ${f##*/} $l $c" ;; esac
        done
    done
}

kernel_view() {
    cat /proc/net/tcp /proc/net/tcp6 >/tmp/$1.txt
    block "$1" /tmp/$1.txt 0
}

# get NAME PATH: GET from the daemon's API into /tmp/NAME.json. (busybox 1.35's `wget -T`
# crashes when linked statically, hence `timeout`.)
get() { timeout 10 wget -q -O "/tmp/$1.json" "http://127.0.0.1:9477$2"; }

finish() {
    kill_peers
    fact tainted "$(cat /proc/sys/kernel/tainted)"
    dmesg | grep -E 'WARNING:|BUG:|Oops|Call Trace|general protection|list_add corruption' >/tmp/dmesg.txt
    block dmesg-problems /tmp/dmesg.txt 0
    mark done
    fact done
    poweroff -f
}

mark init
fact release "$(uname -r)"
fact cmdline "$(cat /proc/cmdline)"
fact lockdown "$(cat /sys/kernel/security/lockdown 2>/dev/null || echo unavailable)"
fact version "$(connreap --version)"
for m in inet_diag tcp_diag; do
    insmod "/lib/modules/$m.ko" || fact insmod_failed "$m"
done

# 1. The snapshot against the kernel's own view: v4, v6 and v4-mapped sockets in LISTEN,
#    ESTABLISHED, CLOSE_WAIT (clients whose server closed) and orphaned FIN_WAIT2.
peer cw close-wait --addr 127.0.0.1:7001 --count 3
peer l4 listen --addr 127.0.0.1:7002
peer l6 listen --addr '[::1]:7003'
peer lm listen --addr '[::ffff:127.0.0.1]:7004'
peer c4 connect --addr 127.0.0.1:7002 --count 2
peer c6 connect --addr '[::1]:7003' --count 2
peer cm connect --addr '[::ffff:127.0.0.1]:7004' --count 2
mark peers
step snapshot connreap snapshot --json
snapshot_rc=$?
mark snapshot
kernel_view tcp-at-snapshot
fds >/tmp/fds.txt
block fds /tmp/fds.txt 0
if [ $snapshot_rc -ne 0 ]; then
    # A refused load: what is left on bpffs afterwards, then the verifier's reason (-v).
    find /sys/fs/bpf >/tmp/pins.txt 2>&1
    block pins /tmp/pins.txt 0
    step snapshot-verbose connreap -v snapshot
    finish
fi
kill_peers

# 2. The daemon fires a CLOSE_WAIT finding, an enforce policy kills the sockets via netlink,
#    the finding resolves. The policy waits longer than the detector, so the finding is seen
#    firing before the kills resolve it.
cat >/tmp/daemon.toml <<'EOF'
[agent]
listen = "127.0.0.1:9477"
scan_interval = "1s"
[detect]
close_wait_min_age = "1s"
close_wait_threshold = 4
[reclaim]
audit_log = "/tmp/audit-netlink.jsonl"
mechanism = "netlink"
[[policy]]
name = "vm-netlink"
mode = "enforce"
trigger = "always"
select = { comm = "connreap-testpe", peer_port = 7005, states = ["CLOSE_WAIT"] }
min_age = "5s"
EOF
connreap run --config /tmp/daemon.toml 2>/tmp/daemon.err &
daemon=$!
i=0
until get healthz /healthz; do
    i=$((i + 1))
    [ $i -gt 300 ] && break
    sleep 0.2
done
mark daemon_ready
block healthz /tmp/healthz.json 0
peer dcw close-wait --addr 127.0.0.1:7005 --count 4
i=0
until get findings-firing /v1/findings && grep -q close_wait_buildup /tmp/findings-firing.json; do
    i=$((i + 1))
    [ $i -gt 150 ] && break
    sleep 0.2
done
mark firing
block findings-firing /tmp/findings-firing.json 0
i=0
until get findings-resolved /v1/findings && ! grep -q close_wait_buildup /tmp/findings-resolved.json; do
    i=$((i + 1))
    [ $i -gt 150 ] && break
    sleep 0.2
done
mark resolved
block findings-resolved /tmp/findings-resolved.json 0
kill -TERM $daemon
wait $daemon
block daemon.err /tmp/daemon.err $?
block audit-netlink /tmp/audit-netlink.jsonl 0
kernel_view tcp-after-netlink
kill_peers

# 3. The bpf_sock_destroy fallback, forced: kills on >= 6.5, an enforce-as-dry-run below.
cat >/tmp/bpf.toml <<'EOF'
[reclaim]
audit_log = "/tmp/audit-bpf.jsonl"
mechanism = "bpf-iter"
[[policy]]
name = "vm-bpf-iter"
mode = "enforce"
trigger = "always"
select = { comm = "connreap-testpe", peer_port = 7006, states = ["CLOSE_WAIT"] }
EOF
peer bcw close-wait --addr 127.0.0.1:7006 --count 2
step bpf-iter connreap reclaim --policy vm-bpf-iter --config /tmp/bpf.toml
mark bpf_iter
kernel_view tcp-after-bpf-iter
finish
