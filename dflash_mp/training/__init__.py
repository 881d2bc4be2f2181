"""The drafter's optimisation, shared by every drafter rank and the single-process reference:
micro-steps, gradient accumulation and optimizer steps (trainer.py), AdamW as one streaming pass
(streaming_adamw.py) and bf16 working weights with fp32 masters (working_weights.py)."""
