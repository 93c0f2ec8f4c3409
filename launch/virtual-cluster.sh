#!/usr/bin/env bash
# A Pi cluster on one machine, for the real launcher: every board of a board list as its own network and UTS
# namespace, with its own host name, address, SSH server, CPU share and link.
#
#   launch/virtual-cluster.sh up    BOARDS VIRTUAL        # BOARDS: a board list as launch/hostfile.example
#   launch/virtual-cluster.sh cut   VIRTUAL HOST SECONDS  # the board's link down for SECONDS, then up again
#   launch/virtual-cluster.sh stop  VIRTUAL HOST          # every process of the board killed (power lost)
#   launch/virtual-cluster.sh start VIRTUAL HOST          # a stopped board powered on again: its sshd, its share
#   launch/virtual-cluster.sh down  VIRTUAL               # everything `up` made removed; safe to repeat
#
# `up` makes, for each board line after the head: a network namespace ef-bN and a UTS namespace whose host
# name is the board's name in BOARDS; a veth link from it to the bridge ef-br0 in this (the head's) namespace;
# the address 10.231.0.(N+1) of the private subnet 10.231.0.0/24, the only addresses this script uses (the
# head is 10.231.0.1; no route, forwarding or NAT leads anywhere else); an sshd listening only there, with
# host and client keys made for this cluster (this machine's ssh reaches the boards, by address and by name,
# through an Include of STATE/ssh_config at the top of ~/.ssh/config in ssh's own home, whatever $HOME says,
# removed by `down`); and
# the board's CPU share: its sshd, and
# so every process started on the board, runs in a cgroup whose CPU quota is the board profile's speed (the
# logistic-regression step) against this machine's, at most one core, on one core (a board is one of its
# cores: its processes see one, and run its devices one at a time). This machine's profile is measured
# once (`edgefed profile`, cached in ~/.cache/edgefed/this-machine.toml, or EDGEFED_MACHINE_PROFILE). Where
# the board's profile names a link speed ([machine] link_mbps) its link is shaped to it (tc tbf, both ways).
# Its memory: the same processes run in a memory cgroup limited to what the real board leaves edgefed (the
# profile's memory_mb less its system_mb, and swap within it where the kernel counts swap), so a rank that
# would not fit the board is killed here by the kernel's OOM killer as it would be there (the launcher then
# names the board and its memory).
# VIRTUAL is then the same board list with the boards' addresses, for launch/pi-cluster.sh and edgefed
# launch --boards, and VIRTUAL.env the launcher's settings pi-cluster.sh reads beside it (MPI over TCP).
# Run as root. STATE: /run/edgefed-virtual.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Two clusters side by side (the tests' beside a user's) differ in all three: EDGEFED_VIRTUAL_NAME names the
# links, namespaces and cgroup, EDGEFED_VIRTUAL_SUBNET their addresses, EDGEFED_VIRTUAL_STATE their state.
NAME=${EDGEFED_VIRTUAL_NAME:-ef}
SUBNET=${EDGEFED_VIRTUAL_SUBNET:-10.231.0}
STATE=${EDGEFED_VIRTUAL_STATE:-/run/edgefed-virtual}
BRIDGE=$NAME-br0
GROUP=edgefed-virtual-$NAME
python=${VENV:-$(cd "$here/.." && pwd)/.venv}/bin/python
machine=${EDGEFED_MACHINE_PROFILE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgefed/this-machine.toml}
include="Include $STATE/ssh_config"
# ssh reads the config of its user's home as the passwd database has it, not $HOME (a `sudo` that keeps the
# user's HOME would otherwise put the Include where root's ssh never looks)
ssh_config="$(getent passwd "$(id -u)" | cut -d: -f6)"
ssh_config="${ssh_config:-$HOME}/.ssh/config"
SSHD=${SSHD:-/usr/sbin/sshd}

