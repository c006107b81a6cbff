"""The closed-form model of Section 2, the session simulator (the whole answer pre-decoded too),
and Figures 4-6 of Section 5.

    from prepos.sim import REFERENCE, model, simulate, SimConfig
"""

from prepos.sim.model import REFERENCE, REFERENCE_MEASURED, Constants
from prepos.sim.simulator import SimConfig, SimResult, closed_form, simulate, sweep

__all__ = [
    "REFERENCE", "REFERENCE_MEASURED", "Constants", "SimConfig", "SimResult", "closed_form",
    "simulate", "sweep",
]
