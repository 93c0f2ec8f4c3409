"""`edgefed warmup` and `edgefed profile`: fill the kernel cache, and measure the machines a run will use.

Warm-up calls every kernel entry point a run can reach (local steps with and without SCAFFOLD's
correction, a single oracle call, full loss and gradient, evaluation) for each model and dtype, so Numba
compiles them into its on-disk cache once per board instead of inside a round's deadline.

A profile (hwprofile.py's format) measures, on this machine: local SGD steps per second of every model at
its usual batch sizes (one thread, float32), the start-up of a fresh process that builds a device and takes
its first step with an empty cache (cold: Numba compiles) and with a filled one (warm), that process's
resident memory, what a device rank costs its board beside its steps (rank_cost.py), and, under
`mpirun`, the broadcast and gather of each model's parameters. Under `mpirun`
one leader rank per host measures it while the others sleep; rank 0 checks every input and target file
before anything is measured, and any failure ends every rank (exit 2), so no rank waits forever.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np

from edgefed import __version__, hwprofile
from edgefed import layers as layer_lib
from edgefed.config.policies import DEFAULT_WIDTHS
from edgefed.errors import EXIT_BAD_INPUT, EdgefedError
from edgefed.kernels import jit_compilations, ops
from edgefed.models import Quadratic, Sequential, warm_model
from edgefed.orchestration import rank_cost
from edgefed.outputs import check_output
from edgefed.problems.data import ClassificationData, QuadraticData
from edgefed.rng import Purpose, kernel_state
from edgefed.runtime.mpi.comm import wait

# The batch sizes each model is measured at: the papers' usual ones (and 64 for the 2NN).
BENCH_MODELS = {
    "logreg": (20,),
    "mlp": (10, 64),
    "cnn": (10,),
    "charlstm": (10,),
}
RECOMMENDED_BATCH = {"logreg": 20, "mlp": 10, "cnn": 10, "charlstm": 10}
FULL_BATCH = 64  # a config with batch_size = "full" is measured at this batch (the profile scales linearly)
CONFIG = "config:"  # a model spec naming a config file: its model, measured on random samples of its shape
WIDTH = "\0"  # CONFIG + path + WIDTH + w: the model of one of its [submodel] widths (no path holds a NUL)


def _config(spec: str):
    from edgefed import config as config_mod

    return config_mod.load_config(spec[len(CONFIG):].split(WIDTH)[0])


def width_specs(spec: str) -> list[str]:
    """The specs of a config's [submodel] widths whose layer lists differ from its model's (none: not set)."""
    if not spec.startswith(CONFIG) or not _config(spec).submodel.enabled:
        return []
    whole = _config_model(spec, "float32").network.signature()
    widths = _config(spec).submodel.widths or DEFAULT_WIDTHS  # (as validation resolves it)
    return [f"{spec}{WIDTH}{w}" for w in widths
            if _config_model(f"{spec}{WIDTH}{w}", "float32").network.signature() != whole]


def batches(spec: str) -> tuple[int, ...]:
    """The batches a model spec is measured at: a built-in's usual ones, a config's own."""
    if not spec.startswith(CONFIG):
        return BENCH_MODELS[spec]
    batch = _config(spec).train.batch_size
    return (FULL_BATCH if batch == "full" else int(batch),)


def build(spec: str, dtype: str = "float32", n: int = 200):
    """A model and n random samples for one device: a built-in kind at its paper size, or CONFIG + path, the
    model a config describes (its data read once for the samples' shape and classes)."""
    g = np.random.default_rng(0)
    dt = np.dtype(dtype)
    if spec == "quadratic":
        d = 16
        model = Quadratic(d, np.zeros(d), dt)
        return model, QuadraticData(np.ones(d, dt), np.zeros(d, dt), 0.0)
    if spec.startswith(CONFIG):
        model = _config_model(spec, dtype)
    elif spec == "charlstm":  # LEAF Shakespeare's: 80 characters of 80 letters
        model = Sequential.builtin(spec, (80,), 80, dt)
    else:
        shape = (60,) if spec == "logreg" else (1, 28, 28)
        model = Sequential.builtin(spec, shape, 10, dt)
    X = _random_samples(g, model, n, model.n_features, model.vocabulary)
    if model.has_accuracy:
        y = g.integers(0, model.n_outputs, n).astype(np.int64)
    else:
        y = g.random((n, model.n_outputs)).astype(dt)
    return model, ClassificationData(X, y, X[:20].copy(), y[:20].copy())


@functools.lru_cache(maxsize=None)
def _config_model(spec: str, dtype: str):
    """A config's model, its data read once per process (only for the samples' shape and the classes)."""
    from edgefed.orchestration.run import problem_and_model
    from edgefed.width_models import width_models

    cfg = _config(spec)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    problem, model = problem_and_model(cfg)
    if WIDTH not in spec:
        return model
    width = float(spec.rsplit(WIDTH, 1)[1])
    return width_models(dataclasses.replace(cfg, submodel=dataclasses.replace(cfg.submodel, widths=(width,))),
                        problem, model).models[width]


def _random_samples(g, model, n: int, width: int, vocabulary: int) -> np.ndarray:
    """n random samples of width values in the model dtype: token ids below vocabulary (0: values in [0, 1))."""
    if vocabulary:
        return g.integers(0, vocabulary, (n, width)).astype(model.dtype)
    return g.random((n, width)).astype(model.dtype)


def speed_entry(model, batch: int, steps_per_s: float, prefix_samples_per_s: float | None = None) -> dict:
    """A profile's [[speed]] entry for a model: a built-in by name, a layer list by its signature; a model whose
    frozen prefix's outputs are its samples, with that prefix's speed (prefix_samples_per_second)."""
    entry = {"model": model.kind, "params": model.n_trainable, "batch": batch, "steps_per_s": float(f"{steps_per_s:.4g}")}
    if model.kind in hwprofile.NAMED:
        entry["layers"] = model.profile_key().split(": ", 1)[1]
    if prefix_samples_per_s is not None:
        entry["prefix_samples_per_s"] = float(f"{prefix_samples_per_s:.4g}")
    return entry


def prefix_samples_per_second(model, min_time_s: float = 0.3) -> float:
    """Samples a second through a model's frozen prefix (the one-off pass when a device's data is built)."""
    n = 4 * model.network.eval_chunk
    X = _random_samples(np.random.default_rng(0), model, n, model.n_inputs,  # (the prefix's own inputs)
                        layer_lib.first_vocabulary(model.network.layers) or 0)
    model.features(X[:1])
    samples, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time_s or not samples:
        model.features(X)
        samples += n
    return samples / (time.perf_counter() - t0)


def warmup(kinds=("logreg", "mlp", "cnn", "quadratic"), dtypes=("float32", "float64"), out=print,
           everything: bool = False) -> int:
    """Compile every kernel of these models and dtypes into the cache (everything: and every other layer
    operation of the library, so that any layer list finds its kernels cached); returns how many were
    compiled."""
    total = 0

    def step(what: str, dtype, work) -> None:
        nonlocal total
        before, t0 = jit_compilations(), time.perf_counter()
        work()
        compiled = jit_compilations() - before
        total += compiled
        state = f"compiled {compiled} kernels" if compiled else "already cached"
        out(f"warmup {what:9s} {dtype}: {state} in {time.perf_counter() - t0:.1f} s")

    for dtype in dtypes:
        for kind in kinds:
            step(kind, dtype, lambda: warm_model(*build(kind, dtype, n=40), 10))
        if everything:
            step("the rest", dtype, lambda: ops.tables(ops.OPERATIONS, dtype,
                                                       ops.Apart(ops.uncached(ops.kernels_of(ops.OPERATIONS), dtype),
                                                                 dtype)))
    return total


def warmup_config(path: str, overrides=(), out=print) -> int:
    """Compile what this experiment's runs compile (its model's kernels for its dtype, its algorithm's calls),
    into the cache; returns how many were compiled."""
    from edgefed import config as config_mod
    from edgefed.algorithms import build_algorithm
    from edgefed.orchestration.run import compile_notice, problem_and_model

    cfg = config_mod.load_config(path, list(overrides))
    problem, model = problem_and_model(cfg)
    before, t0 = jit_compilations(), time.perf_counter()
    warm_model(model, problem.device(0), None if cfg.train.batch_size == "full" else cfg.train.batch_size,
               build_algorithm(cfg).model_calls, compile_notice(cfg, model, out))
    compiled = jit_compilations() - before
    out(f"warmup {path}: " + (f"compiled {compiled} kernels" if compiled else "every kernel was cached") +
        f" in {time.perf_counter() - t0:.1f} s")
    return compiled


# ----------------------------------------------------------------------------------------------- speed
def stepping(spec: str, batch: int):
    """(the model, step(k): k local SGD steps of one device at this batch), warmed up by one step: what a
    speed is measured on."""
    model, data = build(spec, "float32", n=max(200, 4 * batch))
    x = model.initial_params()
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))

    def step(k: int) -> None:
        model.local_steps(x, data, run, k, batch, 0.001)

    step(1)
    return model, step


