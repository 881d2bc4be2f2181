"""Helpers of bench/bench.py, one module per concern, each imported by name where it is used
(`from benchlib.timing import sync`).

shapes: the benchmark shapes and their config (no torch at import: bench.py reads the shapes' names
before torch is imported). synthetic: random micro-batches and models built on the device. flops:
useful-FLOP counts. timing: device-timeline marks, statistics, the matmul peak, memory.
compile_watch: recompilations after warm-up. jsonio: JSON between ranks and on disk. watchdog:
deadlines and failed peers. power: energy, power and clock from NVML. state: what the sections share
(`BenchState`: it builds the job's process groups). chat_data: chat-shaped micro-batches.
family_shapes: the per-family target shapes of bench/target_families.py.
"""
