#!/usr/bin/env bash
# edgefed across a cluster of boards over SSH: the coordinator on the head node, one device rank per board.
#
#   launch/pi-cluster.sh check   BOARDS            # SSH, Python, edgefed and MPI on every board; one MPI hello
#   launch/pi-cluster.sh warmup  BOARDS            # compile every float32 kernel into each board's cache
#   launch/pi-cluster.sh profile BOARDS            # measure every board -> hw_profiles/HOST.toml on the head
#   launch/pi-cluster.sh run     BOARDS CONFIG [edgefed launch/run options...]   # restarts without lost boards
#   launch/pi-cluster.sh trace   BOARDS OUT [edgefed trace record options...]    # one trace per board
#   launch/pi-cluster.sh data    BOARDS CONFIG [FOLDER]  # each board its shard of the config's data, in FOLDER
#
# `data` makes each device rank's shard of the run's data on the head (edgefed data shard: the rows of the
# devices that rank hosts) and copies it over SSH into FOLDER on its board (the same path on every board;
# default: shards/CONFIG-NAME beside the venv); then `run BOARDS CONFIG --set data.shards=FOLDER` reads them.
# BOARDS is a board list like launch/hostfile.example (host, profile, contention per line). `run` passes each
# board's profile as [device] boards and its load as [device] contention (a competitor beside every device
# the board hosts), so a config with `deadline_s = "auto"` gets per-board deadlines.
#
# Environment:
#   VENV     the virtualenv, at the same path on every board (default: this checkout's .venv)
#   MPI      openmpi | mpich for check and profile (default: what `mpirun --version` says; run: edgefed launch detects it)
#   MPIRUN   the launcher (default: $VENV/bin/mpiexec if the pip mpich wheel is there, else mpirun)
#   MPI_ARGS extra launcher flags, e.g. "--mca btl_tcp_if_include eth0" (Open MPI) or "-iface eth0" (MPICH)
#   DRY_RUN  1: print the launch command instead of running it
#   DRIFT_CHECK  0: `run` does not first measure every board at once against its profile (a warning for each
#            board more than 5 % off: its deadlines and predictions would be off; a virtual cluster's
#            BOARDS.env names its CALIBRATE="STATE CGROUP": its boards are calibrated again instead)
# A file BOARDS.env beside the board list, when there is one, is read first: the cluster's own settings of the
# above (the environment given wins). launch/virtual-cluster.sh writes one: MPI over TCP, since boards on one
# machine would otherwise talk through its shared memory and no link between them would matter.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
verb=$1 boards=$2
shift 2
[ -f "$boards" ] || { echo "pi-cluster.sh: board list $boards not found (see launch/hostfile.example)" >&2; exit 2; }

if [ -f "$boards.env" ]; then
    # shellcheck disable=SC1090  # the cluster's settings, written beside its board list
    . "$boards.env"
fi
venv=${VENV:-$(cd "$here/.." && pwd)/.venv}
python="$venv/bin/python"
if [ -z "${MPIRUN:-}" ]; then
    if [ -x "$venv/bin/mpiexec" ]; then MPIRUN="$venv/bin/mpiexec"; else MPIRUN=mpirun; fi
fi
if [ -z "${MPI:-}" ]; then
    if "$MPIRUN" --version 2>&1 | grep -qi "open mpi\|open-mpi\|openrte"; then MPI=openmpi; else MPI=mpich; fi
fi
case "$MPI" in openmpi|mpich) ;; *) echo "pi-cluster.sh: MPI=$MPI; use openmpi or mpich" >&2; exit 2 ;; esac

