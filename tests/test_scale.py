"""Large federations (issue 30): the metrics on a fixed sample of devices ([log] eval_devices)."""

import math

import numpy as np
import pytest

from edgefed.errors import ConfigError
from edgefed.orchestration import run as runs
from edgefed.orchestration import budget
from edgefed.participation.sampling import evaluation_sample
from edgefed.rng import Purpose, generator
from edgefed.runlog import open_run, read_run
from conftest import config_with
from helpers import assert_same_logs
from test_protocol import loopback_run

N, D = 12, 3


def test_the_evaluation_sample_is_one_uniform_draw_of_its_own_stream():
    sample = evaluation_sample(7, 1000, 50)
    assert sample.tolist() == sorted(generator(7, Purpose.EVALUATION_SAMPLE).choice(1000, 50, replace=False))
    assert evaluation_sample(7, 1000, 50).tolist() == sample.tolist() and evaluation_sample(8, 1000, 50).tolist() != sample.tolist()
    assert evaluation_sample(7, 1000, None) is None and evaluation_sample(7, 1000, 1000) is None  # every device


def test_metrics_on_a_sample_are_its_devices_weighted_as_the_objective_by_hand(tmp_path, quad_file):
    g = np.random.default_rng(2)
    A, b, n = g.uniform(0.5, 2.0, (N, D)), g.normal(size=(N, D)), g.integers(1, 9, N)
    x0 = g.normal(size=D)
    base = {"data.kind": "quadratic", "data.path": str(quad_file(A, b, n=n, x0=x0)), "model.dtype": "float64",
            "rounds": 3, "train.clients_per_round": 4, "train.local_steps": 2, "train.weighting": "count_global",
            "log.eval_devices": 5}
    runs.run(config_with(base), tmp_path / "s.h5")
    log = read_run(tmp_path / "s.h5")
    sample = evaluation_sample(0, N, 5)
    w = n[sample] / n[sample].sum()  # the objective's n_k / n, renormalized over the sample
    for r in range(4):
        x = log["trajectory/x"][r]
        losses = 0.5 * (A[sample] * (x - b[sample]) ** 2).sum(axis=1)
        assert log["metrics/train_loss"][r] == pytest.approx(math.fsum(w * losses), rel=1e-12)
    with open_run(tmp_path / "s.h5") as f:
        assert f.attrs["eval_devices"] == 5
        assert f["metrics/train_loss"].attrs["evaluated_on"].startswith("a fixed sample of 5 of the 12 devices")
    assert_same_logs(log, loopback_run(config_with(base), tmp_path / "mpi.h5", 3))
    with pytest.raises(ConfigError, match=r"log.eval_devices = 13 exceeds the 12 devices"):
        runs.run(config_with({**base, "log.eval_devices": 13}), tmp_path / "big.h5")
    assert not (tmp_path / "big.h5").exists()
    with pytest.raises(ConfigError, match=r"log.eval_devices = 0 must be positive"):
        config_with({"log.eval_devices": 0})


def test_the_data_cache_keeps_its_bound_and_a_small_one_writes_the_same_log(tmp_path):
    from edgefed.orchestration.run import problem_and_model
    from edgefed.runtime.device_cache import DeviceCache

    small = {"data.clients": 40, "rounds": 3, "train.clients_per_round": 10, "train.local_steps": 3}
    cfg = config_with(small)
    problem, _ = problem_and_model(cfg)
    one = problem.device(0)
    size = sum(v.nbytes for v in vars(one).values())
    cache = DeviceCache(problem.device, budget=3.5 * size)
    cache(7)
    assert not cache._data  # built once: not kept (in a large federation most devices are drawn once)
    evaluated = DeviceCache(problem.device, budget=3.5 * size, keep=np.array([2, 5]))
    assert evaluated(5) is evaluated(5) and evaluated(3) is not evaluated(3)  # kept from the first build
    with evaluated.held([8, 9]):  # a round's: kept while it runs, let go after as built once
        assert evaluated(8) is evaluated(8)
    assert 8 not in evaluated._data and evaluated(8) is evaluated(8)  # (the next build is its second)
    for k in range(40):
        cache(k)
        assert cache(k) is cache(k)  # kept from the second build on
        assert cache.nbytes <= 3.5 * size or len(cache._data) == 1  # (one device larger than the bound stays)
    assert len(cache._data) <= 5 and list(cache._data)[-1] == 39  # the most recent kept
    assert cache(39) is cache(39) and np.array_equal(cache(0).X_train, one.X_train)  # built again, the same
    runs.run(cfg, tmp_path / "big.h5")
    runs.run(config_with({**small, "data.cache_mb": 0.001}), tmp_path / "small.h5")  # a device or two kept
    assert_same_logs(read_run(tmp_path / "big.h5"), read_run(tmp_path / "small.h5"))


