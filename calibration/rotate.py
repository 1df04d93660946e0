"""Offline orthogonal rotation of a Llama-style model before quantization.

Weight-only quantization suffers from outlier input columns: one large
column sets the scale of its whole row (per channel) or group.  Rotating the
residual stream by an orthogonal matrix Q spreads every column over all the
others (incoherence processing, as in QuIP# / QuaRot / SpinQuant), and it can
be folded entirely into the weights, so inference runs the unchanged model
architecture with no extra op:

1. every RMSNorm's gain g is folded into the linears that read its output
   (W <- W diag(g)) and the gain set to 1, so that
   RMSNorm(x Q) = RMSNorm(x) Q holds exactly;
2. embeddings E <- E Q; linears that read the residual stream (q/k/v,
   gate/up, lm_head) W <- W Q; linears that write it (o, down) W <- Q^T W;
3. optionally, each attention head's values are rotated by a head_dim-sized
   H: v_proj's rows of each KV head W_v <- H^T W_v, o_proj's columns of each
   query head W_o <- W_o H (attention mixes values linearly, per head, so the
   rotation passes through it).

Step 1 needs lm_head to stop sharing its weight with the embeddings (the
final norm's gain is folded into lm_head only), so a tied model comes out
untied: for SmolLM2-135M that stores one more 49152 x 576 matrix.

The float model's outputs are unchanged up to rounding (a test checks the
logits); only the quantization error changes.  down_proj's input (after
SwiGLU) is not rotated: that would need an online Hadamard transform at run
time.

Q is a Hadamard matrix with random column signs when one of the supported
orders exists (2^a, 12 * 2^a, 20 * 2^a, and Kronecker products of those), else
a random orthogonal matrix from a seeded QR.  All rotations run in float64.
"""

from __future__ import annotations

import torch
from torch import nn

from qgemv import arch


def _paley(q: int) -> torch.Tensor:
    """Hadamard matrix of order q + 1 for a prime q = 3 (mod 4) (Paley I)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if i in residues else -1 for i in range(1, q)]
    jac = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard(n: int):
    """A (+1/-1) Hadamard matrix of order n as float64 [n, n], or None if not built here.

    Orders: b * 2^a with b in {1, 12, 20} (Sylvester doubling of a Paley
    matrix), and Kronecker products of two such orders (576 = 12 * 48).
    """
    def direct(m):
        for b, q in ((1, None), (12, 11), (20, 19)):
            if m % b == 0:
                r = m // b
                if r & (r - 1) == 0:
                    h = torch.ones(1, 1, dtype=torch.float64) if q is None else _paley(q)
                    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
                    while h.shape[0] < m:
                        h = torch.kron(h2, h)
                    return h
        return None

    h = direct(n)
    if h is not None:
        return h
    for a in range(2, int(n ** 0.5) + 1):
        if n % a == 0:
            ha, hb = direct(a), direct(n // a)
            if ha is not None and hb is not None:
                return torch.kron(ha, hb)
    return None


def _rotation(n: int, seed: int) -> tuple:
    """(orthogonal float64 [n, n], "hadamard" or "random"): see random_rotation."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n)
    if h is not None:
        signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
        return h * signs[None, :] / n ** 0.5, "hadamard"
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))[None, :], "random"


