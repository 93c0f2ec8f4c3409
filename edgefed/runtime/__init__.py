"""The round loop and the transports that carry a round's local work."""
