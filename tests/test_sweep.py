"""`edgefed sweep`: the grid it expands, the tables it writes (against the logs), skip and resume on a second
invocation, a failing cell, and -j 2 and mpiexec -n 3 writing the same logs as a serial sweep."""

import csv
import re
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed.analysis.logs import Run
from edgefed.cli import main
from edgefed.errors import ConfigError, EdgefedError
from edgefed.orchestration import sweep as sweep_mod
from edgefed.orchestration.sweep import read_sweep
from edgefed.runlog import read_run
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

from helpers import assert_same_logs, run_until

MPIEXEC = local_mpiexec()

BASE = """rounds = 9
[data]
clients = 6
[train]
clients_per_round = "all"
local_steps = 4
batch_size = 10
"""

SWEEP = """base = "base.toml"
seeds = [0, 1]
[set]
rounds = 3
"participation.mode" = "trace"
"participation.trace" = "builtin:5"
[axes]
"participation.scheme" = ["A", "C"]
"data.alpha,data.beta" = [[0.0, 0.0], [1.0, 1.0]]
[target]
test_accuracy = 0.3
"""

SUMMARY_COLUMNS = ["cell", "participation.scheme", "data.alpha", "data.beta", "seed", "log", "status", "rounds",
                   "final_test_accuracy", "best_test_accuracy", "final_train_loss", "wall_s", "clock_s",
                   "bytes_up_per_round", "bytes_down_per_round", "epsilon", "rounds_to_target", "clock_to_target_s",
                   "error", "energy_j", "energy_to_target_j"]