def test_a_large_generated_federation_counts_labels_as_it_builds_devices_and_resumes_them(tmp_path, monkeypatch):
    from edgefed.problems import synthetic
    from helpers import interrupted_then_resumed

    monkeypatch.setattr(synthetic, "EAGER_LABELS_UP_TO", 10)  # 40 devices are "large" here
    cfg = config_with({"data.clients": 40, "rounds": 4, "train.clients_per_round": 5, "train.local_steps": 2,
                       "log.eval_devices": 6})
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 2)
    assert_same_logs(whole, resumed)
    counts, selected = whole["devices/label_counts"], whole["participation/selected"].any(axis=0)
    assert (counts[~selected] == -1).all() and (counts[selected] >= 0).all()  # the sample alone is not counted
    problem = synthetic.SyntheticProblem(cfg.data, cfg.seed, np.float32)
    for k in np.flatnonzero(selected):
        assert counts[k].tolist() == np.bincount(problem.device(int(k)).y_train, minlength=10).tolist()
    assert_same_logs(whole, loopback_run(cfg, tmp_path / "mpi.h5", 3))


def test_a_run_too_large_for_its_address_space_is_refused_in_one_line_before_building_anything(tmp_path):
    import resource
    import subprocess
    import sys

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2 ** 30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    done = subprocess.run([sys.executable, "-m", "edgefed", "run", "--set", "data.clients=10000000", "--out",
                           str(tmp_path / "r.h5")], capture_output=True, text=True, timeout=120, preexec_fn=limited)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("edgefed: error: this run needs about ") and "10,000,000 devices' bookkeeping" in line
    assert "the address-space limit is" in line and "devices would fit in this process" in line
    assert list(tmp_path.iterdir()) == []  # the stub removed


def test_a_large_federations_rows_are_deflated_and_read_the_same(tmp_path, monkeypatch):
    import h5py

    from edgefed import runlog

    cfg = config_with({"data.clients": 12, "rounds": 2, "train.clients_per_round": 4, "train.local_steps": 2})
    runs.run(cfg, tmp_path / "plain.h5")
    monkeypatch.setattr(runlog.schema, "COMPRESS_FROM", 12)
    runs.run(cfg, tmp_path / "deflated.h5")
    with h5py.File(tmp_path / "deflated.h5") as f, h5py.File(tmp_path / "plain.h5") as g:
        assert f["participation/selected"].compression == "gzip" and g["participation/selected"].compression is None
        assert f["metrics/train_loss"].compression is None  # (R,) and (R, d) rows stay as they were
    assert_same_logs(read_run(tmp_path / "plain.h5"), read_run(tmp_path / "deflated.h5"))


