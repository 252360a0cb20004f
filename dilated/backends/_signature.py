"""Call a third-party function whose positional signature changed across releases, by name."""
from __future__ import annotations

import inspect


def call_by_name(fn, values: dict):
    """Call ``fn`` with the entries of ``values`` that its signature names.

    Parameters it has but ``values`` lacks keep their defaults, or get None when they have none
    (the varlen arguments of the flash-attn backward functions, for example).
    """
    kwargs = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in values:
            kwargs[name] = values[name]
        elif p.default is inspect.Parameter.empty:
            kwargs[name] = None
    return fn(**kwargs)
