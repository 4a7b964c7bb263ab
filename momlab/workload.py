"""A Workload: one model with its MOM, optimizer, precision and data.

The model is a catalog name, a transformers config or a user's module
(`momlab.usermodel.resolve` says which; the catalog's functions answer for
all three).

`build()` is the recipe that fixes the order (torchtitan's way): make the
model, move it to the device, apply the MOM (which wraps blocks and installs
saved-tensor hooks), then create the optimizer. The training step never names
a MOM.

Optimizers follow the paper: AdamW for transformers, SGD with momentum for
ResNets. Both run with ``foreach=True`` on every device: it is CUDA's default,
its temporaries can set the peak, and choosing it everywhere makes the CPU's
emulated device account the same step a GPU runs (recorded in `options`). The
paper's stack runs them as torch < 2.0 did, one parameter at a time
(``foreach=False``, `Stack.foreach`).

The software stack beside model and MOM is a `Stack`, named by a *setup*:
"default" is today's (transformers' default attention kernel, sdpa; the
catalog's optimizer), "paper" the paper's own code per model (eager attention
as the 2022 transformers and Swin code ran it, which keeps the attention
probabilities and dropout masks; AdamW for BERT and Swin, Adam for GPT,
SGD with momentum for ResNet; fp16 by autocast with fp32 weights (BERT's
accelerate/AMP, Swin's apex O1, ResNet's AMP), except GPT: fairseq's ``--fp16``
runs a half model with a flat fp32 master copy in its optimizer
(`momlab.master`, `Stack.mixed`), its attention dropout is off (fairseq's GPT-3
architectures default it to 0.0) and its MLP activation is fairseq's exact GELU,
computed in fp32 (where transformers' GPT-2 uses the tanh approximation); BERT's MLP keeps the pretrained
width (4096 for bert-large) whatever its hidden size, as the paper's run_glue.py grew it (`Stack.mlp_width`);
checkpointing is torch 1.x's reentrant checkpoint for BERT, Swin and GPT (`Stack.checkpoint`) and a MOM's
saved-tensor hooks stay on through backward, as GACT's controller installed them once for the whole run
(`Stack.hooks`), so quant4+ckpt quantizes what the recomputation saves and swap+ckpt swaps it;
softmax and log-softmax keep their input for backward beside their output, as torch 1.10's autograd did
(`momlab.legacy`, `Stack.softmax_saves_input`), and BERT adds its attention mask to the scores in fp32
whatever it holds, as transformers 4.x did (`Stack.extended_mask`), so its scores enter the softmax in fp32;
and gradients are zeroed in place rather than freed, as
``zero_grad()`` did before torch 2.0, so they stay allocated through the next
forward; Swin's training script wraps the model in DistributedDataParallel even
on one GPU, whose reducer keeps a second, flat copy of the gradients, its
buckets: the GACT benchmark's Swin main.py, and the paper's Swin records,
whose model-related memory is five copies of the weights); the optimizers
step one parameter at a time (torch < 2.0's default; GPT's fairseq keeps one
flat fp32 buffer, which `foreach` stands for); and an estimated step covers
what the paper's script timed (`Stack.timed`: its BERT script, GACT's
run_glue.py, stops its CUDA events after ``loss.backward()``, before clipping
and the optimizer; ``Estimate.time["window"]`` says which), where `measure`
always times the whole step. An explicit `attention` overrides the setup's.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from momlab import catalog
from momlab.device import autocast, check_device
from momlab.master import Fp32Gelu, LossScaler, MasterWeights
from momlab.usermodel import resolve
from momlab.errors import check_choice
from momlab.legacy import softmax_saves_input
from momlab.moms import apply_stack, parse_mom

PRECISIONS = ("fp32", "bf16", "fp16")
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}

FOREACH = True
ATTENTIONS = ("eager", "sdpa")  # transformers' attn_implementation values momlab supports
SETUPS = ("default", "paper")
# the stack settings' defaults: a configuration that keeps them names neither (records, store keys, trials)
STACK_DEFAULTS = {"attention": None, "setup": "default"}


def stack_settings(attention: str | None, setup: str) -> dict:
    """The stack settings that differ from `STACK_DEFAULTS`: what a trial, a sweep point or a store key names."""
    return {k: v for k, v in (("attention", attention), ("setup", setup)) if v != STACK_DEFAULTS[k]}
# families built from transformers models with attn_implementation ("config", a user's transformers config,
# keeps transformers' own default unless given one)
_ATTENTION_FAMILIES = ("bert", "gpt", "swin", "vit", "llama", "qwen2", "mixtral")
# the paper's optimizer per family (its code: HF run_glue AdamW, Swin's AdamW, fairseq Adam, torchvision SGD)
_PAPER_OPTIMIZER = {"bert": "adamw", "swin": "adamw", "vit": "adamw", "gpt": "adam", "resnet": "sgd"}
ADAMW = {"lr": 1e-4, "weight_decay": 0.01}
# the paper's code that checkpointed with torch 1.x's reentrant checkpoint (transformers 4.x's BERT, Microsoft's
# Swin, fairseq's GPT); its ResNet "ckpt" was DTR, another system
_PAPER_REENTRANT = ("bert", "swin", "gpt")
# the paper's sweeps whose quantizer packed a tensor saved several times once: its earlier BERT-L runs in fp32
# (March to May 2022, `momlab.reference.OTHER_PRECISIONS`) ran GACT's development controller (GACT-ICML
# actnn/actnn/quantizer.py: a contiguous saved tensor keyed by its content, packed once; fp32 only); its later
# runs the gact package, which keys every save apart (`Stack.saved_once`)
_PAPER_SAVED_ONCE = {"bert": ("fp32",)}
# the paper's scripts that timed less than a step (GACT-ICML benchmark/text_classification/run_glue.py)
_PAPER_TIMED = {"bert": "forward-backward"}
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size




@dataclass(frozen=True)
class Stack:
    """The software stack of a step (see the module docstring); a frozen value, parsed once by `stack`."""

    setup: str  # the named setup it came from: "default" or "paper"
    attention: str | None  # transformers' attn_implementation; None for models without attention
    optimizer: str  # adamw | adam | sgd
    # GPT's MLP activation replaced by this (transformers' ACT2FN name, or "gelu-fp32": `momlab.master.Fp32Gelu`);
    # None: keep
    activation: str | None = None
    grads_to_none: bool = True  # zero_grad(set_to_none=...): torch >= 2.0's default frees the gradients
    # DistributedDataParallel on one GPU (Swin's main.py always wraps the model): its reducer keeps the gradients'
    # bucket buffers (gradient_as_bucket_view=False, the default), one more copy of the gradients; with ranks, the
    # parallel strategy's own buffers replace them (`momlab.distributed.parallelize`)
    ddp_buckets: bool = False
    # torch >= 2.0's optimizers update every parameter in a few multi-tensor kernels; torch 1.x's loop over them,
    # a few kernels each (the host's time per kernel, `momlab.timemodel`)
    foreach: bool = True
    # what a step's time covers (momlab.timemodel.WINDOWS): "step"; "forward-backward" where the script that
    # measured it stopped its timer after backward
    timed: str = "step"
    # how fp16/bf16 train (`momlab.master.SCHEMES`): "autocast" (fp32 weights, half ops), or "half-model" (fairseq's
    # --fp16: the model itself in half precision, an fp32 master copy in the optimizer)
    mixed: str = "autocast"
    # the attention probabilities' dropout; None: the model config's (fairseq's GPT-3 architectures: 0.0)
    attention_dropout: float | None = None
    # how "ckpt" checkpoints a block (`momlab.moms.ckpt`): "non-reentrant" (torch >= 2.0's, torchtitan's) or
    # "reentrant" (torch < 2.0's default: transformers 4.x's gradient checkpointing, Microsoft's Swin, fairseq)
    checkpoint: str = "non-reentrant"
    # while a MOM's saved-tensor hooks are active: "forward" (momlab's: the model's forward and the loss) or "step"
    # (GACT's controller pushes them once for the whole run, so backward's reentrant recomputation is
    # quantized or swapped too)
    hooks: str = "forward"
    # torch < 1.11's softmax and log_softmax kept their input for backward beside their output (`momlab.legacy`);
    # the paper ran torch 1.10.1
    softmax_saves_input: bool = False
    # transformers 4.x's BERT added its extended attention mask to the scores always, in the model's dtype (fp32
    # under autocast: the scores enter the softmax in fp32); today's adds none for a mask of all ones
    extended_mask: bool = False
    # whose kernels a quantizing MOM runs on a GPU (`momlab.moms.quant.KERNELS`: what a trace charges; the bytes
    # kept are momlab's either way): "momlab" (its own compiled programs) or "gact" (the paper's GACT: a min/max
    # and a pack kernel per saved tensor reading it in its own dtype, one unpack kernel writing it back; with swap,
    # only the codes go to the host: `momlab.moms.swap.Swapper`'s ``codes_only``)
    quantizer: str = "momlab"
    # a tensor that several ops save (ResNet's in-place ReLU output: the ReLU's and the next convolution's) is packed
    # (quantized, swapped) once, as momlab's hooks do; False: once per save, as GACT's controller did for the paper's
    # later runs (gact/conf.py ``check_dup = False``, its default: every save gets its own key, its own packed copy,
    # and is unpacked on its own in backward; its earlier ones: `_PAPER_SAVED_ONCE`)
    saved_once: bool = True
    # BERT's MLP width (intermediate_size) where it is not 4 x hidden_size: the paper's run_glue.py (GACT's) set
    # only ``config.hidden_size`` on the pretrained config when it grew the model, so its width sweep kept the
    # pretrained MLP (bert-large: 4096) at every hidden size; None: 4 x hidden_size
    mlp_width: int | None = None


def stack(model: str, setup: str = "default", attention: str | None = None, precision: str | None = None) -> Stack:
    """The stack `setup` gives `model`, with `attention` (eager, sdpa) overriding its attention; `precision`:
    the one it trains in, where the paper's stack differed by precision (`_PAPER_SAVED_ONCE`).

    >>> stack("bert-large", "paper")
    Stack(setup='paper', attention='eager', optimizer='adamw', activation=None, grads_to_none=False, ddp_buckets=False, foreach=False, timed='forward-backward', mixed='autocast', attention_dropout=None, checkpoint='reentrant', hooks='step', softmax_saves_input=True, extended_mask=True, quantizer='gact', saved_once=False, mlp_width=4096)
    >>> stack("bert-large", "paper", precision="fp32").saved_once  # the paper's earlier fp32 runs
    True
    >>> stack("gpt3-small", "paper").mixed
    'half-model'
    >>> stack("gpt3-small", attention="eager").optimizer
    'adamw'
    """
    spec = catalog.spec(model)
    family = spec.family
    check_choice("setup", setup, SETUPS)
    if attention is not None:
        check_choice("attention", attention, ATTENTIONS)
        if family not in _ATTENTION_FAMILIES + ("config",):
            raise ValueError(f"{getattr(model, 'name', model)} has no attention layers (transformers' attn_implementation): attention "
                             f"must be None, got {attention!r}")
    elif family in _ATTENTION_FAMILIES:
        attention = "eager" if setup == "paper" else "sdpa"
    # a transformers config or a user's module keeps its own optimizer: the paper never ran it
    optimizer = _PAPER_OPTIMIZER.get(family, spec.optimizer) if setup == "paper" else spec.optimizer
    paper = setup == "paper"
    fairseq = paper and family == "gpt"
    return Stack(setup, attention, optimizer, "gelu-fp32" if fairseq else None, not paper,
                 paper and family == "swin", foreach=not paper or family == "gpt",
                 timed=_PAPER_TIMED.get(family, "step") if paper else "step",
                 mixed="half-model" if fairseq else "autocast", attention_dropout=0.0 if fairseq else None,
                 checkpoint="reentrant" if paper and family in _PAPER_REENTRANT else "non-reentrant",
                 hooks="step" if paper else "forward", softmax_saves_input=paper,
                 extended_mask=paper and family == "bert", quantizer="gact" if paper else "momlab",
                 saved_once=not paper or precision in _PAPER_SAVED_ONCE.get(family, ()),
                 mlp_width=4 * catalog.resolve_size(model, {})["hidden_size"] if paper and family == "bert" else None)


@dataclass
class Workload:
    """A model ready to train: `.step()` runs forward, loss, backward, optimizer, zero grads.

    `name` is the model as `build` took it, resolved: a catalog name, or a
    `ConfigModel` / `UserModel` (whose ``.name`` records use).
    """

    name: str
    size: dict
    batch_size: int
    device: torch.device
    precision: str
    mom: str
    seed: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object | None = None
    handle: object | None = None
    options: dict = field(default_factory=dict)
    generator: torch.Generator | None = None
    rng_state: dict | None = None  # the global generators' state this workload's steps continue from
    grads_to_none: bool = True  # free the gradients after the optimizer step (else zero them in place)
    ddp_buckets: bool = False  # keep DistributedDataParallel's gradient buckets (`Stack.ddp_buckets`)
    buckets: list | None = None  # those buffers, one per gradient dtype, made before the first forward
    half_model: bool = False  # the model itself is fp16/bf16 (`Stack.mixed` "half-model"): no autocast
    hooks: str = "forward"  # the MOM's saved-tensor hooks cover the forward, or the whole "step" (`Stack.hooks`)
    softmax_saves_input: bool = False  # torch < 1.11's softmax autograd (`Stack.softmax_saves_input`)
    extended_mask: bool = False  # transformers 4.x's additive fp32 attention mask (`Stack.extended_mask`)
    # runs the optimizer's update (the optimizer and loss-scaler steps) as update_hook(fn); None: fn(). A trace
    # replays a recorded update there (`momlab.estimate._Tracer.update`)
    update_hook: Callable | None = None

    @contextmanager
    def _own_rng(self):
        """The step draws dropout from the global generators: run it on this workload's own stream, so
        two workloads stepped alternately in one process train exactly as each would alone."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state["cpu"])
                if cuda:
                    torch.cuda.set_rng_state(self.rng_state["cuda"], self.device)
            try:
                yield
            finally:
                self.rng_state = _rng_state(self.device)

    def batch(self) -> dict:
        """A fresh synthetic batch (seeded: the same sequence for the same seed)."""
        return catalog.batch(self.name, self.size, self.batch_size, self.generator, self.device)

    def step(self, batch: dict | None = None, *, on_forward_end: Callable | None = None,
             on_backward_end: Callable | None = None) -> float:
        """One full training step; returns the loss. Callbacks let a probe read memory."""
        with self._own_rng():
            return self._step(batch, on_forward_end, on_backward_end)

    def prime(self) -> None:
        """Leave what a first step leaves, without running the model: the gradient buckets, and the optimizer's
        and the loss scaler's state, made by one update from all-zero gradients (then freed or zeroed as a step
        leaves them). A trace's warm-up (`momlab.estimate`): the state is the same tensors, and a traced model's
        forward and backward cost as much as the step that follows."""
        with self._own_rng():
            self._make_buckets()
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)
            if self.scaler is not None:
                self.scaler.scale(params[0].new_zeros((), dtype=torch.float32))
            self._update()

    def _make_buckets(self) -> None:
        if self.ddp_buckets and self.buckets is None:
            # DDP's reducer makes them when it wraps the model, before any step: here, so that the step's memory
            # accounting (measure's, a trace's) sees the allocation
            sizes: dict = {}
            for p in self.model.parameters():
                if p.requires_grad:
                    sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
            self.buckets = [torch.empty(n, dtype=dt, device=self.device) for dt, n in sizes.items()]

    def _update(self) -> None:
        if self.update_hook is None:
            self._optimizer_step()
        else:
            self.update_hook(self._optimizer_step)
        self.optimizer.zero_grad(set_to_none=self.grads_to_none)

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _step(self, batch, on_forward_end, on_backward_end) -> float:
        self._make_buckets()
        inputs = self.batch() if batch is None else batch
        context = self.handle.context() if self.handle is not None else nullcontext()
        if self.extended_mask and inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 2:
            keep = inputs["attention_mask"][:, None, None, :].to(torch.float32)
            inputs = {**inputs, "attention_mask": (1.0 - keep) * torch.finfo(torch.float32).min}
        if self.half_model:  # images enter a half model in its precision, as fairseq's --fp16 casts its batch
            dtype = _HALF[self.precision]
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        legacy = softmax_saves_input(self.softmax_saves_input)
        with autocast(self.device, "fp32" if self.half_model else self.precision), context, legacy:
            loss = catalog.loss(self.name, self.model, inputs, upcast=self.half_model)
        del inputs, batch
        if on_forward_end is not None:
            on_forward_end()
        # GACT's hooks stay on through backward, where a reentrant checkpoint's recomputation passes them
        with self.handle.context() if self.hooks == "step" and self.handle is not None else nullcontext(), \
                softmax_saves_input(self.softmax_saves_input):
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        if on_backward_end is not None:
            on_backward_end()
        self._update()
        if self.device.type == "meta" or is_fake(loss):  # no data: a traced step (momlab.estimate)
            return float("nan")
        return loss.detach().float().item()

    def recover(self) -> None:
        """Make the workload steppable again after an out-of-memory inside a step.

        Drops the failed step's gradients, and replaces fp16's GradScaler by a
        fresh one with the same scale and growth state: an OOM inside
        ``scaler.step`` leaves its per-optimizer state saying "already
        unscaled", and the next step would then raise (or skip) instead of
        training.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.scaler, LossScaler):
            fresh = LossScaler()
            fresh.load_state_dict(self.scaler.state_dict())
            self.scaler = fresh
        elif self.scaler is not None:
            fresh = torch.amp.GradScaler(self.device.type)
            fresh.load_state_dict(self.scaler.state_dict())
            self.scaler = fresh

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The resident tensors by category: params (with buffers), grads, optimizer."""
        params = list(self.model.parameters()) + list(self.model.buffers())
        grads = [p.grad for p in self.model.parameters() if p.grad is not None] + list(self.buckets or ())
        opt = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if isinstance(self.optimizer, MasterWeights):  # the fp32 weights are optimizer state, their gradient a gradient
            master, master_grad = self.optimizer.master_tensors()
            opt.append(master)
            grads.append(master_grad)
        return {"params": params, "grads": grads, "optimizer": opt}


