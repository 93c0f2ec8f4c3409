"""A [submodel] round's server update two ways, timed side by side (interleaved, medians of 20): the
algorithm's whole update once a width keeping that width's coordinates (what participation/submodels.py
does), and each width's coordinates updated alone (the reports' columns gathered first). The sweep's CNN on
the digits (d = 188,810; widths 0.25, 0.5, 1), 8 reports of widths 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25.

    python benchmarks/submodel_update.py
"""
import dataclasses
import time
from pathlib import Path

import numpy as np

from edgefed.config import load_config
from edgefed.orchestration import run as runs
from edgefed.width_models import width_models
from edgefed.algorithms.fedavg import FedAvg
from edgefed.algorithms.base import DELTA_X, RoundReports, ServerState
from edgefed.participation.submodels import Submodels, server_update

DIGITS = Path(__file__).resolve().parents[1] / "examples" / "data" / "digits.npz"
cfg = load_config(None, ['data.kind="arrays"', f'data.path="{DIGITS}"', "data.clients=16", 'model.kind="cnn"',
                         "train.clients_per_round=8", "train.batch_size=16", 'submodel.method="heterofl"'])
problem, model = runs.problem_and_model(cfg)
wm = width_models(cfg, problem, model)
sub = Submodels("heterofl", wm.widths, wm.positions, np.ones(16))
d, S, g = model.n_trainable, 8, np.random.default_rng(0)
widths = np.array([1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25])
deltas = np.zeros((S, d), np.float32)
for k, w in enumerate(widths):
    deltas[k, wm.positions[w]] = g.normal(size=wm.positions[w].size)
coeffs = g.random((3, S)); coeffs[1:, widths < 0.5] = 0; coeffs[2, widths < 1.0] = 0
state = ServerState(g.normal(size=d).astype(np.float32))
reports = RoundReports(np.arange(S), {DELTA_X: deltas}, coeffs[0], np.ones(S, bool), 1.0, 16)

def whole_each():
    x = state.x.copy()
    for row, coords in zip(coeffs, sub.levels):
        x[coords] = FedAvg().server_update(state, dataclasses.replace(reports, coeffs=row)).x[coords]
    return x

def alone():
    x = state.x.copy()
    for row, coords in zip(coeffs, sub.levels):
        part = dataclasses.replace(reports, coeffs=row, vectors={DELTA_X: deltas[:, coords]})
        x[coords] = FedAvg().server_update(ServerState(state.x[coords]), part).x
    return x


used = server_update(FedAvg(), state, reports, coeffs, sub.levels).x
assert whole_each().tobytes() == alone().tobytes() == used.tobytes()
times = {"a whole update a width": [], "each width's coordinates alone": []}
for _ in range(20):
    for name, f in zip(times, (whole_each, alone)):
        t = time.perf_counter(); f(); times[name].append(time.perf_counter() - t)
print({k: f"{1e3 * np.median(v):.1f} ms" for k, v in times.items()}, "same bits")
