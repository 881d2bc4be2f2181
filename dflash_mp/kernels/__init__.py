"""Hand-written kernels, each beside the plain-torch path it replaces where it cannot run (CPU, no
Triton, no FlashAttention 4): the chunked cross-entropy (fused_ce.py), exact top-K (top_k.py),
weighted row sums (weighted_rows.py), DFlash 2's grouped convolution (grouped_conv.py), the
block-sparse attention on FlashAttention 4 (flash_attention.py) and the block mask in each
attention kernel's form (block_mask.py). They import nothing else from the package."""
