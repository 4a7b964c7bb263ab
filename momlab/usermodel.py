"""Models that are not catalog names: a transformers config, or a user's own module.

`measure`, the searches, sweeps, `estimate` and the what-if take a model as
a catalog name (`momlab.models()`), or as one of:

- a transformers config object (``LlamaConfig(...)``, any config a model
  class can be built from with random weights), or `ConfigModel(config,
  task=..., name=...)` to choose the head: ``causal-lm`` (next-token loss),
  ``sequence-classification`` or ``image-classification`` (cross-entropy
  over ``config.num_labels``). Synthetic inputs come from the config: token
  ids below ``vocab_size``, or ``num_channels`` images of ``image_size``.
- `UserModel(module, batch=..., loss=...)`: any ``nn.Module`` (an instance,
  copied for every workload so that each starts from the same weights; or a
  function that builds one from size keywords), a function making a seeded
  batch and one computing a scalar loss.

`resolve(model)` turns any of these into the value the rest of momlab
works with (parse once, at the edge): a catalog name stays a string, the
others become a `ConfigModel` / `UserModel`, which answer the catalog's
questions themselves (`momlab.catalog` asks them: size keywords, building,
blocks, batches, loss). Records name them by ``name`` (default: the config's
model type and a digest of its values; the module's class name).

Blocks (what ckpt, ckpt-selective, ckpt-auto and swap act on) of a
transformers model are its layer list, found by `momlab.moms.find_blocks`
(the items of the innermost ModuleList of nested, same-class layers:
LlamaDecoderLayer, BertLayer, SwinLayer, ...). A user module names them with
``blocks=``: an attribute path (``"layers"``, ``"encoder.blocks"``) or a
function of the module returning them; without it they are searched the
same way, and where none are found a checkpointing MOM says how to name them.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from momlab import catalog
from momlab.errors import check_choice
from momlab.moms import find_blocks

TASKS = ("causal-lm", "sequence-classification", "image-classification")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# a config's structural knob that the size keyword sets (only where it is one int the model reads)
_CONFIG_DEFAULT_SEQ = 512


def _one_line(exc: BaseException) -> str:
    """The innermost cause of `exc` in one line: transformers wraps its validators' errors."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"a model name is letters, digits, '.', '_' and '-' (it names records and files), "
                         f"got {name!r}")
    if name in catalog.models():
        raise ValueError(f"{name!r} is a catalog model; give your model another name")
    return name


def _check_size(size, keywords, what: str) -> dict:
    size = dict(size or {})
    unknown = [k for k in size if k not in keywords]
    if unknown:
        raise ValueError(f"size keyword(s) {', '.join(unknown)} not valid for {what}; "
                         f"valid: {', '.join(keywords) or '(none)'}")
    for k, v in size.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int for {what}, got {v!r}")
    return size


class _Given:
    """What every given model answers (the catalog's questions); see the module docstring."""

    name: str
    family: str
    optimizer = "adamw"
    size: dict  # defaults of the size keywords
    tiny: dict

    @property
    def keywords(self) -> tuple[str, ...]:
        return tuple(self.size)

    def resolve_size(self, size: dict) -> dict:
        return {**self.size, **_check_size(size, self.keywords, self.name)}

    def size_step(self, dim: str) -> int:
        check_choice(f"size keyword for {self.name}", dim, self.keywords)
        return {"seq_len": 8, "image_size": 16, "hidden_size": 16, "vocab_size": 64}.get(dim, 1)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# -- transformers configs ------------------------------------------------------------------------

def _auto_class(task: str):
    import transformers

    return {"causal-lm": transformers.AutoModelForCausalLM,
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "image-classification": transformers.AutoModelForImageClassification}[task]


def _tasks_of(config) -> list[str]:
    """The tasks transformers has a model class for, for this config's type."""
    out = []
    for task in TASKS:
        mapping = _auto_class(task)._model_mapping
        try:
            mapping[type(config)]
        except (KeyError, ValueError):
            continue
        out.append(task)
    return out


def _is_vision(config) -> bool:
    return isinstance(getattr(config, "image_size", None), int) and hasattr(config, "num_channels")


