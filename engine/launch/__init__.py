"""Putting an experiment onto a target and keeping it honest: targets, the launcher (plan, launch,
cancel, reconcile), the SSH and Slurm clients, and the supervisor that runs beside each run."""
