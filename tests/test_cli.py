"""The command line: the bad-input table (exit 2, one line, no traceback, nothing overwritten) and runs."""

import subprocess
import sys

import h5py
import numpy as np
import pytest

from edgefed.cli import main
from edgefed.runlog import read_run

EXISTING = b"a file the user cares about\n"


@pytest.fixture
def guarded(tmp_path):
    """An existing file at --out that a failed run must leave untouched."""
    path = tmp_path / "existing.h5"
    path.write_bytes(EXISTING)
    return path


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


QUAD = '[data]\nkind = "quadratic"\npath = "{path}"\n[train]\nclients_per_round = "all"\n'


def quad_arrays(tmp_path, name, **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


BAD_CONFIGS = {
    "unknown key": ("[train]\nlocal_step = 3\n", "unknown key [train] 'local_step'; did you mean 'local_steps'?"),
    "wrong type": ("[train]\nlocal_steps = \"ten\"\n", "train.local_steps = 'ten' is a string"),
    "S > N": ("[data]\nclients = 5\n", "train.clients_per_round = 10 exceeds the 5 devices"),
    "K < 1": ("[train]\nlocal_steps = 0\n", "train.local_steps = 0; K must be at least 1"),
    "lr <= 0": ("[train]\nlr_local = -0.1\n", "train.lr_local = -0.1 must be positive"),
    "batch <= 0": ("[train]\nbatch_size = -3\n", "train.batch_size = -3 must be positive"),
    "unknown kind": ("[model]\nkind = \"resnet\"\n", "model.kind = 'resnet' is not known"),
    "not TOML": ("[train\n", "is not valid TOML"),
    "unknown rule": ("[participation]\nscheme = \"nova\"\n",
                     "participation.scheme = 'nova' is not known; did you mean 'fednova'?"),
    "mu < 0": ("[train]\nalgorithm = \"fedprox\"\n[fedprox]\nmu = -1\n", "fedprox.mu = -1.0 must be a finite number >= 0"),
    "fedprox table alone": ("[fedprox]\nmu = 0.1\n",
                            'fedprox.mu applies to train.algorithm = "fedprox", not \'fedavg\''),
    "unknown algorithm": ("[train]\nalgorithm = \"fedpox\"\n", "did you mean 'fedprox'?"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_line(tmp_path, capsys, guarded, case):
    text, message = BAD_CONFIGS[case]
    code, out, err = run_cli(["run", write(tmp_path, "c.toml", text), "--out", str(guarded), "--force"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("edgefed: error: ") and message in err
    assert guarded.read_bytes() == EXISTING


def test_bad_problem_files(tmp_path, capsys, guarded):
    cases = {
        "missing": (str(tmp_path / "nope.npz"), "nope.npz not found"),
        "corrupt": (write(tmp_path, "corrupt.npz", "not a zip"), "cannot be read as .npz"),
        "no b": (quad_arrays(tmp_path, "nob.npz", A=np.ones((3, 2))), "lacks b"),
        "b shape": (quad_arrays(tmp_path, "bshape.npz", A=np.ones((3, 2)), b=np.ones((3, 3))),
                    "b has shape (3, 3); expected A's shape (3, 2)"),
        "A 1-d": (quad_arrays(tmp_path, "a1d.npz", A=np.ones(3), b=np.ones(3)), "A has shape (3,)"),
        "n shape": (quad_arrays(tmp_path, "nshape.npz", A=np.ones((3, 2)), b=np.ones((3, 2)), n=np.ones(4)),
                    "n has shape (4,); expected (3,)"),
        "n zero": (quad_arrays(tmp_path, "nzero.npz", A=np.ones((3, 2)), b=np.ones((3, 2)), n=np.zeros(3)),
                   "n must hold positive integer record counts"),
        "x0 shape": (quad_arrays(tmp_path, "x0.npz", A=np.ones((3, 2)), b=np.ones((3, 2)), x0=np.ones(3)),
                     "x0 has shape (3,); expected (2,)"),
        "nan": (quad_arrays(tmp_path, "nan.npz", A=np.full((3, 2), np.nan), b=np.ones((3, 2))),
                "A holds NaN or infinite values"),
    }
    for name, (path, message) in cases.items():
        cfg = write(tmp_path, "q.toml", QUAD.format(path=path))
        code, out, err = run_cli(["run", cfg, "--out", str(guarded), "--force"], capsys)
        assert code == 2, name
        assert err.count("\n") == 1 and message in err, (name, err)
        assert guarded.read_bytes() == EXISTING


def test_clients_must_agree_with_the_problem_file(tmp_path, capsys):
    path = quad_arrays(tmp_path, "q.npz", A=np.ones((3, 2)), b=np.ones((3, 2)))
    cfg = write(tmp_path, "q.toml", QUAD.format(path=path) + "")
    code, _, err = run_cli(["run", cfg, "--set", "data.clients=4", "--out", str(tmp_path / "o.h5")], capsys)
    assert code == 2 and "data.clients = 4 but the problem file" in err
    code, _, err = run_cli(["run", cfg, "--set", "train.clients_per_round=5", "--out", str(tmp_path / "o.h5")],
                           capsys)
    assert code == 2 and "train.clients_per_round = 5 exceeds the 3 devices" in err


def test_existing_log_is_not_replaced_without_force(tmp_path, capsys, guarded):
    code, _, err = run_cli(["run", "--set", "rounds=1", "--out", str(guarded)], capsys)
    assert code == 2 and "already exists; use --resume" in err
    assert guarded.read_bytes() == EXISTING


def test_resume_of_foreign_files(tmp_path, capsys):
    text = tmp_path / "notes.h5"
    text.write_text("hello")
    code, _, err = run_cli(["run", "--resume", str(text)], capsys)
    assert code == 2 and "is not an HDF5 file" in err and err.count("\n") == 1
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    code, _, err = run_cli(["run", "--resume", str(other)], capsys)
    assert code == 2 and "is not an edgefed run log" in err
    assert other.stat().st_size > 0 and h5py.File(other, "r")["x"][()].tolist() == [0, 1, 2]
    code, _, err = run_cli(["run", "--resume", str(tmp_path / "absent.h5")], capsys)
    assert code == 2 and "not found" in err


def test_resume_with_a_different_config_is_refused(tmp_path, capsys):
    log = tmp_path / "run.h5"
    code, _, _ = run_cli(["run", "--set", "rounds=2", "--set", "data.clients=4", "--set",
                          "train.clients_per_round=2", "--out", str(log), "--quiet"], capsys)
    assert code == 0
    before = log.read_bytes()
    code, _, err = run_cli(["run", "--resume", str(log), "--set", "train.lr_local=0.5"], capsys)
    assert code == 2 and "belongs to a different config (differs in train.lr_local)" in err
    assert log.read_bytes() == before


def test_progress_lines_and_summary(tmp_path, capsys):
    code, out, err = run_cli(["run", "--set", "rounds=3", "--out", str(tmp_path / "r.h5")], capsys)
    lines = out.strip().splitlines()
    assert code == 0 and err == ""
    assert lines[0].startswith("SYNTHETIC(1,1): 30 devices") and "model logreg, d = 610 float32" in lines[0]
    lines = lines[1:]
    assert len(lines) == 5 and lines[0].startswith("round 0/3") and lines[3].startswith("round 3/3")
    assert "participants  10/30" in lines[1] and "test_acc" in lines[1] and " ms" in lines[1]
    assert lines[-1].startswith("done: 3 rounds in") and str(tmp_path / "r.h5") in lines[-1]


def test_entry_point_default_run_and_one_line_error(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "edgefed", "run", "--set", "rounds=4", "--out",
                         str(tmp_path / "d.h5"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert read_run(tmp_path / "d.h5")["metrics/test_accuracy"].shape == (5,)
    bad = subprocess.run([sys.executable, "-m", "edgefed", "run", "--set", "train.local_step=3"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
    usage = subprocess.run([sys.executable, "-m", "edgefed", "rn"], capture_output=True, text=True, timeout=300)
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1


def test_ctrl_c_names_the_log_to_resume_and_exits_130(tmp_path, capsys, monkeypatch):
    from edgefed import cli

    honest = cli.progress_line

    def ctrl_c_after_round_2(s):
        if s.round_idx == 3:
            raise KeyboardInterrupt
        return honest(s)

    monkeypatch.setattr(cli, "progress_line", ctrl_c_after_round_2)
    log = tmp_path / "r.h5"
    code, _, err = run_cli(["run", "--set", "rounds=5", "--out", str(log)], capsys)
    assert code == 130 and err == f"edgefed: interrupted; continue with: edgefed run --resume {log}\n"
    assert read_run(log)["state/round"][0] == 3  # round 3 was logged before its progress line
    monkeypatch.undo()
    code, out, _ = run_cli(["run", "--resume", str(log), "--quiet"], capsys)
    assert code == 0 and "done: 2 rounds" in out


def test_a_failed_measurement_is_an_error_not_an_empty_profile(capsys, monkeypatch):
    from edgefed.orchestration import profiling

    def broken(*args, **kwargs):
        raise RuntimeError("no timer on this board")

    monkeypatch.setattr(profiling, "measure", broken)
    code, out, err = run_cli(["profile", "--models", "logreg", "--no-cold"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("edgefed: error: profiling failed on ") and err.endswith(
        ": RuntimeError: no timer on this board\n")