say() { echo "virtual-cluster.sh: $*" >&2; }
fail() { say "$*"; exit 2; }
usage() { sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

cgroup_root() {  # the cpu controller's folder for this cluster: cgroup v1's cpu hierarchy, or v2's unified one
    if [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ] || [ -d "/sys/fs/cgroup/cpu/$GROUP" ]; then
        echo "/sys/fs/cgroup/cpu/$GROUP"
    elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        echo "/sys/fs/cgroup/$GROUP"
    fi
}

require() {  # what `up` needs, each missing one named in one line with how to get it; nothing made before
    [ "$(id -u)" = 0 ] || fail "run as root: namespaces, links and cgroups are root's to make"
    local tool package
    for tool in ip:iproute2 tc:iproute2 nsenter:util-linux unshare:util-linux taskset:util-linux ssh:openssh-client \
                ssh-keygen:openssh-client; do
        command -v "${tool%%:*}" > /dev/null || fail "${tool%%:*} is missing: apt-get install ${tool#*:}"
    done
    [ -x "$SSHD" ] || fail "sshd is missing ($SSHD): apt-get install openssh-server"
    ip netns list > /dev/null 2>&1 || fail "ip netns does not work here (network namespaces); a kernel with them is needed"
    [ -n "$(cgroup_root)" ] || fail "no cgroup cpu controller at /sys/fs/cgroup (a board's CPU share needs it)"
    [ -n "$(memory_root)" ] || fail "no cgroup memory controller at /sys/fs/cgroup (a board's memory needs it)"
    [ -x "$python" ] || fail "no Python at $python: install edgefed in this checkout's .venv, or set VENV"
    if ip link show "$BRIDGE" > /dev/null 2>&1 || [ -d "$STATE" ]; then
        fail "a virtual cluster is up already: launch/virtual-cluster.sh down VIRTUAL first"
    fi
    if ip -4 addr | grep -q " $SUBNET\."; then
        fail "the subnet $SUBNET.0/24 is in use on this machine; the virtual cluster needs it to itself"
    fi
}

boards_of() {  # the board list as lines "HOST PROFILE LOAD" (the head first, its profile "coordinator")
    local host role load
    while read -r host role load _ || [ -n "${host:-}" ]; do
        host=${host%$'\r'} role=${role%$'\r'} load=${load%$'\r'}
        case "$host" in ''|'#'*) continue ;; esac
        case "$load" in '#'*|'') load=0.0 ;; esac
        echo "$host ${role:-coordinator} $load"
    done < "$1"
}

board_index() {  # N of the board named HOST (its host name or address) in STATE, or fail
    local index name address
    [ -f "$STATE/boards" ] || fail "no virtual cluster is up (no $STATE); launch/virtual-cluster.sh up BOARDS VIRTUAL"
    while read -r index name address _; do
        if [ "$1" = "$name" ] || [ "$1" = "$address" ]; then echo "$index"; return; fi
    done < "$STATE/boards"
    fail "$1 is not a board of this virtual cluster (see $STATE/boards)"
}

