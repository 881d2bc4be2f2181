"""One torchrun job at run time: roles and routing (topology.py), process groups (distributed.py,
target_parallel.py), the target-to-drafter transport (transport.py), what each role does
(roles.py, colocated.py), resuming (resume.py), and liveness (watchdog.py, clock.py)."""
