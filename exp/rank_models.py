"""`transformers` models as hidup model factories (``exp.rank_models:llama``, ``:mixtral``, ``:qwen2``, ``:gpt2``,
``:qwen3_moe``, ``:deepseek_v3``): ``f(world_size=1, device=None, **sizes) -> (step module, (input_ids, labels))``
with ``batch`` sequences of ``seq`` tokens per rank, for ``hidup search/bench-rank --model``.

The MoE factories build their experts with ``implementation`` as ``transformers``' experts implementation
(default ``grouped_mm``, its grouped-GEMM path): hidup's export replaces it by its own op either way,
so the setting decides only what the single-device share of ``bench-rank`` runs, the reference a
rank is measured against."""

from __future__ import annotations

import torch
import transformers


class CausalLMStep(torch.nn.Module):
    """A causal LM's training step: the mean next-token loss of ``labels``.  Every sequence has the
    same number of predicted tokens (no padding), so over ranks holding equal shares the loss is a
    mean over sequences (``loss_form``, read by the baselines)."""

    loss_form = "mean"

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _step(config, model_cls, vocab: int, seq: int, batch: int, world_size: int, device):
    with torch.device(device or "cpu"):
        model = CausalLMStep(model_cls(config))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch * world_size, seq), generator=g).to(device or "cpu")
    return model, (ids, ids.clone())


def llama(
    layers=4, hidden=2048, heads=16, kv_heads=4, ffn=5632, vocab=32000, seq=1024, batch=8, world_size=1, device=None
):
    """Llama (RMSNorm, rotary attention with grouped key/value heads, SwiGLU MLP)."""
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return _step(cfg, transformers.LlamaForCausalLM, vocab, seq, batch, world_size, device)


def mixtral(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=2816, experts=8, vocab=32000, seq=1024, batch=4,
            world_size=1, device=None, implementation="grouped_mm"):  # fmt: skip
    """Mixtral (Llama attention, top-2 routed mixture of SwiGLU experts)."""
    cfg = transformers.MixtralConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=2, vocab_size=vocab,
        max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        experts_implementation=implementation,
    )  # fmt: skip
    return _step(cfg, transformers.MixtralForCausalLM, vocab, seq, batch, world_size, device)


def qwen3_moe(layers=4, hidden=1024, heads=16, kv_heads=4, moe_ffn=384, experts=128, top_k=8, vocab=32000, seq=1024,
              batch=4, world_size=1, device=None, implementation="grouped_mm"):  # fmt: skip
    """Qwen3-MoE (fine-grained experts: 128 SwiGLU experts of width 384, top-8, normalized weights)."""
    cfg = transformers.Qwen3MoeConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        moe_intermediate_size=moe_ffn, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        vocab_size=vocab, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=False, experts_implementation=implementation,
    )  # fmt: skip
    return _step(cfg, transformers.Qwen3MoeForCausalLM, vocab, seq, batch, world_size, device)


def deepseek_v3(layers=4, hidden=1024, heads=16, ffn=2816, moe_ffn=512, experts=64, shared=1, top_k=6, vocab=32000,
                seq=1024, batch=4, world_size=1, device=None, implementation="grouped_mm"):  # fmt: skip
    """DeepSeek-V3 (multi-head latent attention, a dense first layer, then 1 shared and 64 routed
    experts, top-6 of 8 groups with 4 groups kept, sigmoid scores with a bias correction)."""
    cfg = transformers.DeepseekV3Config(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=ffn, moe_intermediate_size=moe_ffn, n_routed_experts=experts, n_shared_experts=shared,
        num_experts_per_tok=top_k, n_group=8, topk_group=4, first_k_dense_replace=1, q_lora_rank=384,
        kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, vocab_size=vocab,
        max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
        experts_implementation=implementation,
    )  # fmt: skip
    return _step(cfg, transformers.DeepseekV3ForCausalLM, vocab, seq, batch, world_size, device)


def qwen2(
    layers=4, hidden=1536, heads=12, kv_heads=2, ffn=8960, vocab=32000, seq=1024, batch=4, world_size=1, device=None
):
    """Qwen2 (Llama-like, with biases on the query/key/value projections)."""
    cfg = transformers.Qwen2Config(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    return _step(cfg, transformers.Qwen2ForCausalLM, vocab, seq, batch, world_size, device)


def gpt2(layers=6, hidden=1280, heads=20, vocab=50257, seq=512, batch=8, world_size=1, device=None):
    """GPT-2 (learned positions, LayerNorm, GELU MLP; its projections are ``Conv1D``: addmm on a
    transposed weight), dropout off."""
    cfg = transformers.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _step(cfg, transformers.GPT2LMHeadModel, vocab, seq, batch, world_size, device)
