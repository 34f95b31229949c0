"""Workbench widgets: memory bars, chart adapter, feasibility map, throttle strip."""
