"""docs/API.md is the contract: every documented name exists with the documented signature.

Each line of a fenced ``python`` block in docs/API.md that starts with
``momlab.`` is checked against the code: ``momlab.NAME(params) -> Return``
by `inspect.signature` (parameter names, order, kinds, defaults; the return
annotation where the code has one), ``momlab.NAME.attribute`` by existence.
A rename, a changed default, a reordered or re-kinded parameter, or a name
that disappears fails here; so does an exported name (``momlab.__all__``)
that the contract does not mention.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import types
from pathlib import Path

import pytest

import momlab

API_MD = Path(__file__).resolve().parent.parent / "docs" / "API.md"
_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}
_MISSING = object()


def contract_lines(text: str) -> list[str]:
    """The ``momlab.`` lines of the fenced python blocks of `text`."""
    out = []
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        out += [line.strip() for line in block.splitlines() if line.strip().startswith("momlab.")]
    return out


def _split(line: str) -> tuple[str, str | None, str | None]:
    """``momlab.a.b(params) -> ret`` -> ("momlab.a.b", "params", "ret"); params None for an attribute line."""
    if "(" not in line:
        return line, None, None
    path, rest = line.split("(", 1)
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    else:
        raise ValueError(f"unbalanced parentheses: {line}")
    params, tail = rest[:i], rest[i + 1:].strip()
    ret = None
    if tail:
        if not tail.startswith("->"):
            raise ValueError(f"expected '-> Return' after the parameters: {line}")
        ret = tail[2:].strip()
    return path.strip(), params, ret


def _documented_params(params: str) -> list[tuple[str, str, object]]:
    """(name, kind, default AST node or _MISSING) for each documented parameter, in order."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    out = [(a.arg, "positional-only", _MISSING) for a in args.posonlyargs]
    out += [(a.arg, "positional", _MISSING) for a in args.args]
    defaults = [*[_MISSING] * (len(out) - len(args.defaults)), *args.defaults]
    out = [(n, k, d) for (n, k, _), d in zip(out, defaults)]
    if args.vararg:
        out.append((args.vararg.arg, "*args", _MISSING))
    out += [(a.arg, "keyword-only", _MISSING if d is None else d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "**kwargs", _MISSING))
    return out


def _resolve(path: str):
    """(object, its parent, the last name) of a dotted ``momlab.`` path; AttributeError if it is not there."""
    parts = path.split(".")
    assert parts[0] == "momlab", path
    parent, obj = None, momlab
    for name in parts[1:]:
        is_dataclass = isinstance(obj, type) and dataclasses.is_dataclass(obj)
        fields = {f.name: f for f in dataclasses.fields(obj)} if is_dataclass else {}
        # a dataclass field without a default is no class attribute: the field is what exists
        parent, obj = obj, fields[name] if name in fields else getattr(obj, name)
    return obj, parent, parts[-1]


def _callable_of(obj, parent, name):
    """What a documented signature describes: (callable, drop the first parameter, is a class)."""
    if isinstance(obj, types.ModuleType):
        # momlab.estimate, momlab.moms, momlab.gpus: callable modules; the signature is their same-named function
        if not callable(obj):
            raise TypeError(f"module {obj.__name__} is not callable")
        return getattr(obj, obj.__name__.rsplit(".", 1)[-1]), False, False
    if isinstance(parent, type):
        raw = inspect.getattr_static(parent, name)
        if isinstance(raw, property) or isinstance(obj, dataclasses.Field):
            raise TypeError(f"{parent.__name__}.{name} is an attribute, not a method: document it without ()")
        if inspect.isfunction(raw):  # a method: documented without self
            return raw, True, False
    return obj, False, isinstance(obj, type)


def _default_matches(node, actual, owner, name) -> bool:
    if actual is not inspect.Parameter.empty and repr(actual) == "<factory>" and dataclasses.is_dataclass(owner):
        actual = next(f for f in dataclasses.fields(owner) if f.name == name).default_factory()
    try:
        documented = ast.literal_eval(node)
    except ValueError:  # not a literal (nan, Grid(step=1, limit=None)): the code's repr must read the same
        return ast.unparse(node) == repr(actual)
    return type(documented) is type(actual) and documented == actual


