"""A workload's steps: reproducible whatever else runs in the process."""

from momlab import catalog
from momlab.workload import build


def test_two_workloads_stepped_alternately_train_as_each_would_alone():
    # dropout draws from the global generator: without each workload's own stream the
    # exact and ckpt runs below disagreed from the first step
    size = catalog.tiny("gpt2")

    def make(mom):
        return build("gpt2", batch_size=2, mom=mom, seed=7, **size)

    exact, ckpt = make("exact"), make("ckpt")
    together = [(exact.step(), ckpt.step()) for _ in range(3)]
    alone = {mom: [w.step() for _ in range(3)] for mom, w in (("exact", make("exact")), ("ckpt", make("ckpt")))}
    assert [a for a, _ in together] == alone["exact"]
    assert [b for _, b in together] == alone["ckpt"]
    assert alone["exact"] == alone["ckpt"]  # ckpt is lossless: bit-identical losses
