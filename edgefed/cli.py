"""The `edgefed` command: verbs, argparse, and the only place that prints errors and exits."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from edgefed import __version__
from edgefed.errors import (DEBUG_ENV, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EdgefedError, Interrupted,
                            debugging, internal_error)
from edgefed.outputs import check_folder, check_output


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        print(f"edgefed: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


class _Verb(_Parser):
    """A verb's parser: --debug is taken after the verb too (`edgefed run CONFIG --debug`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _run_options(verb) -> None:
    """What `edgefed run` takes, and `edgefed launch` passes on to it."""
    verb.add_argument("config", nargs="?", help="experiment TOML file; omit for the built-in default")
    verb.add_argument("--out", help="run log to write (default: [log] path, else runs/NAME-TIME.h5)")
    verb.add_argument("--resume", metavar="RUN.h5", help="continue a killed run in its log")
    verb.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                      help="override a config key, e.g. --set train.local_steps=10 (repeatable)")
    verb.add_argument("--force", action="store_true", help="replace an existing log at --out")
    verb.add_argument("--quiet", action="store_true", help="no per-round progress lines")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgefed", description="Federated learning on the edge.")
    parser.add_argument("--version", action="version", version=f"edgefed {__version__}")
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of an internal error (as {DEBUG_ENV}=1)")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Verb)

    run = verbs.add_parser("run", help="run an experiment (the built-in default without CONFIG)")
    _run_options(run)
    run.add_argument("--launch-status", help=argparse.SUPPRESS)  # edgefed launch: where to name a lost rank
    run.add_argument("--launch-restarts", help=argparse.SUPPRESS)  # edgefed launch: its restarts so far (JSON)
    # edgefed launch: its placement of the devices (a file of --set lines: a board list's devices can be many)
    run.add_argument("--launch-placement", help=argparse.SUPPRESS)
    run.set_defaults(func=cmd_run)

    launch = verbs.add_parser(
        "launch", help="edgefed run under mpiexec, started again on the same log when a rank or board dies",
        description="Start `edgefed run` on every rank of an mpiexec world and watch it; when the world dies, "
                    "leave out the boards that do not answer and start it again with --resume (like torchrun "
                    "--max-restarts). Options after CONFIG are edgefed run's.")
    where = launch.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", dest="ranks", type=int, metavar="P", help="P ranks on this machine")
    where.add_argument("--boards", metavar="FILE", help="a board list (launch/hostfile.example), reached over SSH")
    launch.add_argument("--restarts", type=int, default=3, metavar="N", help="worlds started again at most (3)")
    launch.add_argument("--mpiexec", metavar="PATH", help="the MPI launcher (default: the venv's, else PATH's)")
    launch.add_argument("--mpiexec-args", default="", metavar="FLAGS",
                        help='more flags for mpiexec, e.g. "-iface eth0" (MPICH) or "--mca btl_tcp_if_include eth0"')
    _run_options(launch)
    launch.set_defaults(func=cmd_launch)

    contend = verbs.add_parser("contend", help="a CPU competitor: busy LOAD of every 10 ms (the paper's 0..90 %% loads)")
    contend.add_argument("--load", type=float, required=True, help="share of the core to take, in [0, 1]")
    contend.add_argument("--cpu", type=int, help="core to pin to (default: wherever the OS puts it)")
    contend.add_argument("--seconds", type=float, help="stop after this long (default: until Ctrl-C)")
    contend.set_defaults(func=cmd_contend)

    warm = verbs.add_parser("warmup", help="compile kernels into Numba's cache ahead, so no run's first start pays "
                                           "for it: everything, or what one experiment needs (--config)")
    warm.add_argument("--config", metavar="CONFIG", help="only what this experiment's runs compile (its model's "
                                                         "kernels, its dtype)")
    warm.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                      help="with --config: override a config key, as edgefed run takes it")
    warm.add_argument("--models", help="comma-separated built-in models only (logreg, mlp, cnn, quadratic); default: "
                                       "every kernel of the library")
    warm.add_argument("--dtypes", default="float32,float64", help="comma-separated (default: both)")
    warm.set_defaults(func=cmd_warmup)

    prof = verbs.add_parser("profile", help="measure this machine (under mpirun: also its collectives) "
                                            "and write a hardware profile")
    prof.add_argument("--out", help="profile to write (TOML; under mpirun with several hosts it must contain "
                                    "{host}); default: print it")
    prof.add_argument("--name", help="the profile's name (default: the board's model, else the CPU's)")
    prof.add_argument("--models", help="comma-separated built-in models to measure (default: logreg,mlp,cnn, "
                                       "or none with --config)")
    prof.add_argument("--config", metavar="CONFIG",
                      help="also measure this experiment's model (its layers, data shape and batch), keyed by its "
                           "layer list")
    prof.add_argument("--no-cold", action="store_true",
                      help="skip the cold-start measurement (it compiles every kernel into an empty cache)")
    prof.add_argument("--force", action="store_true", help="replace an existing --out")
    prof.set_defaults(func=cmd_profile)

    trace = verbs.add_parser("trace", help="record or inspect participation traces")
    trace_verbs = trace.add_subparsers(dest="trace_verb", required=True, parser_class=_Verb)
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
    record.add_argument("--force", action="store_true", help="replace an existing --out")
    record.set_defaults(func=cmd_trace_record)
    show = trace_verbs.add_parser("show", help="per-trace statistics of a trace file (or \"builtin\")")
    show.add_argument("file", help="a trace file, or builtin")
    show.set_defaults(func=cmd_trace_show)

    data = verbs.add_parser("data", help="datasets: convert one to the compact form runs read by rows")
    data_verbs = data.add_subparsers(dest="data_verb", required=True, parser_class=_Verb)
    convert = data_verbs.add_parser(
        "convert", help="write a dataset (LEAF folder, CIFAR, MNIST/EMNIST IDX, .npz/.h5) as a compact arrays .h5")
    convert.add_argument("source", help="the dataset: its folder, or an arrays file")
    convert.add_argument("out", metavar="OUT.h5", help="the compact arrays file to write")
    convert.add_argument("--split", help="EMNIST's split (when the folder holds several), CIFAR-100's labels "
                                         "(fine or coarse)")
    convert.add_argument("--holdout", type=int, default=2000,
                         help="MNIST/EMNIST with only the test files: the images held out for testing (2000)")
    convert.add_argument("--vocab-size", type=int, default=10_000,
                         help="LEAF Sent140: the training tweets' most frequent words given ids (10000)")
    convert.add_argument("--vocab", metavar="FILE", help="LEAF Sent140: a file of the vocabulary's words, one a line")
    convert.add_argument("--force", action="store_true", help="replace an existing OUT.h5")
    convert.set_defaults(func=cmd_data_convert)
    shard = data_verbs.add_parser(
        "shard", help="each device rank's shard of a run's data: the rows of the devices it hosts (rank-R.h5)")
    shard.add_argument("config", nargs="?", help="the run's config (omit for the built-in default)")
    world = shard.add_mutually_exclusive_group(required=True)
    world.add_argument("--boards", metavar="BOARDS", help="the board list the run goes on (rank R: line R + 1)")
    world.add_argument("-n", "--ranks", type=int, help="the ranks of the run's world (mpiexec -n)")
    shard.add_argument("--out", required=True, metavar="FOLDER", help="the folder to write rank-1.h5 .. into")
    shard.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                       help="override a config key, as edgefed run takes it")
    shard.add_argument("--force", action="store_true", help="replace shards already in FOLDER")
    shard.set_defaults(func=cmd_data_shard)

    sweep = verbs.add_parser("sweep", help="run a grid of experiments (axes x seeds) into a folder, with tables")
    sweep.add_argument("file", help="sweep file (TOML: base, seeds, [set], [axes], [target])")
    sweep.add_argument("--out", required=True, help="folder for the run logs, summary.csv and cells.csv")
    sweep.add_argument("-j", "--jobs", type=int, default=1, help="experiments at a time on this machine")
    sweep.set_defaults(func=cmd_sweep)

    report = verbs.add_parser("report", help="figures of run logs and sweep folders: an HTML page or PNG files")
    report.add_argument("targets", nargs="+", metavar="TARGET", help="run logs (.h5) and sweep folders")
    report.add_argument("--out", required=True, help="the page (PAGE.html), or a folder with --format png")
    report.add_argument("--format", choices=("html", "png"), default="html")
    report.add_argument("--force", action="store_true", help="replace an existing page or figures")
    report.set_defaults(func=cmd_report)

    summary = verbs.add_parser("summary", help="what a run was and what it reached, in the terminal")
    summary.add_argument("log", help="run log (.h5)")
    summary.add_argument("--target-accuracy", type=float, help="also the rounds and clock seconds to reach it")
    summary.set_defaults(func=cmd_summary)

    export = verbs.add_parser("export", help="a run log as tidy CSV (metrics per round, participation per device), "
                                             "or its model's weights for PyTorch")
    export.add_argument("log", help="run log (.h5)")
    export.add_argument("--csv", metavar="FOLDER", help="folder for metrics.csv, participation.csv")
    export.add_argument("--weights", metavar="OUT.npz",
                        help="the server model as the equivalent torch.nn.Sequential's state_dict (.npz)")
    export.add_argument("--round", type=int, metavar="R", help="with --weights: a stored round (default: the last)")
    export.add_argument("--force", action="store_true", help="replace existing output files")
    export.set_defaults(func=cmd_export)
    return parser


