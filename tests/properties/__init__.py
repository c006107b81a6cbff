"""Property tests: invariants under random interleavings and random schemas."""