def _text(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return re.sub(r"\s+", "", text).strip("'\"")


def mismatches(line: str) -> list[str]:
    """What is wrong with one contract line against the code ([] when it holds)."""
    path, params, ret = _split(line)
    try:
        obj, parent, name = _resolve(path)
    except AttributeError as exc:
        return [f"{path}: not found ({exc})"]
    if params is None:
        return []
    try:
        fn, drop_self, is_class = _callable_of(obj, parent, name)
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return [f"{path}: {exc}"]
    actual = list(sig.parameters.values())[1 if drop_self else 0:]
    documented = _documented_params(params)
    problems = []
    got = [(p.name, _KINDS[p.kind]) for p in actual]
    want = [(n, k) for n, k, _ in documented]
    if got != want:
        problems.append(f"{path}: parameters (name, kind) are {got}, documented {want}")
    by_name = {p.name: p for p in actual}
    for pname, _, node in documented:
        p = by_name.get(pname)
        if p is None:
            continue
        if node is _MISSING:
            if p.default is not inspect.Parameter.empty:
                problems.append(f"{path}: {pname} has default {p.default!r} in the code, none documented")
        elif p.default is inspect.Parameter.empty:
            problems.append(f"{path}: {pname} has no default in the code, documented {ast.unparse(node)}")
        elif not _default_matches(node, p.default, fn if is_class else None, pname):
            problems.append(f"{path}: {pname} defaults to {p.default!r} in the code, documented {ast.unparse(node)}")
    if not is_class and ret is not None and sig.return_annotation is not inspect.Signature.empty:
        if _text(sig.return_annotation) != _text(ret):
            problems.append(f"{path}: returns {_text(sig.return_annotation)} in the code, documented {ret}")
    return problems


LINES = contract_lines(API_MD.read_text())


def test_the_contract_lists_the_surface():
    assert len(LINES) >= 30
    paths = [_split(line)[0] for line in LINES]
    assert len(paths) == len(set(paths)), "a name documented twice"
    heads = {p.split(".")[1] for p in paths}
    undocumented = [n for n in momlab.__all__ if n not in heads]
    assert not undocumented, f"exported but not in docs/API.md: {undocumented}"


@pytest.mark.parametrize("line", [pytest.param(line, id=_split(line)[0]) for line in LINES])
def test_documented_signature_is_the_code(line):
    assert mismatches(line) == []


def test_callable_modules_call_their_function(monkeypatch):
    """momlab.moms(), momlab.gpus() and momlab.estimate(...) are the functions the contract documents."""
    assert momlab.moms() == momlab.moms.moms() and momlab.gpus() == momlab.gpus.gpus()
    monkeypatch.setattr(momlab.estimate, "estimate", lambda *a, **k: ("estimate", a, k))
    assert momlab.estimate("bert-base", batch_size=2, gpu="cpu") == ("estimate", ("bert-base",),
                                                                      {"batch_size": 2, "gpu": "cpu"})


RIGHT = ('momlab.format_bytes(n) -> str', 'momlab.parse_bytes(value) -> int',
           'momlab.OutOfMemory(message, *, requested=0, live=0, budget=None)',
           'momlab.Search(dim, value, trials=[], tried=[], grid=Grid(step=1, limit=None), first_failure=None, '
           'config={})',
           'momlab.Workload.step(batch=None, *, on_forward_end=None, on_backward_end=None) -> float',
           'momlab.Search.capped')


@pytest.mark.parametrize("wrong, says", [
    ("momlab.format_bytes(nbytes) -> str", "parameters"),  # renamed
    ("momlab.parse_bytes(value) -> str", "returns int"),  # another return type
    ("momlab.OutOfMemory(message, *, requested=1, live=0, budget=None)", "requested defaults to 0"),
    ("momlab.OutOfMemory(message, *, live=0, requested=0, budget=None)", "parameters"),  # reordered
    ("momlab.OutOfMemory(message, requested=0, live=0, budget=None)", "parameters"),  # keyword-only lost
    ("momlab.OutOfMemory(message, *, requested=0, live=0, budget=None, **kw)", "parameters"),  # no **kwargs
    ("momlab.OutOfMemory(message, *, requested, live=0, budget=None)", "none documented"),
    ("momlab.OutOfMemory(message='', *, requested=0, live=0, budget=None)", "no default in the code"),
    ("momlab.OutOfMemory(message, *, requested=0.0, live=0, budget=None)", "requested defaults to 0"),  # 0.0 != 0
    ("momlab.Search(dim, value, trials=(), tried=[], grid=Grid(step=1, limit=None), first_failure=None, config={})",
     "trials defaults"),  # a factory of list, not a tuple
    ("momlab.Search(dim, value, trials=[], tried=[], grid=Grid(step=2, limit=None), first_failure=None, config={})",
     "grid defaults"),
    ("momlab.Workload.step(batch=None, *, on_forward_end=None) -> float", "parameters"),  # a parameter left out
    ("momlab.measure_everything(model) -> Measurement", "not found"),
    ("momlab.Search.uncapped", "not found"),
    ("momlab.Search.capped() -> bool", "an attribute, not a method"),
])
def test_the_checker_catches_a_wrong_contract(wrong, says):
    """The checker itself: each line above is wrong in one way, and it says how; the right lines pass."""
    for right in RIGHT:
        assert mismatches(right) == [], right
    problems = mismatches(wrong)
    assert problems and says in " ".join(problems), problems


def test_the_parser_reads_kinds_and_defaults():
    params = _documented_params('model, mom="exact", *, batch_size, budget=None, **size')
    assert [(n, k, d if d is _MISSING else ast.literal_eval(d)) for n, k, d in params] == [
        ("model", "positional", _MISSING), ("mom", "positional", "exact"), ("batch_size", "keyword-only", _MISSING),
        ("budget", "keyword-only", None), ("size", "**kwargs", _MISSING)]
    assert _split("momlab.x.y(a, b=(1, 2)) -> list[str]") == ("momlab.x.y", "a, b=(1, 2)", "list[str]")
    assert contract_lines("text\n```python\nmomlab.a(x)\nnot this\n```\n```sh\nmomlab.b\n```\n") == ["momlab.a(x)"]