def _fmt(value: float, spec: str) -> str:
    return "     -" if math.isnan(value) else format(value, spec)


def progress_line(s) -> str:
    width = len(str(s.rounds))
    dropped = f"  non-finite {s.n_dropped} dropped" if s.n_dropped else ""
    dropped += f"  late {s.n_late}" if s.n_late else ""
    dropped += "  no update" if s.round_idx and not s.n_applied else ""
    if s.steps_asked and s.steps_done < s.steps_asked:
        dropped += f"  steps {s.steps_done}/{s.steps_asked}"
    dropped += f"  {s.note}" if s.note else ""
    return (f"round {s.round_idx:>{width}}/{s.rounds}  train_loss {_fmt(s.train_loss, '8.4f')}  "
            f"test_acc {_fmt(s.test_accuracy, '6.4f')}  participants {s.participants:>3}/{s.n_active}"
            f"{dropped}  {s.elapsed_s * 1e3:7.1f} ms")


def _resolve(args):
    from edgefed.orchestration import run
    from edgefed.orchestration.resume import resolve_config

    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise EdgefedError("--resume continues the log in place; drop --out (or make it the same file)")
    cfg, point = resolve_config(args.config, args.overrides, args.resume)
    if args.resume:
        path = Path(args.resume)
    else:
        path = args.out or cfg.log.path or run.default_log_path(args.config)
        check_output(path, force=True, inputs=[("the config file", args.config)], example="run.h5")  # (the rest: prepare)
        path = Path(path)
    return cfg, point, path


