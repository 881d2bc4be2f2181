"""Launching and operating jobs: one torchrun job per run directory; no silent failure, no zombie,
no orphan. `python -m dflash_mp.launch --help` (dflash_mp/launch/__main__.py) has the commands.

- `launcher`: take the run directory's lock, announce it, preflight, then supervise or detach;
- `doctor`: the preflight checks (`python -m dflash_mp.launch doctor`, and before every job);
- `supervisor`: one job's torchrun, its ranks' heartbeats, the outcome in job.log;
- `outcome`: exit codes, job.json, who failed first and whether a stop was a preemption;
- `detached`: `start`, `status` and `stop` of a job that outlives its terminal;
- `sweep`: Hydra single runs and `-m` sweeps of whole jobs, with a summary of every point;
- `agent`: torchrun's agent, forking the ranks of a CPU job; `rank`: one rank's program.

The job's processes are found through /proc by the job's id (`dflash_mp.run.processes`).
"""