memory_root() {  # the memory controller's folder for this cluster: cgroup v1's memory hierarchy, or v2's
    if [ -d /sys/fs/cgroup/memory ] && [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
        echo "/sys/fs/cgroup/memory/$GROUP"
    elif grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        echo "/sys/fs/cgroup/$GROUP"
    fi
}

kill_board() {  # every process of board N (its cgroup's), SIGKILL, until none is left (or 10 s)
    local procs pid
    procs=$(cgroup_root)/b$1/cgroup.procs
    [ -f "$procs" ] || return 0
    for _ in $(seq 1 100); do  # again and again: one may have forked while the others died
        [ -n "$(cat "$procs" 2> /dev/null)" ] || return 0  # (not -s: a cgroup file's size is 0)
        while read -r pid; do kill -9 "$pid" 2> /dev/null || true; done < "$procs"
        sleep 0.1
    done
}

start_sshd() {  # board N's sshd started in its namespaces and cgroups; prints its pid
    local n=$1 cg mem join core dir="$STATE/b$1"
    cg=$(cgroup_root) mem=$(memory_root)
    join="echo \$\$ > '$cg/b$n/cgroup.procs'"
    [ "$mem" = "$cg" ] || join="$join && echo \$\$ > '$mem/b$n/cgroup.procs'"
    core=$(( (n - 1) % $(nproc) ))  # one core, as the share is of one: the board's lanes see one
    # the board's first process joins its cgroup, then becomes its sshd: all it starts inherit the share.
    # nsenter, not ip netns exec, which mounts a /sys of its own: the board's processes see their cgroup
    # (a CPU competitor takes its load of the board's share, not of a core)
    setsid sh -c "$join && exec taskset -c $core nsenter --net=/run/netns/$NAME-b$n \
--uts='$dir/uts' '$SSHD' -D -f '$dir/sshd_config' -E '$dir/sshd.log'" < /dev/null > /dev/null 2>&1 &
    echo $!
    disown  # (its end is the board's, not this script's to report)
}

answering() {  # wait until board N (HOST, ADDRESS) answers over ssh, or fail saying why its sshd (PID) does not
    local n=$1 host=$2 address=$3 pid=$4
    for _ in $(seq 1 100); do
        ssh -o ConnectTimeout=2 "$address" true 2> /dev/null && return 0
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.1
    done
    fail "the sshd of board $host ($address) $(kill -0 "$pid" 2> /dev/null && echo "does not answer" \
|| echo "exited at start")$(tail -n 1 "$STATE/b$n/sshd.log" 2> /dev/null | sed 's/^/: /')"
}

down() {  # everything up made, whatever of it is there
    local n dir cg mem
    cg=$(cgroup_root) mem=$(memory_root)
    if [ -f "$STATE/boards" ]; then
        while read -r n _; do
            kill_board "$n"
            [ -d "$cg/b$n" ] && rmdir "$cg/b$n" 2> /dev/null || true
            [ -n "$mem" ] && [ -d "$mem/b$n" ] && rmdir "$mem/b$n" 2> /dev/null || true
            umount "$STATE/b$n/uts" 2> /dev/null || true
            ip netns del "$NAME-b$n" 2> /dev/null || true
            ip link del "$NAME-v$n" 2> /dev/null || true
        done < "$STATE/boards"
    fi
    for dir in "$cg"/b*; do  # (a board `up` made before it wrote the list)
        [ -d "$dir" ] || continue
        n=${dir##*/b}; kill_board "$n"; rmdir "$dir" 2> /dev/null || true
    done
    [ -n "$cg" ] && [ -d "$cg" ] && rmdir "$cg" 2> /dev/null || true
    if [ -n "$mem" ] && [ "$mem" != "$cg" ]; then
        for dir in "$mem"/b*; do [ -d "$dir" ] && rmdir "$dir" 2> /dev/null || true; done
        [ -d "$mem" ] && rmdir "$mem" 2> /dev/null || true
    fi
    for n in $(ip netns list 2> /dev/null | awk -v name="$NAME" '$1 ~ "^" name "-b[0-9]+$" {print $1}'); do ip netns del "$n" 2> /dev/null || true; done
    for dir in "$STATE"/b*; do umount "$dir/uts" 2> /dev/null || true; done
    ip link del "$BRIDGE" 2> /dev/null || true
    if [ -f "$ssh_config" ] && grep -qxF "$include" "$ssh_config"; then
        grep -vxF "$include" "$ssh_config" > "$ssh_config.edgefed-tmp" || true
        mv "$ssh_config.edgefed-tmp" "$ssh_config"
    fi
    rm -rf "$STATE"
}

quota_and_link() {  # "QUOTA MEMORY_MB LINK_MBPS" of a board profile against this machine's (LINK_MBPS: "" when
    # none; MEMORY_MB: what the board leaves edgefed, its memory less its system's)
    "$python" - "$1" "$machine" <<'PY'
import sys
from edgefed import hwprofile
from edgefed.errors import EdgefedError
from edgefed.orchestration.board_speed import profile_speed
try:
    board = hwprofile.load_profile(sys.argv[1])
    share = profile_speed(sys.argv[1]) / profile_speed(sys.argv[2])
except EdgefedError as exc:
    sys.exit(f"virtual-cluster.sh: {exc}")
print(f"{min(share, 1.0):.4f} {int(board.available_mb)} {board.machine.get('link_mbps', '')}")
PY
}

up() {
    local boards=$1 virtual=$2
    [ -f "$boards" ] || fail "board list $boards not found (see launch/hostfile.example)"
    require
    local lines
    mapfile -t lines < <(boards_of "$boards")
    [ ${#lines[@]} -ge 2 ] || fail "$boards lists no board after the head node (see launch/hostfile.example)"
    if [ ! -f "$machine" ]; then
        say "measuring this machine once (edgefed profile --models logreg), for the boards' CPU shares: $machine"
        mkdir -p "$(dirname "$machine")"
        "$python" -m edgefed profile --models logreg --no-cold --out "$machine" > /dev/null
    fi
    local shares=() n share
    for n in $(seq 1 $(( ${#lines[@]} - 1 ))); do  # every profile checked before anything is made
        read -r _ profile _ <<< "${lines[$n]}"
        share=$(quota_and_link "$profile") || exit 2
        shares+=("$share")
    done
    partial="$virtual.tmp"  # (global: the trap runs after up returns)
    trap 'status=$?; trap - EXIT; if [ $status -ne 0 ]; then say "up failed; undoing what it made"; down; rm -f "$partial"; fi; exit $status' EXIT
    mkdir -p "$STATE" /run/sshd
    chmod 700 "$STATE"
    ssh-keygen -q -t ed25519 -N "" -C edgefed-virtual -f "$STATE/client_key"
    cp "$STATE/client_key.pub" "$STATE/authorized_keys"
    : > "$STATE/known_hosts"
    cat > "$STATE/ssh_config" <<EOF
Host $SUBNET.*
    IdentityFile $STATE/client_key
    UserKnownHostsFile $STATE/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
EOF
    mkdir -p "$(dirname "$ssh_config")"
    touch "$ssh_config"
    { echo "$include"; grep -vxF "$include" "$ssh_config" || true; } > "$ssh_config.edgefed-tmp"
    mv "$ssh_config.edgefed-tmp" "$ssh_config"
    chmod 600 "$ssh_config"
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local cg mem host profile load share memory link address quota period dir sshds=()
    cg=$(cgroup_root) mem=$(memory_root)
    mkdir -p "$cg" "$mem"
    if [ -f "$cg/cgroup.subtree_control" ]; then  # cgroup v2: the cpu and memory controllers for the boards' groups
        echo "+cpu +memory" > "$(dirname "$cg")/cgroup.subtree_control" 2> /dev/null || true
        echo "+cpu +memory" > "$cg/cgroup.subtree_control"
    fi
    { read -r host _ _ <<< "${lines[0]}"; echo "$SUBNET.1  coordinator  0.0  # the head: this machine ($(hostname)), for $host"; } > "$virtual.tmp"
    : > "$STATE/boards"
    for n in $(seq 1 $(( ${#lines[@]} - 1 ))); do
        read -r host profile load <<< "${lines[$n]}"
        read -r share memory link <<< "${shares[$((n - 1))]}"
        address="$SUBNET.$(( n + 1 ))"
        dir="$STATE/b$n"
        mkdir -p "$dir"
        echo "$n $host $address $profile $share ${link:--} $memory" >> "$STATE/boards"
        ip netns add "$NAME-b$n"
        ip link add "$NAME-v$n" type veth peer name eth0 netns "$NAME-b$n"
        ip link set "$NAME-v$n" master "$BRIDGE" up
        ip -n "$NAME-b$n" addr add "$address/24" dev eth0
        ip -n "$NAME-b$n" link set lo up
        ip -n "$NAME-b$n" link set eth0 up
        if [ -n "$link" ]; then  # the board's link speed, each way
            tc qdisc add dev "$NAME-v$n" root tbf rate "${link}mbit" burst 64kb latency 400ms
            ip netns exec "$NAME-b$n" tc qdisc add dev eth0 root tbf rate "${link}mbit" burst 64kb latency 400ms
        fi
        touch "$dir/uts"
        unshare --uts="$dir/uts" hostname "$host"
        mkdir -p "$cg/b$n"  # (its share: below, once the boards file lists them all)
        mkdir -p "$mem/b$n"  # (v2: the same folder as the CPU's)
        if [ -f "$mem/b$n/memory.limit_in_bytes" ]; then  # v1; with swap accounting, swap counted in
            echo $(( memory * 1024 * 1024 )) > "$mem/b$n/memory.limit_in_bytes"
            [ ! -f "$mem/b$n/memory.memsw.limit_in_bytes" ] || echo $(( memory * 1024 * 1024 )) > "$mem/b$n/memory.memsw.limit_in_bytes"
        else
            echo $(( memory * 1024 * 1024 )) > "$mem/b$n/memory.max"
            [ ! -f "$mem/b$n/memory.swap.max" ] || echo 0 > "$mem/b$n/memory.swap.max"
        fi
        ssh-keygen -q -t ed25519 -N "" -C "edgefed-virtual $host" -f "$dir/host_key"
        echo "$address $(cut -d' ' -f1,2 "$dir/host_key.pub")" >> "$STATE/known_hosts"
        # its name reaches it too while the cluster is up (`ssh vzero-0.local`), with the same keys
        printf 'Host %s\n    HostName %s\n    HostKeyAlias %s\n    IdentityFile %s\n    UserKnownHostsFile %s\n    StrictHostKeyChecking yes\n    BatchMode yes\n' \
            "$host" "$address" "$address" "$STATE/client_key" "$STATE/known_hosts" >> "$STATE/ssh_config"
        cat > "$dir/sshd_config" <<EOF
ListenAddress $address
HostKey $dir/host_key
AuthorizedKeysFile $STATE/authorized_keys
PidFile $dir/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
EOF
        sshds+=("$(start_sshd "$n")")
    done
    # each board's share as a quota of 2 ms in a period of 2 ms / share: a short period, so the share holds at
    # a deadline's scale (within a period the board runs at this machine's speed until its quota is spent,
    # docs/pi-cluster.md); 2 ms, not the kernel's least (1 ms): at 1 ms a board got only 70 % of its share
    # here (a quarter millisecond lost a period)
    "$python" -m edgefed.orchestration.board_speed shares "$STATE" "$cg"
    for n in $(seq 1 $(( ${#lines[@]} - 1 ))); do  # every sshd answering before the cluster is said to be up
        read -r host _ <<< "${lines[$n]}"
        answering "$n" "$host" "$SUBNET.$(( n + 1 ))" "${sshds[$((n - 1))]}"
    done
    # the quotas from the profiles' speeds, then measured with every board running at once (as a run loads
    # them: boards that share a core, this machine's own load) and rescaled until each is within 3 % of its
    # profile; a board that cannot be is named, and the cluster stays up as it is
    if [ "${EDGEFED_VIRTUAL_CALIBRATE:-1}" != 0 ]; then
        "$python" -m edgefed.orchestration.board_speed calibrate "$STATE" "$cg" || true
    fi
    while read -r n host address profile share link memory; do
        read -r _ _ load <<< "${lines[$n]}"
        echo "$address  $profile  $load  # $host: $(awk "BEGIN {printf \"%.0f\", $share * 100}") % of a core, $memory MB$([ "$link" != - ] && echo ", link $link Mbit/s")" >> "$virtual.tmp"
    done < "$STATE/boards"
    # MPI over the links: ranks of one machine would otherwise find each other's shared memory (MPICH's UCX
    # netmod does), and no cut or shaped link would touch them
    echo 'MPI_ARGS=${MPI_ARGS:-"-genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp"}' > "$virtual.env"
    # and pi-cluster.sh run calibrates the boards again before each run (this machine's speed drifts)
    [ "${EDGEFED_VIRTUAL_CALIBRATE:-1}" = 0 ] || echo "CALIBRATE=\${CALIBRATE:-\"$STATE $cg\"}" >> "$virtual.env"
    mv "$virtual.tmp" "$virtual"
    trap - EXIT
    say "up: $(( ${#lines[@]} - 1 )) boards on $SUBNET.0/24; board list $virtual"
}

[ $# -ge 1 ] || usage
[[ $NAME =~ ^[a-z][a-z0-9]{0,7}$ ]] || fail "EDGEFED_VIRTUAL_NAME must be 1 to 8 lower-case letters or digits, not '$NAME'"
[[ $SUBNET =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || fail "EDGEFED_VIRTUAL_SUBNET must be a private /24 as 10.X.Y, not '$SUBNET'"
verb=$1
shift
case "$verb" in
up)
    [ $# -eq 2 ] || usage
    up "$1" "$2"
    ;;
cut)
    [ $# -eq 3 ] || usage
    [ "$(id -u)" = 0 ] || fail "run as root"
    case "$3" in ''|*[!0-9.]*) fail "SECONDS must be a number of seconds, not $3" ;; esac
    n=$(board_index "$2")
    ip link set "$NAME-v$n" down
    sleep "$3"
    ip link set "$NAME-v$n" up
    ;;
stop)
    [ $# -eq 2 ] || usage
    [ "$(id -u)" = 0 ] || fail "run as root"
    n=$(board_index "$2")
    ip link set "$NAME-v$n" down
    kill_board "$n"
    ;;
start)
    [ $# -eq 2 ] || usage
    [ "$(id -u)" = 0 ] || fail "run as root"
    n=$(board_index "$2")
    read -r _ host address _ < <(awk -v n="$n" '$1 == n' "$STATE/boards")
    [ -z "$(cat "$(cgroup_root)/b$n/cgroup.procs" 2> /dev/null)" ] || fail "board $host is up already; stop it first (launch/virtual-cluster.sh stop VIRTUAL $host)"
    ip link set "$NAME-v$n" up
    answering "$n" "$host" "$address" "$(start_sshd "$n")"
    say "start: board $host ($address) is up again"
    ;;
down)
    [ $# -eq 1 ] || usage
    [ "$(id -u)" = 0 ] || fail "run as root"
    down
    rm -f "$1" "$1.tmp" "$1.env"
    ;;
*)
    usage
    ;;
esac
