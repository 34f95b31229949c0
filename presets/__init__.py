"""Shipped data (models, hardware, experiments, baselines) read with importlib.resources."""
