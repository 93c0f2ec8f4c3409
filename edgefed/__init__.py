"""edgefed: federated learning on the edge, exact to the papers and reproducible to the bit."""

__version__ = "0.1.0"
