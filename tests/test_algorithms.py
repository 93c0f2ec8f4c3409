"""The algorithm seam: an algorithm declared here, with a server vector, a report vector and a device
vector, runs through the registry, the engine, both transports, the MPI wire and the run log, with nothing
else told about it; and the registry is what the config is checked against."""

from dataclasses import dataclass

import numpy as np
import pytest

from edgefed import algorithms
from edgefed.algorithms.base import DELTA_X, DeviceVector, ServerState, ServerVector
from edgefed.algorithms.fedavg import FedAvg, server_update
from edgefed.config.schema import Config, LogConfig
from edgefed.errors import ConfigError, ResourceError
from edgefed.orchestration import run as runs
from edgefed.orchestration import budget
from edgefed.orchestration.header import log_layout
from edgefed.participation import schemes
from edgefed.runlog import Header, read_run
from conftest import config_with
from helpers import assert_same_logs, interrupted_then_resumed
from test_protocol import loopback_run


@dataclass(frozen=True)
class MomentumWithMemory(FedAvg):
    """Server momentum m <- beta m + step, x <- x + eta_g m, with step = sum_k p_k Delta_k, and v <- v + step;
    each device sums its own accepted updates into h_k and counts its accepted rounds in n_k (each sent as a
    report vector of its own, so the device applies them only on acceptance). Two vectors of each kind, and
    the server update names them out of declaration order."""

    beta: float = 0.5

    default_weighting = "uniform"
    server_vectors = (ServerVector("m", "toy/m", "server momentum after those rounds"),
                      ServerVector("v", "toy/v", "every applied step, summed"))
    device_vectors = (DeviceVector("h_clients", "toy/h_clients", "each device's accepted updates, summed", "delta_h",
                                   "the toy algorithm", "memories"),
                      DeviceVector("n_clients", "toy/n_clients", "each device's accepted rounds", "delta_n",
                                   "the toy algorithm", "counts"))
    report_vectors = ("delta_h", "delta_n")

    def client_update(self, model, data, task, out):
        steps = super().client_update(model, data, task, out)
        out["delta_h"][:] = out[DELTA_X]
        out["delta_n"][:] = 1
        return steps

    def server_update(self, state, reports):
        step = server_update(np.zeros_like(state.x), reports.device_ids, reports.vectors[DELTA_X], reports.coeffs, 1.0)
        m = (self.beta * state.vectors["m"] + step).astype(state.x.dtype)
        v = state.vectors["v"] + step
        return ServerState((state.x + reports.lr_global * m).astype(state.x.dtype), {"v": v, "m": m})

    def server_start(self, x0, member_rows):
        return {"m": np.zeros_like(x0), "v": np.zeros_like(x0)}

    def device_start(self, model, data, x):
        return {"h_clients": np.zeros_like(x), "n_clients": np.zeros_like(x)}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(algorithms.ALGORITHMS, "momentum-memory", MomentumWithMemory)


def toy_config(path, **extra):
    return config_with({"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64",
                        "train.algorithm": "momentum-memory", "train.clients_per_round": 3, "train.local_steps": 4,
                        "train.lr_local": 0.2, "train.lr_global": 0.9, "rounds": 6, "log.client_controls": True,
                        **extra})


def test_a_new_algorithm_follows_its_own_rule_through_every_layer(toy, tmp_path, quad_file):
    g = np.random.default_rng(4)
    A, b, x0 = g.uniform(0.5, 2.0, (5, 3)), g.normal(size=(5, 3)), g.normal(size=3)
    cfg = toy_config(quad_file(A, b, x0=x0))
    runs.run(cfg, tmp_path / "toy.h5")
    log = read_run(tmp_path / "toy.h5")
    # by hand: K exact gradient steps on f_k take y to b_k + (1 - lr a_k)^K (x - b_k)
    x, m, v, h, n = x0.copy(), np.zeros(3), np.zeros(3), np.zeros((5, 3)), np.zeros((5, 3))
    expect = {"trajectory/x": [x], "toy/m": [m], "toy/v": [v], "toy/h_clients": [h.copy()], "toy/n_clients": [n.copy()]}
    for selected in log["participation/selected"]:
        ids = np.flatnonzero(selected)
        deltas = b[ids] + (1 - 0.2 * A[ids]) ** 4 * (x - b[ids]) - x
        m = 0.5 * m + deltas.mean(axis=0)
        v = v + deltas.mean(axis=0)
        x = x + 0.9 * m
        h[ids] += deltas
        n[ids] += 1
        for name, value in (("trajectory/x", x), ("toy/m", m), ("toy/v", v), ("toy/h_clients", h.copy()),
                            ("toy/n_clients", n.copy())):
            expect[name].append(value)
    for name, values in expect.items():
        np.testing.assert_allclose(log[name], values, rtol=1e-12, atol=1e-14, err_msg=name)
    assert log["state/m"].shape == log["state/v"].shape == (2, 3) and log["state/n_clients"].shape == (5, 3)
    # under MPI (ranks as threads) the same bytes; stopped and resumed, the same log
    assert_same_logs(log, loopback_run(cfg, tmp_path / "mpi.h5", 3))
    assert_same_logs(*interrupted_then_resumed(cfg, tmp_path, 3))


