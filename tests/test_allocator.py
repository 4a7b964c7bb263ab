"""The caching allocator replay (momlab.allocator) and what estimates ask of it.

The rules are checked on hand-built event sequences whose reservations follow from
c10/cuda/CUDACachingAllocator.cpp by hand; a replay of a traced step is checked against the
trace's own live bytes and against the search that uses it. Whether the replay matches a real
GPU's reserved peak is `make gpu-check`'s (phase 7); against the paper's V100 maximum batches,
`momlab.validation.max_batch_table` and `make bench`.
"""

import pytest
import torch

from momlab import allocator as A
from momlab import catalog
from momlab import estimate as E

MiB = 1 << 20
FREE = A.FREE
TINY_BERT = catalog.tiny("bert-base")


def _reserved_after(events, capacity=1 << 40):
    a = A.CachingAllocator(capacity)
    for key, n in events:
        a.free(key) if n == FREE else a.malloc(key, n)
    return a


def test_segments_by_request_size():
    # small requests share a 2 MiB segment; under 10 MiB a 20 MiB one; above, the request rounded to 2 MiB
    a = _reserved_after([("s1", 1000), ("s2", 512 * 1024)])
    assert a.reserved == 2 * MiB and a.allocated == 1024 + 512 * 1024
    a = _reserved_after([("m", 3 * MiB), ("m2", 5 * MiB)])
    assert a.reserved == 20 * MiB  # the second fits the first's 17 MiB rest
    a = _reserved_after([("l", 11 * MiB + 1)])
    assert a.reserved == 12 * MiB and a.allocated == 12 * MiB  # the 1 MiB - 512 B rest is not split off


def test_split_threshold_of_the_large_pool():
    # a rest of exactly 1 MiB is not split off (large pool: more than 1 MiB), so the block stays whole
    a = _reserved_after([("x", 11 * MiB), ("x", FREE), ("y", 11 * MiB)])
    assert a.reserved == 12 * MiB and a.allocated == 12 * MiB  # y holds the whole 12 MiB block
    b = _reserved_after([("x", 11 * MiB), ("x", FREE), ("y", 10 * MiB + 512)])
    assert b.reserved == 12 * MiB and b.allocated == 10 * MiB + 512  # a rest of 2 MiB - 512 B is split off


def test_best_fit_and_merging_with_neighbours():
    ev = [("a", 12 * MiB), ("b", 16 * MiB), ("a", FREE), ("b", FREE), ("c", 14 * MiB)]
    a = _reserved_after(ev)
    # a and b are separate segments (never merged across segments); c takes b's 16 MiB block (best fit
    # of those >= 14 MiB), splitting off 2 MiB
    assert a.reserved == 28 * MiB and a.allocated == 14 * MiB
    # inside one segment, freed neighbours merge: three 4 MiB blocks of a 20 MiB segment become one
    ev = [("p", 4 * MiB), ("q", 4 * MiB), ("r", 4 * MiB), ("p", FREE), ("r", FREE), ("q", FREE), ("s", 18 * MiB)]
    a = _reserved_after(ev)
    assert a.reserved == 20 * MiB  # s fits the merged 20 MiB segment, no new one


def test_fragmentation_is_an_out_of_memory_below_the_capacity():
    # 2 MiB holes between live blocks: 10 MiB free in all, no block of 10 MiB
    ev = [(i, 2 * MiB) for i in range(10)] + [(i, FREE) for i in range(0, 10, 2)] + [("big", 10 * MiB)]
    r = A.replay(ev, 20 * MiB)
    assert not r.fits and r.failed_request == 10 * MiB and r.peak_allocated == 20 * MiB
    assert A.replay(ev, 30 * MiB).fits  # a third segment is room enough


def test_wholly_free_segments_are_released_before_failing():
    ev = [("a", 12 * MiB), ("b", 12 * MiB), ("a", FREE), ("c", 14 * MiB)]
    assert A.replay(ev, 1 << 40).peak_reserved == 38 * MiB  # c fits no cached block: a new segment
    r = A.replay(ev, 26 * MiB)  # a's free segment goes back to the driver and c gets one of its own
    assert r.fits and r.peak_reserved == 26 * MiB
    assert not A.replay(ev, 25 * MiB).fits


