"""The Llama family's decoder layout, written once.

qgemv runs transformers' Llama, Mistral, Qwen2 and Qwen3 causal LMs.  They
share one layout: ``model.layers[i]`` holds ``self_attn`` (q/k/v/o
projections; Qwen2 with q/k/v biases, Qwen3 with per-head ``q_norm`` /
``k_norm``) and ``mlp`` (gate/up/down, SiLU), each preceded by an RMSNorm
(``input_layernorm``, ``post_attention_layernorm``); ``model.norm`` and
``lm_head`` end the model, ``model.rotary_emb`` gives RoPE's cos / sin.

Everything that walks a decoder layer reads the names from here: the fused
projections of :mod:`qgemv.nn` (:data:`FUSE_GROUPS`), the calibration's
execution order and scaling groups, the rotation, and the engine.
"""

from __future__ import annotations

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Paths from the causal LM.
LAYERS = "model.layers"
FINAL_NORM = "model.norm"
ROTARY = "model.rotary_emb"

# Paths inside one decoder layer.
ATTN, MLP = "self_attn", "mlp"
IN_NORM, POST_NORM = "input_layernorm", "post_attention_layernorm"
Q, K, V, O = "q_proj", "k_proj", "v_proj", "o_proj"  # attributes of ATTN
GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"  # attributes of MLP
Q_NORM, K_NORM = "q_norm", "k_norm"  # attributes of ATTN (Qwen3 only)

# Owner attribute -> member linears, in the order the owner calls them: the
# projections that read one input and are stored as one packed weight.
FUSE_GROUPS = {
    "qkv": (Q, K, V),
    "gate_up": (GATE, UP),
}

# A layer's linears by attribute name, in execution order; each stage's
# inputs depend on the stage before.
STAGES = ((Q, K, V), (O,), (GATE, UP), (DOWN,))

# Every linear of a layer, as a path inside the layer, in execution order.
LINEARS = tuple(f"{ATTN}.{n}" for n in (Q, K, V, O)) + tuple(f"{MLP}.{n}" for n in (GATE, UP, DOWN))

# Each RMSNorm and the linears that read its output (a norm's gain folds into them).
NORM_READERS = (
    (IN_NORM, tuple(f"{ATTN}.{n}" for n in (Q, K, V))),
    (POST_NORM, tuple(f"{MLP}.{n}" for n in (GATE, UP))),
)

__all__ = ["ARCHITECTURES", "ATTN", "DOWN", "FINAL_NORM", "FUSE_GROUPS", "GATE", "IN_NORM", "K", "K_NORM", "LAYERS",
           "LINEARS", "MLP", "NORM_READERS", "O", "POST_NORM", "Q", "Q_NORM", "ROTARY", "STAGES", "UP", "V"]
