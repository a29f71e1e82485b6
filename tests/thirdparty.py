"""Third-party models built from small configs (no downloads), each wrapped as a training step that
returns the model's own loss: ``transformers`` GPT-2, BERT, Llama (grouped-query attention), ViT
(image classification, a convolutional patch embedding) and ``torch.nn.Transformer``.  Everything
is float64 so that parity with one device is exact up to float64 rounding whatever CPU kernels run
(the ``transformers`` language-model losses upcast logits to float32, so the loss itself carries
float32 rounding, and tests allow for it: ``LOSS_DTYPE``).

Labels are padded: for the token models the first ``PAD`` positions of every sequence and the whole
first sequence are ``-100`` (ignored); for ViT the first image's label and every third one after it
are ``-100``.  So ranks and duplicated copies hold different numbers of counted labels (some none at
all) and only a loss normalized by the *global* count matches.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH, PAD = 96, 16, 8, 3
IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10


class LMStep(nn.Module):
    """``model(input_ids, labels=labels).loss`` (mean over the counted tokens)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


class ImageStep(nn.Module):
    """``model(pixel_values, labels=labels).loss``: cross-entropy over the classes, mean over the
    counted images."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


class Seq2SeqStep(nn.Module):
    """``nn.Transformer`` over embedded tokens with a cross-entropy over the target vocabulary."""

    def __init__(self, d_model: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.core = nn.Transformer(
            d_model,
            heads,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=64,
            dropout=0.0,
            batch_first=True,
        )
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        y = self.core(x, x)
        logits = self.head(y)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _no_dropout(config) -> None:
    for key in (
        "attn_pdrop",
        "resid_pdrop",
        "embd_pdrop",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "attention_dropout",
        "hidden_dropout",
        "classifier_dropout",
    ):
        if hasattr(config, key):
            setattr(config, key, 0.0)


def build(name: str, seed: int = 0):
    """(step module in float64, (input_ids or pixel_values, labels)) for model ``name``."""
    torch.manual_seed(seed)
    if name == "nn-transformer":
        model = Seq2SeqStep()
    else:
        import transformers as T

        if name == "gpt2":
            config = T.GPT2Config(
                n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
            )
            cls = T.GPT2LMHeadModel
        elif name == "bert":
            config = T.BertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                pad_token_id=0,
            )
            cls = T.BertForMaskedLM
        elif name == "llama":
            config = T.LlamaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            )
            cls = T.LlamaForCausalLM
        elif name == "vit":
            config = T.ViTConfig(
                image_size=IMAGE,
                patch_size=PATCH,
                num_channels=CHANNELS,
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                num_labels=CLASSES,
            )
            cls = T.ViTForImageClassification
        else:
            raise ValueError(f"unknown third-party model {name!r}")
        _no_dropout(config)
        model = (ImageStep if name == "vit" else LMStep)(cls(config))
    model = model.double()
    g = torch.Generator().manual_seed(seed + 1)
    if name == "vit":
        pixels = torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g, dtype=torch.float64)
        labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
        labels[::3] = -100
        return model, (pixels, labels)
    return model, _tokens(seed, first_padded=True)


def _tokens(seed: int, first_padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their labels, the first ``PAD`` positions (and with ``first_padded`` the whole
    first sequence) ignored."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :PAD] = -100
    if first_padded:
        labels[0] = -100
    return ids, labels


NAMES = ("gpt2", "bert", "llama", "vit", "nn-transformer")


def build_with_dropout(name: str, seed: int = 0):
    """A model of ``transformers`` with its default dropout left on, in float64, as :func:`build`
    returns it: ``t5`` (dropout 0.1 on every residual branch, and on the attention weights inside
    torch's scaled-dot-product attention) and ``gpt2`` (embedding, residual and attention dropout
    0.1); and ``deepseek-v3`` (no dropout; its attention fills its keys slice by slice).  T5 and
    DeepSeek-V3 are the exactness sweep's (``exp/exactness.py``)."""
    import transformers as T

    import exp.exactness

    torch.manual_seed(seed)
    if name in ("t5", "deepseek-v3"):
        return getattr(exp.exactness, name.replace("-", "_"))()
    if name != "gpt2":
        raise ValueError(f"no dropout variant of {name!r}")
    config = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                          eos_token_id=0)  # fmt: skip
    return LMStep(T.GPT2LMHeadModel(config)).double().train(), _tokens(seed, first_padded=False)


# the dtype each model computes its loss in: the language-model losses of transformers upcast their
# logits to float32; ViT's classification loss and nn.Transformer's stay in the model's float64
LOSS_DTYPE = {
    "gpt2": torch.float32,
    "bert": torch.float32,
    "llama": torch.float32,
    "vit": torch.float64,
    "nn-transformer": torch.float64,
}


def sum_tolerance(name: str, zoo_terms: int) -> float:
    """Relative tolerance of a loss or gradient computed as a sum in another order: four epsilons of
    the loss's dtype per term; a third-party model sums over batch x sequence terms, a zoo model (in
    float64) over ``zoo_terms``."""
    if name in NAMES:
        return 4 * BATCH * SEQ * torch.finfo(LOSS_DTYPE[name]).eps
    return 4 * zoo_terms * torch.finfo(torch.float64).eps
