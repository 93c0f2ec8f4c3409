"""The run log: schema of docs/design.md 3.4, determinism, readers during a run, resume after a kill."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed.orchestration import run as runs
from edgefed.orchestration.resume import resolve_config
from edgefed.runlog import open_run, read_run
from helpers import assert_same_logs, compared, interrupted_then_resumed, run_until

SMALL = {"rounds": 12, "data.clients": 8, "train.clients_per_round": 3, "train.local_steps": 4,
         "data.samples": "pareto", "log.every": 5, "log.eval_every": 4}


def test_schema_shapes_types_and_attributes(run_experiment):
    log = run_experiment(SMALL)
    R, N, d = 12, 8, 610
    attrs = log["attrs"]
    assert attrs["format"] == "edgefed-run" and attrs["format_version"] == 1 and attrs["status"] == "complete"
    assert attrs["seed"] == 0 and attrs["edgefed_version"]
    cfg = config_mod.config_from_dict(config_mod.parse_toml(attrs["config"]))
    assert cfg.rounds == R and cfg.train.local_steps == 4
    shapes = {
        "trajectory/round": ((4,), np.int64), "trajectory/x": ((4, d), np.float32),
        "participation/selected": ((R, N), np.bool_), "participation/active": ((R, N), np.bool_),
        "participation/budget": ((R, N), np.int32), "participation/steps": ((R, N), np.int32),
        "participation/coeff": ((R, N), np.float64), "participation/elapsed_s": ((R, N), np.float32),
        "participation/cpu_percent": ((R, N), np.float32), "metrics/lr": ((R,), np.float64),
        "metrics/train_loss": ((R + 1,), np.float64), "metrics/test_loss": ((R + 1,), np.float64),
        "metrics/test_accuracy": ((R + 1,), np.float64),
    }
    for name, (shape, dtype) in shapes.items():
        assert log[name].shape == shape and log[name].dtype == dtype, name
    assert log["trajectory/round"].tolist() == [0, 5, 10, 12]  # round 0, every 5th, and the last
    assert log["trajectory/x"][0].tolist() == [0.0] * d
    evaluated = np.isfinite(log["metrics/train_loss"])
    assert np.flatnonzero(evaluated).tolist() == [0, 4, 8, 12]
    assert np.all(log["participation/selected"].sum(axis=1) == 3)
    assert np.array_equal(log["participation/budget"] > 0, log["participation/selected"])
    assert np.all(log["participation/coeff"][~log["participation/selected"]] == 0)
    np.testing.assert_allclose(log["participation/coeff"].sum(axis=1), 1.0)  # count_selected sums to one
    assert np.all(log["participation/elapsed_s"][log["participation/selected"]] > 0)
    assert np.all(np.isnan(log["participation/cpu_percent"][~log["participation/selected"]]))
    assert np.array_equal(log["state/x"][R % 2], log["trajectory/x"][-1]) and log["state/round"][0] == R


def test_same_seed_same_bytes_other_seed_differs(run_experiment):
    a, b = run_experiment(SMALL), run_experiment(SMALL)
    c = run_experiment({**SMALL, "seed": 1})
    assert compared(a).keys() == compared(b).keys()
    for name, value in compared(a).items():
        assert value.tobytes() == b[name].tobytes(), name
    assert a["trajectory/x"].tobytes() != c["trajectory/x"].tobytes()
    assert a["participation/selected"].tobytes() != c["participation/selected"].tobytes()


def test_test_accuracy_rises_on_the_default_problem(run_experiment):
    log = run_experiment({"rounds": 30})
    acc = log["metrics/test_accuracy"]
    assert acc[0] < 0.2 and acc[-1] > 0.6 and acc[-1] > acc[0] + 0.4
    assert log["metrics/train_loss"][-1] < log["metrics/train_loss"][0] - 0.8


def test_interrupted_run_resumes_to_the_same_log(tmp_path):
    overrides = [f"{k}={v!r}" if not isinstance(v, str) else f'{k}="{v}"' for k, v in SMALL.items()]
    whole, resumed = interrupted_then_resumed(config_mod.load_config(None, overrides), tmp_path, 7)
    assert_same_logs(whole, resumed)


def test_killed_run_resumes_byte_identical(tmp_path, capsys):
    """SIGKILL a real `edgefed run` mid-run while reading its log, then --resume it (in this process, as the
    uninterrupted run: the CLI's own code, without two more interpreters to start). While it lives, a --resume
    or a --force run on its log is refused, and the live run goes on."""
    from edgefed.cli import main

    cfg_path = tmp_path / "exp.toml"
    cfg_path.write_text("rounds = 300\n[log]\nevery = 7\n")
    killed, whole = tmp_path / "killed.h5", tmp_path / "whole.h5"
    cmd = [sys.executable, "-m", "edgefed", "run", str(cfg_path), "--quiet"]
    proc = subprocess.Popen(cmd + ["--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        seen = -1
        while seen < 20:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the run never reached round 20"
            time.sleep(0.05)
            if killed.exists():
                try:
                    with open_run(killed) as f:  # readable while the run goes on
                        seen = int(f["state/round"][0])
                except Exception:
                    continue
        for args in (["--resume", str(killed)], [str(cfg_path), "--out", str(killed), "--force"]):
            assert main(["run", *args, "--quiet"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and (f"run log {killed} is being written by process {proc.pid}, which is "
                                             "still running; let it finish (or stop it)") in err, err
        while read_run(killed)["state/round"][0] < seen + 5:  # the live run goes on, in its own log
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = read_run(killed)["state/round"][0]
    assert 25 <= done < 300, "the kill did not land mid-run"
    assert main(["run", "--resume", str(killed), "--quiet"]) == 0
    assert main(["run", str(cfg_path), "--out", str(whole), "--quiet"]) == 0
    a, b = read_run(whole), read_run(killed)
    assert b["attrs"]["status"] == "complete"
    for name, value in compared(a).items():
        assert value.tobytes() == b[name].tobytes(), name
    capsys.readouterr()
    assert main(["run", "--resume", str(killed), "--quiet"]) == 0 and "already complete" in capsys.readouterr().out


def test_a_resume_that_fails_leaves_a_resumable_log(tmp_path, monkeypatch):
    from edgefed.engine.rounds import RoundEngine

    overrides = [f"{k}={v!r}" if not isinstance(v, str) else f'{k}="{v}"' for k, v in SMALL.items()]
    cfg = config_mod.load_config(None, overrides + ['train.algorithm="scaffold"', "log.client_controls=true"])
    honest_resume = RoundEngine.resume
    calls = []

    def fails_once(self, state, done, prefix=None):
        calls.append(done)
        if len(calls) == 1:
            raise RuntimeError("e.g. a device rank died while loading its controls")
        return honest_resume(self, state, done, prefix)

    monkeypatch.setattr(RoundEngine, "resume", fails_once)
    part = tmp_path / "part.h5"
    point = run_until(cfg, part, 5)
    with pytest.raises(RuntimeError):
        runs.run(cfg, part, resume_point=point)
    _, point = resolve_config(None, [], str(part))  # the log is still resumable, at the same round
    assert point.rounds_done == 5
    runs.run(cfg, part, resume_point=point)
    runs.run(cfg, tmp_path / "whole.h5")
    assert calls == [5, 5]
    assert_same_logs(read_run(tmp_path / "whole.h5"), read_run(part))


def test_a_log_caught_mid_round_is_read_up_to_its_last_completed_round(tmp_path):
    """A reader that opens the log while round r + 1 is being written sees some datasets a row ahead; it
    gets every dataset cut at round r, the last the marker says is complete."""
    import h5py

    cfg = config_mod.load_config(None, ["rounds=6", "data.clients=5", "train.clients_per_round=2"])
    run_until(cfg, tmp_path / "r.h5", 3)
    with h5py.File(tmp_path / "r.h5", "r+") as f:  # as a kill mid-round leaves it: rows of round 4 in some
        for name in ("participation/steps", "metrics/train_loss", "trajectory/x"):
            f[name].resize(f[name].shape[0] + 1, axis=0)
    data = read_run(tmp_path / "r.h5")
    assert data["participation/steps"].shape[0] == data["participation/selected"].shape[0] == 3
    assert data["metrics/train_loss"].shape[0] == data["metrics/test_accuracy"].shape[0] == 4
    assert data["trajectory/x"].shape[0] == data["trajectory/round"].shape[0]


def test_a_reader_holding_the_log_open_never_fails_the_run(tmp_path):
    """A watcher (a report, edgefed launch) may hold the log open at any moment, the end of the run included,
    when the writer reopens it for the final attributes."""
    path = tmp_path / "r.h5"
    watcher = subprocess.Popen([sys.executable, "-c", f"""
import time
from edgefed.runlog import open_run
end = time.monotonic() + 60
while time.monotonic() < end:
    try:
        f = open_run({str(path)!r})
    except Exception:
        time.sleep(0.01)
        continue
    done = f.attrs.get("status") == "complete"
    time.sleep(0.05)  # holding it open
    f.close()
    if done:
        break
"""])
    try:
        time.sleep(1.0)  # the watcher is up
        cfg = config_mod.load_config(None, ["rounds=60", "data.clients=5", "train.clients_per_round=2"])
        runs.run(cfg, path)
        assert read_run(path)["attrs"]["status"] == "complete"
    finally:
        watcher.kill()
        watcher.wait()


def test_the_stored_trajectory_keeps_within_its_budget_and_says_what_it_stores(tmp_path):
    """[log] every unset: every round while the models fit trajectory_mb, else every k-th (round 0 and R
    always), k the smallest that fits; every set keeps its meaning; the run's first line says which."""
    from edgefed.algorithms import build_algorithm
    from edgefed.config import load_config
    from edgefed.orchestration.header import log_layout, trajectory_every
    from edgefed.orchestration.run import prepare

    cfg = load_config(None, ["rounds=100"])  # logistic regression: 610 float32 values, 2.4 KB a round
    layout = log_layout(build_algorithm(cfg), cfg, 30, 610, np.float32)
    assert trajectory_every(cfg, layout, 610, np.float32) == (1, "log: the model every round, 101 of 101 (240.7 KB)")
    small = load_config(None, ["rounds=100", "log.trajectory_mb=0.03"])  # 12 rows of 2,440 bytes
    every, text = trajectory_every(small, layout, 610, np.float32)
    assert every == 10 and text == ("log: the model every 10 rounds to keep within [log] trajectory_mb = 0.03, "
                                    "11 of 101 (26.2 KB)")
    assert trajectory_every(load_config(None, ["rounds=100", "log.every=3", "log.trajectory_mb=0.03"]), layout, 610,
                            np.float32)[0] == 3  # set: today's meaning, whatever the budget
    lines = []
    setup = prepare(small, tmp_path / "r.h5", on_info=lines.append)
    assert setup.cfg.log.every == 10 and lines[0].endswith(text)
    runs.run(small, tmp_path / "s.h5")
    assert read_run(tmp_path / "s.h5")["trajectory/round"].tolist() == list(range(0, 101, 10))


def _claim(path, barrier, out):
    from edgefed.errors import RunLogError
    from edgefed.runlog import write_stub

    barrier.wait()
    try:
        write_stub(path, "seed = 0\n", claim=True)
        out.put("wrote")
    except RunLogError as exc:
        out.put(str(exc))


def test_two_runs_starting_on_one_out_at_once_one_claims_it_the_other_is_told(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for trial in range(12):
        path, barrier, out = tmp_path / f"r{trial}.h5", ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_claim, args=(path, barrier, out)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        said = sorted(out.get(timeout=5) for _ in procs)
        assert said == sorted(["wrote", f"run log {path} already exists; use --resume {path} to continue it, "
                                        "--force to replace it, or another --out"]), said
        assert open_run(path).attrs["status"] == "starting"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no copy left beside it


def _hold_then_die(path, held, go):
    from edgefed import holds

    assert holds.hold(path) is None
    held.set()
    go.wait(30)
    os._exit(0)  # no let_go: as a killed process ends


def test_a_log_is_held_by_one_live_process_and_let_go_when_it_ends_however_it_ends(tmp_path):
    import multiprocessing

    from edgefed import holds

    ctx = multiprocessing.get_context("fork")
    path, held, go = tmp_path / "r.h5", ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_then_die, args=(path, held, go))
    child.start()
    try:
        assert held.wait(30)
        assert holds.hold(path) == f"process {child.pid}"
    finally:
        go.set()
        child.join(30)
    assert holds.hold(path) is None and holds.hold(path) is None  # (again: this process holds it already)
    assert (tmp_path / ".r.h5.writer").exists()
    holds.let_go(path)
    assert [p.name for p in tmp_path.iterdir()] == []  # its lock file goes with the last holder


def test_a_cpu_competitor_leaves_no_file_in_the_temporary_folder_even_if_never_stopped():
    from edgefed.runtime.contention import Competitor

    import struct

    competitor = Competitor(None, 0.1)
    try:
        deadline = time.monotonic() + 20
        while struct.unpack("q", competitor._cell[16:24])[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until it has run a period: it has mapped the file by then
        assert struct.unpack("q", competitor._cell[16:24])[0] > 0
        assert not os.path.exists(competitor._path)
    finally:
        competitor.stop()
