"""The model catalog: the paper's workloads, built from configs at any size.

Every model is a transformers model class built from a config with random
weights (nothing is downloaded), fed seeded synthetic inputs, and trained on
its own task loss: sequence classification for BERT, next-token prediction for
GPT and today's decoders (Llama, Qwen2, Mixtral), 1000-way image
classification for Swin, ViT and ResNet. The loss is
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
- ``vocab_size``: the token vocabulary of the Llama, Qwen2 and Mixtral
  decoders (128,256, 151,936, 32,000): their logits grow with it, and the
  tiny presets shrink it so that a test step stays cheap.

The decoders keep their published shapes' ratios when a size keyword changes
them: MLP (and expert) width = hidden_size * the published ratio, key/value
heads = num_heads / the published group size (grouped-query attention, at
least one), head dim = hidden_size / num_heads.

Models that are not catalog names (a transformers config, a user's module)
are `momlab.usermodel`'s; every function here also takes one of those (an
object with the same methods), so the code below a workload never asks
which kind of model it trains.

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

SIZE_KEYWORDS = ("num_layers", "hidden_size", "num_heads", "seq_len", "image_size", "width_per_group", "vocab_size")


@dataclass(frozen=True)
class Spec:
    """One catalog entry: its family, default size and tiny preset."""

    name: str
    family: str  # bert | gpt | swin | vit | resnet | llama | qwen2 | mixtral
    size: dict
    tiny: dict
    optimizer: str  # adamw | sgd (as in the paper)
    extra: dict = field(default_factory=dict)

    @property
    def keywords(self) -> tuple[str, ...]:
        return tuple(self.size)


_TEXT_TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "seq_len": 32}
# decoders: 4 heads so that grouped-query attention keeps more query than key/value heads
_DECODER_TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_len": 32, "vocab_size": 512}
_DECODER_KEYS = ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size")


def _decoder(hidden, layers, heads, vocab, seq_len=4096):
    return dict(zip(_DECODER_KEYS, (layers, hidden, heads, seq_len, vocab)))


# Published shapes (config.json of each model; weights are random here): Llama 3.2 1B and Llama 3.1 8B
# (MLP 4x / 3.5x, 8 key/value heads, tied embeddings for 1B), Qwen2.5 0.5B and Qwen2 7B (MLP 38/7 and 37/7
# of the width, key/value groups of 7, tied for 0.5B), Mixtral 8x7B (8 experts, 2 per token). The
# default context is 4k tokens: a common training length for all of them.
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
        Spec("llama-1b", "llama", _decoder(2048, 16, 32, 128256), _DECODER_TINY, "adamw",
             {"mlp": (4, 1), "kv_group": 4, "tied": True, "rope_theta": 500000.0}),
        Spec("llama-8b", "llama", _decoder(4096, 32, 32, 128256), _DECODER_TINY, "adamw",
             {"mlp": (7, 2), "kv_group": 4, "tied": False, "rope_theta": 500000.0}),
        Spec("qwen2-0.5b", "qwen2", _decoder(896, 24, 14, 151936), _DECODER_TINY, "adamw",
             {"mlp": (38, 7), "kv_group": 7, "tied": True, "rope_theta": 1000000.0}),
        Spec("qwen2-7b", "qwen2", _decoder(3584, 28, 28, 152064), _DECODER_TINY, "adamw",
             {"mlp": (37, 7), "kv_group": 7, "tied": False, "rope_theta": 1000000.0}),
        Spec("mixtral-8x7b", "mixtral", _decoder(4096, 32, 32, 32000), _DECODER_TINY, "adamw",
             {"mlp": (7, 2), "kv_group": 4, "tied": False, "rope_theta": 1000000.0, "experts": 8, "top_k": 2}),
    )
}
DECODERS = ("llama", "qwen2", "mixtral")

NUM_CLASSES_IMAGE = 1000  # ImageNet head, as in the paper
NUM_CLASSES_TEXT = 2


def models() -> list[str]:
    """Names of the catalog's workloads."""
    return list(_CATALOG)


def _given(model) -> bool:
    """True for a model that is not a catalog name (momlab.usermodel): it answers for itself."""
    return not isinstance(model, str) and hasattr(model, "make_model")


def spec(model: str) -> Spec:
    """The catalog entry of `model`; a given model (momlab.usermodel) is its own entry."""
    if _given(model):
        return model
    if not isinstance(model, str):
        raise ValueError(f"a model is a catalog name (valid: {', '.join(_CATALOG)}), a transformers config, "
                         f"or momlab.UserModel(module, batch=..., loss=...); got {type(model).__name__}")
    check_choice("model", model, _CATALOG)
    return _CATALOG[model]