# Parse the board list: skip comments and blank lines; line 1 is the head node.
hosts=() profiles=() loads=()
while read -r host role load _ || [ -n "${host:-}" ]; do  # also a last line without a newline
    host=${host%$'\r'} role=${role%$'\r'} load=${load%$'\r'}  # a board list saved on Windows
    case "$host" in ''|'#'*) continue ;; esac
    hosts+=("$host")
    if [ ${#hosts[@]} -gt 1 ]; then
        [ "$role" != "" ] && [ "$role" != coordinator ] || {
            echo "pi-cluster.sh: $boards: board $host needs a hardware profile (e.g. pi4b)" >&2; exit 2; }
        profiles+=("$role")
        loads+=("${load:-0.0}")
    fi
done < "$boards"
n_boards=$(( ${#hosts[@]} - 1 ))
[ "$n_boards" -ge 1 ] || { echo "pi-cluster.sh: $boards lists no boards after the head node" >&2; exit 2; }

# One slot per machine, in order, so rank r runs on line r + 1 of the board list.
mpi_hosts=$(mktemp)
trap 'rm -f "$mpi_hosts"' EXIT
for host in "${hosts[@]}"; do
    if [ "$MPI" = openmpi ]; then echo "$host slots=1"; else echo "$host:1"; fi
done > "$mpi_hosts"
if [ "$MPI" = openmpi ]; then
    launch=("$MPIRUN" --hostfile "$mpi_hosts" --map-by slot -np "$(( n_boards + 1 ))")
else
    launch=("$MPIRUN" -f "$mpi_hosts" -n "$(( n_boards + 1 ))")
fi
# shellcheck disable=SC2206  # MPI_ARGS is a list of flags
launch+=(${MPI_ARGS:-})

run() {
    if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

case "$verb" in
check)
    for host in "${hosts[@]:1}"; do
        run ssh -o BatchMode=yes "$host" "$python" -c "'import platform, edgefed, mpi4py; \
print(platform.node(), platform.machine(), \"edgefed\", edgefed.__version__, \"mpi4py\", mpi4py.__version__)'"
    done
    # one write per line (print writes the newline apart, unbuffered), so the ranks' lines do not run together
    run "${launch[@]}" "$python" -c "from mpi4py import MPI; import platform, sys; \
c = MPI.COMM_WORLD; sys.stdout.write(f'rank {c.Get_rank()} of {c.Get_size()} on {platform.node()}\n'); sys.stdout.flush()"
    ;;
warmup)
    run "$python" -m edgefed warmup --dtypes float32  # the head is this machine (it needs no sshd of its own)
    for host in "${hosts[@]:1}"; do
        run ssh -o BatchMode=yes "$host" "$python" -m edgefed warmup --dtypes float32
    done
    ;;
profile)
    mkdir -p "$here/../hw_profiles"
    run "${launch[@]}" "$python" -m edgefed profile --out "$here/../hw_profiles/{host}.toml" --force "$@"
    ;;
run)
    [ $# -ge 1 ] || usage
    config=$1
    shift
    if [ "${DRIFT_CHECK:-1}" != 0 ] && [ "${DRY_RUN:-0}" != 1 ]; then
        if [ -n "${CALIBRATE:-}" ]; then  # a virtual cluster's boards: brought back to their profiles
            # shellcheck disable=SC2086  # CALIBRATE is the cluster's state folder and cgroup
            "$python" -m edgefed.orchestration.board_speed calibrate $CALIBRATE || true
        else
            "$python" -m edgefed.orchestration.board_speed drift "$boards" || true
        fi
    fi
    # edgefed launch reads the board list itself: each board's profile as [device] boards, its load as
    # [device] contention; when the world dies it drops the boards that no longer answer and resumes
    run "$python" -m edgefed launch --boards "$boards" --mpiexec "$MPIRUN" --mpiexec-args "${MPI_ARGS:-}" "$config" "$@"
    ;;
trace)
    [ $# -ge 1 ] || usage
    out=$1
    shift
    # one device per board, named by the board's own host name, beside its board's load; written on the head
    names=()
    for host in "${hosts[@]:1}"; do
        names+=("$(ssh -o BatchMode=yes "$host" hostname)") || {
            echo "pi-cluster.sh: board $host does not answer over SSH (launch/pi-cluster.sh check BOARDS)" >&2; exit 2; }
    done
    names=$(IFS=,; echo "${names[*]}") contention=$(IFS=,; echo "${loads[*]}")
    run "${launch[@]}" "$python" -m edgefed trace record --out "$out" --names "$names" --contention "$contention" "$@"
    ;;
data)
    [ $# -ge 1 ] || usage
    config=$1
    dest=${2:-$(dirname "$venv")/shards/$(basename "$config" .toml)}
    case "$dest" in /*) ;; *) echo "pi-cluster.sh: FOLDER $dest must be an absolute path (the same on every board)" >&2; exit 2 ;; esac
    made=$(mktemp -d)
    trap 'rm -rf "$mpi_hosts" "$made"' EXIT
    run "$python" -m edgefed data shard "$config" --boards "$boards" --out "$made" --force
    for r in $(seq 1 "$n_boards"); do  # rank r runs on line r + 1: hosts[r]
        if [ "${DRY_RUN:-0}" = 1 ]; then
            printf '%q ' ssh -o BatchMode=yes "${hosts[$r]}" "cat > '$dest/rank-$r.h5'"; echo "< $made/rank-$r.h5"; continue
        fi
        run ssh -o BatchMode=yes "${hosts[$r]}" "mkdir -p '$dest' && cat > '$dest/rank-$r.h5.tmp' && mv '$dest/rank-$r.h5.tmp' '$dest/rank-$r.h5'" \
            < "$made/rank-$r.h5" || { echo "pi-cluster.sh: could not copy rank $r's shard to ${hosts[$r]}" >&2; exit 2; }
    done
    echo "each board holds its shard in $dest; run it with: launch/pi-cluster.sh run $boards $config --set data.shards=$dest"
    ;;
*)
    usage
    ;;
esac
