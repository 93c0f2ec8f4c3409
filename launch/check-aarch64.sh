#!/usr/bin/env bash
# Check that edgefed installs and runs on 64-bit ARM (aarch64, e.g. a Raspberry Pi 4/5 on a 64-bit OS)
# from an x86_64 Debian/Ubuntu host, by running a Debian bookworm arm64 root file system under qemu-user
# emulation. Needs root (debootstrap, chroot, bind mounts).
#
#   sudo launch/check-aarch64.sh [ROOT]          # ROOT default /var/tmp/edgefed-arm64
#
# A first run took 39 minutes on 2 x86 cores (debootstrap 7, pip 3.5, cold compile 3, tests 24);
# later runs skip debootstrap and keep the venv.
#
# What it does, each phase timed and summarised at the end:
#   1. installs qemu-user-static, binfmt-support, debootstrap (apt) if missing and enables the aarch64
#      binfmt handler, so the kernel hands aarch64 ELF binaries to qemu-aarch64-static;
#   2. debootstraps bookworm arm64 into ROOT (skipped when ROOT/usr/bin/python3 exists: idempotent);
#      bookworm's python3 is 3.11, the version our wheels target;
#   3. copies a snapshot of the repo (git archive HEAD, so uncommitted edits are not tested) to
#      ROOT/srv/edgefed, keeping a venv from an earlier run;
#   4. inside the chroot (uname -m must say aarch64): venv, pip install -e '.[mpi,test]', versions,
#      the golden hashes of tests/golden.py (short runs of every model), the default experiment (5 rounds) in the simulator cold (compiling every kernel) and warm, the
#      same run under mpiexec -n 3, a byte comparison of the three run logs, then a pytest subset;
#   5. optionally (X86_COMPARE=1, the default) the same run natively on the host with the same snapshot,
#      compared with the aarch64 log: bit-identical or not, and how far apart the models are; and the
#      golden hashes computed on the host beside those made on aarch64.
#
# Environment knobs: ARM_TESTS (pytest arguments, default below), ARM_RANKS (3), ARM_ROUNDS (5),
# X86_COMPARE (1), HOST_PYTHON (step 5's, with edgefed's dependencies: the repo's .venv/bin/python, else
# python3), EDGEFED_REPO (the repo to
# snapshot), FRESH_VENV (0; 1 recreates the arm64 venv), GOLDEN_WRITE (0; 1 copies the golden hashes
# made on aarch64 into the repo: after a kernel change meant to change the bits, see tests/golden.py).
# Exit status: 0 when everything passed, 1 when a test, a run or a comparison failed.
set -euo pipefail

ROOT=${1:-/var/tmp/edgefed-arm64}
ROOT=$(realpath -m "$ROOT")
REPO=${EDGEFED_REPO:-$(cd "$(dirname "$0")/.." && pwd)}
RANKS=${ARM_RANKS:-3}
ROUNDS=${ARM_ROUNDS:-5}
X86_COMPARE=${X86_COMPARE:-1}
HOST_PYTHON=${HOST_PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}  # the repo's venv when it has one
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-}   # empty: debootstrap's default Debian mirror
# The pytest subset (pytest arguments, read by bash: quote what the shell must not split), chosen to
# finish in about 25 minutes emulated on 2 cores (measured: 24 min, 175 passed, 2 skipped). Left out: the CNN tests (-k 'not cnn'; McMahan's CNN is minutes per test natively, hours
# emulated) and test_edge's board-profiling tests, which time the emulator rather than edgefed; its
# warm-up test stays, since a Pi relies on `edgefed warmup`. Kept: the Numba kernels against the NumPy
# references and finite differences (test_kernels, test_images' MLP), FedAvg's and SCAFFOLD's math
# against hand computations and the papers' rules (test_fedavg, test_scaffold, test_flexible, and a
# test-only algorithm through every layer in test_algorithms), the MPI wire in one process (test_protocol), data and
# participation (test_synthetic, test_participation), config, CLI and run log incl. kill and resume
# (test_config, test_cli, test_runlog), and every non-CNN mpiexec test (test_mpi: the simulator's bytes
# under 2, 3 and 5 ranks, SCAFFOLD with traces, a raising rank, deadlines with a hung device, contention).
DEFAULT_TESTS="tests/test_kernels.py tests/test_fedavg.py tests/test_scaffold.py tests/test_synthetic.py
 tests/test_participation.py tests/test_config.py tests/test_cli.py tests/test_runlog.py tests/test_flexible.py
 tests/test_images.py tests/test_mpi.py tests/test_protocol.py tests/test_algorithms.py
 tests/test_edge.py::test_warmup_fills_the_cache_so_a_run_compiles_nothing
 -k 'not cnn'"
