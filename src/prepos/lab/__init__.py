"""The lab: tools for training, calibrating, measuring and demonstrating prepos, apart from the
serving core (the core never imports from here)."""
