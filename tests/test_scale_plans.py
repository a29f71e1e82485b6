"""exp/scale_plans.py: the MFU of a plan by the published convention, and the causal attention its models
run (the same loss as ``transformers``' masked attention on sequences without padding)."""

from __future__ import annotations

import pytest
import torch

from exp import scale_plans as S


def test_model_flops_of_a_dense_model_by_hand():
    model, _ = S.build("llama3-8b", 2, batch=1, seq=16)
    h, kv, f, layers, seq = 4096, 1024, 14336, 2, 4096
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two norms
    params = layers * per_layer + h  # and the final norm; not the embedding, not the LM head
    config = {**S.JOBS["llama3-8b"]["config"], "num_hidden_layers": layers}
    assert S.model_flops(model, config, seq) == 6 * params + 12 * layers * h * seq
    # 2 layers, 8 GPUs of 4 sequences, a step of 1.25 s: 8 * 4 * 4096 tokens
    expected = (6 * params + 12 * layers * h * seq) * 8 * 4 * 4096 / (8 * 989e12 * 1.25)
    assert S.mfu(S.model_flops(model, config, seq), 8 * 4 * 4096, 8, 1.25) == pytest.approx(expected)


def test_model_flops_of_a_moe_model_count_the_active_experts():
    model, _ = S.build("mixtral-8x7b", 1, batch=1, seq=16)
    h, kv, f, seq = 4096, 1024, 14336, 4096
    dense = 2 * h * h + 2 * h * kv + h * 8 + 2 * h + h  # attention, router, norms, final norm
    experts = 8 * 3 * h * f  # 8 experts, of which a token uses 2
    config = {**S.JOBS["mixtral-8x7b"]["config"], "num_hidden_layers": 1}
    assert S.model_flops(model, config, seq) == 6 * (dense + experts * 2 / 8) + 12 * h * seq


def test_causal_attention_computes_the_masked_models_loss():
    import transformers

    transformers.AttentionInterface.register(S.CAUSAL_ATTENTION, S.causal_attention)
    shape = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=50, max_position_embeddings=64,
    )  # fmt: skip
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for attention in ("sdpa", S.CAUSAL_ATTENTION):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**shape, attn_implementation=attention)
        model = S.CausalLMStep(transformers.LlamaForCausalLM(config).double())
        losses.append(model(ids, ids))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=1e-12)
