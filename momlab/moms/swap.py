"""swap: saved activations live in host memory between forward and backward.

Every tensor saved for backward is copied to host memory as forward produces
it and copied back when backward needs it; vDNN (Rhu et al., 2016). Device
memory then holds only the activations of the layer being computed. The
trade-off is PCIe traffic: twice the activation bytes per step, hidden only
as far as the copies overlap compute, plus host memory to hold them.

On CUDA the copies run on side streams into pinned host buffers. The forward
copy starts after the compute stream has produced the tensor (the side stream
waits on it) and the source's memory is kept from reuse until the copy has
read it (``record_stream``). In backward, when the gradient of block i's
output arrives (block i is about to run backward), the host->device copies of
block i-1's tensors start, so they travel while block i computes
(``prefetch=False`` turns that off: every tensor is then fetched when
autograd asks for it). On a CPU "device" the host copy is a copy made inside
``momlab.accounting.host_allocation()``, so the emulated accounting moves its
bytes to the host account; the copy back is a new device-account copy.

Host memory is bounded: the tracker that counts host bytes raises
`HostOutOfMemory` past `momlab.device.host_limit()`, and a failed pinned
allocation is reported the same way, so a search records "host out of
memory" instead of exhausting the machine or blaming the device.

Model parameters and buffers are never swapped (they stay resident anyway):
that is decided outside this module (``momlab.moms.compose``).

Apply it through ``momlab.moms.apply(model, "swap")``; this module exposes the
`Swapper` (the pack/unpack pair, its parameters and its block hooks).
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from momlab.accounting import host_allocation
from momlab.device import is_oom
from momlab.errors import HostOutOfMemory
from momlab.moms.quant import Packed

__all__ = ["Swapper"]


class _OnHost:
    """A tensor's host copy; on CUDA also its copy events and a prefetched device copy."""

    __slots__ = ("host", "device", "stored", "fetched", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, stored=None):
        self.host = host
        self.device = device
        self.stored = stored  # CUDA event: the device->host copy is complete
        self.fetched: torch.Tensor | None = None  # CUDA: device copy started by a prefetch
        self.ready = None  # CUDA event: `fetched` is complete


class Swapper:
    """The pack/unpack pair of swap for ``saved_tensors_hooks``, plus block hooks.

    Parameters: `prefetch` (CUDA): start copying block i-1's tensors back when
    block i's backward begins; False fetches each tensor on demand.
    `pack` takes a tensor or any pytree of tensors (e.g. a quantized tensor's
    codes and metadata) and moves every tensor in it; with `codes_only`, only
    the codes of a quantized tensor (`momlab.moms.quant.Packed`, bits > 1) move
    and everything else stays on the device: its minimum and scale, 1-bit
    dropout masks, tensors left unquantized. That is what the paper's GACT
    quantize+swap kept (gact/quantizer.py: after quantizing, only the packed
    codes are copied to pinned host memory; masks and unquantized tensors
    return before that copy).
    """

    def __init__(self, *, prefetch: bool = True, codes_only: bool = False):
        self.prefetch = prefetch
        self.codes_only = codes_only
        self._block: int | None = None  # the block whose forward is running
        self._by_block: dict[int, list] = defaultdict(list)  # weak refs to its _OnHost items
        self._streams: dict[tuple, torch.cuda.Stream] = {}

    # -- saved-tensor hooks ---------------------------------------------------
    def pack(self, obj):
        if not self.codes_only:
            return tree_map_only(torch.Tensor, self._to_host, obj)
        if isinstance(obj, Packed) and obj.bits > 1:
            return obj._replace(data=self._to_host(obj.data))
        return obj

    def unpack(self, obj):
        return tree_map_only(_OnHost, self._to_device, obj)

    def _to_host(self, x: torch.Tensor) -> _OnHost:
        with torch.no_grad():
            if x.device.type == "cuda":
                item = self._offload(x.detach())
            elif x.device.type in ("cpu", "meta"):
                # the emulated device: the copy is the host copy, by accounting
                with host_allocation():
                    item = _OnHost(x.detach().clone(), x.device)
            else:
                raise NotImplementedError(f"swap runs on cpu, meta and cuda devices, not {x.device.type}")
        if self._block is not None:
            self._by_block[self._block].append(weakref.ref(item))
        return item

    def _to_device(self, item: _OnHost) -> torch.Tensor:
        if item.device.type != "cuda":
            with torch.no_grad():
                return item.host.clone()
        self._fetch(item)
        compute = torch.cuda.current_stream(item.device)
        compute.wait_event(item.ready)
        tensor, item.fetched = item.fetched, None  # a second unpack (retain_graph) fetches again
        # allocated on the copy stream, used and freed on the compute stream
        tensor.record_stream(compute)
        return tensor

    # -- CUDA copies ------------------------------------------------------------
    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        key = (device.index, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def _offload(self, x: torch.Tensor) -> _OnHost:
        stream = self._stream(x.device, "d2h")
        # the copy must not start before the compute stream has produced x
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with host_allocation():
            try:
                host = torch.empty_like(x, device="cpu", pin_memory=True)
            except RuntimeError as e:
                # cudaHostAlloc failing is the host running out, not the device
                if not is_oom(e):
                    raise
                raise HostOutOfMemory(f"pinned host memory for swap exhausted ({x.nbytes} bytes asked): "
                                      f"{str(e).splitlines()[0]}", requested=x.nbytes) from None
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
            stored = torch.cuda.Event()
            stored.record(stream)
        # x may be freed on the compute stream right after this; its memory
        # must not be handed out again before the side stream has read it
        x.record_stream(stream)
        return _OnHost(host, x.device, stored)

    def _fetch(self, item: _OnHost) -> None:
        if item.fetched is not None:
            return
        stream = self._stream(item.device, "h2d")
        stream.wait_event(item.stored)
        with torch.cuda.stream(stream):
            fetched = torch.empty_like(item.host, device=item.device)
            fetched.copy_(item.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        item.fetched, item.ready = fetched, ready

    def _prefetch_block(self, index: int) -> None:
        for ref in self._by_block.pop(index, []):
            item = ref()
            if item is not None and item.device.type == "cuda":
                self._fetch(item)

    # -- block hooks --------------------------------------------------------------
    def attach(self, blocks: list[nn.Module]) -> list:
        """Tag saved tensors with the block that saved them; on CUDA, prefetch in backward.

        Returns the hook handles (``.remove()`` each to detach).
        """
        handles = []
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(self._enter_block(i)))
            handles.append(block.register_forward_hook(self._leave_block(i), always_call=True))
        return handles

    def _enter_block(self, index: int):
        def hook(module, args):
            self._block = index
            # forward without backward (evaluation with grad on) leaves dead references behind
            self._by_block[index] = [r for r in self._by_block[index] if r() is not None]
        return hook

    def _leave_block(self, index: int):
        def hook(module, args, output):
            self._block = None
            if not (self.prefetch and torch.is_grad_enabled()):
                return
            flat, _ = tree_flatten(output)
            grads = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad and t.is_cuda]
            if grads:
                # the gradient of this block's output arrives just before its own
                # backward starts: the previous block's tensors can travel meanwhile
                grads[0].register_hook(self._on_block_backward(index))
        return hook

    def _on_block_backward(self, index: int):
        def hook(grad):
            self._prefetch_block(index)  # normally already under way
            if index > 0:
                self._prefetch_block(index - 1)
        return hook