class ConfigModel(_Given):
    """A transformers config with random weights as a momlab model (see the module docstring).

    `task`: ``causal-lm``, ``sequence-classification`` or
    ``image-classification``; default: image classification for a vision
    config, else causal LM where transformers has one, else sequence
    classification. `name` names its records. Size keywords: ``seq_len``
    (text; default the smaller of 512 and the config's positions) or
    ``image_size`` (vision; default the config's), and ``num_layers`` where
    the config has one int layer count (``num_hidden_layers``).
    Construction builds the model on the meta device once, so a config
    transformers cannot build fails here, in one line.

    >>> from transformers import MistralConfig
    >>> m = ConfigModel(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    >>> m.task, m.keywords
    ('causal-lm', ('seq_len', 'num_layers'))
    """

    family = "config"

    def __init__(self, config, task: str | None = None, name: str | None = None):
        from transformers import PretrainedConfig

        if not isinstance(config, PretrainedConfig):
            raise ValueError(f"ConfigModel takes a transformers config (a PretrainedConfig such as LlamaConfig), "
                             f"got {type(config).__name__}")
        self.config = copy.deepcopy(config)
        tasks = _tasks_of(self.config)
        if not tasks:
            raise ValueError(f"transformers has no causal-LM, sequence- or image-classification model for "
                             f"{type(config).__name__}; valid: a config of one of those")
        if task is None:
            task = next(t for t in ("image-classification", "causal-lm", "sequence-classification")
                        if t in tasks and (t != "image-classification" or _is_vision(self.config)))
        check_choice(f"task for {type(config).__name__}", task, tasks)
        self.task = task
        if task == "sequence-classification" and getattr(self.config, "pad_token_id", None) is None:
            # decoders pool at the last non-pad token and refuse batches > 1 without a pad id
            self.config.pad_token_id = 0
        if task == "causal-lm":
            self.config.use_cache = False
        digest = hashlib.sha256(self.config.to_json_string(use_diff=False).encode()).hexdigest()[:8]
        self.name = _check_name(name if name is not None else f"{self.config.model_type}-{digest}")
        size = {}
        if task == "image-classification":
            size["image_size"] = int(self.config.image_size)
        else:
            positions = getattr(self.config, "max_position_embeddings", None)
            size["seq_len"] = min(_CONFIG_DEFAULT_SEQ, positions) if isinstance(positions, int) else \
                _CONFIG_DEFAULT_SEQ
        layers = getattr(self.config, "num_hidden_layers", None)
        if isinstance(layers, int) and not isinstance(getattr(self.config, "depths", None), (list, tuple)):
            size["num_layers"] = layers
        self.size = size
        self.tiny = {k: min(v, {"seq_len": 32, "num_layers": 2}.get(k, v)) for k, v in size.items()}
        self._check_builds()

    def _config_at(self, size: dict):
        cfg = copy.deepcopy(self.config)
        if "num_layers" in size:
            cfg.num_hidden_layers = size["num_layers"]
        if "image_size" in size:
            cfg.image_size = size["image_size"]
        return cfg

    def _check_builds(self) -> None:
        try:
            with torch.device("meta"):
                _auto_class(self.task).from_config(self.config)
        except Exception as exc:  # noqa: BLE001 - whatever transformers raised, said in one line
            raise ValueError(f"transformers cannot build a {self.task} model from this {type(self.config).__name__}: "
                             f"{_one_line(exc)}") from None

    def make_model(self, size: dict) -> nn.Module:
        return _auto_class(self.task).from_config(self._config_at(size))

    def blocks(self, net: nn.Module) -> list[nn.Module]:
        return find_blocks(net)

    def batch(self, size: dict, batch_size: int, generator: torch.Generator, device) -> dict:
        cfg = self.config
        if self.task == "image-classification":
            px = size["image_size"]
            out = {"pixel_values": torch.randn(batch_size, cfg.num_channels, px, px, generator=generator),
                   "labels": torch.randint(0, cfg.num_labels, (batch_size,), generator=generator)}
        else:
            ids = torch.randint(0, cfg.vocab_size, (batch_size, size["seq_len"]), generator=generator)
            out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if self.task == "causal-lm":
                out["labels"] = torch.cat([ids[:, 1:], torch.full((batch_size, 1), -100)], dim=1)
            else:
                out["labels"] = torch.randint(0, cfg.num_labels, (batch_size,), generator=generator)
        return {k: v.to(device) for k, v in out.items()}

    def loss(self, net: nn.Module, inputs: dict) -> torch.Tensor:
        labels = inputs["labels"]
        logits = net(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        if self.task == "causal-lm":
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return F.cross_entropy(logits, labels)


# -- a user's module ------------------------------------------------------------------------------

def _takes(fn: Callable, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments (True when it cannot be inspected)."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # builtins without a signature
        return True
    return True


class UserModel(_Given):
    """A user's ``nn.Module`` with its batch and loss (see the module docstring).

    - `module`: an ``nn.Module`` (deep-copied for every workload), or a
      function returning one; with `size`, it is called with those size
      keywords (``module(num_layers=4, hidden_size=256)``), which makes the
      model searchable by size (`max_model_size`).
    - `batch(batch_size, generator, **size)`: the model's inputs for one step
      (a tensor, a tuple/list or a dict of tensors, each with `batch_size`
      rows first), drawn from `generator` so that a seed fixes them.
    - `loss(module, batch)`: forward and loss, a scalar tensor.
    - `blocks`: the repeated layers the checkpointing MOMs wrap: an
      attribute path (``"layers"``) or a function of the module; default:
      found (`momlab.moms.find_blocks`).
    - `name`: what records call it (default: the module's class name).
    - `size`: default size keywords (only with a function `module`); `tiny`
      a small preset of them; `optimizer`: ``adamw`` or ``sgd``.

    >>> m = UserModel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
    ...               batch=lambda b, g: (torch.randn(b, 8, generator=g), torch.randint(0, 2, (b,), generator=g)),
    ...               loss=lambda net, xy: F.cross_entropy(net(xy[0]), xy[1]), name="mlp")
    >>> m.name, m.keywords
    ('mlp', ())
    """

    family = "user"

    def __init__(self, module, *, batch: Callable, loss: Callable, blocks=None, name: str | None = None,
                 size: dict | None = None, tiny: dict | None = None, optimizer: str = "adamw"):
        if not (isinstance(module, nn.Module) or callable(module)):
            raise ValueError(f"UserModel takes an nn.Module or a function returning one, got {type(module).__name__}")
        if isinstance(module, nn.Module) and size:
            raise ValueError("size keywords need a function that builds the module from them "
                             "(UserModel(lambda num_layers: Net(num_layers), size={'num_layers': 4}, ...)); "
                             "an nn.Module instance has one size")
        if getattr(module, "_momlab_mom", None) is not None:
            raise ValueError(f"the module already has MOM {module._momlab_mom!r} applied; pass the plain module")
        for what, fn, args in (("batch", batch, 2), ("loss", loss, 2)):
            if not callable(fn):
                raise ValueError(f"{what} must be a function, got {type(fn).__name__}")
            if not _takes(fn, args):
                expected = ("batch(batch_size, generator, **size)" if what == "batch" else "loss(module, batch)")
                raise ValueError(f"{what} must take {args} positional arguments: {expected}")
        if not (blocks is None or isinstance(blocks, str) or callable(blocks)):
            raise ValueError(f"blocks must be an attribute path such as 'layers', a function of the module "
                             f"returning its blocks, or None (found), got {type(blocks).__name__}")
        check_choice("optimizer", optimizer, ("adamw", "sgd"))
        self.module, self.batch_fn, self.loss_fn, self.blocks_spec = module, batch, loss, blocks
        self.optimizer = optimizer
        if name is None:
            name = type(module).__name__ if isinstance(module, nn.Module) else getattr(module, "__name__", "")
            if not name or not _NAME.match(name) or name == "<lambda>":
                raise ValueError("give the model a name (UserModel(..., name='mynet')): records need one")
        self.name = _check_name(name)
        self.size = _check_size(size, catalog.SIZE_KEYWORDS, self.name)
        self.tiny = {**self.size, **_check_size(tiny, self.keywords, self.name)}

    # -- the catalog's questions --------------------------------------------------------------
    def make_model(self, size: dict) -> nn.Module:
        if not isinstance(self.module, nn.Module):
            net = self.module(**size)
            if not isinstance(net, nn.Module):
                raise ValueError(f"the module function of {self.name} must return an nn.Module, "
                                 f"got {type(net).__name__}")
            return net
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        fake = detect_fake_mode()
        with unset_fake_temporarily():
            net = copy.deepcopy(self.module)
        return net if fake is None else _to_fake(net, fake)

    def blocks(self, net: nn.Module) -> list[nn.Module]:
        spec = self.blocks_spec
        if spec is None:
            return find_blocks(net)  # [] when none: a checkpointing MOM then asks for blocks=
        if callable(spec):
            found = spec(net)
        else:
            found = net
            for part in spec.split("."):
                if not hasattr(found, part):
                    raise ValueError(f"blocks={spec!r}: {type(found).__name__} has no attribute {part!r}; name "
                                     f"the module's list of repeated layers, e.g. blocks='layers'")
                found = getattr(found, part)
        if isinstance(found, nn.Module) and not isinstance(found, (nn.ModuleList, nn.Sequential)):
            found = [found]
        found = list(found)
        if not found or not all(isinstance(b, nn.Module) for b in found):
            raise ValueError(f"blocks={spec!r} of {self.name} must name a non-empty list of nn.Modules")
        return found

    def batch(self, size: dict, batch_size: int, generator: torch.Generator, device):
        out = self.batch_fn(batch_size, generator, **size)
        tensors = _check_batch(out, batch_size, self.name)
        moved = {id(t): t.to(device) for t in tensors}
        return _tree_map(out, lambda t: moved[id(t)])

    def loss(self, net: nn.Module, inputs) -> torch.Tensor:
        out = self.loss_fn(net, inputs)
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
            what = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                    else type(out).__name__)
            raise ValueError(f"loss of {self.name} must return a scalar floating-point tensor (shape ()), "
                             f"got {what}")
        return out


def _tree_map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _tree_map(v, fn) for k, v in obj.items()}
    return type(obj)(_tree_map(v, fn) for v in obj)


