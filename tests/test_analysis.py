"""Reading logs for answers: `summary`, `export --csv` and `report` on known logs and a sweep folder, checked
against the logs' own datasets; bad inputs; and logs in the HDF5 1.10 format every HDF5 tool opens."""

import base64
import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed import runlog
from edgefed.analysis.logs import Run
from edgefed.cli import main
from edgefed.orchestration import run as runs
from edgefed.orchestration.sweep import run_sweep
from edgefed.memory import size_text
from edgefed.runlog import read_run

TRACE = ["rounds=5", "data.clients=6", "train.clients_per_round=4", "train.local_steps=6", "train.batch_size=10",
         'participation.mode="trace"', 'participation.trace="builtin:8"', 'participation.scheme="C"']
MEASURED = ["rounds=3", "data.clients=3", 'train.clients_per_round="all"', "train.local_steps=50",
            'participation.mode="deadline"', "participation.deadline_s=0.004", "participation.grace_s=0.5"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logs")
    out = {}
    for name, overrides in (("trace", TRACE), ("measured", MEASURED)):
        runs.run(config_mod.load_config(None, overrides), folder / f"{name}.h5")
        out[name] = folder / f"{name}.h5"
    return out


@pytest.fixture(scope="module")
def sweep_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "s.toml").write_text('seeds = [0, 1]\n[set]\nrounds = 3\n"data.clients" = 5\n'
                                   '"train.clients_per_round" = "all"\n"train.local_steps" = 4\n'
                                   '"participation.mode" = "trace"\n"device.profile" = "pi4b"\n[axes]\n'
                                   '"participation.trace" = ["builtin:1", "builtin:8"]\n'
                                   '"participation.scheme" = ["A", "C"]\n[target]\ntest_accuracy = 0.2\n')
    assert run_sweep(folder / "s.toml", folder / "out", on_line=lambda line: None) == 0
    return folder / "out"


def cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# -- the numbers ---------------------------------------------------------------------------------------------------
def test_fractions_and_per_device_shares_from_the_datasets(logs):
    data, run = read_run(logs["trace"]), Run.read(logs["trace"])
    sel, steps, budget = data["participation/selected"], data["participation/steps"], data["participation/budget"]
    assert sel.sum() == 5 * 4 and (steps[sel] < budget[sel]).any() and (steps[sel] == 0).any()
    frac = run.fractions()
    assert np.isnan(frac[~sel]).all()
    np.testing.assert_array_equal(frac[sel], steps[sel] / budget[sel])
    for row in run.devices():
        k, mine = row["device"], sel[:, row["device"]]
        assert row["selected"] == mine.sum()
        if mine.any():
            assert row["fraction"] == pytest.approx(np.mean(steps[mine, k] / budget[mine, k]))
            assert row["inactive"] == pytest.approx(np.mean(steps[mine, k] == 0))
            assert row["late"] == pytest.approx(np.mean(data["participation/late"][mine, k]))


def test_rounds_and_clock_to_a_target(logs):
    run = Run.read(logs["trace"])
    acc, clock = run["metrics/test_accuracy"], run["metrics/clock_s"]
    target = float(np.sort(acc)[-2])  # the second best: reached first at a known round
    first = int(np.flatnonzero(acc >= target)[0])
    assert run.to_target(target) == (first, float(clock[first]))
    assert all(np.isnan(v) for v in run.to_target(1.01 if acc.max() < 1.01 else 2.0))
    assert run.final("test_accuracy") == acc[-1] and run.best("test_accuracy") == acc.max()


def test_summary_says_what_differs_what_it_reached_and_each_device(logs, capsys):
    run = Run.read(logs["trace"])
    acc = run["metrics/test_accuracy"]
    target = float(acc.max())
    code, out, err = cli(["summary", str(logs["trace"]), "--target-accuracy", str(target)], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"{logs['trace']}: complete, 5 of 5 rounds; SYNTHETIC(1,1)")
    for key in ("rounds = 5", "data.clients = 6", "participation.scheme = 'C'", "participation.trace = 'builtin:8'"):
        assert f"  {key}" in lines
    assert f"test accuracy: final {acc[-1]:.4f}, best {acc.max():.4f}" in out
    first = int(np.flatnonzero(acc >= target)[0])
    assert f"to test accuracy {target:g}: round {first}, clock {run['metrics/clock_s'][first]:.3f} s" in out
    up = run["participation/bytes_up"].sum(axis=1).mean()
    assert f"wire per round: {size_text(up)} up, " in out and "(uplink none, downlink none)" in out
    table = lines[lines.index("device  selected  fraction  inactive   late  non-finite  cpu %") + 1:]
    assert len(table) == 6
    d0 = run.devices()[0]
    assert table[0].split()[:3] == ["0", str(d0["selected"]), f"{d0['fraction']:.3f}" if d0["selected"] else "-"]