ARM_TESTS=${ARM_TESTS:-$DEFAULT_TESTS}
ARM_TESTS=${ARM_TESTS//$'\n'/ }   # one line: it is eval'ed inside the chroot
FRESH_VENV=${FRESH_VENV:-0}        # 1: recreate the venv (to time a first install); default keeps it
GOLDEN_WRITE=${GOLDEN_WRITE:-0}    # 1: copy the aarch64 golden hashes into the repo's tests/golden_hashes.json

[ "$(id -u)" = 0 ] || { echo "check-aarch64: run as root (debootstrap, chroot and mounts need it)" >&2; exit 2; }
[ "$(uname -m)" = aarch64 ] && echo "check-aarch64: note: host is already aarch64; no emulation involved"

TIMES=()      # "phase<TAB>seconds" lines for the summary
STATUS=0
phase_start() { PHASE=$1; T0=$EPOCHREALTIME; echo; echo "=== $PHASE"; }
phase_end() { TIMES+=("$(awk -v a="$T0" -v b="$EPOCHREALTIME" -v p="$PHASE" 'BEGIN { printf "%-44s %8.1f s", p, b - a }')"); }

# --- 1. emulator -------------------------------------------------------------------------------------
phase_start "host tools (apt) and binfmt"
need=()
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v update-binfmts >/dev/null || need+=(binfmt-support)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
# binfmt_misc is what lets the kernel run foreign binaries through qemu; in containers it is often not
# mounted. qemu-user-static registers its handler with the F (fix-binary) flag, so the chroot needs no
# copy of the emulator.
mountpoint -q /proc/sys/fs/binfmt_misc || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || update-binfmts --enable qemu-aarch64
grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 ||
    echo "check-aarch64: warning: qemu-aarch64 binfmt lacks the F flag; the chroot may not find the emulator" >&2
QEMU_VERSION=$(qemu-aarch64-static --version | head -1)
echo "$QEMU_VERSION"
phase_end

# --- 2. arm64 root file system ------------------------------------------------------------------------
if [ -x "$ROOT/usr/bin/python3" ]; then
    echo; echo "=== debootstrap: skipped, $ROOT already has python3"
else
    phase_start "debootstrap $SUITE arm64"
    mkdir -p "$ROOT"
    # minbase + what a venv and pip need; ca-certificates so pip can verify the registry.
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$ROOT" $MIRROR
    phase_end
fi

# --- mounts, undone on any exit -------------------------------------------------------------------------
MOUNTED=()
cleanup() {
    local m i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        m=${MOUNTED[i]}
        # processes of an aborted mpiexec may still hold /dev/shm for a moment: retry, then detach lazily
        umount -R "$m" 2>/dev/null || { sleep 3; umount -R "$m" 2>/dev/null; } || umount -lR "$m" 2>/dev/null ||
            echo "check-aarch64: could not unmount $m" >&2
    done
}
trap cleanup EXIT
bind() {  # bind(src, dest-inside-root, [ro]); first drops a mount left there by an earlier, killed run
    local dest=$ROOT$2
    mkdir -p "$dest"
    mountpoint -q "$dest" && umount -R "$dest"
    mount --rbind "$1" "$dest"
    mount --make-rslave "$dest"
    [ "${3:-}" = ro ] && mount -o remount,bind,ro "$dest"
    MOUNTED+=("$dest")
}
bind /proc /proc
bind /sys /sys
bind /dev /dev     # with /dev/shm: MPICH's shared-memory transport lives there

# --- pip's configuration: the host's CA bundle and index settings, so pip inside reaches the registry ----
# The host may sit behind a TLS-inspecting proxy whose CA is only in the host's bundle: install that
# bundle beside Debian's own and point pip (and Python's ssl) at it.
HOST_CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
cp "$HOST_CA" "$ROOT/etc/ssl/certs/host-ca-bundle.crt"
for f in /etc/pip.conf /etc/xdg/pip/pip.conf /etc/xdg/pip/constraints.txt "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf"; do
    [ -f "$f" ] && { mkdir -p "$ROOT$(dirname "$f")"; cp "$f" "$ROOT$f"; }
done
# Local wheel folders and file:// indexes named in pip's configuration or environment are bind-mounted
# read-only at the same path so the copied config stays valid (their x86 wheels are simply not picked
# for aarch64, but pure-Python wheels are, and anything else pip takes from the registry). A file://
# index's pages link to their files by relative paths (../../files/x.whl), so for an index folder
# .../simple the folder above it is mounted.
local_dirs=$( { pip3 config list 2>/dev/null || true; env | grep '^PIP_' || true; } |
    grep -oE "(file://)?/[A-Za-z0-9_.-][^' ]*" | sed -e 's|^file://||' -e 's|/simple/*$||' | sort -u)
for d in $local_dirs; do
    [ -d "$d" ] && bind "$d" "$d" ro
done
# Forward the PIP_* settings of this environment (find-links, timeouts, ...) into the chroot.
PIP_ENV=()
while IFS= read -r line; do PIP_ENV+=("$line"); done < <(env | grep '^PIP_' | grep -v '^PIP_CERT=' || true)
PIP_ENV+=(PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca-bundle.crt)

# --- 3. repo snapshot -----------------------------------------------------------------------------------
phase_start "repo snapshot (git archive HEAD)"
DEST=$ROOT/srv/edgefed
mkdir -p "$DEST"
# Fresh sources each run (also drops Numba's cache, so the first run below is a cold compile); the venv
# survives, its editable install points at this same path.
find "$DEST" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
[ "$FRESH_VENV" = 1 ] && rm -rf "$DEST/.venv"
git -C "$REPO" archive HEAD | tar -x -C "$DEST"
echo "snapshot of $(git -C "$REPO" rev-parse --short HEAD): $(git -C "$REPO" log -1 --format=%s HEAD)"
mkdir -p "$ROOT/tmp/edgefed-check"
rm -f "$ROOT"/tmp/edgefed-check/*
phase_end

# --- 4. inside the arm64 chroot ---------------------------------------------------------------------------
# The steps inside, as a file in the chroot; they append their timings to /tmp/edgefed-check/times.
cat > "$ROOT/tmp/edgefed-check/inside.sh" <<'INSIDE'
set -uo pipefail
cd /srv/edgefed
out=/tmp/edgefed-check
# t NAME CMD...: run CMD, append NAME, seconds and exit code to $out/times
t() { local name=$1 t0=$EPOCHREALTIME rc; shift; "$@"; rc=$?
      awk -v n="$name" -v a="$t0" -v b="$EPOCHREALTIME" -v rc=$rc "BEGIN { printf \"%s\t%.1f\t%d\n\", n, b - a, rc }" >> $out/times
      return $rc; }
echo "uname -m inside the chroot: $(uname -m)"
[ "$(uname -m)" = aarch64 ] || { echo "not aarch64: emulation is not in effect"; exit 3; }
python3 --version
grep PRETTY_NAME /etc/os-release

echo; echo "=== venv and pip install -e .[mpi,test]"
# pip notes every package a local file:// index lacks; those notes are dropped, the rest is kept as proof
# of which wheels (aarch64 ones) were installed.
install() { python3 -m venv .venv && .venv/bin/pip install --progress-bar off -e ".[mpi,test]" 2>&1 |
            { grep -v "^WARNING: Location .* is ignored: it is neither a file nor a directory" || true; }; }
if [ -x .venv/bin/python ]; then
    t "pip install -e .[mpi,test] (venv kept)" .venv/bin/pip install -q -e ".[mpi,test]" || exit 4
else
    t "venv and pip install -e .[mpi,test]" install || exit 4
fi
. .venv/bin/activate
echo; echo "=== versions"
python -c "import platform, sys; print(platform.machine(), platform.python_version(), sys.byteorder)"
pip list 2>/dev/null | grep -iE "^(numpy|numba|llvmlite|h5py|mpi4py|psutil|mpich|pytest|hypothesis|edgefed) "
python -c 'import llvmlite.binding as b; print("LLVM host CPU (what Numba compiles for):", b.get_host_cpu_name())' 

echo; echo "=== golden hashes: short float32 runs of every model (tests/golden.py), cold compile included"
t "golden hashes (6 short runs, cold)" python tests/golden.py --write $out/golden_hashes.json

echo; echo "=== cold run in the simulator (compiles and caches every kernel)"
t "simulator run, cold compile" python -m edgefed run --set rounds=$ROUNDS --out $out/arm-sim.h5 --force
echo; echo "=== the same run again, warm (kernels from the cache)"
t "simulator run, warm cache" python -m edgefed run --set rounds=$ROUNDS --out $out/arm-sim2.h5 --force

echo; echo "=== mpiexec -n $RANKS"
# The mpich wheel copies intra-node messages of 8 KB and more (MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD) with
# process_vm_readv (CMA), a system call qemu-user does not implement (errno 38, ENOSYS): without this,
# round 1's reports (one message per rank with its devices' updates) abort the run under emulation. A
# real arm64 kernel implements the call (as the x86 host does), so a Pi does not need it.
export MPIR_CVAR_CH4_CMA_ENABLE=0
t "mpiexec -n $RANKS run" mpiexec -n $RANKS python -m edgefed run --set rounds=$ROUNDS --out $out/arm-mpi.h5 --force

echo; echo "=== run logs compared byte for byte (tests/helpers.py: all datasets but the measured ones)"
PYTHONPATH=tests python - $out/arm-sim.h5 $out/arm-sim2.h5 $out/arm-mpi.h5 <<"PY"
import sys
from edgefed.runlog import read_run
from helpers import compared
logs = {p: compared(read_run(p)) for p in sys.argv[1:]}
ref_path, ref = sys.argv[1], logs[sys.argv[1]]
print("trajectory/x:", ref["trajectory/x"].shape, ref["trajectory/x"].dtype, "rounds", list(ref["trajectory/round"]))
bad = 0
for p, log in list(logs.items())[1:]:
    diff = sorted(k for k in ref.keys() | log.keys() if k not in log or k not in ref or ref[k].tobytes() != log[k].tobytes())
    same_x = ref["trajectory/x"].tobytes() == log["trajectory/x"].tobytes()
    print(f"{p} vs {ref_path}: {len(ref)} datasets, trajectory/x byte-identical: {same_x}, differing: {diff or 'none'}")
    bad += bool(diff)
sys.exit(1 if bad else 0)
PY
t "simulator vs mpiexec log comparison" test $? = 0

echo; echo "=== pytest subset"
echo "python -m pytest -q $ARM_TESTS"
t "pytest subset" eval "python -m pytest -q -p no:cacheprovider --durations=30 $ARM_TESTS 2>&1 | tee $out/pytest.log"
exit 0
INSIDE

# Run with a clean environment: only what the steps need, plus pip's settings.
set +e
chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    "${PIP_ENV[@]}" ARM_TESTS="$ARM_TESTS" RANKS="$RANKS" ROUNDS="$ROUNDS" /bin/bash /tmp/edgefed-check/inside.sh
rc=$?
set -e
[ $rc = 0 ] || STATUS=1
if [ -f "$ROOT/tmp/edgefed-check/times" ]; then
    while IFS=$'\t' read -r name secs prc; do
        TIMES+=("$(printf '%-44s %8.1f s%s' "$name" "$secs" "$([ "$prc" = 0 ] || echo "   (FAILED, exit $prc)")")")
        [ "$prc" = 0 ] || STATUS=1
    done < "$ROOT/tmp/edgefed-check/times"
fi

# --- 5. the same run natively on the host ---------------------------------------------------------------
if [ "$X86_COMPARE" = 1 ] && [ -f "$ROOT/tmp/edgefed-check/arm-sim.h5" ]; then
    phase_start "x86_64 host run and comparison"
    # The snapshot's sources with the host's numpy/numba/h5py; Numba's cache goes to a scratch folder so
    # the arm64 cache in the snapshot is left alone.
    x86_log=$ROOT/tmp/edgefed-check/x86-sim.h5
    x86_cache=$(mktemp -d)
    (cd "$DEST" && NUMBA_CACHE_DIR=$x86_cache PYTHONPATH=$DEST "$HOST_PYTHON" -m edgefed run --set rounds="$ROUNDS" --out "$x86_log" --force >/dev/null)
    echo "golden hashes, x86_64 beside aarch64:"
    (cd "$DEST" && NUMBA_CACHE_DIR=$x86_cache PYTHONPATH=$DEST "$HOST_PYTHON" tests/golden.py \
        --check "$ROOT/tmp/edgefed-check/golden_hashes.json") || STATUS=1
    if [ "$GOLDEN_WRITE" = 1 ]; then
        cp "$ROOT/tmp/edgefed-check/golden_hashes.json" "$REPO/tests/golden_hashes.json"
        echo "copied the aarch64 hashes to $REPO/tests/golden_hashes.json (commit them with the change that made them)"
    fi
    rm -rf "$x86_cache"
    (cd "$DEST" && PYTHONPATH=$DEST:$DEST/tests "$HOST_PYTHON" - "$ROOT/tmp/edgefed-check/arm-sim.h5" "$x86_log" <<'PY') || STATUS=1
import sys
import numpy as np, numba, h5py
from edgefed.runlog import read_run
from helpers import compared
print(f"host: numpy {np.__version__}, numba {numba.__version__}, h5py {h5py.__version__}")
arm, x86 = (compared(read_run(p)) for p in sys.argv[1:])
diff = sorted(k for k in arm if arm[k].tobytes() != x86[k].tobytes())
print(f"aarch64 vs x86_64: {len(arm)} datasets compared, differing:", diff or "none (bit-identical)")
for k in diff:
    a, b = arm[k].astype(np.float64), x86[k].astype(np.float64)
    ulp = np.abs(a - b) / np.spacing(np.abs(b).astype(arm[k].dtype)).astype(np.float64)
    print(f"  {k}: {int((a != b).sum())}/{a.size} values differ, max |diff| {np.abs(a - b).max():.3g}, max ULPs {np.nanmax(ulp):.0f}")
xa, xb = arm["trajectory/x"].astype(np.float64), x86["trajectory/x"].astype(np.float64)
for r, a, b in zip(arm["trajectory/round"], xa, xb):
    rel = np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)
    ulp = np.abs(a - b) / np.spacing(np.abs(b).astype(arm["trajectory/x"].dtype)).astype(np.float64)
    print(f"  round {r:3d}: max |x_arm - x_x86| / max|x| = {rel:.2e}, max ULPs {ulp.max():.0f}, elements differing {int((a != b).sum())}/{a.size}")
PY
    phase_end
fi

echo
echo "=== summary (host $(uname -m), $(nproc) cores, $QEMU_VERSION)"
printf '%s\n' "${TIMES[@]}"
[ -f "$ROOT/tmp/edgefed-check/pytest.log" ] && echo "pytest subset: $(tail -1 "$ROOT/tmp/edgefed-check/pytest.log")"
echo "logs in $ROOT/tmp/edgefed-check; exit status $STATUS"
exit $STATUS