def tiny(model: str) -> dict:
    """The tiny preset of `model` as size keywords (for tests and smoke runs)."""
    return dict(spec(model).tiny)


def resolve_size(model: str, size: dict) -> dict:
    """Defaults filled in, unknown keywords and impossible values refused."""
    if _given(model):
        return model.resolve_size(size)
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
    if s.family in DECODERS and out["num_heads"] % _kv_heads(s, out["num_heads"]):
        raise ValueError(f"num_heads {out['num_heads']} of {model} must be a multiple of its key/value heads "
                         f"(num_heads / {s.extra['kv_group']}, at least 1): use a multiple of {s.extra['kv_group']}")
    return out


def size_step(model: str, dim: str) -> int:
    """The natural grid step of a size keyword (for model-size searches)."""
    if _given(model):
        return model.size_step(dim)
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
    if dim == "vocab_size":
        return 64
    return 1


# -- model construction -------------------------------------------------------

def make_model(model: str, size: dict, attention: str | None = None, mlp_width: int | None = None) -> nn.Module:
    """Build the transformers model for `model` at `size` (random weights, CPU, fp32); `attention`
    sets transformers' attn_implementation ("eager", "sdpa"; None: the model's default); `mlp_width`: BERT's
    intermediate_size where it is not 4 x hidden_size (the paper's stack, `momlab.workload.Stack.mlp_width`)."""
    if mlp_width is not None and (_given(model) or spec(model).family != "bert"):
        raise ValueError(f"mlp_width sets BERT's intermediate_size; {getattr(model, 'name', model)} is not a BERT")
    if _given(model):
        net = model.make_model(size)
    elif mlp_width is not None:
        net = _bert(spec(model), size, mlp_width)
    else:
        net = _BUILDERS[spec(model).family](spec(model), size)
    if attention is not None:
        # the attention modules read the shared config's choice at every forward
        net.set_attn_implementation(attention)
    return net


def _bert(s: Spec, z: dict, mlp_width: int | None = None) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        num_hidden_layers=z["num_layers"], hidden_size=z["hidden_size"], num_attention_heads=z["num_heads"],
        intermediate_size=mlp_width or 4 * z["hidden_size"], max_position_embeddings=max(512, z["seq_len"]),
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


def _kv_heads(s: Spec, heads: int) -> int:
    return max(1, heads // s.extra["kv_group"])


def _llm(s: Spec, z: dict) -> nn.Module:
    """Llama, Qwen2 and Mixtral: rotary embeddings, gated MLP, grouped-query attention, RMSNorm."""
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mixtral": "Mixtral"}[s.family]
    num, den = s.extra["mlp"]
    kw = dict(
        num_hidden_layers=z["num_layers"], hidden_size=z["hidden_size"], num_attention_heads=z["num_heads"],
        num_key_value_heads=_kv_heads(s, z["num_heads"]), head_dim=z["hidden_size"] // z["num_heads"],
        intermediate_size=z["hidden_size"] * num // den, vocab_size=z["vocab_size"],
        max_position_embeddings=max(4096, z["seq_len"]), tie_word_embeddings=s.extra["tied"],
        rope_parameters={"rope_type": "default", "rope_theta": s.extra["rope_theta"]}, use_cache=False,
    )
    if s.family == "mixtral":
        kw.update(num_local_experts=s.extra["experts"], num_experts_per_tok=s.extra["top_k"],
                  # tokens sorted by expert, one grouped matmul per projection (see `_experts`)
                  experts_implementation=_experts_implementation())
    cfg = getattr(transformers, prefix + "Config")(**kw)
    return getattr(transformers, prefix + "ForCausalLM")(cfg)


def _experts(self, hidden_states, top_k_index, top_k_weights):
    """Mixtral's experts, tokens sorted by expert, one grouped matmul per projection.

    The grouped matmul is an opaque op (`grouped_mm`: one mm per expert inside,
    a shape-only fake outside, its backward opaque too): unlike the eager loop
    (whose shapes depend on the routing, which a trace on tensors without data
    cannot follow) and unlike torch's ``_grouped_mm`` (bf16 only, while the
    weights here are fp32 masters), it runs on every device and precision,
    and a trace sees the same ops a step runs. Memory: one (tokens x top-k)
    row per routed token, as grouped GEMMs keep.
    """
    mm = torch.ops.momlab.grouped_mm
    k, (n, h) = top_k_index.size(-1), hidden_states.shape
    ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // k]
    counts = torch.histc(ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = mm(x, self.gate_up_proj.transpose(-2, -1).to(x.dtype), offs).chunk(2, dim=-1)
    out = mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1).to(x.dtype), offs)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inverse].view(n, k, h).sum(dim=1).to(hidden_states.dtype)