def test_a_large_federations_rows_hold_only_the_rounds_devices_and_read_the_same(tmp_path, monkeypatch):
    """From SPARSE_FROM devices a round's (N,) rows are chunked in pieces and only the values other than the
    column's fill are written: HDF5 allocates the chunks of the round's devices alone, and every value reads
    as a whole row's would (an arrival's inactive rounds too: active's fill is true)."""
    import h5py

    from edgefed import runlog

    cfg = config_with({"data.clients": 200, "data.samples": 30, "rounds": 3, "train.clients_per_round": 4,
                       "train.local_steps": 2, "log.eval_devices": 10,
                       "dynamics.arrive": [{"device": 7, "round": 2}]})
    runs.run(cfg, tmp_path / "whole.h5")
    monkeypatch.setattr(runlog.schema, "SPARSE_FROM", 200)
    monkeypatch.setattr(runlog.schema, "SPARSE_CHUNK", 8)
    runs.run(cfg, tmp_path / "sparse.h5")
    assert_same_logs(read_run(tmp_path / "whole.h5"), read_run(tmp_path / "sparse.h5"))
    with h5py.File(tmp_path / "sparse.h5") as f:
        assert f["participation/steps"].chunks == (1, 8)
        assert f["participation/steps"].id.get_num_chunks() <= 3 * 4  # a chunk for each device a round, at most
        assert f["participation/active"].id.get_num_chunks() == 1  # device 7 before it arrived: its chunk only
        assert f["participation/cpu_percent"].id.get_num_chunks() <= 3 * 4
    # a resume reads each round's written values, never R x N of them, and continues as the whole run went
    from helpers import run_until

    point = run_until(cfg, tmp_path / "part.h5", 2)
    steps, active = point.logged["participation/steps"], point.logged["participation/active"]
    assert isinstance(steps, runlog.SparseRounds) and steps.shape == (2, 200)
    assert [a.tolist() for a in active.ids] == [[7], []]  # device 7 arrives in round 2
    assert (steps.at(0, steps.ids[0]) > 0).all() and steps.at(0, [7]).tolist() == [0]
    runs.run(cfg, tmp_path / "part.h5", resume_point=point)
    assert_same_logs(read_run(tmp_path / "whole.h5"), read_run(tmp_path / "part.h5"))
    # FedBuff resumes from its stored models, whose (d,) rows are as long as a large federation's (d = 610)
    fedbuff = config_with({"data.clients": 200, "data.samples": 30, "rounds": 4, "train.local_steps": 2,
                           "log.eval_devices": 10, "participation.mode": "async", "device.profile": "pi4b",
                           "async.concurrency": 4, "async.buffer": 2})
    runs.run(fedbuff, tmp_path / "fedbuff.h5")
    point = run_until(fedbuff, tmp_path / "fedbuff-part.h5", 2)
    assert isinstance(point.logged["trajectory/x"], np.ndarray)
    runs.run(fedbuff, tmp_path / "fedbuff-part.h5", resume_point=point)
    assert_same_logs(read_run(tmp_path / "fedbuff.h5"), read_run(tmp_path / "fedbuff-part.h5"))


def test_a_file_backed_federation_with_a_tiny_cache_writes_the_same_log_on_ranks_too(tmp_path):
    from test_datasets import arrays_file

    path, _ = arrays_file(tmp_path, "data.npz")
    base = {"data.kind": "arrays", "data.path": str(path), "data.clients": 4, "model.kind": "logreg",
            "train.clients_per_round": 2, "rounds": 3, "train.local_steps": 2}
    runs.run(config_with(base), tmp_path / "big.h5")
    tiny = config_with({**base, "data.cache_mb": 1e-6})  # every device built again each time it is needed
    runs.run(tiny, tmp_path / "tiny.h5")
    whole = read_run(tmp_path / "big.h5")
    assert_same_logs(whole, read_run(tmp_path / "tiny.h5"))
    assert_same_logs(whole, loopback_run(tiny, tmp_path / "mpi.h5", 3))


