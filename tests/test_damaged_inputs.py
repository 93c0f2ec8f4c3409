"""Bad files and a full disk: every damaged or foreign file kind, for every verb that reads logs, is one line
and exit 2 within seconds, and the file is left as it was; a full disk ends a run with one line and a log
that resumes to the uninterrupted one; out-of-range seeds and diverging runs are said plainly."""

import resource
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed.cli import main
from edgefed.orchestration import run as runs
from edgefed.orchestration.resume import resolve_config
from edgefed.runlog import read_run

from helpers import assert_same_logs

ROUNDS = ["rounds=4", "data.clients=6", "train.clients_per_round=3", "train.local_steps=5"]


def corrupt_header(good: bytes, path, dataset: str, offset: int, fill: bytes) -> None:
    """The log with bytes of one object header overwritten: the version byte area (offset 4) makes HDF5
    refuse the header, a later area (offset 40) fails its checksum (what SWMR readers retry)."""
    tmp = path.with_suffix(".src")
    tmp.write_bytes(good)
    with h5py.File(tmp, "r") as f:
        addr = h5py.h5o.get_info((f[dataset] if dataset != "/" else f).id).addr
    data = bytearray(good)
    data[addr + offset:addr + offset + len(fill)] = fill
    path.write_bytes(bytes(data))
    tmp.unlink()


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damaged")
    good_path = folder / "good.h5"
    runs.run(config_mod.load_config(None, ROUNDS), good_path)
    good = good_path.read_bytes()
    with h5py.File(folder / "foreign.h5", "w") as f:
        f["x"] = np.arange(3)
    kinds = {"truncated": good[: len(good) // 2], "empty": b"", "random": np.random.default_rng(0).bytes(40_000),
             "text": b"round,loss\n1,2.3\n", "foreign": (folder / "foreign.h5").read_bytes()}
    paths = {}
    for kind, data in kinds.items():
        paths[kind] = folder / f"{kind}.h5"
        paths[kind].write_bytes(data)
    for kind, dataset, offset, fill in (("bad header", "participation/steps", 4, b"\xff" * 60),
                                        ("bad root", "/", 4, b"\xff" * 60),
                                        ("bad checksum", "participation/steps", 40, b"\x00" * 8)):
        paths[kind] = folder / f"{kind.replace(' ', '-')}.h5"
        corrupt_header(good, paths[kind], dataset, offset, fill)
    return paths


VERBS = {
    "resume": lambda p, tmp: ["run", "--resume", str(p), "--quiet"],
    "replay": lambda p, tmp: ["run", *[a for o in ROUNDS for a in ("--set", o)], "--set", 'participation.mode="trace"',
                              "--set", f'participation.trace="{p}"', "--out", str(tmp / "r.h5"), "--quiet"],
    "summary": lambda p, tmp: ["summary", str(p)],
    "report": lambda p, tmp: ["report", str(p), "--out", str(tmp / "p.html")],
    "export": lambda p, tmp: ["export", str(p), "--csv", str(tmp / "csv")],
    "trace show": lambda p, tmp: ["trace", "show", str(p)],
}
KINDS = ["truncated", "empty", "random", "text", "foreign", "bad header", "bad root", "bad checksum"]


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_damaged_or_foreign_file_is_one_line_fast_and_untouched(damaged, tmp_path, capsys, verb):
    for kind in KINDS:
        path = damaged[kind]
        before = path.read_bytes()
        started = time.monotonic()
        code = main(VERBS[verb](path, tmp_path))
        took = time.monotonic() - started
        out, err = capsys.readouterr()
        assert code == 2, (verb, kind, out, err)
        assert err.count("\n") == 1 and err.startswith("edgefed: error: ") and str(path) in err, (verb, kind, err)
        assert took < 5, (verb, kind, took)
        assert path.read_bytes() == before, (verb, kind)
        assert not (tmp_path / "r.h5").exists() and not (tmp_path / "p.html").exists()
    assert "damaged" in err or "is an HDF5 file, not a trace file" in err  # the last kind: a bad checksum


def test_a_full_disk_ends_the_run_with_one_line_and_a_log_that_resumes(tmp_path):
    overrides = ["rounds=300"]
    whole = tmp_path / "whole.h5"
    runs.run(config_mod.load_config(None, overrides), whole)  # also warms the kernel cache (writes no file later)
    part = tmp_path / "part.h5"

    def small_disk():  # as if the card held 2 MB: writes past it fail (EFBIG) instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_500_000, 2_500_000))

    done = subprocess.run([sys.executable, "-m", "edgefed", "run", "--set", overrides[0], "--out", str(part),
                           "--quiet"], preexec_fn=small_disk, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f"the disk holding run log {part} is full" in done.stderr
    assert f"free space or move the log, then edgefed run --resume {part}" in done.stderr
    _, point = resolve_config(None, [], str(part))
    assert 0 < point.rounds_done < 300
    assert main(["run", "--resume", str(part), "--quiet"]) == 0
    assert_same_logs(read_run(whole), read_run(part))


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1", str(2**64)])
def test_a_seed_outside_64_bits_is_one_line(tmp_path, capsys, seed):
    assert main(["run", "--set", f"seed={seed}", "--out", str(tmp_path / "r.h5")]) == 2
    err = capsys.readouterr().err
    assert err == f"edgefed: error: config: seed = {seed} is out of range; give an integer from 0 to {2**64 - 1}\n"
    assert not (tmp_path / "r.h5").exists()


def test_the_largest_seed_runs(tmp_path):
    runs.run(config_mod.load_config(None, ["rounds=1", f"seed={2**64 - 1}"]), tmp_path / "r.h5")
    assert int(read_run(tmp_path / "r.h5")["attrs"]["seed"]) == 2**64 - 1


def test_a_diverging_run_says_so_once_and_goes_on(tmp_path, capsys):
    assert main(["run", "--set", "rounds=6", "--set", "train.lr_local=1e30", "--out", str(tmp_path / "r.h5")]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: the train loss") == 1 and "diverges" in out and "round 6/6" in out
    assert main(["run", "--set", "rounds=6", "--out", str(tmp_path / "ok.h5")]) == 0
    assert "warning" not in capsys.readouterr().out
