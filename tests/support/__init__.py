"""Shared test helpers: the tiny models' matrix, harnesses for real server processes, clusters
and agents, stand-ins for remote engines."""
