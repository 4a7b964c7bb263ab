"""The model catalog: the paper's workloads, built from configs at any size.

Every model is a transformers model class built from a config with random
weights (nothing is downloaded), fed seeded synthetic inputs, and trained on
its own task loss: sequence classification for BERT, next-token prediction for
GPT, 1000-way image classification for Swin, ViT and ResNet. The loss is
computed outside the model (HF BERT builds a CrossEntropyLoss inside forward
when given labels, which some tracing tools cannot follow).

Size keywords (each valid only where the model has it):
- ``num_layers``: transformer layers; for Swin and ResNet the depth of the
  third stage, the one that grows between variants (Swin-T 6, Swin-L 18;
  ResNet-50 6, ResNet-152 36).
- ``hidden_size``: model width; Swin's embedding dim (doubles per stage);
  ResNet's stage-1 output channels (256; doubles per stage).
- ``num_heads``: attention heads (Swin: first stage, doubling per stage).
- ``seq_len``: tokens per sample. ``image_size``: pixels per side.
- ``width_per_group``: ResNet bottleneck width rule of torchvision (64
  standard, 128 for Wide-ResNet-50-2): inner width = out_channels/4 * wpg/64.

Real sizes are the catalog defaults; `tiny(model)` gives the small preset
that tests and smoke runs use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from momlab.errors import check_choice

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZE_KEYWORDS = ("num_layers", "hidden_size", "num_heads", "seq_len", "image_size", "width_per_group")


@dataclass(frozen=True)
class Spec:
    """One catalog entry: its family, default size and tiny preset."""

    name: str
    family: str  # bert | gpt | swin | vit | resnet
    size: dict
    tiny: dict
    optimizer: str  # adamw | sgd (as in the paper)
    extra: dict = field(default_factory=dict)

    @property
    def keywords(self) -> tuple[str, ...]:
        return tuple(self.size)


_TEXT_TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "seq_len": 32}
_CATALOG = {
    s.name: s
    for s in (
        Spec("bert-base", "bert", {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "seq_len": 128}, _TEXT_TINY, "adamw"),
        Spec("bert-large", "bert", {"num_layers": 24, "hidden_size": 1024, "num_heads": 16, "seq_len": 128}, _TEXT_TINY, "adamw"),
        Spec("gpt2", "gpt", {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "seq_len": 1024}, _TEXT_TINY, "adamw",
             {"n_positions": 1024}),
        Spec("gpt3-small", "gpt", {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "seq_len": 512}, _TEXT_TINY, "adamw",
             {"n_positions": 2048}),
        Spec("gpt3-medium", "gpt", {"num_layers": 24, "hidden_size": 1024, "num_heads": 16, "seq_len": 512}, _TEXT_TINY, "adamw",
             {"n_positions": 2048}),
        Spec("swin-tiny", "swin", {"num_layers": 6, "hidden_size": 96, "num_heads": 3, "image_size": 224},
             {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "image_size": 64}, "adamw", {"depths": (2, 2), "last": 2}),
        Spec("swin-large", "swin", {"num_layers": 18, "hidden_size": 192, "num_heads": 6, "image_size": 224},
             {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "image_size": 64}, "adamw", {"depths": (2, 2), "last": 2}),
        Spec("vit-base", "vit", {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "image_size": 224},
             {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "image_size": 32}, "adamw"),
        Spec("resnet50", "resnet", {"num_layers": 6, "hidden_size": 256, "width_per_group": 64, "image_size": 224},
             {"num_layers": 2, "hidden_size": 32, "width_per_group": 64, "image_size": 64}, "sgd", {"depths": (3, 4, 3)}),
        Spec("wide-resnet50-2", "resnet", {"num_layers": 6, "hidden_size": 256, "width_per_group": 128, "image_size": 224},
             {"num_layers": 2, "hidden_size": 32, "width_per_group": 128, "image_size": 64}, "sgd", {"depths": (3, 4, 3)}),
        Spec("resnet152", "resnet", {"num_layers": 36, "hidden_size": 256, "width_per_group": 64, "image_size": 224},
             {"num_layers": 2, "hidden_size": 32, "width_per_group": 64, "image_size": 64}, "sgd", {"depths": (3, 8, 3)}),
    )
}

NUM_CLASSES_IMAGE = 1000  # ImageNet head, as in the paper
NUM_CLASSES_TEXT = 2


def models() -> list[str]:
    """Names of the catalog's workloads."""
    return list(_CATALOG)


