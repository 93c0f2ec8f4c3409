"""The `edgefed` command: verbs, argparse, and the only place that prints errors and exits."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from edgefed import __version__
from edgefed.errors import EdgefedError

EXIT_BAD_INPUT = 2


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
    return parser


def _fmt(value: float, spec: str) -> str:
    return "     -" if math.isnan(value) else format(value, spec)


def progress_line(s) -> str:
    width = len(str(s.rounds))
    dropped = f"  dropped {s.n_dropped}" if s.n_dropped else ""
    dropped += f"  late {s.n_late}" if s.n_late else ""
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


def cmd_run(args) -> int:
    from edgefed import experiment
    from edgefed.runtime import mpi

    on_round = None if args.quiet else (lambda s: print(progress_line(s), flush=True))
    comm = mpi.world()
    if comm is not None:
        from edgefed.runtime import ranks

        if comm.Get_rank() != 0:
            return ranks.run_device_rank(comm)
        result = ranks.run_coordinator(comm, lambda: _resolve(args), args.force, on_round, _info, _error)
        if isinstance(result, int):
            return result
        path = result.path
    else:
        cfg, point, path = _resolve(args)
        try:
            result = experiment.run(cfg, path, resume_point=point, force=args.force, on_round=on_round, on_info=_info)
        except KeyboardInterrupt:
            print(f"edgefed: interrupted; continue with: edgefed run --resume {path}", file=sys.stderr)
            return 130
    if result.already_complete:
        print(f"{path}: the run is already complete; nothing to resume")
        return 0
    test = "" if math.isnan(result.best_test_accuracy) else (
        f", test accuracy {result.final_test_accuracy:.4f} (best {result.best_test_accuracy:.4f} "
        f"at round {result.best_round})")
    print(f"done: {result.rounds_run} rounds in {result.wall_s:.1f} s; final train loss "
          f"{result.final_train_loss:.6g}{test}; log {path}")
    return 0


def cmd_contend(args) -> int:
    import os
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
