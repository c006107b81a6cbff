"""The lab's tools: the simulator, calibration, the market task."""