def metered(spec: str, batch: int, call_s: float = 0.002):
    """(step, k): stepping's step and the steps of a call of about call_s of CPU, whatever pauses the
    board's share puts around it (what a board's meter and a rank's cost are measured in)."""
    step = stepping(spec, batch)[1]
    cpu = time.process_time()
    step(1000)
    return step, max(1, int(1000 * call_s / max(time.process_time() - cpu, 1e-6)))


def steps_per_second(spec: str, batch: int, min_time_s: float = 0.5) -> tuple[object, float]:
    """(the model, local SGD steps per second) of one thread, after a warm-up; calls of K steps, as a round."""
    model, step = stepping(spec, batch)
    k, steps, seconds = 1, 0, 0.0
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        step(k)
        took = time.perf_counter() - t
        # the sustained speed: every call of a round's length (~50 ms) over min_time_s, not the fastest call,
        # since on a board whose CPU share is enforced per period (a cgroup quota: a virtual board) a call can
        # run at full speed while its period's quota lasts
        if took >= 0.04:
            steps, seconds = steps + k, seconds + took
        if time.perf_counter() - t0 > min_time_s and steps:
            break
        k = max(1, int(0.05 * k / max(took, 1e-6)))
    return model, steps / seconds


def first_step_report(spec: str) -> dict:
    """In a fresh process: build one device of a model spec and run every kernel once; its resident memory."""
    import psutil

    model, data = build(spec, "float32", n=600)
    warm_model(model, data, batches(spec)[0])
    return {"rss_mb": psutil.Process().memory_info().rss / 2**20}


