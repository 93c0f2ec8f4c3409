"""Reading logs for answers: summaries, CSV export, sweep tables and reports. Imports no runtime."""