def _check_batch(out, batch_size: int, name: str) -> list[torch.Tensor]:
    """The tensors of a batch function's result; ValueError unless each has `batch_size` rows first."""
    if isinstance(out, torch.Tensor):
        items = [("batch", out)]
    elif isinstance(out, dict) and out:
        items = [(f"batch[{k!r}]", v) for k, v in out.items()]
    elif isinstance(out, (tuple, list)) and out:
        items = [(f"batch[{i}]", v) for i, v in enumerate(out)]
    else:
        raise ValueError(f"batch of {name} must return a tensor, or a non-empty tuple, list or dict of tensors, "
                         f"got {type(out).__name__}")
    for where, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"batch of {name} must return tensors; {where} is a {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] != batch_size:
            raise ValueError(f"batch of {name}: {where} has shape {tuple(t.shape)}; expected batch_size="
                             f"{batch_size} rows first, shape ({batch_size}, ...)")
    return [t for _, t in items]


def _to_fake(net: nn.Module, mode) -> nn.Module:
    """`net` with every parameter and buffer replaced by a fake tensor of `mode` (shared ones stay shared)."""
    memo: dict[int, torch.Tensor] = {}
    for mod in net.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
                mod._parameters[key] = memo[id(p)]
        for key, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = mode.from_tensor(b)
                mod._buffers[key] = memo[id(b)]
    return net


