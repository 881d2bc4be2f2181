"""The drafter's optimisation, shared by every drafter rank and the single-process reference:
micro-steps, gradient accumulation and optimizer steps (trainer.py), what a step adds up and reads
back (step_totals.py), the drafter and lr schedule a config asks for (recipe.py), the micro-batch it
trains on (features.py), AdamW as one streaming pass (streaming_adamw.py) and bf16 working weights
with fp32 masters (working_weights.py)."""
