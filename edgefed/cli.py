"""The `edgefed` command: verbs, argparse, and the only place that prints errors and exits."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tomllib
from pathlib import Path

from edgefed import __version__
from edgefed.errors import EXIT_BAD_INPUT, EdgefedError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        print(f"edgefed: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgefed", description="Federated learning on the edge.")
    parser.add_argument("--version", action="version", version=f"edgefed {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    run = verbs.add_parser("run", help="run an experiment (the built-in default without CONFIG)")
    run.add_argument("config", nargs="?", help="experiment TOML file; omit for the built-in default")
    run.add_argument("--out", help="run log to write (default: [log] path, else runs/NAME-TIME.h5)")
    run.add_argument("--resume", metavar="RUN.h5", help="continue a killed run in its log")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                     help="override a config key, e.g. --set train.local_steps=10 (repeatable)")
    run.add_argument("--force", action="store_true", help="replace an existing log at --out")
    run.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    run.set_defaults(func=cmd_run)

    contend = verbs.add_parser("contend", help="a CPU competitor: busy LOAD of every 10 ms (the paper's 0..90 %% loads)")
    contend.add_argument("--load", type=float, required=True, help="share of the core to take, in [0, 1]")
    contend.add_argument("--cpu", type=int, help="core to pin to (default: wherever the OS puts it)")
    contend.add_argument("--seconds", type=float, help="stop after this long (default: until Ctrl-C)")
    contend.set_defaults(func=cmd_contend)

    warm = verbs.add_parser("warmup", help="compile every kernel into Numba's cache, so no first round pays for it")
    warm.add_argument("--models", default="logreg,mlp,cnn,quadratic", help="comma-separated (default: all)")
    warm.add_argument("--dtypes", default="float32,float64", help="comma-separated (default: both)")
    warm.set_defaults(func=cmd_warmup)

    prof = verbs.add_parser("profile", help="measure this machine (under mpirun: also its collectives) "
                                            "and write a hardware profile")
    prof.add_argument("--out", help="profile to write (TOML; under mpirun with several hosts it must contain "
                                    "{host}); default: print it")
    prof.add_argument("--name", help="the profile's name (default: the board's model, else the CPU's)")
    prof.add_argument("--models", default="logreg,mlp,cnn", help="comma-separated models to measure")
    prof.add_argument("--no-cold", action="store_true",
                      help="skip the cold-start measurement (it compiles every kernel into an empty cache)")
    prof.add_argument("--force", action="store_true", help="replace an existing --out")
    prof.set_defaults(func=cmd_profile)

    trace = verbs.add_parser("trace", help="record or inspect participation traces")
    trace_verbs = trace.add_subparsers(dest="trace_verb", required=True, parser_class=_Parser)
    record = trace_verbs.add_parser(
        "record", help="measure traces: a deadline run, one device per trace, every device every round")
    record.add_argument("--out", required=True, help="trace file to write (CSV)")
    record.add_argument("--names", required=True, help="comma-separated trace names, e.g. cpu0,cpu30")
    record.add_argument("--contention", help="competitor load per trace, e.g. 0,0.3 (default: none)")
    record.add_argument("--drop", help="probability per trace that a round's upload is lost (s = 0), e.g. 0,0.5")
    record.add_argument("--rounds", type=int, default=200)
    record.add_argument("--local-steps", type=int, default=500)
    record.add_argument("--deadline-s", type=float,
                        help="per-device deadline (default: the time K steps take on a free core here, x 1.1)")
    record.add_argument("--seed", type=int, default=0)
    record.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="more config overrides for the recording run (model, data, ...)")
    record.add_argument("--quiet", action="store_true")
    record.set_defaults(func=cmd_trace_record)
    show = trace_verbs.add_parser("show", help="per-trace statistics of a trace file (or \"builtin\")")
    show.add_argument("file", help="a trace file, or builtin")
    show.set_defaults(func=cmd_trace_show)
    return parser


def _fmt(value: float, spec: str) -> str:
    return "     -" if math.isnan(value) else format(value, spec)


def progress_line(s) -> str:
    width = len(str(s.rounds))
    dropped = f"  dropped {s.n_dropped}" if s.n_dropped else ""
    dropped += f"  late {s.n_late}" if s.n_late else ""
    dropped += "  no update" if s.round_idx and not s.n_applied else ""
    if s.steps_asked and s.steps_done < s.steps_asked:
        dropped += f"  steps {s.steps_done}/{s.steps_asked}"
    return (f"round {s.round_idx:>{width}}/{s.rounds}  train_loss {_fmt(s.train_loss, '8.4f')}  "
            f"test_acc {_fmt(s.test_accuracy, '6.4f')}  participants {s.participants:>3}/{s.n_active}"
            f"{dropped}  {s.elapsed_s * 1e3:7.1f} ms")


def _resolve(args):
    from edgefed import experiment

    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise EdgefedError("--resume continues the log in place; drop --out (or make it the same file)")
    cfg, point = experiment.resolve_config(args.config, args.overrides, args.resume)
    if args.resume:
        path = Path(args.resume)
    else:
        path = Path(args.out or cfg.log.path or experiment.default_log_path(args.config))
    return cfg, point, path


def _info(line: str) -> None:
    print(line, flush=True)


def _error(message: str) -> None:
    print(f"edgefed: error: {message}", file=sys.stderr, flush=True)


def execute(resolve, force: bool, quiet: bool):
    """Run an experiment in this process or, under mpirun, across the ranks.

    `resolve()` gives (config, resume point, log path). Returns the RunResult on the process that wrote the
    log, or an exit code (device ranks, bad input, interruption).
    """
    from edgefed import experiment
    from edgefed.runtime import mpi

    on_round = None if quiet else (lambda s: print(progress_line(s), flush=True))
    comm = mpi.world()
    if comm is not None:
        from edgefed.runtime import ranks

        if comm.Get_rank() != 0:
            return ranks.run_device_rank(comm)
        return ranks.run_coordinator(comm, resolve, force, on_round, _info, _error)
    cfg, point, path = resolve()
    try:
        return experiment.run(cfg, path, resume_point=point, force=force, on_round=on_round, on_info=_info)
    except KeyboardInterrupt:
        print(f"edgefed: interrupted; continue with: edgefed run --resume {path}", file=sys.stderr)
        return 130


def cmd_run(args) -> int:
    result = execute(lambda: _resolve(args), args.force, args.quiet)
    if isinstance(result, int):
        return result
    path = result.path
    if result.already_complete:
        print(f"{path}: the run is already complete; nothing to resume")
        return 0
    test = "" if math.isnan(result.best_test_accuracy) else (
        f", test accuracy {result.final_test_accuracy:.4f} (best {result.best_test_accuracy:.4f} "
        f"at round {result.best_round})")
    print(f"done: {result.rounds_run} rounds in {result.wall_s:.1f} s; final train loss "
          f"{result.final_train_loss:.6g}{test}; log {path}")
    return 0


def cmd_trace_record(args) -> int:
    import datetime
    import os
    import platform
    import shlex
    import tempfile

    import numpy as np

    from edgefed import config as config_mod
    from edgefed.hwprofile import AUTO_FACTOR
    from edgefed.participation.traces import write_trace_file
    from edgefed.rng import Purpose, generator
    from edgefed.runlog import read_run

    names = [n.strip() for n in args.names.split(",") if n.strip()]

    def per_trace(text, what):
        if text is None:
            return [0.0] * len(names)
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            raise EdgefedError(f"--{what} {text!r}: give comma-separated numbers, one per trace") from None
        if len(values) != len(names) or not all(0 <= v < 1 or (what == "drop" and v == 1) for v in values):
            bound = "[0, 1]" if what == "drop" else "[0, 1)"
            raise EdgefedError(f"--{what} needs {len(names)} values in {bound}, one per trace in --names")
        return values

    loads, drops = per_trace(args.contention, "contention"), per_trace(args.drop, "drop")
    if not names or args.rounds < 1 or args.local_steps < 1 or (args.deadline_s is not None and not args.deadline_s > 0):
        raise EdgefedError("trace record needs --names, and positive --rounds, --local-steps and --deadline-s")
    from edgefed.runtime import mpi

    comm = mpi.world()
    coordinator = comm is None or comm.Get_rank() == 0  # device ranks get the config from rank 0
    if args.deadline_s is None and coordinator:  # so a free device just completes K, a loaded one shows its loss
        args.deadline_s = round(AUTO_FACTOR * unloaded_seconds(args.local_steps, args.overrides), 5)
        print(f"deadline: {args.deadline_s * 1e3:.2f} ms ({AUTO_FACTOR} x the time of {args.local_steps} steps measured here)")
    tmp = tempfile.TemporaryDirectory()
    log_path = Path(tmp.name) / "record.h5"
    overrides = [f"seed={args.seed}", f"rounds={args.rounds}", f"data.clients={len(names)}",
                 'train.clients_per_round="all"', f"train.local_steps={args.local_steps}",
                 'participation.mode="deadline"', f"participation.deadline_s={args.deadline_s}",
                 f"participation.contention={loads}", f"log.eval_every={args.rounds}", *args.overrides]
    resolve = lambda: (config_mod.load_config(None, overrides), None, log_path)  # noqa: E731
    result = execute(resolve, False, args.quiet)
    if isinstance(result, int):
        return result
    log = read_run(log_path)
    steps, budget = log["participation/steps"], log["participation/budget"]
    fractions = steps / np.maximum(budget, 1)
    for k, p in enumerate(drops):  # an upload lost on a weak link: the round counts as inactive
        lost = np.array([generator(args.seed, Purpose.TRACE_DROP, r + 1, k).random() < p for r in range(args.rounds)])
        fractions[lost, k] = 0.0
    meta = {"recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "edgefed " + shlex.join(sys.argv[1:]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "local_steps": args.local_steps, "deadline_s": args.deadline_s,
            "contention": ",".join(map(str, loads)), "drop": ",".join(map(str, drops))}
    write_trace_file(args.out, names, fractions, meta)
    print(f"wrote {args.out}: {len(names)} traces x {args.rounds} rounds")
    return cmd_trace_show(argparse.Namespace(file=args.out))


def unloaded_seconds(n_steps: int, overrides) -> float:
    """Median wall time of n_steps local steps of device 0 of the recording's model, on this core, unloaded."""
    import time

    from edgefed import config as config_mod
    from edgefed.models import build_model
    from edgefed.problems import build_problem
    from edgefed.rng import Purpose, kernel_state

    cfg = config_mod.load_config(None, ['train.clients_per_round="all"', "data.clients=1", *overrides])
    problem = build_problem(cfg)
    model = build_model(cfg.model.kind, problem, cfg.model.dtype, cfg.model.hidden, cfg.seed)
    data = problem.device(0)
    batch = None if cfg.train.batch_size == "full" else cfg.train.batch_size
    times = []
    for i in range(7):
        x = model.initial_params()
        run = model.begin(data, kernel_state(cfg.seed, Purpose.LOCAL, 1, 0))
        start = time.perf_counter()
        model.local_steps(x, data, run, n_steps, batch, cfg.train.lr_local)
        if i:  # the first call compiles or loads the kernels
            times.append(time.perf_counter() - start)
    return float(sorted(times)[len(times) // 2])


def cmd_trace_show(args) -> int:
    from edgefed.participation.traces import BUILTIN, read_trace_file

    file = read_trace_file(BUILTIN if args.file == "builtin" else args.file)
    for key in ("command", "recorded", "local_steps", "deadline_s"):
        if key in file.meta:
            print(f"# {key}: {file.meta[key]}")
    print(f"{'trace':<12}{'rounds':>7}{'mean':>8}{'std':>8}{'min':>8}{'max':>8}{'inactive':>10}{'complete':>10}")
    for st in file.stats():
        print(f"{st['name']:<12}{st['rounds']:>7}{st['mean']:>8.3f}{st['std']:>8.3f}{st['min']:>8.3f}{st['max']:>8.3f}"
              f"{st['inactive']:>10.1%}{st['complete']:>10.1%}")
    return 0


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise EdgefedError(f"--{what} {text!r}: choose from {', '.join(known)}")
    return names


def cmd_warmup(args) -> int:
    from edgefed.profiling import warmup

    models = _names(args.models, ("logreg", "mlp", "cnn", "quadratic"), "models")
    dtypes = _names(args.dtypes, ("float32", "float64"), "dtypes")
    compiled = warmup(models, dtypes)
    print(f"warmup: {compiled} kernels compiled into the cache" if compiled else "warmup: every kernel was cached")
    return 0


def cmd_profile(args) -> int:
    from edgefed import hwprofile, profiling
    from edgefed.runtime import mpi

    comm = mpi.world()
    rank = 0 if comm is None else comm.Get_rank()
    host = profiling.host_name()
    hosts = [host] if comm is None else comm.allgather(host)
    names = list(dict.fromkeys(hosts))
    error, models, targets = None, [], []
    if rank == 0:  # the head node checks the inputs and the files it will write, before anything is measured
        try:
            models = _names(args.models, hwprofile.MODELS, "models")
            targets = _profile_targets(args, names)
        except EdgefedError as exc:
            error = str(exc)
    if comm is not None:
        error, models = comm.bcast((error, models), root=0)
    if error:
        if rank == 0:
            raise EdgefedError(error)
        return EXIT_BAD_INPUT
    leader = hosts.index(host) == rank  # one rank per host measures it; the others wait, sleeping
    say = print if rank == 0 else (lambda line: print(f"[{host}] {line}", flush=True))
    result = (None, None)
    if leader:
        try:
            result = (None, profiling.measure(models, cold=not args.no_cold, out=say))
        except Exception as exc:  # noqa: BLE001 - reported by rank 0, so no rank waits forever
            result = (f"{host}: {type(exc).__name__}: {exc}", None)
    if comm is None:
        results = [result]
    else:
        mpi.wait(comm.Ibarrier())
        results = comm.gather(result, root=0)
        errors = comm.bcast([e for e, _ in results if e] if rank == 0 else None, root=0)
        if errors:
            if rank == 0:
                raise EdgefedError("profiling failed on " + "; ".join(errors))
            return EXIT_BAD_INPUT
        collectives = profiling.mpi_collectives(comm, models)
        if rank != 0:
            return 0
        for _, m in results:
            if m is not None:
                m["mpi"] = {"ranks": comm.Get_size(), "hosts": len(names), "collective": collectives}
    for (host_name, path), profile in zip(targets, [m for _, m in results if m is not None]):
        if args.name:
            profile["name"] = args.name.replace("{host}", host_name)
        text = hwprofile.to_toml(profile, profiling.header_comment(profile))
        hwprofile.profile_from_dict(tomllib.loads(text), f"the profile measured on {host_name}")  # loads back
        if path is None:
            print(text, end="")
            continue
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise EdgefedError(f"cannot write profile {path} ({exc}); choose another --out") from None
        print(f"profile of {host_name} written to {path}")
    return 0


def _profile_targets(args, hosts: list[str]) -> list[tuple[str, Path | None]]:
    """(host, file) of every profile to write, checked before anything is measured."""
    if not args.out:
        if len(hosts) > 1:
            raise EdgefedError(f"profiling {len(hosts)} hosts; give --out with {{host}} in it, "
                               "e.g. --out hw_profiles/{host}.toml")
        return [(hosts[0], None)]
    if len(hosts) > 1 and "{host}" not in args.out:
        raise EdgefedError(f"profiling {len(hosts)} hosts; put {{host}} in --out, e.g. --out hw_profiles/{{host}}.toml")
    targets = [(h, Path(args.out.replace("{host}", h))) for h in hosts]
    for _, path in targets:
        if path.exists() and not args.force:
            raise EdgefedError(f"{path} already exists; pass --force to replace it or choose another --out")
        folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path.cwd())
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise EdgefedError(f"cannot write profile {path}: {folder} is not a writable folder; choose another --out")
    for _, path in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EdgefedError(f"cannot write profile {path} ({exc}); choose another --out") from None
    return targets


def cmd_contend(args) -> int:
    import time

    from edgefed.runtime.contention import duty_cycle, pin

    if not 0 <= args.load <= 1:
        raise EdgefedError(f"--load {args.load} must lie in [0, 1] (a share of one core, e.g. 0.7)")
    cores = os.cpu_count() or 1
    if args.cpu is not None and not 0 <= args.cpu < cores:
        raise EdgefedError(f"--cpu {args.cpu} is not a core of this machine (0..{cores - 1})")
    if args.seconds is not None and not args.seconds > 0:
        raise EdgefedError(f"--seconds {args.seconds} must be positive")
    pin(args.cpu)
    end = math.inf if args.seconds is None else time.monotonic() + args.seconds
    where = "" if args.cpu is None else f" on core {args.cpu}"
    print(f"contending: {args.load:.0%} of a core{where}" + ("" if args.seconds is None else f" for {args.seconds:g} s"),
          flush=True)
    try:
        duty_cycle(lambda: args.load, lambda: time.monotonic() >= end)
    except KeyboardInterrupt:
        pass
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgefedError as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