# -- at the edge ------------------------------------------------------------------------------

_RESOLVED: dict[int, tuple] = {}  # id(config) -> (config, its JSON, its ConfigModel)


def resolve(model):
    """The model as momlab works with it: a catalog name (checked), a `ConfigModel` or a `UserModel`.

    A transformers config becomes ``ConfigModel(config)``; anything else
    raises ValueError naming what a model can be.
    """
    if isinstance(model, (ConfigModel, UserModel)):
        return model
    if isinstance(model, str):
        catalog.spec(model)
        return model
    try:
        from transformers import PretrainedConfig
    except ImportError:  # pragma: no cover
        PretrainedConfig = ()
    if isinstance(model, PretrainedConfig):
        # the same config object (unchanged) is the same model: its traces and records are shared
        text = model.to_json_string(use_diff=False)
        known = _RESOLVED.get(id(model))
        if known is None or known[0] is not model or known[1] != text:
            known = _RESOLVED[id(model)] = (model, text, ConfigModel(model))
        return known[2]
    if isinstance(model, nn.Module):
        raise ValueError(f"a module needs its batch and loss: momlab.UserModel({type(model).__name__}(...), "
                         f"batch=make_batch, loss=loss_fn)")
    return catalog.spec(model)  # raises, naming what a model can be


def name_of(model) -> str:
    """The name records give `model` (a catalog name, or a given model's `name`)."""
    return model if isinstance(model, str) else resolve(model).name


def from_text(text: str):
    """A model named on the command line: a catalog name, a config.json file, or ``module:attribute``.

    A ``.json`` file is a transformers config (its ``model_type`` picks the
    class; nothing is fetched); ``package.module:name`` imports `name` (a
    config, a `ConfigModel` or `UserModel`, or a function of no arguments
    returning one).
    """
    import importlib
    import json
    from pathlib import Path

    if text in catalog.models():
        return text
    if text.endswith(".json"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"no config file {text!r}; a model is a catalog name ({', '.join(catalog.models())}), "
                             f"a transformers config.json, or module:attribute")
        try:
            data = json.loads(path.read_text())
            from transformers import AutoConfig

            config = AutoConfig.for_model(data.pop("model_type"), **data)
        except Exception as exc:  # noqa: BLE001 - transformers' config validation has its own error types
            raise ValueError(f"{text}: not a transformers config.json with a known model_type "
                             f"({_one_line(exc)})") from None
        return resolve(config)
    if ":" in text:
        mod, _, attr = text.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import {text!r} ({exc}); expected module:attribute naming a model") from None
        if callable(obj) and not isinstance(obj, (nn.Module, type)) and not isinstance(obj, _Given):
            obj = obj()
        return resolve(obj)
    return resolve(text)  # an unknown name: the catalog's error, naming the valid ones
