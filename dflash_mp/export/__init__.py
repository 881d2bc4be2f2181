"""The trained drafter for inference engines: `python -m dflash_mp.export RUN_DIR`.

Rooms: hf.py (write an export, load one back, rebuild a checkpoint's drafter), modeling_dflash.py
(the self-contained modelling file every export carries), cli.py (arguments and output).
"""
