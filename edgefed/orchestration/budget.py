"""What a run will hold, estimated before anything large is built: each process's memory (the runtime and its
kernels, the model's lanes and a round's vectors, the devices' bookkeeping, data and vectors) and the log's disk,
held to what the machine (or a rank's board) has, with one line saying what would fit."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import psutil

from edgefed.algorithms import Algorithm
from edgefed.config import Config
from edgefed.errors import ResourceError
from edgefed.memory import memory_limit, size_text
from edgefed.orchestration.header import stored_rounds
from edgefed.participation.timing import overselected


KERNEL_BYTES = 64 * 2 ** 20  # what loading a run's compiled kernels adds to the process (measured: 56-61 MB for
# each built-in model, LLVM's own state the most of it; benchmarks/RESULTS.md, "Data at the edge")
PER_DEVICE_BYTES = 150  # what the coordinator keeps per device (sizes, budgets, the membership, the clock's and
# the selection's arrays, the drawing of the sizes): benchmarks/scale.py's peaks grow 104 B a device from 10^5
# to 10^6 and 78 B from 10^6 to 10^7 (423 -> 517 -> 1188 MB); 150 leaves room for what that slope hides
RANK_DEVICE_BYTES = 64  # what a device rank keeps per device it hosts (their ids and sizes, and while they are
# drawn and its data estimated, their draws and data sizes: about 50 B by their dtypes); it holds nothing per
# device of the federation. Measured: 20 B a hosted device from 10^5 to 10^7 (316 -> 412 MB, 2 ranks)


def memory_need(cfg: Config, n: int, data_bytes: int = 0, state_bytes: int = 0, state_what: str = "",
                device_bytes: int = PER_DEVICE_BYTES, model_bytes: int = 0) -> tuple[int, list[str], int]:
    """(bytes, their parts in words, of them the runtime's) a process needs: this process as it stands (the runtime, the problem) and
    its kernels, the model's further buffers, N devices' bookkeeping at device_bytes each, the devices' data it
    may hold (data_held), the devices' vectors."""
    runtime = psutil.Process().memory_info().rss + KERNEL_BYTES
    per_device = n * device_bytes
    parts = [f"{size_text(runtime)} the runtime"]
    parts += [f"{size_text(model_bytes)} the model's buffers (its lanes' workspaces, a round's updates)"] if model_bytes else []
    parts += [f"{size_text(per_device)} for {n:,} devices' bookkeeping"]
    parts += [f"{size_text(data_bytes)} of their data (up to data.cache_mb)"] if data_bytes else []
    parts += [f"{size_text(state_bytes)} {state_what}"] if state_bytes else []
    return runtime + model_bytes + per_device + data_bytes + state_bytes, parts, runtime


def check_memory(cfg: Config, n: int, data_bytes: int = 0, state_bytes: int = 0, state_what: str = "",
                 device_bytes: int = PER_DEVICE_BYTES, model_bytes: int = 0) -> int:
    """Refuse, before anything large is built, a run whose estimate (memory_need) exceeds what this process may
    use; one line with the estimate, the limit and what would fit. Returns the estimate."""
    need, parts, runtime = memory_need(cfg, n, data_bytes, state_bytes, state_what, device_bytes, model_bytes)
    limit, what = memory_limit()
    if need <= limit:
        return need
    if runtime + model_bytes + data_bytes >= limit:  # no number of devices fits: the model is what is too large
        raise ResourceError(f"this run needs about {size_text(need)} of memory ({', '.join(parts)}) but {what} is "
                            f"{size_text(limit)}; use a smaller model, smaller minibatches (train.batch_size), fewer "
                            "devices a round, fewer mpi.threads_per_rank" + (" or a smaller data.cache_mb"
                                                                             if data_bytes else ""))
    fit = max(int((limit - runtime - model_bytes - data_bytes) // (device_bytes + state_bytes / max(n, 1))), 0)
    smaller = ", a smaller data.cache_mb, or log.eval_devices (evaluation builds every device)" if data_bytes else ""
    raise ResourceError(f"this run needs about {size_text(need)} of memory ({', '.join(parts)}) but {what} is "
                        f"{size_text(limit)}; about {fit:,} devices would fit in this process: use fewer devices "
                        f"(data.clients) or fewer per rank (more ranks under mpiexec){smaller}")


def data_held(cfg: Config, problem, own: np.ndarray | None = None) -> int:
    """The most of the devices' data a process hosting `own` (None: every device) holds at once: the devices a
    run can build there (the rounds' selections and the evaluated ones; every hosted one when all are
    evaluated), the largest first, up to data.cache_mb and the one device its cache keeps beyond it."""
    if not hasattr(problem, "device_bytes"):
        return 0
    sizes = problem.device_bytes() if own is None else problem.device_bytes(own)
    if not sizes.size:
        return 0
    built = sizes.size if cfg.log.eval_devices is None else min(
        sizes.size, touched_rows(cfg, problem.n_devices) + cfg.log.eval_devices)
    largest = np.partition(sizes, sizes.size - built)[sizes.size - built:] if built < sizes.size else sizes
    return int(min(largest.sum(), cfg.data.cache_mb * 2 ** 20 + largest.max()))


MPI_COPIES = 3  # a round's report vectors under mpiexec, in the process that holds them: as computed (or
# decoded), as the wire's records, and MPI's own copy of a large message (measured: the MNIST CNN, 50 devices
# a round over 2 device ranks, 1.18 GB at rank 0 and 0.78 GB at each device rank, against 0.71 GB in one process)


def model_bytes(cfg: Config, algorithm: Algorithm, problem, model, lanes: int, hosted: int | None = None,
                distributed: bool = False) -> int:
    """What a run's model costs beyond the one built (its parameters, which the process holds already): the
    workspaces of a model for each lane and of one for evaluation where it runs apart, a round's report vectors (a row per selected device this process holds, and
    its residual with error feedback; MPI_COPIES under mpiexec) and the server's vectors (x, its update and sum,
    the algorithm's). hosted: the devices of a device rank (None: every device, the coordinator's view)."""
    n = problem.n_devices
    per_round = (cfg.asynchronous.concurrency if cfg.participation.mode == "async"
                 else overselected(cfg.clients_per_round_count(n), cfg.participation.overselect, n))
    rows = min(per_round, n if hosted is None else hosted) * len(algorithm.reports)
    rows *= (2 if cfg.compress.error_feedback else 1) * (MPI_COPIES if distributed else 1)
    server = (4 if hosted is None else 1) + 2 * len(algorithm.server_vectors)  # a device rank: the broadcast
    vectors = (rows + server) * model.n_trainable * np.dtype(model.dtype).itemsize
    models = lanes + (1 if lanes and evaluates_apart(cfg) else 0)  # (workspaces are made when first used)
    return models * model.memory_bytes() + vectors


def touched_rows(cfg: Config, n: int) -> int:
    """The most devices a report can change in a run: rounds x the devices a round selects (a replayed
    log's or an async run's selections are not counted here: all of them)."""
    p = cfg.participation
    replay = p.mode == "trace" and isinstance(p.trace, str) and p.trace.endswith((".h5", ".hdf5"))
    if replay or p.mode == "async":
        return n
    per_round = overselected(cfg.clients_per_round_count(n), cfg.participation.overselect, n)
    return min(n, cfg.rounds * per_round)


def held_rows(algorithm: Algorithm, cfg: Config, n: int) -> int:
    """The most devices whose vectors a run holds (sparse state): those a report can change, or all of them
    when they start from anything but zero."""
    return touched_rows(cfg, n) if algorithm.zero_start else n


def residual_bytes(algorithm: Algorithm, cfg: Config, n: int, d: int, dtype) -> int:
    """Error feedback's residuals: a row per report vector of each device a report changed (zero before)."""
    if not cfg.compress.error_feedback:
        return 0
    return len(algorithm.reports) * touched_rows(cfg, n) * d * np.dtype(dtype).itemsize


def _rank_terms(cfg: Config, algorithm: Algorithm, problem, model, own: np.ndarray, lanes: int) -> tuple:
    """memory_need's terms for a device rank hosting `own` with `lanes` lanes: the devices' data it may hold,
    the vectors of its devices a run can touch, and its lanes' models."""
    touched = min(own.size, touched_rows(cfg, problem.n_devices))
    rows = len(algorithm.device_vectors) * (touched if algorithm.zero_start else own.size)
    rows += len(algorithm.reports) * touched if cfg.compress.error_feedback else 0
    state = rows * model.n_trainable * np.dtype(model.dtype).itemsize
    return (cfg, own.size, data_held(cfg, problem, own), state, "its devices' vectors", RANK_DEVICE_BYTES,
            model_bytes(cfg, algorithm, problem, model, lanes, own.size, distributed=True))


def rank_memory(cfg: Config, algorithm: Algorithm, problem, model, own: np.ndarray, lanes: int) -> tuple[int, list]:
    """A device rank's estimate (memory_need): what rank 0 holds a board to before the world builds anything
    (this process stands in for the rank's runtime: the same software and problem)."""
    return memory_need(*_rank_terms(cfg, algorithm, problem, model, own, lanes))[:2]


def check_rank_memory(cfg: Config, algorithm: Algorithm, problem, model, own: np.ndarray, lanes: int) -> int:
    """A device rank's estimate before it builds its devices, against what its machine has."""
    return check_memory(*_rank_terms(cfg, algorithm, problem, model, own, lanes))


def check_boards(needs: dict[int, tuple[int, list]], boards: dict) -> None:
    """Each device rank's estimate against its board's memory less what the board's own system takes
    (hwprofile: machine.system_mb): a rank that cannot fit its board is refused before the world builds
    anything, in one line naming the board."""
    for rank, board in sorted(boards.items()):  # (rank -> its board's hwprofile.Profile)
        need, parts = needs[rank]
        name = Path(board.source).stem
        if need > board.available_mb * 2 ** 20:
            memory, system = board.machine["memory_mb"], board.machine.get("system_mb", 0)
            raise ResourceError(
                f"board {name} (rank {rank}) has {memory} MB, of which its system takes {system} MB: "
                f"{board.available_mb:.0f} MB for the rank, which needs about {size_text(need)} ({', '.join(parts)}); "
                "give the rank fewer devices (more boards), a smaller data.cache_mb or train.batch_size, or a "
                "smaller model")


def check_device_memory(algorithm: Algorithm, cfg: Config, problem, model, log_path: Path, on_info,
                        distributed: bool = False) -> int:
    """Report what the devices' vectors (SCAFFOLD's controls: a row for each device a run can touch, or all
    N) and error feedback's residuals can take, and refuse when memory (with the model's lanes and a round's
    vectors, in one process) or disk cannot hold them. Returns this process's estimate."""
    vectors = algorithm.device_vectors
    n, d, dtype = problem.n_devices, model.n_trainable, model.dtype
    data_bytes = 0 if distributed else data_held(cfg, problem)  # (under mpiexec the device ranks hold it)
    residuals = residual_bytes(algorithm, cfg, n, d, dtype)
    held_model = model_bytes(cfg, algorithm, problem, model, 0 if distributed else cfg.mpi.threads_per_rank or 1,
                             distributed=distributed)  # (under mpiexec the coordinator hosts no device)
    if not vectors:
        return check_memory(cfg, n, data_bytes, residuals, "error feedback's residuals", model_bytes=held_model)
    owner, noun = vectors[0].owner, " and ".join(dict.fromkeys(v.noun for v in vectors))
    item = np.dtype(dtype).itemsize
    held = held_rows(algorithm, cfg, n)
    in_memory = len(vectors) * held * d * item
    whole = len(vectors) * n * d * item  # what [log] client_controls stores every stored round
    on_disk = 2 * in_memory + (stored_rounds(cfg.rounds, cfg.log.every) * whole if cfg.log.client_controls else 0)
    shape = f"{held} x {d}" if len(vectors) == 1 else f"{len(vectors)} x {held} x {d}"
    touched = "" if held == n else f" (held for the {held:,} of {n:,} devices {cfg.rounds} rounds can touch)"
    on_info(f"{owner} {noun}: {shape} {np.dtype(dtype).name} = {size_text(in_memory)} in memory, "
            f"{size_text(on_disk)} in the run log{touched}")
    available = psutil.virtual_memory().available
    if in_memory > 0.8 * available:
        hint = "" if np.dtype(dtype) == np.float32 else 'model.dtype = "float32" halves it, or '
        raise ResourceError(f"{owner}'s {noun} need {size_text(in_memory)} but only {size_text(available)} of memory "
                            f"is available; {hint}use fewer devices (data.clients)"
                            f"{'' if held == n else ', fewer rounds or fewer devices a round'}")
    need = check_memory(cfg, n, data_bytes, in_memory + residuals,
                        f"{owner}'s {noun}" + (" and the residuals" if residuals else ""), model_bytes=held_model)
    free = shutil.disk_usage(log_path.parent if log_path.parent.exists() else Path.cwd()).free
    if on_disk > free:
        raise ResourceError(f"the run log would need {size_text(on_disk)} for {owner}'s {noun} but the disk has "
                            f"{size_text(free)} free; log fewer rounds (log.every), set log.client_controls = false, "
                            'or use model.dtype = "float32"')
    return need


def evaluates_apart(cfg: Config) -> bool:
    """Whether evaluation may overlap a worker still computing (so it needs a model of its own)."""
    return cfg.participation.mode in ("deadline", "async") or cfg.participation.overselect > 0
