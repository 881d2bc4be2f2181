"""Acceptance length of a drafter with the full target: the speculative decoding loop
(decoding.py) and the evaluation of prompts, used during training and by `python -m dflash_mp.eval`
(acceptance.py)."""
