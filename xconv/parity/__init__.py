"""parity."""
