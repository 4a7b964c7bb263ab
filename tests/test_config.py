"""A configuration is parsed once per public call, and the MOM travels as parsed data (issue 12)."""

import pickle

import pytest

import momlab
from momlab import catalog, moms
from momlab.moms import Mom

SIZE = catalog.tiny("gpt2")


@pytest.fixture
def parses(monkeypatch):
    """How many times the one MOM parser (`moms._check_parts`) runs."""
    calls = []
    real = moms._check_parts

    def counted(mom):
        calls.append(mom)
        return real(mom)

    monkeypatch.setattr(moms, "_check_parts", counted)
    return calls


@pytest.mark.parametrize("call", [
    lambda: momlab.build("gpt2", batch_size=2, mom="ckpt+quant4", **SIZE),
    lambda: momlab.measure("gpt2", "ckpt+quant4", batch_size=2, steps=1, **SIZE),
    lambda: momlab.max_batch_size("gpt2", "ckpt+quant4", budget="64MiB", limit=2, **SIZE),
    lambda: momlab.moms.apply(catalog.make_model("gpt2", catalog.resolve_size("gpt2", SIZE)), "swap+ckpt"),
], ids=["build", "measure", "max_batch_size", "apply"])
def test_one_parse_per_public_call(parses, call):
    call()
    assert len(parses) == 1, parses


def test_the_parsed_mom_is_its_canonical_string():
    m = Mom.of("ckpt+swap+quant4")
    assert m == "quant4+swap+ckpt" and isinstance(m, str) and m.parts == ("quant4", "swap", "ckpt")
    assert m.checkpointing == "ckpt" and Mom.of("exact").checkpointing is None
    assert Mom.of(m) is m
    back = pickle.loads(pickle.dumps(m))  # to ranks and fresh-process trials
    assert type(back) is Mom and back.parts == m.parts and back == m
    assert momlab.measure("gpt2", "ckpt+quant4", batch_size=2, steps=1, **SIZE).mom == "quant4+ckpt"
    with pytest.raises(ValueError, match="valid atomic MOMs: exact, ckpt"):
        Mom.of("ckpt+dtr")
