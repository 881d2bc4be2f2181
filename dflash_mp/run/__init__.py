"""What a run leaves on disk and in /proc: the run directory's lock and config history (rundir.py),
checkpoints (checkpoint.py), metrics (metrics.py), logs (logs.py), plots (plots.py) and the job's
processes (processes.py). Imports nothing else from the package, so the launcher, the ranks and the
tools all read a run the same way."""
