#!/usr/bin/env bash
# Run the default experiment under mpiexec on this machine, in deadline mode with devices under
# 0/30/50/70/90 % CPU competitors (launch/local-deadline.toml), then print the steps completed per level.
#
#   launch/local.sh [RANKS] [more edgefed run options, e.g. --restarts 5]
#
# RANKS (default 3): rank 0 coordinates, ranks 1..RANKS-1 host the devices round-robin, each pinned to a core.
# It runs under `edgefed launch`: a rank that dies or hangs costs a restart of the world, not the run.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ranks=${1:-3}
shift || true
out=runs/local-deadline-$(date +%Y%m%d-%H%M%S).h5
python=${PYTHON:-python}
mpiexec=${MPIEXEC:-$(dirname "$(command -v "$python")")/mpiexec}
[ -x "$mpiexec" ] || mpiexec=mpiexec
"$python" -m edgefed launch -n "$ranks" --mpiexec "$mpiexec" "$here/local-deadline.toml" --out "$out" "$@"
"$python" - "$out" <<'PY'
import sys
import numpy as np
from edgefed.runlog import read_run
log = read_run(sys.argv[1])
levels = [0.0, 0.3, 0.5, 0.7, 0.9]
steps, sel = log["participation/steps"], log["participation/selected"]
cpu = log["participation/cpu_percent"]
print("competitor load  mean steps done (of 500)  mean CPU share")
for i, load in enumerate(levels):
    cols = np.arange(i, steps.shape[1], len(levels))
    mask = sel[:, cols]
    print(f"{load:>14.0%}  {steps[:, cols][mask].mean():>24.1f}  {np.nanmean(cpu[:, cols][mask]):>13.0f} %")
PY
