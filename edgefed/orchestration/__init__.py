"""What a run is, above the runtime: resolve and prepare it, drive it in one process or across MPI ranks,
record traces with it, profile the machines it will use."""
