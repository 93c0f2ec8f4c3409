"""Secure aggregation's math (Bonawitz et al., CCS 2017): pure, no I/O, no transport."""