def test_the_data_cache_builds_a_device_once_when_lanes_ask_for_it_at_once():
    import threading
    import time

    from edgefed.runtime.device_cache import DeviceCache

    built, inside = [], threading.Lock()

    def build(k):
        assert inside.acquire(blocking=False), "built twice at once"  # a pool's build is not safe twice
        try:
            time.sleep(0.05)
            built.append(k)
            return type("D", (), {"X": np.zeros(10)})()
        finally:
            inside.release()

    cache = DeviceCache(build, budget=1e9)
    out = []
    threads = [threading.Thread(target=lambda: out.append(cache(3))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [3] and len({id(d) for d in out}) == 1


def test_sparse_device_state_holds_only_touched_rows_and_resumes_exactly_on_ranks_too(tmp_path):
    """SCAFFOLD's c_k (zero start) and error feedback's residuals over 300 devices, 3 a round: the log's
    /state keeps a row only for a device a report changed, a resume restores exactly those (on ranks too)."""
    import h5py

    from edgefed.algorithms.base import nonzero_rows
    from edgefed.runlog.rows import _nonzero_blocks, stored_rows
    from helpers import run_until

    cfg = config_with({"data.clients": 300, "train.clients_per_round": 3, "train.algorithm": "scaffold",
                       "rounds": 5, "train.local_steps": 3, "compress.uplink": "int8", "compress.error_feedback": True})
    runs.run(cfg, tmp_path / "whole.h5")
    whole = read_run(tmp_path / "whole.h5")
    reported = np.flatnonzero((whole["participation/coeff"] != 0).any(axis=0))
    assert 3 < reported.size <= 15
    d = whole["trajectory/x"].shape[1]
    with h5py.File(tmp_path / "whole.h5", "r") as f:
        for name in ("c_clients", "residual_delta_x", "residual_delta_c"):
            assert f[f"state/{name}"].shape == (300, d)
            assert f[f"state/{name}"].id.get_num_chunks() == reported.size, name  # a chunk a touched row
            found, scanned = stored_rows(f[f"state/{name}"]), _nonzero_blocks(f[f"state/{name}"], 64)
            assert found.ids.tolist() == scanned.ids.tolist() and found.rows.tobytes() == scanned.rows.tobytes()
            assert found.ids.size and nonzero_rows(found.rows).all()  # (the scan: where HDF5 cannot list chunks)
    point = run_until(cfg, tmp_path / "part.h5", 3)
    held = point.state["c_clients"]
    touched = np.flatnonzero((whole["participation/coeff"][:3] != 0).any(axis=0))
    np.testing.assert_array_equal(held.ids, touched)
    assert held.rows.shape == (touched.size, d) and held.n == 300
    assert_same_logs(whole, loopback_run(cfg, tmp_path / "part.h5", 3, resume_point=point))
    point = run_until(cfg, tmp_path / "early.h5", 0)  # stopped before any report: no row held anywhere
    assert point.state["c_clients"].ids.size == point.state["residual_delta_x"].ids.size == 0
    runs.run(cfg, tmp_path / "early.h5", resume_point=point)
    assert_same_logs(whole, read_run(tmp_path / "early.h5"))


def test_a_device_rank_counts_only_the_vectors_its_devices_can_touch(monkeypatch):
    """SCAFFOLD (zero start) with error feedback: a rank hosting 500 of 1,000 devices, 10 a round for 5
    rounds, holds at most 50 controls and 2 x 50 residuals, whatever it hosts."""
    from edgefed.algorithms import build_algorithm
    from edgefed.errors import ResourceError

    cfg = config_with({"data.clients": 1000, "train.clients_per_round": 10, "rounds": 5, "train.algorithm": "scaffold",
                       "compress.uplink": "int8", "compress.error_feedback": True, "data.cache_mb": 1e-6})
    problem, model = runs.problem_and_model(cfg)
    rows = 150 * model.n_trainable * 4  # float32
    lanes = budget.model_bytes(cfg, build_algorithm(cfg), problem, model, 1, 500, distributed=True)
    data = budget.data_held(cfg, problem, np.arange(0, 1000, 2))  # (the one device a tiny cache still keeps)
    runtime = budget.psutil.Process().memory_info().rss + budget.KERNEL_BYTES + 500 * budget.RANK_DEVICE_BYTES + lanes + data
    monkeypatch.setattr(budget, "memory_limit", lambda: (runtime + rows + 2 ** 20, "the memory available"))
    budget.check_rank_memory(cfg, build_algorithm(cfg), problem, model, np.arange(0, 1000, 2), 1)  # fits
    monkeypatch.setattr(budget, "memory_limit", lambda: (runtime + rows - 2 ** 20, "the memory available"))
    with pytest.raises(ResourceError, match="its devices' vectors"):
        budget.check_rank_memory(cfg, build_algorithm(cfg), problem, model, np.arange(0, 1000, 2), 1)


def test_a_device_rank_draws_its_own_devices_sizes_alone():
    """A device rank of a large federation holds no array of every device: its round-robin share is computed
    where it runs, and a generated problem draws the sizes of the devices it hosts alone, the same ones."""
    from edgefed.problems.synthetic import SyntheticProblem
    from edgefed.runtime.mpi.placement import device_owners, round_robin_devices

    for rank in (1, 2, 3):
        assert round_robin_devices(rank, 11, 4).tolist() == np.flatnonzero(device_owners(11, 4) == rank).tolist()
    cfg = config_with({"data.clients": 50})
    whole = SyntheticProblem(cfg.data, cfg.seed, np.dtype(np.float32))
    rank = SyntheticProblem(cfg.data, cfg.seed, np.dtype(np.float32))
    own = round_robin_devices(2, 50, 3)
    rank.host(own)
    assert np.array_equal(rank.device_bytes(own), whole.device_bytes()[own])
    for k in (own[0], own[-1], 3):  # (3 is another rank's: drawn alone)
        a, b = rank.device(int(k)), whole.device(int(k))
        assert np.array_equal(a.X_train, b.X_train) and np.array_equal(a.y_test, b.y_test)
    assert rank.largest_train() == whole.n_train.max()  # (what sizes the model's workspaces on every rank)
    assert rank._all is None  # nothing held every device's size


def test_a_rounds_elapsed_time_holds_its_writes_to_the_log(tmp_path, monkeypatch):
    """round_elapsed_s is the whole round: the resume state it stages (slowed here) is inside it."""
    import time

    from edgefed.runlog.writer import RunLogWriter

    staged = RunLogWriter.stage

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return staged(self, *args, **kwargs)

    monkeypatch.setattr(RunLogWriter, "stage", slow)
    runs.run(config_with({"data.clients": 8, "rounds": 2, "train.clients_per_round": 2, "train.local_steps": 2}),
             tmp_path / "r.h5")
    assert (read_run(tmp_path / "r.h5")["metrics/round_elapsed_s"][1:] >= 0.05).all()


def test_a_huge_size_draw_is_capped_not_wrapped(monkeypatch):
    """A draw past 2^63 samples (a Pareto tail at 10^8 devices) is capped as a float: an int64 cast first
    would wrap it negative."""
    from types import SimpleNamespace

    from edgefed.problems import synthetic

    def huge(entropy, ids, kind, loc, scale, out, done, pool, words):
        out[:], done[:] = 1e300, True

    monkeypatch.setattr(synthetic, "first_draws", huge)
    ids = np.arange(3)
    pareto = SimpleNamespace(samples="pareto", samples_min=50, samples_max=None)
    assert synthetic.total_samples(pareto, 0, ids).tolist() == [synthetic.PARETO_DEFAULT_MAX] * 3
    lognormal = SimpleNamespace(samples="lognormal", samples_min=None, samples_max=None)
    assert (synthetic.total_samples(lognormal, 0, ids) > 0).all()
    assert synthetic.total_samples(SimpleNamespace(**{**vars(lognormal), "samples_max": 60}), 0, ids).tolist() == [60] * 3
