"""When a cached token may answer: the calibrated gate of Eq. 12 (`calibrated.py`), question
classes and the relaxed path's online risk gate (`relaxed.py`)."""