def startup(spec: str, cache_dir: str | None) -> dict:
    """Wall time from a fresh interpreter to one device's first step, and its RSS (cache_dir: Numba's)."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    code = ("import json; from edgefed.orchestration.profiling import first_step_report; "
            f"print(json.dumps(first_step_report({spec!r})))")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"profiling the start-up of {spec} failed: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["wall_s"] = wall
    return report


# ------------------------------------------------------------------------------------------------ machine
def machine_facts() -> dict:
    import numba
    import psutil

    cpu = platform.processor() or platform.machine()
    board = None
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "model name" and cpu in (platform.processor(), platform.machine()):
                cpu = value.strip()
            elif key == "model":
                board = value.strip() or board  # a Raspberry Pi names itself here
    except OSError:
        pass
    memory = psutil.virtual_memory()
    # what the board's own system takes: all but what is available, less this process (edgefed's own ranks)
    system = memory.total - memory.available - psutil.Process().memory_info().rss
    facts = {"arch": platform.machine(), "cpu": cpu, "cores": psutil.cpu_count(logical=False) or os.cpu_count(),
             "logical_cores": os.cpu_count(), "memory_mb": int(memory.total / 2**20),
             "system_mb": max(int(system / 2**20), 0),
             "python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
             "edgefed": __version__}
    if board and not board.isdigit():
        facts["board"] = board
    return facts


def label(spec: str) -> str:
    """How a profile's startup and memory tables name a model spec: a built-in's name, a config's file name."""
    return Path(spec[len(CONFIG):]).name if spec.startswith(CONFIG) else spec


