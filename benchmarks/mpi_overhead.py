"""MPI round overhead and the CPU of waiting ranks, side by side in one run.

    mpiexec -n 2 python benchmarks/mpi_overhead.py [--repeats 200]

Part 1, per model size (float32): one model broadcast by MPI's blocking `Bcast`, by edgefed's non-blocking
`Ibcast` + polling wait (what a round does), one device record sent back point to point (Isend/Iprobe/Recv,
as a round's report), and a `memcpy` (np.copyto) of the same bytes in one process, the floor any transport
compares with. Medians over the repeats.
Part 2: the CPU share of a rank that waits 2 s for a broadcast, with MPICH's blocking `Bcast` and with
edgefed's polling wait, measured by the waiting rank's own CPU time.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from mpi4py import MPI

from edgefed.runtime.mpi.comm import wait

SIZES = {"logreg 60x10": 610, "2NN 784-200-200-10": 199_210, "CNN (McMahan)": 1_663_370}


def median_us(samples):
    return 1e6 * float(np.median(samples))


def bench_sizes(comm, repeats: int):
    rank = comm.Get_rank()
    rows = []
    for name, n in SIZES.items():
        x = np.ones(n, np.float32)
        y = np.empty_like(x)
        copies, bcasts, ibcasts, sends = [], [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            np.copyto(y, x)
            copies.append(time.perf_counter() - t)
            comm.Barrier()
            t = time.perf_counter()
            comm.Bcast(x, root=0)
            comm.Barrier()  # both sides done: the broadcast has landed
            bcasts.append(time.perf_counter() - t)
            t = time.perf_counter()
            wait(comm.Ibcast(x, root=0))
            comm.Barrier()
            ibcasts.append(time.perf_counter() - t)
            t = time.perf_counter()
            if rank == 1:
                wait(comm.Isend(x, dest=0, tag=7))
            elif rank == 0:
                status = MPI.Status()
                while not comm.Iprobe(1, 7, status):
                    pass
                comm.Recv(y, source=1, tag=7)
            comm.Barrier()
            sends.append(time.perf_counter() - t)
        barrier = []
        for _ in range(repeats):
            t = time.perf_counter()
            comm.Barrier()
            comm.Barrier()
            barrier.append(time.perf_counter() - t)
        b = float(np.median(barrier)) / 2  # one barrier's cost, subtracted from the timed collectives
        rows.append((name, n, 4 * n, median_us(copies), median_us(bcasts) - 1e6 * b, median_us(ibcasts) - 1e6 * b,
                     median_us(sends) - 1e6 * b))
    return rows


def cpu_while_waiting(comm, seconds: float, polling: bool) -> float:
    """CPU share (%) of rank 1 while rank 0 keeps it waiting `seconds` for a broadcast."""
    buf = np.zeros(610, np.float32)
    comm.Barrier()
    if comm.Get_rank() == 0:  # a blocking and a non-blocking broadcast never match: both sides use one kind
        time.sleep(seconds)
        wait(comm.Ibcast(buf, root=0)) if polling else comm.Bcast(buf, root=0)
        return float("nan")
    wall, cpu = time.perf_counter(), time.process_time()
    if polling:
        wait(comm.Ibcast(buf, root=0))
    else:
        comm.Bcast(buf, root=0)
    return 100.0 * (time.process_time() - cpu) / (time.perf_counter() - wall)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--wait-seconds", type=float, default=2.0)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rows = bench_sizes(comm, args.repeats)
    blocking = cpu_while_waiting(comm, args.wait_seconds, polling=False)
    polling = cpu_while_waiting(comm, args.wait_seconds, polling=True)
    shares = comm.gather((blocking, polling), root=0)
    if comm.Get_rank() != 0:
        return
    print(f"# {platform.machine()}, {comm.Get_size()} ranks, MPI: {MPI.Get_library_version().splitlines()[0]}")
    print("| model | floats | bytes | memcpy µs | Bcast µs | Ibcast+poll µs | Ibcast / memcpy | record up (Isend/Recv) µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, n, nbytes, copy, bcast, ibcast, send in rows:
        print(f"| {name} | {n:,} | {nbytes:,} | {copy:.1f} | {bcast:.1f} | {ibcast:.1f} | {ibcast / copy:.1f}x | {send:.1f} |")
    print()
    print("| waiting for a broadcast | CPU share of the waiting rank |")
    print("| --- | --- |")
    print(f"| MPICH blocking Bcast | {shares[1][0]:.0f} % |")
    print(f"| edgefed polling wait (Ibcast + Test + sleeps up to 1 ms) | {shares[1][1]:.1f} % |")


if __name__ == "__main__":
    main()