def test_a_large_federations_summary_lists_the_devices_selected_most_and_reads_no_state(logs, capsys, monkeypatch):
    """(DEVICE_ROWS = 3 of the log's 6: as 1,000 of a million.) The most selected, ties to the lower ids, in
    id order, each row the one the whole table has; the summary never reads /state."""
    from edgefed.analysis import summary as summary_mod

    run = Run.read(logs["trace"])
    counts = run["participation/selected"].sum(axis=0)
    shown = sorted(sorted(range(6), key=lambda k: (-counts[k], k))[:3])
    whole = {d["device"]: d for d in run.devices()}
    monkeypatch.setattr(summary_mod, "DEVICE_ROWS", 3)
    lines = summary_mod.summary_lines(run)
    table = lines[lines.index("device  selected  fraction  inactive   late  non-finite  cpu %") + 1:]
    assert [int(row.split()[0]) for row in table[:3]] == shown
    assert [int(row.split()[1]) for row in table[:3]] == [whole[k]["selected"] for k in shown]
    assert table[3].startswith("(the 3 devices selected most of 6;")
    assert "state/x" not in run.data and not any(name.startswith("state/") for name in run.data)
    from edgefed.analysis import figures as figures_mod  # the per-device figures draw the same devices

    monkeypatch.setattr(figures_mod, "FIGURE_DEVICES", 3)
    assert figures_mod._shown_devices(run)[0].tolist() == shown
    figure = figures_mod.participation(run, "t")
    assert figure.axes[0].get_ylabel() == "the 3 devices selected most, of 6"
    assert figure.axes[0].get_images()[0].get_array().shape == (3, 5)  # 3 devices x 5 rounds


def test_summary_of_a_measured_run_shows_cpu_shares(logs, capsys):
    code, out, _ = cli(["summary", str(logs["measured"])], capsys)
    assert code == 0
    rows = out.splitlines()[-3:]
    cpu = read_run(logs["measured"])["participation/cpu_percent"]
    for k, row in enumerate(rows):
        assert row.split()[-1] == f"{np.nanmean(cpu[:, k]):.1f}"


def test_export_writes_tidy_csv_equal_to_the_log(logs, tmp_path, capsys):
    code, out, _ = cli(["export", str(logs["trace"]), "--csv", str(tmp_path / "csv")], capsys)
    assert code == 0 and out.count("wrote ") == 2
    data = read_run(logs["trace"])
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        metrics = list(csv.DictReader(f))
    assert len(metrics) == 6 and [int(r["round"]) for r in metrics] == list(range(6))
    assert list(metrics[0])[:5] == ["round", "train_loss", "test_loss", "test_accuracy", "clock_s"]
    for r, row in enumerate(metrics):
        for name in ("train_loss", "test_accuracy", "clock_s"):
            assert float(row[name]) == data[f"metrics/{name}"][r]
        assert row["lr"] == ("" if r == 0 else repr(float(data["metrics/lr"][r - 1])))
    with open(tmp_path / "csv" / "participation.csv", newline="") as f:
        part = list(csv.DictReader(f))
    assert len(part) == 5 * 6
    for row in part:
        r, k = int(row["round"]) - 1, int(row["device"])
        assert int(row["steps"]) == data["participation/steps"][r, k]
        assert row["selected"] == ("1" if data["participation/selected"][r, k] else "0")
        assert float(row["coeff"]) == data["participation/coeff"][r, k]
        cpu = data["participation/cpu_percent"][r, k]
        assert row["cpu_percent"] == ("" if np.isnan(cpu) else repr(float(cpu)))  # NaN is empty, not "nan"
    assert any(row["cpu_percent"] == "" for row in part)  # the devices not selected


# -- the report -----------------------------------------------------------------------------------------------------
def images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)]