def build(model: str, *, batch_size: int, mom: str = "exact", device: str = "cpu", precision: str = "fp32",
          seed: int = 0, attention: str | None = None, setup: str = "default", **size) -> Workload:
    """Build `model` (a catalog name, transformers config or `momlab.UserModel`) at `size` with `mom`
    applied, ready to `.step()`; `setup` and `attention` pick the software stack (`stack`)."""
    model = resolve(model)
    check_choice("precision", precision, PRECISIONS)
    st = stack(model, setup, attention, precision)
    size = catalog.resolve_size(model, size)
    check_batch_size(batch_size)
    mom = parse_mom(mom)
    dev = check_device(device)

    torch.manual_seed(seed)
    half = st.mixed == "half-model" and precision in _HALF
    # a half model is made in its precision (converting a traced model's fake weights would swap their storage)
    made_as = _default_dtype(_HALF[precision]) if half else nullcontext()
    if dev.type == "meta":
        with torch.device("meta"), made_as:
            net = catalog.make_model(model, size, attention=st.attention, mlp_width=st.mlp_width)
        net = net.to("meta")  # a user's module instance is copied with its own (cpu) weights
    else:
        with made_as:
            net = catalog.make_model(model, size, attention=st.attention, mlp_width=st.mlp_width)
        if dev.type != "cpu":  # built on the CPU; .to() would try to swap a fake tensor's storage (estimate)
            net = net.to(dev)
    if st.activation is not None:
        from transformers.activations import ACT2FN

        for block in catalog.blocks(model, net):
            block.mlp.act = Fp32Gelu() if st.activation == "gelu-fp32" else ACT2FN[st.activation]
    if st.attention_dropout is not None:
        for block in catalog.blocks(model, net):
            block.attn.attn_dropout.p = st.attention_dropout
    net.train()
    handle = None
    if mom != "exact":
        blocks = catalog.blocks(model, net)
        if not blocks and not isinstance(model, str) and mom.checkpointing:
            raise ValueError(
                f"{mom} checkpoints repeated blocks and none were found in {model.name} (no nn.ModuleList or "
                f"nn.Sequential of same-class layers): name them, momlab.UserModel(module, ..., blocks='layers') "
                f"(an attribute path or a function of the module returning its blocks)")
        handle = apply_stack(net, mom, blocks=blocks,
                             reentrant=st.checkpoint == "reentrant" and mom.checkpointing != "ckpt-selective",
                             kernels=st.quantizer, saved_once=st.saved_once)
    foreach = FOREACH and st.foreach
    if st.optimizer == "adamw":
        cls, kw = torch.optim.AdamW, ADAMW
    elif st.optimizer == "adam":  # the same two moments as AdamW, no decoupled weight decay
        cls, kw = torch.optim.Adam, {"lr": ADAMW["lr"]}
    else:
        cls, kw = torch.optim.SGD, SGD
    if half:
        opt = MasterWeights(net.parameters(), cls, foreach=foreach, **kw)
        scaler = LossScaler() if precision == "fp16" else None
    else:
        opt = cls(net.parameters(), foreach=foreach, **kw)
        scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" and dev.type != "meta" else None
    gen = torch.Generator().manual_seed(seed)
    options = {
        "optimizer": st.optimizer, "foreach": foreach, "setup": st.setup, "activation": st.activation,
        "grads_to_none": st.grads_to_none, "ddp_buckets": st.ddp_buckets,
        "checkpoint": st.checkpoint, "hooks": st.hooks,
        "mixed": "fp32" if precision == "fp32" else ("half-model" if half else "autocast"),
        "attn_implementation": getattr(getattr(net, "config", None), "_attn_implementation", None),
    }
    # steps continue the global stream from where the model's initialization left it (see _own_rng)
    return Workload(model, size, batch_size, dev, precision, mom, seed, net, opt, scaler, handle, options, gen,
                    _rng_state(dev), st.grads_to_none, st.ddp_buckets, half_model=half, hooks=st.hooks,
                    softmax_saves_input=st.softmax_saves_input, extended_mask=st.extended_mask)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state
