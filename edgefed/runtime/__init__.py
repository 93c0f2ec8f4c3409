"""Transports: the devices in this process (local.py) or across MPI ranks (mpi/), with what local work needs
on a board (deadline.py: the deadline runner and board readings; contention.py: CPU competitors)."""
