"""The benchmarks, each run as a script (`python benchmarks/x.py`); a package so that the
tests import what they check by name (`benchmarks.common`, `benchmarks.agent_jobs`)."""
