"""`edgefed sweep`: a grid of experiments (axes x seeds) into one folder of ordinary run logs and two tables.

The sweep file (docs/sweeps.md): `base` (a config file, relative to the sweep file; without it the
built-in default), `seeds`, `[set]` (dotted keys applied to every run, as --set), `[axes]` (dotted keys, each
a list of values: every combination is a cell) and `[target]` (test_accuracy: report rounds and clock seconds
to reach it). Precedence: base < set < axes < seed. Every run's config is built and checked before anything
runs. Running the same command again skips complete runs (their logs untouched), resumes interrupted ones and
runs the missing; a failed run is recorded with its one-line error and the others go on. With -j N, N runs
at a time (each its own process); under mpiexec the runs are dealt over the ranks, each in one process.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomli_w

from edgefed import config as config_mod
from edgefed.analysis.logs import Run
from edgefed.errors import EXIT_BAD_INPUT, ConfigError, EdgefedError
from edgefed.orchestration import run as runs
from edgefed.orchestration.resume import resolve_config
from edgefed.outputs import check_output
from edgefed.runtime.mpi.comm import wait, world

KEYS = ("base", "seeds", "set", "axes", "target")
TARGETS = ("test_accuracy",)
FIGURES = ("final_test_accuracy", "best_test_accuracy", "final_train_loss", "wall_s", "clock_s", "bytes_up_per_round",
           "bytes_down_per_round", "epsilon")
TARGET_FIGURES = ("rounds_to_target", "clock_to_target_s")
ENERGY_FIGURES = ("energy_j", "energy_to_target_j")  # (the last columns: added since; the second with a target)
REACHED = TARGET_FIGURES + ENERGY_FIGURES[1:]  # the figures a seed has only when it reached the target


def _figures(target: float | None) -> tuple[str, ...]:
    """The figures of summary.csv's rows, in its columns' order."""
    return FIGURES + (TARGET_FIGURES if target is not None else ()) + ENERGY_FIGURES[:1 if target is None else 2]


@dataclass(frozen=True)
class Job:
    """One run of the grid."""

    cell: str  # "scheme=A, trace=builtin:4": the cell's axis values, as a name
    values: tuple  # (dotted key, value) of each axis
    seed: int
    log: str  # path relative to the sweep folder
    raw: dict  # the config as TOML data (base, set, axes, seed)


@dataclass(frozen=True)
class Sweep:
    path: Path
    axes: tuple[str, ...]  # the dotted key of every axis (a linked axis gives each of its keys)
    target: float | None
    jobs: tuple[Job, ...]
    base: dict = field(default_factory=dict)  # the base config and [set] as read, what every cell adds its values to
    settings: dict = field(default_factory=dict)


def _inline_toml(value) -> str:
    """A value as inline TOML, on one line (tomli_w writes arrays of tables over several)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_inline_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_inline_toml(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).partition("=")[2].strip()


def _value_text(value) -> str:
    """An axis value as written in the sweep file (strings bare)."""
    return value if isinstance(value, str) else _inline_toml(value)


def _slug(text: str) -> str:
    words = "".join(ch if ch.isalnum() or ch in "." else " " for ch in text).split()
    return "-".join(words)[:60]


def _log_name(cell: str, values) -> str:
    """A cell's log name from its values alone (its words, then a digest that keeps apart cells whose words
    agree), so growing an axis leaves every existing cell's logs where they are."""
    return f"{_slug(cell) or 'run'}-{hashlib.sha1(repr(values).encode()).hexdigest()[:8]}"


def _cell_name(values) -> str:
    """"scheme=A, trace=builtin:4": each axis by its last key part, unless two axes share it."""
    short = [k.rpartition(".")[2] for k, _ in values]
    names = short if len(set(short)) == len(short) else [k for k, _ in values]
    return ", ".join(f"{n}={_value_text(v)}" for n, (_, v) in zip(names, values)) or "all"


def _dotted(table: dict, prefix: str = "") -> dict:
    """{"train": {"lr_local": ...}} (TOML's reading of a bare `train.lr_local = ...`) as {"train.lr_local": ...},
    so a bare dotted key sets one key, as a quoted one does, and never replaces the base's whole table."""
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


PROGRESS_RUNS = 1000  # a sweep of at least this many runs says that it is checking their configs
PROGRESS_S = 2.0  # and how far it got, this often