def random_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal float64 [n, n]: a normalised Hadamard with random column signs, else a seeded random QR."""
    return _rotation(n, seed)[0]


def _fold_norm(norm: nn.Module, linears: list) -> None:
    g = norm.weight.detach().to(torch.float64)
    for lin in linears:
        lin.weight.data = (lin.weight.data.to(torch.float64) * g[None, :]).to(lin.weight.dtype)
    norm.weight.data.fill_(1.0)


def _check_norm(name: str, norm) -> None:
    if norm is None or getattr(norm, "weight", None) is None:
        raise ValueError(f"{name}: rotation needs an RMSNorm with a weight here")
    if getattr(norm, "bias", None) is not None:
        raise ValueError(f"{name} ({type(norm).__name__}) has a bias: only RMSNorm-style norms can be folded")


def _right(lin: nn.Linear, q: torch.Tensor) -> None:
    """W <- W Q (the linear reads a rotated input)."""
    lin.weight.data = (lin.weight.data.to(torch.float64) @ q).to(lin.weight.dtype)


def _left(lin: nn.Linear, q: torch.Tensor) -> None:
    """W <- Q^T W, b <- Q^T b (the linear's output is rotated)."""
    lin.weight.data = (q.t() @ lin.weight.data.to(torch.float64)).to(lin.weight.dtype)
    if lin.bias is not None:
        lin.bias.data = (lin.bias.data.to(torch.float64) @ q).to(lin.bias.dtype)


@torch.no_grad()
def rotate_llama(model: nn.Module, seed: int = 0, heads: bool = True) -> dict:
    """Rotate a transformers Llama-family causal LM in place (see the module doc).

    Returns a dict for the checkpoint's calibration record:
    {"residual": "hadamard"|"random", "head": ..., "seed": seed}.
    Raises ValueError for models it does not know how to rotate (norms with
    bias, attention or MLP projections with other names).
    """
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise ValueError(f"{type(model).__name__}: rotation needs a Llama-style model.model.layers / embed_tokens")
    lm_head = model.get_output_embeddings()
    emb = inner.embed_tokens
    hidden = emb.weight.shape[1]
    if lm_head is None or lm_head.weight.shape[1] != hidden:
        raise ValueError("rotation needs an lm_head reading the hidden state")
    # Check everything before changing anything: a model this cannot rotate is left as it was.
    for i, layer in enumerate(inner.layers):
        for path in arch.LINEARS + (arch.IN_NORM, arch.POST_NORM):
            try:
                layer.get_submodule(path)
            except AttributeError as e:
                raise ValueError(f"layer {i}: rotation needs a Llama-style {path}") from e
        for norm, _readers in arch.NORM_READERS:
            _check_norm(f"{arch.LAYERS}.{i}.{norm}", layer.get_submodule(norm))
    _check_norm(arch.FINAL_NORM, getattr(inner, "norm", None))

    # lm_head gets the final norm's gain, the embeddings must not: untie
    if lm_head.weight is emb.weight or lm_head.weight.data_ptr() == emb.weight.data_ptr():
        lm_head.weight = nn.Parameter(emb.weight.detach().clone())
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = None

    q, residual_kind = _rotation(hidden, seed)
    for layer in inner.layers:
        for norm, readers in arch.NORM_READERS:
            _fold_norm(layer.get_submodule(norm), [layer.get_submodule(r) for r in readers])
    _fold_norm(inner.norm, [lm_head])

    emb.weight.data = (emb.weight.data.to(torch.float64) @ q).to(emb.weight.dtype)
    _right(lm_head, q)
    d = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    h, head_kind = _rotation(d, seed + 1) if heads else (None, None)  # one H for every head of every layer
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            _right(lin, q)
        for lin in (a.o_proj, m.down_proj):
            _left(lin, q)
        if h is not None and not _rotate_heads(a, h):
            head_kind = None
    return {"residual": residual_kind, "head": head_kind, "seed": seed}


def _rotate_heads(attn: nn.Module, h: torch.Tensor) -> bool:
    """Rotate each head's values by h [d, d]; False (nothing changed) if v / o are not whole heads of d."""
    d = h.shape[0]
    n_kv = attn.v_proj.out_features // d
    n_q = attn.o_proj.in_features // d
    if n_kv * d != attn.v_proj.out_features or n_q * d != attn.o_proj.in_features:
        return False
    _left(attn.v_proj, torch.kron(torch.eye(n_kv, dtype=torch.float64), h))   # v of every KV head: v H
    _right(attn.o_proj, torch.kron(torch.eye(n_q, dtype=torch.float64), h))   # o reads every query head's H-rotated output
    return True