# `grouped_mm` and its backward: transformers' `grouped_mm_fallback` pair (transformers/integrations/moe.py,
# Apache-2.0; 5.24 has both as opaque ops, 5.17, the lent GPU machine's, only the forward, whose Python backward
# reads the offsets a trace does not have), as momlab's own ops so every transformers version traces alike.
@torch.library.custom_op("momlab::grouped_mm", mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, K) rows sorted by group, times (G, K, N) weights: rows ``offs[i-1]:offs[i]`` by ``weight[i]``."""
    output = torch.zeros(input.size(0), weight.size(2), device=input.device, dtype=input.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):  # one host read of the offsets
        if start != end:
            torch.mm(input[start:end], weight[i], out=output[start:end])
        start = end
    return output


@grouped_mm.register_fake
def _grouped_mm_fake(input, weight, offs):
    return input.new_empty(input.size(0), weight.size(2))


@torch.library.custom_op("momlab::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                         grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if start != end:
            torch.mm(grad_output[start:end], weight[i].T, out=grad_input[start:end])
            torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[i])
        start = end
    return grad_input, grad_weight


@_grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(input, weight, offs, grad_output):
    return torch.empty_like(input), torch.empty_like(weight)


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]  # held by the autograd context, not through saved-tensor hooks


def _grouped_mm_grad(ctx, grad_output):
    input, weight = ctx.saved_tensors
    return (*torch.ops.momlab.grouped_mm_backward(input, weight, ctx.offs, grad_output), None)


grouped_mm.register_autograd(_grouped_mm_grad, setup_context=_grouped_mm_setup)


def _grouped_flops(input_shape, weight_shape, *args, **kwargs) -> int:
    """(S, K) rows, each times one expert's (K, N): torch's counter has no formula for the opaque op."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]


def _grouped_backward_flops(input_shape, weight_shape, *args, **kwargs) -> int:
    return 2 * _grouped_flops(input_shape, weight_shape)  # input and weight gradients


def _experts_implementation() -> str:
    """"momlab_grouped" (`_experts`), registered with transformers' experts interface once; a transformers
    without that interface keeps its own "grouped_mm"."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return "grouped_mm"
    if "momlab_grouped" not in ALL_EXPERTS_FUNCTIONS:
        from torch.utils.flop_counter import register_flop_formula

        register_flop_formula(torch.ops.momlab.grouped_mm)(_grouped_flops)
        register_flop_formula(torch.ops.momlab.grouped_mm_backward)(_grouped_backward_flops)
        ALL_EXPERTS_FUNCTIONS.register("momlab_grouped", _experts)
    return "momlab_grouped"


_BUILDERS: dict[str, Callable[[Spec, dict], nn.Module]] = {
    "bert": _bert, "gpt": _gpt, "swin": _swin, "vit": _vit, "resnet": _resnet,
    "llama": _llm, "qwen2": _llm, "mixtral": _llm,
}


# -- blocks (the unit a checkpointing MOM wraps) -----------------------------

def _resnet_blocks(net: nn.Module) -> list[nn.Module]:
    return [layer for stage in net.resnet.encoder.stages for layer in stage.layers]


def blocks(model: str, net: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a catalog model: transformer layers, Swin blocks, bottlenecks."""
    if _given(model):
        return model.blocks(net)
    family = spec(model).family
    if family in DECODERS:
        return list(net.model.layers)
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
    if _given(model):
        return model.batch(size, batch_size, generator, device)
    s = spec(model)
    if s.family in ("bert", "gpt", *DECODERS):
        vocab = {"bert": 30522, "gpt": 50257}.get(s.family) or size["vocab_size"]
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


def loss(model: str, net: nn.Module, inputs: dict, *, upcast: bool = False) -> torch.Tensor:
    """Forward pass and the model's task loss (computed outside the model); `upcast`: the logits in fp32 first,
    as a half model's trainer computes its loss (fairseq's log-softmax, transformers' own losses)."""
    if _given(model):
        return model.loss(net, inputs)
    labels = inputs["labels"]
    features = {k: v for k, v in inputs.items() if k != "labels"}
    logits = net(**features).logits
    if spec(model).family in ("gpt", *DECODERS):
        logits, labels = logits.view(-1, logits.size(-1)), labels.view(-1)
    if upcast:  # the log-softmax reads the half logits into fp32 (fairseq's `log_softmax(x, dtype=float32)`)
        return F.nll_loss(F.log_softmax(logits, -1, dtype=torch.float32), labels, ignore_index=-100)
    return F.cross_entropy(logits, labels, ignore_index=-100)
