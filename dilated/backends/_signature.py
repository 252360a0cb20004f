"""Call a third-party kernel function by parameter name: positional signatures of flash-attn's
private functions changed across releases, and since flash-attn 2.7 (and the hopper interface
since mid 2025) they are ``torch.library`` custom ops, whose Python signature is only
``(*args, **kwargs)``; their parameter names are in the op's schema."""
from __future__ import annotations

import functools
import inspect

import torch


def _schema(fn):
    """The ``torch._C.FunctionSchema`` of a custom op, an op overload or an overload packet, or None."""
    for obj in (getattr(fn, "_opoverload", None), fn, getattr(fn, "default", None)):
        schema = getattr(obj, "_schema", None)
        if isinstance(schema, torch._C.FunctionSchema):
            return schema
    return None


@functools.lru_cache(maxsize=256)
def parameters(fn) -> dict[str, bool]:
    """``fn``'s parameter names, each with whether it has a default (from the op schema where
    ``fn`` is a ``torch.library`` op, else from its Python signature; ``*args``/``**kwargs`` skipped).
    Cached per function: reading a signature of forty parameters costs more host time than
    launching the kernel."""
    schema = _schema(fn)
    if schema is not None:
        return {a.name: a.has_default_value() for a in schema.arguments}
    return {name: p.default is not inspect.Parameter.empty
            for name, p in inspect.signature(fn).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def call_by_name(fn, values: dict, required=()):
    """Call ``fn`` with the entries of ``values`` that it names.

    Parameters it has but ``values`` lacks keep their defaults, or get None when they have none
    (the varlen arguments of the flash-attn backward functions, for example). ``required``: names
    (or tuples of alternative names, such as ``("causal", "is_causal")``) of which ``fn`` must take
    one; a function that takes none of them raises TypeError instead of being called without it
    (a causal flag silently dropped would make causal attention non-causal).
    """
    passed, absent = _call_plan(fn, tuple(values), tuple(required))
    kwargs = {name: values[name] for name in passed}
    kwargs.update(absent)
    return fn(**kwargs)


@functools.lru_cache(maxsize=1024)
def _call_plan(fn, names: tuple, required: tuple):
    """Which of ``names`` ``fn`` takes, and its parameters without a default that ``names`` lacks
    (as ``{name: None}``), after checking ``required``; cached per call site's names (matching
    forty parameters against a dict on every call cost tens of microseconds of host time)."""
    params = parameters(fn)
    for need in required:
        alternatives = (need,) if isinstance(need, str) else tuple(need)
        if not any(n in params for n in alternatives):
            raise TypeError(f"{getattr(fn, '__name__', fn)} takes no parameter named {' or '.join(alternatives)} (it "
                            f"takes {', '.join(params)}): its interface changed; this adapter cannot call it correctly")
    given = set(names)
    passed = tuple(name for name in params if name in given)
    absent = {name: None for name, has_default in params.items() if name not in given and not has_default}
    return passed, absent
