"""Client updates and server aggregation, pure: no transport, no files."""