def measure(specs=tuple(BENCH_MODELS), cold: bool = True, out=print) -> dict:
    """Everything `edgefed profile` measures on this machine, as a profile dict (no [mpi] table): the models
    of specs (built-in kinds, or CONFIG + a config file's path)."""
    facts = machine_facts()
    name = facts.get("board") or f"{facts['cpu']} ({facts['arch']})"
    speeds, cold_s, warm_s, rss, recommended, timed = [], {}, {}, {}, {}, {}
    for spec in specs:
        tag = label(spec)
        if cold:
            with tempfile.TemporaryDirectory(prefix="edgefed-cold-") as empty:
                cold_s[tag] = round(startup(spec, empty)["wall_s"], 2)
            out(f"{tag}: cold start (empty kernel cache) {cold_s[tag]:.1f} s")
        warm_model(*build(spec, "float32", n=40), 10)  # fills this machine's cache for the warm start
        report = startup(spec, None)
        warm_s[tag], rss[tag] = round(report["wall_s"], 2), round(report["rss_mb"], 1)
        out(f"{tag}: warm start {warm_s[tag]:.2f} s, one device's process {rss[tag]:.0f} MB resident")
        for batch in batches(spec):
            model, sps = steps_per_second(spec, batch)
            timed[model.profile_key()] = model
            speeds.append(speed_entry(model, batch, sps, prefix_samples_per_second(model) if model.prefix_end else None))
            prefix = speeds[-1].get("prefix_samples_per_s")
            once = f"; its frozen prefix, once a sample: {prefix:,.0f} samples/s" if prefix else ""
            out(f"{tag}: batch {batch}: {sps:,.1f} steps/s ({1e3 / sps:.3f} ms per step){once}")
        for part in width_specs(spec):  # a [submodel] width's steps, timed as its own layer list
            for batch in batches(spec):
                model, sps = steps_per_second(part, batch)
                speeds.append(speed_entry(model, batch, sps))
                out(f"{tag}: width {part.rsplit(WIDTH, 1)[1]}: batch {batch}: {sps:,.1f} steps/s "
                    f"({1e3 / sps:.3f} ms per step)")
        recommended[tag] = RECOMMENDED_BATCH.get(spec, batches(spec)[0])
    profile = {
        "format": 1, "name": name, "measured": True,
        "machine": facts,
        "recommend": {"dtype": "float32", "threads": 1, "device_ranks": facts["cores"], "batch": recommended},
        "startup": {"warm_s": warm_s, **({"cold_s": cold_s, "compile_s": {
            tag: round(max(cold_s[tag] - warm_s[tag], 0.0), 2) for tag in cold_s}} if cold else {})},
        "memory": {"rank_rss_mb": rss},
        "speed": speeds,
        "rank": rank_cost.measure(timed, *metered("logreg", 20), out),  # (the board meter's model)
    }
    return profile


