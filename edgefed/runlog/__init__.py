"""The HDF5 run log of docs/design.md 3.4, a package of roles: `schema` (what a log holds), `files` (writing
a log only whole, the writer's hold on it, the stub), `writer` (appending rounds and their resume state),
`rows` (per-device rows at HDF5's low level), `reader` (opening, reading, the resume point).

Written only by the coordinator, in HDF5's single-writer/multiple-reader (SWMR) mode so the log stays
consistent and readable while the run goes on and after a kill: open it with `open_run` (or
`h5py.File(path, "r", swmr=True)`). Every round-indexed dataset grows by one row per round and says in its
`rows` attribute how rows map to rounds:

- `round`:    row i holds round i + 1 (R rows when complete), e.g. /participation/*, /metrics/lr;
- `round+1`:  row r holds round r, row 0 the start (R + 1 rows), e.g. /metrics/train_loss;
- `stored`:   one row per entry of /trajectory/round (round 0, every `log.every`-th round, and round R).

`/state` holds what a resume needs, written so that a kill at any instant leaves one consistent round:
small vectors (x, SCAFFOLD's c) alternate between two slots, round r writing slot r % 2; per-device rows
(the controls c_k, updated only for the devices that reported) are first copied to an undo area; the round
marker /state/round is written last, after a flush. Resume never writes into the killed file (a crashed
SWMR writer leaves it locked for writing): it copies the rounds that were completely logged into a fresh
file and swaps it in atomically, so nothing logged is lost if the resume itself fails.
"""

from edgefed.runlog.files import discard_stub, exists_error, hold, let_go, write_stub
from edgefed.runlog.reader import (LazyRun, RecordedParticipation, ResumePoint, device_count, last_completed_round, no_round_yet,
                                   nonfinite_counts, open_run, read_participation, read_resume_point, read_run,
                                   reading, root_attrs, run_status)
from edgefed.runlog.rows import Scattered, SparseRounds, read_rows, round_ids, round_values, stored_rows, write_rows
from edgefed.runlog.schema import (EVALUATED, FORMAT, FORMAT_VERSION, FROZEN, LIBVER, MEASURED, MEASURED_ATTRS,
                                   MEASURED_CLOCK, RESTART, Column, Header, columns, measured, restart_records)
from edgefed.runlog.writer import RunLogWriter

__all__ = ["Scattered", "SparseRounds", "round_ids", "round_values", "EVALUATED", "FORMAT", "FORMAT_VERSION", "FROZEN", "LIBVER", "MEASURED", "MEASURED_ATTRS", "MEASURED_CLOCK",
           "RESTART", "Column", "Header", "LazyRun", "RecordedParticipation", "ResumePoint", "RunLogWriter", "columns",
           "device_count", "last_completed_round", "discard_stub", "exists_error", "hold", "let_go", "measured", "no_round_yet",
           "nonfinite_counts", "open_run", "read_participation", "read_resume_point", "read_rows", "read_run", "reading",
           "restart_records", "root_attrs", "run_status", "stored_rows", "write_rows", "write_stub"]
