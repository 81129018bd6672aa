"""Test helper: the decoder LMs of the transformers zoo, each built offline from a tiny config.

``tiny_decoder(family)`` gives the ``*ForCausalLM`` class and its config; ``FAST`` are the families
run by default (one of each kind of graph the checks met), ``SLOW`` the rest (``-m slow``).
Used by the float64-oracle tests of decoder ``.pt2`` files and the generation tests.
"""

from __future__ import annotations

import transformers

_T = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
      "intermediate_size": 32, "max_position_embeddings": 32, "use_cache": False}  # fmt: skip
_KV = {"num_key_value_heads": 1}


MOE = {
    "mixtral": ("Mixtral", {"num_local_experts": 4}),
    "qwen2_moe": ("Qwen2Moe", {"num_experts": 4, "moe_intermediate_size": 16,
                               "shared_expert_intermediate_size": 16}),
    "olmoe": ("Olmoe", {"num_experts": 4}),
}  # fmt: skip


def tiny_decoder(family: str):
    tf = transformers
    if family == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, use_cache=False,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if family == "opt":
        return tf.OPTForCausalLM, tf.OPTConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
            max_position_embeddings=32, word_embed_proj_dim=16, use_cache=False, pad_token_id=1,
            bos_token_id=2, eos_token_id=2,
        )  # fmt: skip
    if family == "falcon":  # rotary, parallel attention, multi-query
        return tf.FalconForCausalLM, tf.FalconConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if family == "gpt_neox":
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**_T, bos_token_id=0, eos_token_id=0)
    if family == "bloom":  # ALiBi
        return tf.BloomForCausalLM, tf.BloomConfig(
            vocab_size=64, hidden_size=16, n_layer=2, n_head=2, use_cache=False
        )
    if family == "gptj":
        return tf.GPTJForCausalLM, tf.GPTJConfig(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=32,
            use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if family in MOE:  # mixture of experts: top-2 of 4 experts per token
        name, experts = MOE[family]
        config = getattr(tf, f"{name}Config")(**_T, **_KV, **experts, num_experts_per_tok=2,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        return getattr(tf, f"{name}ForCausalLM"), config
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
            "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3Text", "phi3": "Phi3",
            "phi": "Phi", "stablelm": "StableLm", "olmo2": "Olmo2", "starcoder2": "Starcoder2",
            "cohere": "Cohere", "granite": "Granite"}[family]  # fmt: skip
    extra = {"head_dim": 8} if family.startswith("gemma") else {}
    config = getattr(tf, f"{name}Config")(**_T, **_KV, **extra, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2)  # fmt: skip
    return getattr(tf, f"{name.replace('Gemma3Text', 'Gemma3')}ForCausalLM"), config


#: Run by default (CI, both transformers releases): one of each kind of graph the oracle and
#: the cuts met (rotary tables in a higher-order op, learned positions from a float
#: ``torch.ones``, GPT-2's final norm, parallel attention, mixture-of-experts routing through
#: transformers' grouped matmul). The rest: ``-m slow``.
FAST = ("llama", "gpt2", "opt", "falcon", "mixtral")
SLOW = ("qwen2_moe", "olmoe", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "gpt_neox", "phi",
        "stablelm", "olmo2", "starcoder2", "cohere", "granite", "bloom", "gptj")  # fmt: skip