def test_its_device_memory_is_sized_and_refused_by_its_own_names(toy, tmp_path, quad_file, monkeypatch):
    path = quad_file(np.ones((4, 2)), np.zeros((4, 2)))
    lines = []
    runs.run(toy_config(path, rounds=1), tmp_path / "r.h5", on_info=lines.append)
    assert "the toy algorithm memories and counts: 2 x 4 x 2 float64 = 128 B in memory" in lines[1]
    monkeypatch.setattr(budget.psutil, "virtual_memory", lambda: type("M", (), {"available": 10})())
    with pytest.raises(ResourceError, match="the toy algorithm's memories and counts need 128 B"):
        runs.run(toy_config(path, rounds=1), tmp_path / "s.h5")


def test_the_config_knows_what_the_registries_know(toy):
    assert config_with({"train.algorithm": "momentum-memory"}).train.weighting == "uniform"  # its default
    with pytest.raises(ConfigError, match=r"train.algorithm = 'scafold' is not known; did you mean 'scaffold'\?"):
        config_with({"train.algorithm": "scafold"})
    with pytest.raises(ConfigError, match="participation.scheme = 'D' is not known"):
        config_with({"participation.scheme": "D"})
    assert set(schemes.SCHEMES) == {"A", "B", "C", "fednova", "drop"}
    assert set(algorithms.ALGORITHMS) >= {"fedavg", "fedprox", "scaffold"}


def test_an_update_that_breaks_its_declarations_is_stopped(toy, tmp_path, quad_file, monkeypatch):
    """A server update that returns an undeclared vector (or drops one) would travel and resume wrongly."""
    honest = MomentumWithMemory.server_update
    monkeypatch.setattr(MomentumWithMemory, "server_update",
                        lambda self, state, reports: ServerState(honest(self, state, reports).x, {"m": state.x}))
    with pytest.raises(TypeError, match=r"MomentumWithMemory.server_update gave server vectors \['m'\], but the "
                                        r"algorithm declares \['m', 'v'\]"):
        runs.run(toy_config(quad_file(np.ones((4, 2)), np.zeros((4, 2))), rounds=2), tmp_path / "r.h5")


def _logging(client_controls: bool) -> Config:
    return Config(log=LogConfig(client_controls=client_controls))


def test_vector_names_the_log_keeps_for_itself_are_refused():
    for clash in (ServerVector("x", "toy/x", ""), ServerVector("m", "trajectory/x", "")):
        algorithm = MomentumWithMemory()
        object.__setattr__(algorithm, "server_vectors", (clash,))
        with pytest.raises(ValueError, match="are taken twice"):
            Header("", 0, 1, 4, 3, np.float32, np.ones(4), **log_layout(algorithm, _logging(True), 4, 3, np.float32))


def test_declarations_are_what_the_engine_reads():
    fedavg, scaffold = algorithms.FedAvg(), algorithms.Scaffold("I", "gradient")
    assert fedavg.reports == ("delta_x",) and not fedavg.server_vectors and not fedavg.device_vectors
    assert scaffold.reports == ("delta_x", "delta_c")
    assert [v.column for v in scaffold.server_vectors] == ["scaffold/c"]
    assert [(v.name, v.delta) for v in scaffold.device_vectors] == [("c_clients", "delta_c")]
    layout = log_layout(scaffold, _logging(True), 4, 3, np.float32)
    assert [c.path for c in layout["extra_columns"]] == ["scaffold/c", "scaffold/c_clients"]
    assert layout["slots"] == (("c", (3,), np.float32),) and layout["row_states"] == (("c_clients", (4, 3), np.float32),)
    assert [c.path for c in log_layout(scaffold, _logging(False), 4, 3, np.float32)["extra_columns"]] == ["scaffold/c"]