def _info(line: str) -> None:
    """One line to standard output; when its reader has left (`edgefed run | head -1`) the work goes on and the
    rest of its lines go nowhere."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _error(message: str) -> None:
    print(f"edgefed: error: {message}", file=sys.stderr, flush=True)


def _progress(quiet: bool):
    return None if quiet else (lambda s: _info(progress_line(s)))


def _launch_context(args):
    import json

    from edgefed.orchestration.resume import Launch

    if args.launch_status is None and args.launch_restarts is None:
        return None
    try:
        restarts = tuple(json.loads(args.launch_restarts)) if args.launch_restarts else ()
    except ValueError:
        raise EdgefedError("--launch-restarts is not JSON (it is edgefed launch's, not for use by hand)") from None
    return Launch(Path(args.launch_status) if args.launch_status else None, restarts)


def cmd_run(args) -> int:
    from edgefed.orchestration.ranks import execute

    if args.launch_placement:
        try:
            args.overrides += Path(args.launch_placement).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise EdgefedError(f"--launch-placement cannot be read ({exc}; it is edgefed launch's, not for use by "
                               "hand)") from None

    result = execute(lambda: _resolve(args), args.force, _progress(args.quiet), _info, _error, _launch_context(args))
    if isinstance(result, int):
        return result
    path = result.path
    if result.already_complete:
        print(f"{path}: the run is already complete; nothing to resume")
        return 0
    test = "" if math.isnan(result.best_test_accuracy) else (
        f", test accuracy {result.final_test_accuracy:.4f} (best {result.best_test_accuracy:.4f} "
        f"at round {result.best_round})")
    dropped = ""
    if result.nonfinite:
        dropped = (f"; {result.nonfinite} reports dropped as non-finite (NaN or infinity) in "
                   f"{result.nonfinite_rounds} rounds")
    if not result.applied_rounds:
        cure = (" (a diverging run wants a smaller train.lr_local; a model whose output is NaN, a fix)"
                if result.nonfinite else "")
        dropped += f"; no update was ever applied: the model is still x_0{cure}"
    print(f"done: {result.rounds_run} rounds in {result.wall_s:.1f} s; final train loss "
          f"{result.final_train_loss:.6g}{test}{dropped}; log {path}")
    return 0


def cmd_launch(args) -> int:
    import shlex

    from edgefed.orchestration.launcher import Launcher, board_overrides, read_boards

    if args.ranks is not None and args.ranks < 1:
        raise EdgefedError(f"-n {args.ranks}: give at least 1 rank")
    if args.restarts < 0:
        raise EdgefedError(f"--restarts {args.restarts}: give 0 or more")
    boards = read_boards(Path(args.boards)) if args.boards else None
    overrides = list(args.overrides)
    if boards:  # checked as the world will run it: with the boards' profiles and loads
        args.overrides = overrides + board_overrides(boards)
    cfg, _, log = _resolve(args)  # bad input ends here, before any world starts
    placement = {"device.boards": cfg.device.boards, "device.contention": cfg.device.contention,
                 "mpi.device_ranks": cfg.mpi.device_ranks}
    return Launcher(log, args.config, overrides, force=args.force, ranks=args.ranks, boards=boards,
                    placement=placement, restarts=args.restarts, mpiexec=args.mpiexec,
                    mpiexec_args=shlex.split(args.mpiexec_args), quiet=args.quiet, resume=bool(args.resume),
                    on_line=_info, rejoin_check_s=cfg.mpi.rejoin_check_s if cfg.mpi.rejoin else None).run()


def cmd_trace_record(args) -> int:
    import shlex

    from edgefed.orchestration.trace_record import record_traces

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
    code = record_traces(args.out, args.force, names, loads, drops, rounds=args.rounds, local_steps=args.local_steps,
                         deadline_s=args.deadline_s, seed=args.seed, overrides=args.overrides,
                         command="edgefed " + shlex.join(sys.argv[1:]), on_round=_progress(args.quiet),
                         on_info=_info, on_error=_error)
    if code is not None:
        return code
    print(f"wrote {args.out}: {len(names)} traces x {args.rounds} rounds")
    return cmd_trace_show(argparse.Namespace(file=args.out))


def cmd_data_convert(args) -> int:
    import time

    from edgefed.problems.convert import convert

    if args.vocab_size < 1:
        raise EdgefedError(f"--vocab-size {args.vocab_size} must be at least 1")
    check_output(args.out, force=args.force, inputs=[("the dataset", args.source)], flag="OUT", example="data.h5")
    start = time.perf_counter()
    what = convert(args.source, args.out, split=args.split, holdout=args.holdout, vocab_size=args.vocab_size,
                   vocab=args.vocab)
    print(f"wrote {args.out}: {what} ({Path(args.out).stat().st_size / 2**20:.1f} MB, "
          f"{time.perf_counter() - start:.1f} s); run it with [data] kind = \"arrays\", path = \"{args.out}\"")
    return 0


def cmd_data_shard(args) -> int:
    from edgefed.orchestration.datasets import make_shards
    from edgefed.orchestration.launcher import read_boards

    ranks = len(read_boards(Path(args.boards))) if args.boards else args.ranks
    if ranks < 2:
        raise EdgefedError(f"-n {ranks}: a world with device ranks has at least 2 ranks")
    for rank, path, size in make_shards(args.config, args.overrides, ranks, args.out, args.force):
        print(f"wrote {path}: rank {rank}'s shard ({size / 2**20:.1f} MB)")
    print("copy rank-R.h5 to board R's folder (the same path on every board), then run with --set "
          "data.shards=FOLDER (launch/pi-cluster.sh data BOARDS CONFIG does both)")
    return 0


def cmd_trace_show(args) -> int:
    from edgefed.tracefiles import BUILTIN, read_trace_file

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
    from edgefed.orchestration.profiling import warmup, warmup_config

    if args.config:
        if args.models:
            raise EdgefedError("--config compiles what that experiment needs; drop --models (or --config)")
        warmup_config(args.config, args.overrides, _info)
        return 0
    if args.overrides:
        raise EdgefedError("--set overrides a config's keys; give the --config it applies to")
    models = _names(args.models or "logreg,mlp,cnn,quadratic", ("logreg", "mlp", "cnn", "quadratic"), "models")
    dtypes = _names(args.dtypes, ("float32", "float64"), "dtypes")
    compiled = warmup(models, dtypes, _info, everything=args.models is None)
    _info(f"warmup: {compiled} kernels compiled into the cache" if compiled else "warmup: every kernel was cached")
    return 0


def cmd_profile(args) -> int:
    from edgefed import hwprofile
    from edgefed.orchestration import profiling
    from edgefed.runtime.mpi.comm import world

    def prepare(hosts):
        specs = [] if args.models is None and args.config else _names(args.models or "logreg,mlp,cnn",
                                                                         hwprofile.MODELS, "models")
        reads = []
        if args.config:
            from edgefed.config import files_read, load_config

            reads = [("the config file", args.config)] + [  # (bad input ends here) its data and module; the
                (what, path) for what, path in files_read(load_config(args.config))  # profile it names is what
                if "device." not in what]  # a profile of this machine may well be meant to become
            specs.append(profiling.CONFIG + str(Path(args.config).resolve()))
        return specs, profiling.profile_targets(args.out, hosts, args.force, reads)

    measured = profiling.profile_hosts(world(), prepare, not args.no_cold, _info)
    if isinstance(measured, int):
        return measured
    for (host, path), profile in measured:
        text = profiling.profile_text(profile, host, args.name)
        if path is None:
            print(text, end="")
            continue
        profiling.write_profile(path, text)
        print(f"profile of {host} written to {path}")
    return 0


def cmd_summary(args) -> int:
    from edgefed.analysis.logs import Run
    from edgefed.analysis.summary import summary_lines

    target = args.target_accuracy
    if target is not None and not 0 < target <= 1:  # (NaN fails this too)
        raise EdgefedError(f"--target-accuracy {target:g} is not an accuracy in (0, 1] (one above 1, or NaN, is never "
                           "reached); give one, e.g. 0.8")
    print("\n".join(summary_lines(Run.read(args.log), args.target_accuracy)))
    return 0


def cmd_export(args) -> int:
    from edgefed.analysis.export import CSV_FILES, export_csv, export_weights
    from edgefed.analysis.logs import Run

    if not (args.csv or args.weights):
        raise EdgefedError("export needs --csv FOLDER or --weights OUT.npz (or both)")
    if args.round is not None and not args.weights:
        raise EdgefedError("--round picks the model --weights writes; add --weights OUT.npz")
    reads = [("the run log", args.log)]
    if args.weights and args.csv and Path(args.weights).resolve() == Path(args.csv).resolve():
        raise EdgefedError(f"--weights and --csv both name {args.csv}; give the weights a file and the tables a folder")
    if args.weights:
        check_output(args.weights, force=args.force, inputs=reads, flag="--weights", example="model.npz")
    if args.csv:
        check_folder(args.csv, CSV_FILES, force=args.force, inputs=reads, flag="--csv")
    run = Run.read(args.log)
    if args.csv:  # made before anything is written: a folder that cannot be made leaves no weights behind
        try:
            Path(args.csv).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EdgefedError(f"cannot write CSV into {args.csv} ({exc}); choose another --csv folder") from None
    if args.weights:
        round_idx, module = export_weights(run, Path(args.weights), args.round)
        print(f"wrote {args.weights}: the server model after round {round_idx}, as the state_dict of\n{module}\n"
              f"load it with model.load_state_dict({{k: torch.from_numpy(v) for k, v in "
              f"numpy.load({str(args.weights)!r}).items()}})")
    if args.csv:
        for path in export_csv(run, Path(args.csv)):
            print(f"wrote {path}")
    return 0


def cmd_report(args) -> int:
    from edgefed.analysis.report import write_report

    written = write_report(args.targets, args.out, args.format, args.force)
    print(f"wrote {written[0]}" if args.format == "html" else f"wrote {len(written)} figures into {args.out}")
    return 0


def cmd_sweep(args) -> int:
    from edgefed.orchestration.sweep import run_sweep

    if args.jobs < 1:
        raise EdgefedError(f"-j {args.jobs}: give at least 1 experiment at a time")
    try:
        return run_sweep(Path(args.file), Path(args.out), args.jobs, on_line=_info,
                         live=sys.stdout.isatty())
    except KeyboardInterrupt:
        print("edgefed: sweep interrupted; the same command continues it (complete runs are kept, the "
              "interrupted one resumes)", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def cmd_contend(args) -> int:
    import time

    from edgefed.runtime.contention import cpu_share, duty_cycle, pin

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
    share = cpu_share()
    of = "a core" if share >= 1 else f"the {share:.0%} of a core this cgroup allows"
    print(f"contending: {args.load:.0%} of {of}{where}" + ("" if args.seconds is None else f" for {args.seconds:g} s"),
          flush=True)
    try:
        duty_cycle(lambda: args.load, lambda: time.monotonic() >= end, share=share)
    except KeyboardInterrupt:
        pass
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    before = os.environ.get(DEBUG_ENV)
    if args.debug:  # also for what this process starts (mpiexec's ranks, a sweep's runs)
        os.environ[DEBUG_ENV] = "1"
    try:
        return args.func(args)
    except EdgefedError as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
    except Interrupted as exc:
        print(f"edgefed: {exc}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("edgefed: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `edgefed summary RUN.h5 | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemoryError as exc:  # what no estimate foresaw: the machine's limit, not a bug
        if debugging():
            raise
        _error(f"out of memory ({exc or 'an allocation failed'}); this machine cannot hold what "
               f"`edgefed {shlex.join(argv)}` asks for: a smaller model, less data or fewer devices")
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - a bug: one line saying how to report it, not a traceback
        if debugging():
            raise
        print(f"edgefed: {internal_error(exc, 'edgefed ' + shlex.join(argv))}", file=sys.stderr, flush=True)
        return EXIT_INTERNAL
    finally:
        if before is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = before