def read_sweep(path: Path, on_progress=None) -> Sweep:
    """The sweep file, expanded and every run's config checked (ConfigError naming the axis and value);
    on_progress: told what is being checked, with a count, when there are many runs."""
    where = f"sweep {path}"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{where} is not a readable TOML file ({exc})") from None
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a sweep has {', '.join(KEYS)}")
    base = {}
    if "base" in raw:
        if not isinstance(raw["base"], str):
            raise ConfigError(f"{where}: base must be the path of a config file")
        try:
            base = config_mod.read_toml(path.parent / raw["base"])
        except ConfigError as exc:
            raise ConfigError(f"{where}: base: {exc}") from None
        config_mod.absolute_paths(base, (path.parent / raw["base"]).parent, str(path.parent / raw["base"]))
    seeds = raw.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds
                              or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise ConfigError(f"{where}: seeds must be a non-empty list of non-negative integers, e.g. seeds = [0, 1, 2]")
    if seeds is not None and len(set(seeds)) < len(seeds):
        raise ConfigError(f"{where}: seeds lists a seed twice; give each seed once")
    settings = raw.get("set", {})
    axes = raw.get("axes", {})
    for name, table in (("set", settings), ("axes", axes)):
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{name}] must be a table of dotted keys")
    settings, axes = _dotted(settings), _dotted(axes)
    for key in config_mod.PATH_KEYS:  # a file named in the sweep: relative to the sweep file
        if key in settings:
            settings[key] = config_mod.absolute_value(key, settings[key], path.parent, str(path))
        if isinstance(axes.get(key), list):
            axes[key] = [config_mod.absolute_value(key, v, path.parent, str(path)) for v in axes[key]]
    groups = []  # (keys, value tuples): an axis "a.x,a.y" links keys that move together
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: axis {key!r} must be a non-empty list of values")
        keys = tuple(k.strip() for k in key.split(","))
        if len(keys) > 1 and not all(isinstance(v, list) and len(v) == len(keys) for v in values):
            raise ConfigError(f"{where}: axis {key!r} links {len(keys)} keys: each value must be a list of "
                              f"{len(keys)}, one per key, e.g. [{', '.join(['0.5'] * len(keys))}]")
        groups.append((keys, [tuple(v) if len(keys) > 1 else (v,) for v in values]))
    columns = [k for keys, _ in groups for k in keys]
    if len(set(columns)) < len(columns):
        raise ConfigError(f"{where}: a key appears in two axes; give each key one axis")
    target = None
    if "target" in raw:
        bad = [k for k in raw["target"] if k not in TARGETS] if isinstance(raw["target"], dict) else ["?"]
        if bad:
            raise ConfigError(f"{where}: [target] takes {', '.join(TARGETS)}, not {bad[0]!r}")
        target = raw["target"].get("test_accuracy")
        if target is not None and not (isinstance(target, (int, float)) and 0 < target <= 1):
            raise ConfigError(f"{where}: target test_accuracy = {target!r} must lie in (0, 1]")
    jobs = []
    total = math.prod(len(values) for _, values in groups) * (len(seeds) if seeds is not None else 1)
    say = on_progress if on_progress is not None and total >= PROGRESS_RUNS else None
    if say:
        say(f"sweep: checking the configs of {total:,} runs")
    said = time.perf_counter()
    for combo in itertools.product(*(values for _, values in groups)):
        values = tuple((k, v) for (keys, _), picked in zip(groups, combo) for k, v in zip(keys, picked))
        cell = _cell_name(values)
        for seed in seeds if seeds is not None else [None]:
            if say and jobs and time.perf_counter() - said >= PROGRESS_S:
                say(f"sweep: checked {len(jobs):,} of {total:,} configs")
                said = time.perf_counter()
            try:
                cfg_raw = _merged(base, settings, values, seed, where)
            except ConfigError:
                _blame_one_axis(base, settings, values, seed, where)
                raise
            seed = cfg_raw.get("seed", 0)
            log = f"runs/{_log_name(cell, values)}-seed{seed}.h5"
            jobs.append(Job(cell, values, seed, log, cfg_raw))
    return Sweep(path, tuple(columns), None if target is None else float(target), tuple(jobs), base, settings)


def _blame_one_axis(base: dict, settings: dict, values, seed, where: str) -> None:
    """Raise the error of the first axis value that fails on its own, so the message names it."""
    for value in values:
        try:
            _merged(base, settings, (value,), seed, where)
        except ConfigError as exc:
            alone = exc
            try:
                _merged(base, settings, (), seed, where)
            except ConfigError:
                return  # base + set fail without this axis too: the cell's message says more
            raise alone from None