def spec(model: str) -> Spec:
    check_choice("model", model, _CATALOG)
    return _CATALOG[model]


def tiny(model: str) -> dict:
    """The tiny preset of `model` as size keywords (for tests and smoke runs)."""
    return dict(spec(model).tiny)


def resolve_size(model: str, size: dict) -> dict:
    """Defaults filled in, unknown keywords and impossible values refused."""
    s = spec(model)
    unknown = [k for k in size if k not in s.keywords]
    if unknown:
        raise ValueError(
            f"size keyword(s) {', '.join(unknown)} not valid for {model}; valid: {', '.join(s.keywords)}"
        )
    out = {**s.size, **size}
    for k, v in out.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int for {model}, got {v!r}")
    if "num_heads" in out and s.family != "swin" and out["hidden_size"] % out["num_heads"]:
        raise ValueError(f"hidden_size {out['hidden_size']} must be a multiple of num_heads {out['num_heads']}")
    if s.family == "swin" and out["hidden_size"] % out["num_heads"]:
        raise ValueError(f"hidden_size (embed dim) {out['hidden_size']} must be a multiple of num_heads {out['num_heads']}")
    return out


def size_step(model: str, dim: str) -> int:
    """The natural grid step of a size keyword (for model-size searches)."""
    s = spec(model)
    check_choice(f"size keyword for {model}", dim, s.keywords)
    if dim == "hidden_size":
        return s.size.get("num_heads", 1) if s.family != "resnet" else 16
    if dim == "image_size":
        return {"swin": 32, "vit": 16, "resnet": 32}[s.family]
    if dim == "seq_len":
        return 8
    if dim == "width_per_group":
        return 8
    return 1


# -- model construction -------------------------------------------------------

def make_model(model: str, size: dict, attention: str | None = None) -> nn.Module:
    """Build the transformers model for `model` at `size` (random weights, CPU, fp32); `attention`
    sets transformers' attn_implementation ("eager", "sdpa"; None: transformers' default)."""
    s = spec(model)
    net = _BUILDERS[s.family](s, size)
    if attention is not None:
        # the attention modules read the shared config's choice at every forward
        net.set_attn_implementation(attention)
    return net


def _bert(s: Spec, z: dict) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        num_hidden_layers=z["num_layers"], hidden_size=z["hidden_size"], num_attention_heads=z["num_heads"],
        intermediate_size=4 * z["hidden_size"], max_position_embeddings=max(512, z["seq_len"]),
        num_labels=NUM_CLASSES_TEXT,
    )
    return BertForSequenceClassification(cfg)


def _gpt(s: Spec, z: dict) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=z["num_layers"], n_embd=z["hidden_size"], n_head=z["num_heads"],
        n_positions=max(s.extra["n_positions"], z["seq_len"]), use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def _swin(s: Spec, z: dict) -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    heads = z["num_heads"]
    cfg = SwinConfig(
        image_size=z["image_size"], embed_dim=z["hidden_size"],
        depths=[*s.extra["depths"], z["num_layers"], s.extra["last"]],
        num_heads=[heads, 2 * heads, 4 * heads, 8 * heads], num_labels=NUM_CLASSES_IMAGE,
        # Swin's 7x7 windows need >= 7x7 patches in the last stage (224 px);
        # smaller images (the tiny preset) shrink the window to fit
        window_size=7 if z["image_size"] >= 224 else max(1, z["image_size"] // 32),
    )
    return SwinForImageClassification(cfg)


def _vit(s: Spec, z: dict) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        num_hidden_layers=z["num_layers"], hidden_size=z["hidden_size"], num_attention_heads=z["num_heads"],
        intermediate_size=4 * z["hidden_size"], image_size=z["image_size"], num_labels=NUM_CLASSES_IMAGE,
    )
    return ViTForImageClassification(cfg)


