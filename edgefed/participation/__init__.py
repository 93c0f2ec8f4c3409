"""Who takes part in a round and with which weight: pure functions, no transport, no files."""
