"""The DFlash training objective (docs/DESIGN.md §3): anchors and draft blocks (draft_blocks.py),
the decay-weighted block-diffusion loss of a micro-batch (block_diffusion.py) through the frozen
LM head (lm_head_loss.py), and DFlash 2's selector term (selector_loss.py)."""
