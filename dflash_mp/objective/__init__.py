"""The DFlash training objective (docs/DESIGN.md §3): anchors and draft blocks (draft_blocks.py),
the decay-weighted block-diffusion loss through the frozen LM head (block_diffusion.py), and
DFlash 2's selector term (selector_loss.py)."""