@pytest.mark.parametrize("mom", ["ckpt", "quant4+swap"])
def test_a_traced_process_replays_its_own_live_bytes(mom):
    # quant4+swap: the packed codes are made by torch.empty, no tensor argument; made with data, they held real
    # memory (gigabytes at bert-large's largest batches) and their fake copies allocated twice in the events
    ev = E.allocation_events("bert-base", mom, batch_size=8, precision="fp16", **TINY_BERT)
    live, cur, peak = {}, 0, 0
    for key, n in ev:
        if n == FREE:
            cur -= live.pop(key)  # every free matches an allocation still live
        else:
            assert key not in live
            live[key] = n
            cur += n
            peak = max(peak, cur)
    prof = E.profile("bert-base", mom, precision="fp16", **TINY_BERT)
    assert peak == prof.at(8, trace=True).peak_bytes  # the steady step's peak, as the profile traces it
    r = A.replay(ev, 1 << 40)
    assert r.peak_allocated >= peak and r.peak_reserved >= r.peak_allocated  # rounded up, then segments


def test_caching_max_batch_is_the_largest_the_replay_serves():
    kw = dict(gpu="V100-16", precision="fp16", budget="64MiB", **TINY_BERT)
    ideal = E.predict_max_batch("bert-base", "exact", **kw)
    best = E.predict_max_batch("bert-base", "exact", allocator="caching", **kw)
    assert 0 < best <= ideal
    at, above = (E.estimate("bert-base", "exact", batch_size=b, allocator="caching", **kw) for b in (best, best + 1))
    assert at.fits and not above.fits and at.allocator == "caching"
    assert at.reserved_bytes <= at.capacity_bytes < above.reserved_bytes
    assert at.reserved_bytes >= at.peak_bytes - at.rounding_bytes  # segments hold at least the live tensors
    assert E.estimate("bert-base", "exact", batch_size=best, **kw).reserved_bytes is None  # ideal: not replayed


def test_caching_max_size_is_the_largest_the_replay_serves():
    size = {k: v for k, v in TINY_BERT.items() if k != "num_layers"}
    kw = dict(gpu="V100-16", precision="fp16", budget="96MiB", **size)  # one layer reserves 64 MiB
    ideal = E.predict_max_size("bert-base", "exact", dim="num_layers", batch_size=8, **kw)
    best = E.predict_max_size("bert-base", "exact", dim="num_layers", batch_size=8, allocator="caching", **kw)
    assert 0 < best <= ideal
    at, above = (E.estimate("bert-base", "exact", batch_size=8, allocator="caching", num_layers=n, **kw)
                 for n in (best, best + 1))
    assert at.fits and not above.fits
    with pytest.raises(ValueError, match="ideal.*caching"):
        E.predict_max_size("bert-base", dim="num_layers", batch_size=8, allocator="buddy", **kw)


def test_bad_allocator_settings_name_the_valid_ones():
    with pytest.raises(ValueError, match="ideal.*caching"):
        E.predict_max_batch("bert-base", gpu="V100-16", allocator="buddy", **TINY_BERT)
    with pytest.raises(ValueError, match="not a CUDA GPU"):
        E.estimate("bert-base", batch_size=2, gpu="cpu", allocator="caching", **TINY_BERT)
    with pytest.raises(ValueError, match="steps"):
        E.allocation_events("bert-base", batch_size=2, steps=0, **TINY_BERT)


def test_a_trace_holds_no_real_memory_for_quantized_tensors(monkeypatch):
    """A trace's tensors are fake: quantization's packed codes too, made by torch.empty without a tensor argument.
    Made with data, they held real memory (and swap copied them again): a trace of bert-large quant4+swap at
    its predicted largest batch, 1990, ran out of this machine's 24 GiB."""
    from torch._subclasses.fake_tensor import is_fake

    from momlab.moms import swap

    packed = []
    to_host = swap.Swapper._to_host

    def record(self, x):
        packed.append((x.dtype, is_fake(x)))
        return to_host(self, x)

    monkeypatch.setattr(swap.Swapper, "_to_host", record)
    E.allocation_events("bert-base", "quant4+swap", batch_size=8, precision="fp16", **TINY_BERT)
    codes = [fake for dtype, fake in packed if dtype == torch.uint8]
    assert codes and all(codes)
    assert all(fake for dtype, fake in packed if dtype.is_floating_point)
