"""Training FLOPs per token, the formula the families share (PaLM, Chowdhery et al. 2022,
appendix B): 6 per parameter (forward + backward) plus attention's 12·L·T·D, D the query width
(heads × head dim). Recomputation is not counted (it is MFU's numerator). No jax here."""


def palm_flops_per_token(params: float, n_layers: int, seq_len: int, d_attn: int) -> float:
    return 6 * params + 12 * n_layers * seq_len * d_attn