def assert_self_contained(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", page)
    assert "<script" not in page and "@import" not in page and "url(" not in page


def test_report_of_one_measured_log(logs, tmp_path, capsys):
    out = tmp_path / "page.html"
    code, printed, err = cli(["report", str(logs["measured"]), "--out", str(out)], capsys)
    assert code == 0 and printed == f"wrote {out}\n"
    page = out.read_text()
    assert_self_contained(page)
    pngs = images(page)
    assert len(pngs) == 4 and all(p.startswith(PNG) for p in pngs)  # curves, partition, participation, measured
    assert "deadline_s = 0.004" in page  # the config, as TOML
    run = Run.read(logs["measured"])
    assert f"<td>{run.final('test_accuracy'):.4f}</td>" in page


def test_report_of_several_logs_and_a_sweep_folder(logs, sweep_folder, tmp_path):
    from edgefed.analysis.report import write_report

    (page_path,) = write_report([str(logs["trace"]), str(logs["measured"]), str(sweep_folder)], tmp_path / "r.html")
    page = page_path.read_text()
    assert_self_contained(page)
    # sweep: overview + its partition + 2 curve groups (by trace) and their energy (its boards have [power]) + 4
    # cells' participation; runs: curves + 2 partitions + 2 participation + 2 measured (CPU shares, and for the
    # deadline run its deadlines)
    assert len(images(page)) == 1 + 1 + 2 + 2 + 4 + 1 + 2 + 2 + 2
    with open(sweep_folder / "cells.csv", newline="") as f:
        cells = list(csv.DictReader(f))
    for cell in cells:
        mean, std = float(cell["final_test_accuracy_mean"]), float(cell["final_test_accuracy_std"])
        assert f"<td>{mean:.4f} ± {std:.4f}</td>" in page
    assert "4 cells; axes: participation.trace, participation.scheme" in page
    with open(sweep_folder / "summary.csv", newline="") as f:
        for row in csv.DictReader(f):  # the energy each run spent, and to the target, from its log
            run = Run.read(sweep_folder / row["log"])
            assert float(row["energy_j"]) == run.spent_j()[-1] > 0
            assert float(row["energy_to_target_j"]) == run.energy_to_target(0.2) <= run.spent_j()[-1]
    assert "<th>energy (J)</th>" in page and "<th>energy to target (J)</th>" in page


def test_linked_axes_are_one_dimension_of_the_report():
    from edgefed.analysis.sweeps import Sweep

    def sweep(pairs):
        cells = {f"c{i}": {"data.alpha": a, "data.beta": b, "participation.scheme": s}
                 for i, (a, b, s) in enumerate((a, b, s) for a, b in pairs for s in "AC")}
        return Sweep(Path("."), cells={c: [] for c in cells}, axes=["data.alpha", "data.beta",
                                                                   "participation.scheme"], values=cells)

    linked = sweep([("0", "0"), ("1", "1")])
    assert linked.dimensions() == [("data.alpha", "data.beta"), ("participation.scheme",)]
    assert list(linked.groups()) == ["alpha=0, beta=0", "alpha=1, beta=1"]
    assert [label for label, _ in linked.groups()["alpha=1, beta=1"]] == ["scheme=A", "scheme=C"]
    grid = sweep([("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")])
    assert grid.dimensions() == [("data.alpha",), ("data.beta",), ("participation.scheme",)]
    assert len(grid.groups()) == 4


def test_report_as_png_files(sweep_folder, tmp_path, capsys):
    code, printed, _ = cli(["report", str(sweep_folder), "--format", "png", "--out", str(tmp_path / "figs")], capsys)
    assert code == 0 and printed == f"wrote 10 figures into {tmp_path / 'figs'}\n"
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert "out-overview.png" in names and "out-trace-builtin-1-curves.png" in names and "out-partition.png" in names
    assert all((tmp_path / "figs" / n).read_bytes().startswith(PNG) for n in names)


def test_report_without_matplotlib_says_how_to_get_it(logs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, _, err = cli(["report", str(logs["trace"]), "--out", str(tmp_path / "p.html")], capsys)
    assert code == 2 and err == ("edgefed: error: edgefed report draws with matplotlib, which is not installed; "
                                 "pip install 'edgefed[plot]'\n")
    assert not (tmp_path / "p.html").exists()


# -- bad inputs --------------------------------------------------------------------------------------------------
def test_damaged_and_foreign_files_get_one_line(tmp_path, logs, capsys):
    text = tmp_path / "notes.h5"
    text.write_text("not HDF5\n")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.zeros(3)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(logs["trace"].read_bytes()[:4096])
    cases = [(["summary", str(tmp_path / "none.h5")], "run log {} not found".format(tmp_path / "none.h5")),
             (["summary", str(text)], "is not an HDF5 file"),
             (["summary", str(cut)], "is cut short: 4096 of its"),
             (["run", "--resume", str(cut)], "is cut short: 4096 of its"),
             (["export", str(foreign), "--csv", str(tmp_path / "c")], "is not an edgefed run log"),
             (["report", str(foreign), "--out", str(tmp_path / "p.html")], "is not an edgefed run log"),
             (["report", str(tmp_path), "--out", str(tmp_path / "p.html")], "summary.csv cannot be read"),
             (["report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p.html")], "not found; give run logs"),
             (["export", str(logs["trace"]), "--csv", str(text)], "is a file; give a folder to write metrics.csv")]
    for args, message in cases:
        code, out, err = cli(args, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (args, err)
    assert text.read_text() == "not HDF5\n"
    assert not (tmp_path / "p.html").exists()


# -- the file format ----------------------------------------------------------------------------------------------
def test_logs_are_written_in_the_hdf5_1_10_format(tmp_path, monkeypatch):
    opened = []
    real = h5py.File

    def spy(*args, **kwargs):
        f = real(*args, **kwargs)
        if f.mode == "r+":
            opened.append(f.id.get_access_plist().get_libver_bounds())
        return f

    monkeypatch.setattr(h5py, "File", spy)
    runs.run(config_mod.load_config(None, ["rounds=2", "data.clients=4", "train.clients_per_round=2"]),
             tmp_path / "a.h5")
    v110 = (h5py.h5f.LIBVER_V110, h5py.h5f.LIBVER_V110)
    assert opened and all(bounds == v110 for bounds in opened)  # the skeleton and every round after it


def test_logs_in_the_newer_format_stay_readable_and_resumable(tmp_path, monkeypatch, capsys):
    cfg = config_mod.load_config(None, ["rounds=3", "data.clients=4", "train.clients_per_round=2"])
    monkeypatch.setattr(runlog.schema, "LIBVER", "latest")  # as edgefed wrote logs before
    from helpers import run_until

    run_until(cfg, tmp_path / "old.h5", 1)
    monkeypatch.undo()
    assert main(["run", "--resume", str(tmp_path / "old.h5"), "--quiet"]) == 0
    runs.run(cfg, tmp_path / "new.h5")
    from helpers import assert_same_logs

    assert_same_logs(read_run(tmp_path / "old.h5"), read_run(tmp_path / "new.h5"))
    assert main(["summary", str(tmp_path / "old.h5")]) == 0


@pytest.mark.skipif(shutil.which("h5ls") is None or shutil.which("h5dump") is None,
                    reason="the HDF5 command-line tools are not installed (apt install hdf5-tools)")
def test_the_systems_hdf5_tools_read_every_dataset(logs):
    listing = subprocess.run(["h5ls", "-r", str(logs["measured"])], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "ERROR" not in listing.stdout + listing.stderr
    for name in ("/participation/selected", "/participation/late", "/participation/nonfinite", "/metrics/clock_s",
                 "/participation/cpu_percent", "/trajectory/x"):
        assert re.search(rf"^{re.escape(name)}\s+Dataset", listing.stdout, re.M), name
    dump = subprocess.run(["h5dump", "-A", str(logs["measured"])], capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0 and "error" not in dump.stderr.lower()
    values = subprocess.run(["h5dump", "-d", "/participation/selected", "-y", "-w", "0", str(logs["measured"])],
                            capture_output=True, text=True, timeout=60)
    assert values.returncode == 0
    got = re.search(r"DATA \{\s*(.*?)\s*\}", values.stdout, re.S).group(1)
    flags = [int(v) for v in re.findall(r"TRUE|FALSE|\d+", got.replace("TRUE", "1").replace("FALSE", "0"))]
    assert flags == read_run(logs["measured"])["participation/selected"].astype(int).ravel().tolist()
