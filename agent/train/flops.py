"""Model FLOPs per token of the built-in GPT, for MFU (torch-free)."""

from __future__ import annotations


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward: 6N + 12·L·H·Q·T.

    PaLM appendix B, as in nanoGPT's estimate_mfu. N is every parameter except the position
    embedding; the tied token embedding counts, since it is also the output projection (this is
    ``GPT.num_params()`` in agent/train/model.py). The second term is the attention score and value
    matmuls over a context of T tokens.
    """
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len