def _merged(base: dict, settings: dict, values, seed, where: str) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    try:
        for key, value in settings.items():
            config_mod.set_key(raw, key, value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: [set]: {exc}") from None
    for key, value in values:
        try:
            config_mod.set_key(raw, key, value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: axis {key!r}: {exc}") from None
    if seed is not None:
        raw["seed"] = seed
    try:
        config_mod.config_from_dict(raw)
    except ConfigError as exc:
        what = ", ".join(f"{k!r} = {_value_text(v)}" for k, v in values)
        what = ("axis " if len(values) == 1 else "cell ") + what if values else ("[set]" if settings else "base")
        raise ConfigError(f"{where}: {what}: {exc}") from None
    return raw


# -- running ----------------------------------------------------------------------------------------------
def _state(folder: Path, job: Job) -> tuple[str, object]:
    """("complete" | "resume" | "new" | "failed", resume point or error) of a job's log as it is now."""
    path = folder / job.log
    if not path.exists():
        return "new", None
    try:
        _, point = resolve_config(None, [], str(path))
    except EdgefedError as exc:
        return "failed", f"{exc} (delete {path} to run it afresh)"
    _, diffs = config_mod.log_differences(config_mod.config_from_dict(job.raw), point.config_toml, str(path))
    if diffs:
        return "failed", (f"{path} belongs to another config (differs in {', '.join(diffs)}); delete it or use "
                          "another --out")
    return ("complete" if point.complete else "resume"), point


Outcome = tuple[str, "str | None"]  # (what happened: "skipped" | "resumed" | "ran", the one-line error or None)


def _run_here(folder: Path, job: Job) -> Outcome:
    """Run (or resume) one job in this process."""
    state, point = _state(folder, job)
    if state in ("complete", "failed"):
        return "skipped", point if state == "failed" else None
    what = "resumed" if state == "resume" else "ran"
    try:
        runs.run(config_mod.config_from_dict(job.raw), folder / job.log,
                 resume_point=point if state == "resume" else None)
    except EdgefedError as exc:
        return what, str(exc)
    except Exception as exc:  # noqa: BLE001 - one run's failure must not end the sweep
        return what, f"{type(exc).__name__}: {exc}"
    return what, None


def _run_apart(folder: Path, job: Job) -> Outcome:
    """Run (or resume) one job in a process of its own (for -j N)."""
    state, point = _state(folder, job)
    if state in ("complete", "failed"):
        return "skipped", point if state == "failed" else None
    what = "resumed" if state == "resume" else "ran"
    path = folder / job.log
    if state == "resume":
        cmd = ["run", "--resume", str(path)]
    else:
        cfg = folder / "configs" / (Path(job.log).stem + ".toml")
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(tomli_w.dumps(job.raw), encoding="utf-8")
        cmd = ["run", str(cfg), "--out", str(path)]
    done = subprocess.run([sys.executable, "-m", "edgefed", *cmd, "--quiet"], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return what, (lines[-1] if lines else f"exit code {done.returncode}").removeprefix("edgefed: error: ")
    return what, None


def row_of(folder: Path, job: Job, target: float | None, error: str | None) -> dict:
    """The job's summary.csv row, from its log."""
    row = {"cell": job.cell, **{k: _value_text(v) for k, v in job.values}, "seed": job.seed, "log": job.log}
    figures = dict.fromkeys(("rounds", *_figures(target)), "")
    status = "failed" if error else "complete"
    if (folder / job.log).is_file():
        try:
            run = Run.read(folder / job.log)
            status = "failed" if error else run.status
            figures.update({"rounds": run.rounds, "final_test_accuracy": run.final("test_accuracy"),
                            "best_test_accuracy": run.best("test_accuracy"), "final_train_loss": run.final("train_loss"),
                            "wall_s": run.wall_s(), "clock_s": float(run.clock[-1]),
                            "bytes_up_per_round": run.bytes_per_round("up"),
                            "bytes_down_per_round": run.bytes_per_round("down")})
            private = run.privacy()
            if private is not None:
                figures["epsilon"] = private["epsilon"]
            spent = run.spent_j()
            if spent is not None:
                figures["energy_j"] = float(spent[-1])
            if target is not None:
                rounds, seconds = run.to_target(target)
                figures.update({"rounds_to_target": "" if math.isnan(rounds) else int(rounds),
                                "clock_to_target_s": seconds,
                                "energy_to_target_j": "" if spent is None else run.energy_to_target(target)})
        except EdgefedError as exc:
            status, error = "failed", error or str(exc)
    energy = {name: figures.pop(name) for name in ENERGY_FIGURES if name in figures}  # (after error: added since)
    return {**row, "status": status, **figures, "error": error or "", **energy}


def cell_rows(rows: list[dict], axes, target: float | None) -> list[dict]:
    """cells.csv: per cell, the seeds that completed and mean and std of each figure over them."""
    out = []
    names = _figures(target)
    for cell in dict.fromkeys(r["cell"] for r in rows):
        mine = [r for r in rows if r["cell"] == cell]
        done = [r for r in mine if r["status"] == "complete"]
        row = {"cell": cell, **{k: mine[0][k] for k in axes}, "seeds": len(done)}
        for name in names:
            values = np.array([float(r[name]) for r in done if r[name] != "" and math.isfinite(float(r[name]))])
            row[f"{name}_mean"] = float(values.mean()) if values.size else ""
            row[f"{name}_std"] = float(values.std()) if values.size else ""
            if name in REACHED:
                row[f"{name}_reached"] = int(values.size)
        out.append(row)
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["cell"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (repr(v) if isinstance(v, float) and not math.isnan(v) else
                                 "" if isinstance(v, float) else v) for k, v in row.items()})
    tmp.replace(path)


def _headline(row: dict) -> str:
    def num(key, spec):
        value = row.get(key, "")
        return "-" if value == "" or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    if row["status"] == "failed":
        return f"FAILED: {row['error']}"
    text = f"test acc {num('final_test_accuracy', '.4f')} (best {num('best_test_accuracy', '.4f')}), " \
           f"clock {num('clock_s', '.3f')} s"
    if "rounds_to_target" in row:
        text += f", target at round {num('rounds_to_target', '.0f')}"
    return text


TABLES = {"summary.csv": {"cell", "seed", "log", "status"}, "cells.csv": {"cell", "seeds"}}  # name: its columns


def check_tables(folder: Path) -> None:
    """The sweep's tables in folder are rewritten at the end (running a sweep again resumes it), but a file of
    that name that is not a sweep's table is never replaced."""
    for name, columns in TABLES.items():
        path = folder / name
        if not path.exists():
            continue
        try:
            with open(path, newline="", encoding="utf-8") as f:
                header = set(next(csv.reader(f), []))
        except (OSError, UnicodeDecodeError, csv.Error):
            header = set()
        if not columns <= header:
            raise EdgefedError(f"{path} is there and is not a sweep's table; it is never replaced: choose another --out "
                               "(a new folder, or one a sweep wrote)")


def plan_runs(sweep: Sweep, folder: Path, indices, on_progress=None) -> str | None:
    """Plan every run of `indices` still to run (run.dry_run: its model against its data, its files read as far
    as the run reads them before its first round), writing nothing; the first that cannot run, as one line
    naming its cell and seed and why (None: all can). Runs that share their data (and seed) are planned one
    after another and read it once; one problem is held at a time."""
    todo = [i for i in indices if not (folder / sweep.jobs[i].log).exists()]  # (logs there: skipped or resumed)
    configs = {i: config_mod.config_from_dict(sweep.jobs[i].raw) for i in todo}
    groups: dict = {}
    for i in todo:
        groups.setdefault(runs.problem_key(configs[i]), []).append(i)
    done, said = 0, time.perf_counter()
    for group in groups.values():
        problems = {}  # this group's problem, dropped before the next group's is built
        for i in group:
            job = sweep.jobs[i]
            if on_progress is not None and time.perf_counter() - said >= PROGRESS_S:
                on_progress(f"sweep: planned {done:,} of {len(todo):,} runs")
                said = time.perf_counter()
            done += 1
            try:
                for name in TABLES:  # the tables the sweep rewrites at its end are no run's input
                    check_output(folder / name, force=True, inputs=config_mod.files_read(configs[i]), flag="--out")
                runs.dry_run(configs[i], folder / job.log, problems)
            except EdgefedError as exc:
                return f"sweep {sweep.path}: {_blame(sweep, job, exc)}; nothing was run or written"
    return None


def _blame(sweep: Sweep, job: Job, exc: EdgefedError) -> str:
    """Who a run that cannot run is to be blamed on: its cell, or (when the base config and [set] fail the same
    way without any axis value) the sweep's base."""
    if job.values:
        try:
            raw = _merged(sweep.base, sweep.settings, (), job.seed, str(sweep.path))
            runs.dry_run(config_mod.config_from_dict(raw), Path(job.log), None)
        except EdgefedError as alone:
            if str(alone) == str(exc):
                return f"its base config and [set] cannot run, in any cell: {exc}; fix base or [set]"
    return f"cell {job.cell!r}, seed {job.seed} cannot run: {exc}; fix the cell, or remove its value from the axis"


def run_sweep(path: Path, folder: Path, jobs: int = 1, on_line=print, live: bool = False) -> int:
    """Run the sweep into folder; 0 if every run completed, 1 if any failed. Every run still to run is planned
    first: a run that cannot run ends the sweep before any runs (exit 2), with nothing written (but a LEAF
    folder's converted copy, which its runs read)."""
    comm = world()
    sweep = read_sweep(path, on_line if comm is None or comm.Get_rank() == 0 else None)
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    if jobs > 1 and comm is not None:
        raise EdgefedError("-j runs experiments side by side on one machine; under mpiexec the ranks do that, "
                           "so drop -j (or run without mpiexec)")
    mine = list(range(rank, len(sweep.jobs), size))
    check_tables(folder)
    failure = plan_runs(sweep, folder, mine, on_line if rank == 0 else None)
    if comm is not None:  # each rank plans its own runs; any rank's failure stops them all
        failures = [f for f in comm.allgather(failure) if f]
        failure = failures[0] if failures else None
        if failure is not None and rank != 0:
            return EXIT_BAD_INPUT
    if failure is not None:
        raise ConfigError(failure)
    try:
        (folder / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EdgefedError(f"cannot write the sweep into {folder} ({exc}); choose another --out") from None
    started, finished, ran = time.perf_counter(), 0, 0
    errors: dict[int, str | None] = {}

    def report(i: int, outcome: Outcome) -> None:
        nonlocal finished, ran
        what, error = outcome
        errors[i] = error
        finished += 1
        ran += what != "skipped"
        eta = (time.perf_counter() - started) / max(ran, 1) * (len(mine) - finished)  # skipped runs cost nothing
        job = sweep.jobs[i]
        prefix = "" if size == 1 else f"[rank {rank}] "
        done = "already complete: " if what == "skipped" and not error else "resumed: " if what == "resumed" else ""
        line = (f"{prefix}run {finished}/{len(mine)}: {job.cell}, seed {job.seed}: {done}"
                f"{_headline(row_of(folder, job, sweep.target, error))}; ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        if live:
            bar = "#" * round(30 * finished / len(mine))
            on_line(f"\r\033[K{line}\n[{bar:<30}] {finished}/{len(mine)}" + ("\n" if finished == len(mine) else ""))
        else:
            on_line(line)

    if jobs > 1:
        pool = ThreadPoolExecutor(jobs)
        try:
            futures = {pool.submit(_run_apart, folder, sweep.jobs[i]): i for i in mine}
            for future in as_completed(futures):
                report(futures[future], future.result())
        finally:  # Ctrl-C: no queued run starts (the running ones got the signal too)
            pool.shutdown(wait=False, cancel_futures=True)
    else:
        for i in mine:
            report(i, _run_here(folder, sweep.jobs[i]))
    if comm is not None:
        wait(comm.Ibarrier(), poll_max_s=0.05)  # ranks done early sleep here instead of spinning in gather
        gathered = comm.gather(errors, root=0)
        if rank != 0:
            return comm.bcast(None, root=0)
        errors = {i: e for part in gathered for i, e in part.items()}
    rows = [row_of(folder, job, sweep.target, errors.get(i)) for i, job in enumerate(sweep.jobs)]
    _write_csv(folder / "summary.csv", rows)
    _write_csv(folder / "cells.csv", cell_rows(rows, sweep.axes, sweep.target))
    failed = sum(r["status"] == "failed" for r in rows)
    on_line(f"sweep: {len(rows)} runs in {len(set(r['cell'] for r in rows))} cells, {failed} failed; "
            f"{folder / 'summary.csv'}, {folder / 'cells.csv'}")
    code = 1 if failed else 0
    return code if comm is None else comm.bcast(code, root=0)
