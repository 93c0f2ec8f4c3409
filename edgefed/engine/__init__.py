"""Engines: the loops that turn plans and reports into server updates, over any transport."""