def mpi_collectives(comm, specs=tuple(BENCH_MODELS), repeats: int = 20) -> list[dict]:
    """Median milliseconds, on rank 0, of moving each model's parameters as a round does: down, a
    non-blocking broadcast waited on with edgefed's sleeping poll; up, one point-to-point message from
    every other rank, received as they arrive. Every rank must call this."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = []
    for spec in specs:
        model = build(spec, "float32", n=2)[0]
        dim = model.n_trainable
        buf = np.zeros(dim, np.float32)
        inbox = np.zeros((size, dim), np.float32) if rank == 0 else None
        bcast, gather = [], []
        for _ in range(repeats):
            wait(comm.Ibarrier())
            t = time.perf_counter()
            wait(comm.Ibcast(buf, root=0))
            bcast.append(time.perf_counter() - t)
            wait(comm.Ibarrier())
            t = time.perf_counter()
            if rank == 0:
                for req in [comm.Irecv(inbox[r], source=r, tag=7) for r in range(1, size)]:
                    wait(req)
            else:
                wait(comm.Isend(buf, dest=0, tag=7))
            gather.append(time.perf_counter() - t)
        out.append({"model": model.profile_key(), "params": dim, "bytes": dim * 4,
                    "bcast_ms": round(float(np.median(bcast)) * 1e3, 3),
                    "gather_ms": round(float(np.median(gather)) * 1e3, 3)})
    return out


def header_comment(profile: dict) -> str:
    m = profile["machine"]
    return (f"Measured by `edgefed profile` (edgefed {__version__}) on {time.strftime('%Y-%m-%d')}: "
            f"{m['cpu']}, {m['arch']}, {m['cores']} cores, {m['memory_mb']} MB.\n"
            "system_mb: what the machine's own system took as it was profiled (total less available, less edgefed).\n"
            "speed: local SGD steps per second, one thread, float32 (sustained over calls of ~50 ms, a round's work).\n"
            "startup: seconds from a fresh interpreter to one device's first step; cold = empty Numba cache;\n"
            "compile_s = cold - warm, what a run's first start on this board spends compiling (it says so).\n"
            "rank: what a device rank costs the board beside its devices' steps: lost_share of a device's steps in a\n"
            "deadline (its chunks, its rank's polls), round_s a round's own work (state unpacked, a report packed).")


def host_name() -> str:
    return socket.gethostname().split(".")[0] or "host"


# ------------------------------------------------------------------------------------------------ a cluster
def profile_hosts(comm, prepare, cold: bool, say):
    """Measure every host once and, under MPI (comm not None), the collectives between the ranks.

    prepare(host names) -> (models, targets) runs on rank 0 before anything is measured (an EdgefedError
    there ends every rank). Returns [(target, profile dict)] on rank 0, one per host in target order, and
    an exit code on the other ranks.
    """
    rank = 0 if comm is None else comm.Get_rank()
    host = host_name()
    hosts = [host] if comm is None else comm.allgather(host)
    names = list(dict.fromkeys(hosts))
    error, models, targets = None, [], []
    if rank == 0:
        try:
            models, targets = prepare(names)
        except EdgefedError as exc:
            error = str(exc)
    if comm is not None:
        error, models = comm.bcast((error, models), root=0)
    if error:
        if rank == 0:
            raise EdgefedError(error)
        return EXIT_BAD_INPUT
    leader = hosts.index(host) == rank  # one rank per host measures it; the others wait, sleeping
    out = say if rank == 0 else (lambda line: say(f"[{host}] {line}"))
    result = (None, None)
    if leader:
        try:
            result = (None, measure(models, cold=cold, out=out))
        except Exception as exc:  # noqa: BLE001 - reported by rank 0, so no rank waits forever
            result = (f"{host}: {type(exc).__name__}: {exc}", None)
    if comm is None:
        if result[0]:
            raise EdgefedError(f"profiling failed on {result[0]}")
        results = [result]
    else:
        wait(comm.Ibarrier())
        results = comm.gather(result, root=0)
        errors = comm.bcast([e for e, _ in results if e] if rank == 0 else None, root=0)
        if errors:
            if rank == 0:
                raise EdgefedError("profiling failed on " + "; ".join(errors))
            return EXIT_BAD_INPUT
        collectives = mpi_collectives(comm, models)
        if rank != 0:
            return 0
        for _, m in results:
            if m is not None:
                m["mpi"] = {"ranks": comm.Get_size(), "hosts": len(names), "collective": collectives}
    return list(zip(targets, [m for _, m in results if m is not None]))


def profile_targets(out: str | None, hosts: list[str], force: bool, inputs=()) -> list[tuple[str, Path | None]]:
    """(host, file) of every profile to write (None: print it), checked before anything is measured; inputs:
    (what, path) of the files the command reads, never written over."""
    if not out:
        if len(hosts) > 1:
            raise EdgefedError(f"profiling {len(hosts)} hosts; give --out with {{host}} in it, "
                               "e.g. --out hw_profiles/{host}.toml")
        return [(hosts[0], None)]
    if len(hosts) > 1 and "{host}" not in out:
        raise EdgefedError(f"profiling {len(hosts)} hosts; put {{host}} in --out, e.g. --out hw_profiles/{{host}}.toml")
    targets = [(h, check_output(out.replace("{host}", h), force=force, inputs=inputs, example="board.toml"))
               for h in hosts]
    for _, path in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EdgefedError(f"cannot write profile {path} ({exc}); choose another --out") from None
    return targets


def profile_text(profile: dict, host: str, name: str | None = None) -> str:
    """The profile as the TOML file `edgefed profile` writes, checked to load back."""
    if name:
        profile["name"] = name.replace("{host}", host)
    text = hwprofile.profile_toml(profile, header_comment(profile))
    hwprofile.profile_from_dict(tomllib.loads(text), f"the profile measured on {host}")
    return text


def write_profile(path: Path, text: str) -> None:
    """Write beside the target, then swap it in: a failed write leaves the old file whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EdgefedError(f"cannot write profile {path} ({exc}); choose another --out") from None