def write_sweep(folder: Path, text: str = SWEEP, base: str = BASE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.toml").write_text(base)
    path = folder / "sweep.toml"
    path.write_text(text)
    return path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sweep_cli(args, capsys):
    code = main(["sweep", *args])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(folder: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((folder / "runs").glob("*.h5"))}


# -- expansion -------------------------------------------------------------------------------------------------
def test_axes_times_seeds_with_base_set_axes_seed_precedence(tmp_path):
    sweep = read_sweep(write_sweep(tmp_path, SWEEP.replace('[set]\n', '[set]\n"train.local_steps" = 2\n')
                                   .replace('[axes]\n', '[axes]\n"train.local_steps" = [3, 5]\n')))
    assert len(sweep.jobs) == 2 * 2 * 2 * 2  # local_steps x scheme x (alpha, beta) x seeds
    assert sweep.axes == ("train.local_steps", "participation.scheme", "data.alpha", "data.beta")
    seen = set()
    for job in sweep.jobs:
        cfg = config_mod.config_from_dict(job.raw)
        values = dict(job.values)
        assert cfg.rounds == 3  # [set] beats the base's 9
        assert cfg.data.clients == 6 and cfg.train.batch_size == 10  # the base where nothing overrides it
        assert cfg.train.local_steps == values["train.local_steps"]  # the axis beats [set]
        assert cfg.participation.scheme == values["participation.scheme"]
        assert cfg.data.alpha == cfg.data.beta == values["data.alpha"] == values["data.beta"]  # linked
        assert cfg.seed == job.seed
        seen.add((values["train.local_steps"], values["participation.scheme"], values["data.alpha"], job.seed))
    assert len(seen) == 16
    assert len({job.log for job in sweep.jobs}) == 16
    first = sweep.jobs[0]
    assert first.cell == "local_steps=3, scheme=A, alpha=0.0, beta=0.0"
    assert re.fullmatch(r"runs/local-steps-3-scheme-A-alpha-0\.0-beta-0\.0-[0-9a-f]{8}-seed0\.h5", first.log)
    assert [j.seed for j in sweep.jobs[:2]] == [0, 1]  # seeds vary fastest, within a cell


def test_bare_dotted_keys_set_one_key_as_quoted_ones_do(tmp_path):
    bare = read_sweep(write_sweep(tmp_path / "a", 'base = "base.toml"\n[set]\ntrain.batch_size = 5\n[axes]\ntrain.lr_local = [0.1, 0.2]\n'))
    quoted = read_sweep(write_sweep(tmp_path / "b", 'base = "base.toml"\n[set]\n"train.batch_size" = 5\n[axes]\n'
                                                     '"train.lr_local" = [0.1, 0.2]\n'))
    assert [j.raw for j in bare.jobs] == [j.raw for j in quoted.jobs]
    cfg = config_mod.config_from_dict(bare.jobs[0].raw)
    assert (cfg.train.batch_size, cfg.train.local_steps, cfg.train.lr_local) == (5, 4, 0.1)  # the base's K stays


def test_a_module_file_is_found_beside_the_config_or_the_sweep_that_names_it(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "torch.toml").write_text('[model]\nkind = "torch"\nmodule = "net.py"\nfactory = "f"\n')
    sweep = tmp_path / "sweeps" / "s.toml"
    sweep.parent.mkdir()
    sweep.write_text('base = "../configs/torch.toml"\n[axes]\nseed = [0, 1]\n')
    assert {j.raw["model"]["module"] for j in read_sweep(sweep).jobs} == {str((tmp_path / "configs" / "net.py").resolve())}
    sweep.write_text('base = "../configs/torch.toml"\n[axes]\n"model.module" = ["a.py", "/abs/b.py"]\n')
    assert [j.raw["model"]["module"] for j in read_sweep(sweep).jobs] == [str((sweep.parent / "a.py").resolve()),
                                                                     "/abs/b.py"]


def test_growing_an_axis_keeps_the_names_of_the_cells_there_were(tmp_path):
    small = read_sweep(write_sweep(tmp_path, '[axes]\n"participation.scheme" = ["B"]\n"train.lr_local" = [0.1]\n'))
    grown = read_sweep(write_sweep(tmp_path, '[axes]\n"participation.scheme" = ["A", "B"]\n'
                                             '"train.lr_local" = [0.1, 0.2]\n'))
    assert {j.log for j in small.jobs} < {j.log for j in grown.jobs}
    assert len({j.log for j in grown.jobs}) == 4


def test_without_base_or_seeds_the_default_config_and_its_seed(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('seeds = [4]\n[axes]\n"train.lr_local" = [0.1, 0.2]\n')
    sweep = read_sweep(path)
    default = config_mod.load_config(None)
    assert [config_mod.config_from_dict(j.raw).train.lr_local for j in sweep.jobs] == [0.1, 0.2]
    assert all(config_mod.config_from_dict(j.raw).rounds == default.rounds for j in sweep.jobs)
    path.write_text('[set]\nseed = 7\n[axes]\n"train.lr_local" = [0.1]\n')
    assert [j.seed for j in read_sweep(path).jobs] == [7]  # no seeds list: the run's own seed
    path.write_text('[set]\nrounds = 2\n')
    (only,) = read_sweep(path).jobs  # no axes: one cell
    assert only.cell == "all" and config_mod.config_from_dict(only.raw).rounds == 2


BAD_SWEEPS = {
    "unknown key": ('sets = 1\n', "unknown key 'sets'; a sweep has base, seeds, set, axes, target"),
    "axis over no key": ('[axes]\n"train.lr" = [0.1]\n', "axis 'train.lr' = 0.1: config: unknown key [train] 'lr'"),
    "empty axis": ('[axes]\n"train.lr_local" = []\n', "axis 'train.lr_local' must be a non-empty list of values"),
    "value rejected": ('[axes]\n"participation.scheme" = ["A", "Z"]\n',
                       "axis 'participation.scheme' = Z: config: participation.scheme = 'Z' is not known"),
    "linked length": ('[axes]\n"data.alpha,data.beta" = [[0.5]]\n',
                      "axis 'data.alpha,data.beta' links 2 keys: each value must be a list of 2"),
    "key twice": ('[axes]\n"data.alpha" = [0.5]\n"data.alpha,data.beta" = [[0.5, 0.5]]\n',
                  "a key appears in two axes"),
    "bad seeds": ('seeds = [0, -1]\n', "seeds must be a non-empty list of non-negative integers"),
    "seed twice": ('seeds = [0, 0]\n', "seeds lists a seed twice"),
    "bad target": ('[target]\ntest_accuracy = 2\n', "target test_accuracy = 2 must lie in (0, 1]"),
    "target key": ('[target]\ntrain_loss = 0.1\n', "[target] takes test_accuracy, not 'train_loss'"),
    "set rejected": ('[set]\n"train.local_steps" = 0\n', "[set]: config: train.local_steps = 0"),
    "missing base": ('base = "nowhere.toml"\n', "nowhere.toml"),
    "not TOML": ('[axes\n', "is not a readable TOML file"),
}


@pytest.mark.parametrize("case", sorted(BAD_SWEEPS))
def test_bad_sweep_files_are_refused_before_anything_runs(tmp_path, capsys, case):
    text, message = BAD_SWEEPS[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, out, err = sweep_cli([str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"edgefed: error: sweep {path}") and message in err, err
    assert not (tmp_path / "out").exists()


def test_jobs_must_be_positive(tmp_path, capsys):
    code, _, err = sweep_cli([str(write_sweep(tmp_path)), "--out", str(tmp_path / "o"), "-j", "0"], capsys)
    assert code == 2 and "-j 0: give at least 1" in err


# -- running and the tables --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """A serial sweep of SWEEP: (folder, exit code, printed lines)."""
    folder = tmp_path_factory.mktemp("serial")
    path = write_sweep(folder)
    lines = []
    from edgefed.orchestration.sweep import run_sweep

    code = run_sweep(path, folder / "out", on_line=lines.append)
    return folder / "out", code, lines


def test_summary_rows_are_the_logs_own_figures(serial):
    folder, code, lines = serial
    assert code == 0
    rows = read_csv(folder / "summary.csv")
    assert list(rows[0]) == SUMMARY_COLUMNS
    assert len(rows) == 8 and {r["status"] for r in rows} == {"complete"}
    sweep = read_sweep(folder.parent / "sweep.toml")
    for row, job in zip(rows, sweep.jobs):
        assert row["log"] == job.log and int(row["seed"]) == job.seed and row["cell"] == job.cell
        assert row["participation.scheme"] == dict(job.values)["participation.scheme"]
        assert row["data.alpha"] == str(dict(job.values)["data.alpha"])
        log = read_run(folder / row["log"])
        assert log["attrs"]["status"] == "complete"
        assert config_mod.same_experiment(config_mod.config_from_dict(config_mod.parse_toml(log["attrs"]["config"])),
                                          config_mod.config_from_dict(job.raw)) == []
        acc, loss, clock = log["metrics/test_accuracy"], log["metrics/train_loss"], log["metrics/clock_s"]
        assert int(row["rounds"]) == 3
        assert float(row["final_test_accuracy"]) == acc[-1]
        assert float(row["best_test_accuracy"]) == np.nanmax(acc)
        assert float(row["final_train_loss"]) == loss[-1]
        assert float(row["clock_s"]) == clock[-1]
        assert float(row["wall_s"]) == pytest.approx(log["metrics/round_elapsed_s"].sum())
        assert float(row["bytes_up_per_round"]) == log["participation/bytes_up"].sum(axis=1).mean()
        reached = np.flatnonzero(acc >= 0.3)
        if reached.size:
            assert int(row["rounds_to_target"]) == reached[0]
            assert float(row["clock_to_target_s"]) == clock[reached[0]]
        else:
            assert row["rounds_to_target"] == row["clock_to_target_s"] == ""
        assert row["error"] == ""
    assert len([line for line in lines if line.startswith("run ")]) == 8
    assert "ETA" in lines[0] and lines[-1].startswith("sweep: 8 runs in 4 cells, 0 failed")


def test_cells_are_mean_and_std_over_seeds(serial):
    folder, _, _ = serial
    rows, cells = read_csv(folder / "summary.csv"), read_csv(folder / "cells.csv")
    assert len(cells) == 4
    assert list(cells[0])[:5] == ["cell", "participation.scheme", "data.alpha", "data.beta", "seeds"]
    for cell in cells:
        mine = [r for r in rows if r["cell"] == cell["cell"]]
        assert int(cell["seeds"]) == 2
        for name in ("final_test_accuracy", "final_train_loss", "clock_s"):
            values = np.array([float(r[name]) for r in mine])
            assert float(cell[f"{name}_mean"]) == pytest.approx(values.mean(), rel=1e-12)
            assert float(cell[f"{name}_std"]) == pytest.approx(values.std(), rel=1e-12, abs=1e-15)
        reached = [r for r in mine if r["rounds_to_target"] != ""]
        assert int(cell["rounds_to_target_reached"]) == len(reached)


def test_second_invocation_skips_complete_runs_and_resumes_an_interrupted_one(serial, tmp_path, capsys):
    folder, _, _ = serial
    copy = tmp_path / "out"
    shutil.copytree(folder, copy)
    sweep = read_sweep(folder.parent / "sweep.toml")
    interrupted = sweep.jobs[5]
    (copy / interrupted.log).unlink()
    run_until(config_mod.config_from_dict(interrupted.raw), copy / interrupted.log, 1)  # killed after round 1
    (copy / sweep.jobs[6].log).unlink()  # never ran
    before = snapshot(copy)
    code, out, err = sweep_cli([str(folder.parent / "sweep.toml"), "--out", str(copy)], capsys)
    assert code == 0, err
    after = snapshot(copy)
    untouched = [Path(j.log).name for i, j in enumerate(sweep.jobs) if i not in (5, 6)]
    assert all(after[name] == before[name] for name in untouched)
    assert out.count("already complete") == 6 and out.count("resumed") == 1
    for job in (interrupted, sweep.jobs[6]):
        assert_same_logs(read_run(folder / job.log), read_run(copy / job.log))
    assert read_csv(copy / "summary.csv")[5]["status"] == "complete"


def test_a_cell_that_cannot_run_is_found_before_any_runs_and_one_that_fails_later_is_recorded(tmp_path, capsys,
                                                                                               monkeypatch):
    path = write_sweep(tmp_path, '[set]\nrounds = 2\n"participation.mode" = "trace"\n[axes]\n'
                                 f'"participation.trace" = ["builtin:2", "{tmp_path / "missing.csv"}"]\n')
    code, out, err = sweep_cli([str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and "missing.csv', seed 0 cannot run" in err
    assert "missing.csv not found" in err and not (tmp_path / "out").exists()
    path.write_text('[set]\nrounds = 2\n"participation.mode" = "trace"\n[axes]\n'
                    '"participation.trace" = ["builtin:2", "builtin:3"]\n')
    real = sweep_mod.runs.run

    def failing(cfg, log, **kwargs):  # what no plan foresees (a full disk, a lost board): at run time
        if "builtin-3" in log.name:
            raise EdgefedError("the disk is full")
        return real(cfg, log, **kwargs)

    monkeypatch.setattr(sweep_mod.runs, "run", failing)
    code, out, err = sweep_cli([str(path), "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and err == ""
    rows = read_csv(tmp_path / "out" / "summary.csv")
    assert [r["status"] for r in rows] == ["complete", "failed"]
    assert rows[1]["error"] == "the disk is full" and rows[0]["error"] == ""
    assert rows[1]["final_test_accuracy"] == ""
    assert "FAILED: the disk is full" in out and "1 failed" in out
    cells = read_csv(tmp_path / "out" / "cells.csv")
    assert [c["seeds"] for c in cells] == ["1", "0"]


def test_a_foreign_log_in_the_way_fails_its_cell_without_being_touched(serial, tmp_path, capsys):
    folder, _, _ = serial
    copy = tmp_path / "out"
    shutil.copytree(folder, copy)
    job = read_sweep(folder.parent / "sweep.toml").jobs[0]
    other = read_sweep(folder.parent / "sweep.toml").jobs[2]  # another cell's complete log
    shutil.copy(copy / other.log, copy / job.log)
    before = (copy / job.log).read_bytes()
    code, _, _ = sweep_cli([str(folder.parent / "sweep.toml"), "--out", str(copy)], capsys)
    assert code == 1
    row = read_csv(copy / "summary.csv")[0]
    assert row["status"] == "failed" and "belongs to another config" in row["error"]
    assert (copy / job.log).read_bytes() == before


def test_a_log_of_another_trace_is_not_taken_for_complete(serial, tmp_path, capsys):
    folder, _, _ = serial
    copy = tmp_path / "out"
    shutil.copytree(folder, copy)
    other = tmp_path / "other.toml"
    other.write_text((folder.parent / "sweep.toml").read_text().replace("builtin:5", "builtin:8"))
    shutil.copy(folder.parent / "base.toml", tmp_path)
    code, out, _ = sweep_cli([str(other), "--out", str(copy)], capsys)
    assert code == 1 and "already complete" not in out
    assert all("differs in participation.trace" in r["error"] for r in read_csv(copy / "summary.csv"))


def test_jobs_at_a_time_write_the_serial_logs(serial, tmp_path, capsys):
    """Two of the serial sweep's runs (a sweep of their own: a process each, at once)."""
    folder, _, _ = serial
    part = write_sweep(tmp_path, SWEEP.replace('"participation.scheme" = ["A", "C"]', '"participation.scheme" = ["C", "A"]')
                       .replace("[[0.0, 0.0], [1.0, 1.0]]", "[[1.0, 1.0]]").replace("seeds = [0, 1]", "seeds = [1]"))
    code, out, err = sweep_cli([str(part), "--out", str(tmp_path / "j2"), "-j", "2"], capsys)
    assert code == 0, err
    rows = read_csv(tmp_path / "j2" / "summary.csv")
    assert [r["log"] for r in rows] == ["runs/scheme-C-alpha-1.0-beta-1.0-8b8d0220-seed1.h5",
                                        "runs/scheme-A-alpha-1.0-beta-1.0-74b8832d-seed1.h5"]  # in the sweep's order
    for row in rows:
        assert_same_logs(read_run(folder / row["log"]), read_run(tmp_path / "j2" / row["log"]))


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_mpiexec_spreads_the_runs_over_ranks_and_writes_the_serial_logs(serial, tmp_path):
    folder, _, _ = serial
    env = outside_world_env()
    done = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-m", "edgefed", "sweep",
                           str(folder.parent / "sweep.toml"), "--out", str(tmp_path / "m3")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    for rank, count in ((0, 3), (1, 3), (2, 2)):  # 8 runs dealt round-robin
        assert done.stdout.count(f"[rank {rank}] run ") == count
    assert done.stdout.count("sweep: 8 runs") == 1  # rank 0 writes the tables
    for row in read_csv(folder / "summary.csv"):
        assert_same_logs(read_run(folder / row["log"]), read_run(tmp_path / "m3" / row["log"]))
    ours = read_csv(tmp_path / "m3" / "summary.csv")
    assert [(r["log"], r["final_test_accuracy"]) for r in ours] == \
           [(r["log"], r["final_test_accuracy"]) for r in read_csv(folder / "summary.csv")]


def test_every_run_is_an_ordinary_log(serial, capsys):
    folder, _, _ = serial
    log = folder / read_csv(folder / "summary.csv")[0]["log"]
    assert main(["run", "--resume", str(log)]) == 0
    assert "already complete" in capsys.readouterr().out
    run = Run.read(log)
    assert run.status == "complete" and not math.isnan(run.final("test_accuracy"))


def test_config_errors_carry_the_axis(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[axes]\n"data.clients" = [20]\n"train.clients_per_round" = [25]\n')
    with pytest.raises(ConfigError, match=r"cell 'data.clients' = 20, 'train.clients_per_round' = 25: config: "
                                          r"train.clients_per_round = 25 exceeds the 20 devices"):
        read_sweep(path)  # each value alone is fine: the cell is at fault
    path.write_text('[axes]\n"train.algorithm" = ["fedavg", "fedprox"]\n"fedprox.mu" = [0.1]\n')
    with pytest.raises(ConfigError, match=r"axis 'fedprox.mu' = 0.1: config: fedprox.mu applies to"):
        read_sweep(path)  # the value fails alone: the message names its axis


def test_a_large_sweep_says_it_is_checking_its_configs_with_a_count(tmp_path, monkeypatch):
    from edgefed.orchestration import sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "PROGRESS_S", 0.0)  # every config then says how far it got
    monkeypatch.setattr(sweep_mod, "PROGRESS_RUNS", 50)  # (1,000 by default: the same lines, 20x the time)
    path = tmp_path / "big.toml"
    path.write_text(f"seeds = {list(range(50))}\n[set]\nrounds = 1\n")
    lines = []
    assert len(read_sweep(path, lines.append).jobs) == 50
    assert lines[0] == "sweep: checking the configs of 50 runs"
    assert lines[-1] == "sweep: checked 49 of 50 configs" and len(lines) == 50
    lines.clear()
    path.write_text("seeds = [0, 1]\n")
    read_sweep(path, lines.append)
    assert lines == []  # a small sweep starts at once, in silence
