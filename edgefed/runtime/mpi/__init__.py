"""The MPI runtime: rank 0 coordinates (the engine's transport), ranks 1..P-1 host devices.

comm.py: the world and sleeping waits; protocol.py: every message as a named record; coordinator.py: rank
0's transport; device_server.py: a device rank's loop; placement.py: which rank hosts which device.
"""