def _resnet(s: Spec, z: dict) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification
    from transformers.models.resnet.modeling_resnet import ResNetConvLayer

    d1, d2, d4 = s.extra["depths"]
    h = z["hidden_size"]
    cfg = ResNetConfig(
        embedding_size=max(h // 4, 8), hidden_sizes=[h, 2 * h, 4 * h, 8 * h],
        depths=[d1, d2, z["num_layers"], d4], layer_type="bottleneck", num_labels=NUM_CLASSES_IMAGE,
    )
    net = ResNetForImageClassification(cfg)
    wpg = z["width_per_group"]
    if wpg != 64:
        # transformers' bottleneck fixes its inner width at out/4 (torchvision's
        # width_per_group=64); a wide ResNet rebuilds the three convs of each
        # bottleneck with torchvision's rule, using transformers' own layers.
        for block in _resnet_blocks(net):
            c1, c2, c3 = block.layer
            cin, cout = c1.convolution.in_channels, c3.convolution.out_channels
            inner = cout // 4 * wpg // 64
            stride = c2.convolution.stride[0]
            block.layer = nn.Sequential(
                ResNetConvLayer(cin, inner, kernel_size=1),
                ResNetConvLayer(inner, inner, stride=stride),
                ResNetConvLayer(inner, cout, kernel_size=1, activation=None),
            )
    return net


_BUILDERS: dict[str, Callable[[Spec, dict], nn.Module]] = {
    "bert": _bert, "gpt": _gpt, "swin": _swin, "vit": _vit, "resnet": _resnet,
}


# -- blocks (the unit a checkpointing MOM wraps) -----------------------------

def _resnet_blocks(net: nn.Module) -> list[nn.Module]:
    return [layer for stage in net.resnet.encoder.stages for layer in stage.layers]


def blocks(model: str, net: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a catalog model: transformer layers, Swin blocks, bottlenecks."""
    family = spec(model).family
    if family == "bert":
        return list(net.bert.encoder.layer)
    if family == "gpt":
        return list(net.transformer.h)
    if family == "swin":
        return [b for stage in net.swin.encoder.layers for b in stage.blocks]
    if family == "vit":  # transformers 5.24 keeps ViT's layers on the model itself (5.17: encoder.layer)
        return list(net.vit.layers if hasattr(net.vit, "layers") else net.vit.encoder.layer)
    return _resnet_blocks(net)


# -- synthetic data and task loss -----------------------------------------------

def batch(model: str, size: dict, batch_size: int, generator: torch.Generator, device) -> dict:
    """A seeded synthetic batch: model inputs plus `labels`."""
    s = spec(model)
    if s.family in ("bert", "gpt"):
        vocab = 30522 if s.family == "bert" else 50257
        ids = torch.randint(0, vocab, (batch_size, size["seq_len"]), generator=generator)
        out = {"input_ids": ids}
        if s.family == "bert":
            out["attention_mask"] = torch.ones_like(ids)
            out["labels"] = torch.randint(0, NUM_CLASSES_TEXT, (batch_size,), generator=generator)
        else:
            # next-token targets, shifted here so the loss needs no copy of the logits
            out["labels"] = torch.cat([ids[:, 1:], torch.full((batch_size, 1), -100)], dim=1)
    else:
        px = size["image_size"]
        out = {
            "pixel_values": torch.randn(batch_size, 3, px, px, generator=generator),
            "labels": torch.randint(0, NUM_CLASSES_IMAGE, (batch_size,), generator=generator),
        }
    return {k: v.to(device) for k, v in out.items()}


def loss(model: str, net: nn.Module, inputs: dict) -> torch.Tensor:
    """Forward pass and the model's task loss (computed outside the model)."""
    labels = inputs["labels"]
    features = {k: v for k, v in inputs.items() if k != "labels"}
    logits = net(**features).logits
    if spec(model).family == "gpt":
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
    return F.cross_entropy(logits, labels)
