"""Cache policies, one small file each, registered by name.

A policy decides which positions the next forward computes and when to refresh everything; it
never computes or stores (``cache/base.py``). ``make_policy(name, **params)`` builds one and
refuses a parameter it does not declare, as the command line does.
"""

from __future__ import annotations

import dataclasses
import importlib

from ..contract.fields import check_value, field_types, takes_text, text_number
from ..contract.names import policy_modules
from ..errors import UsageError
from .base import CachePolicy, ForwardPlan


def _discover() -> dict[str, type[CachePolicy]]:
    """Every policy module of this package, by policy name: module ``x_y.py`` holds the policy ``x-y``
    (its one ``CachePolicy`` subclass whose ``name`` is that), in ``contract.names`` order."""
    found = {}
    for mod in policy_modules():
        name = mod.replace("_", "-")
        module = importlib.import_module(f".{mod}", __name__)
        classes = [c for c in vars(module).values()
                   if isinstance(c, type) and issubclass(c, CachePolicy) and c.__module__ == module.__name__]
        assert len(classes) == 1 and classes[0].name == name, \
            f"cache/{mod}.py must define one CachePolicy subclass named {name!r}"
        found[name] = classes[0]
    return found


POLICIES: dict[str, type[CachePolicy]] = _discover()


def policies_for(block_causal: bool) -> list[str]:
    """The policies that apply to a model's attention, in registry order: those made for any attention and
    those made for its kind (``CachePolicy.attention``: "block-causal" for block diffusion, else
    "bidirectional")."""
    kind = "block-causal" if block_causal else "bidirectional"
    return [n for n, c in POLICIES.items() if c.attention in ("any", kind)]


def policy_params(name: str) -> set[str]:
    """Names of the hyperparameters policy ``name`` accepts."""
    return {f.name for f in dataclasses.fields(POLICIES[name])}


def spec_hint(name: str) -> str:
    """For a ``name:key=value`` spec given where a bare policy name is expected: where its parameters go."""
    if not isinstance(name, str) or ":" not in name:
        return ""
    return (f" (a policy's parameters go in a profile's cache: section, e.g. cache: {{policy: {name.split(':')[0]}, "
            "key: value}, or in `ecache profile --policies name:key=value`; --tau and --recent-k are flags)")


def unknown_policy(name, label: str = "--cache", names=None, hint: bool = True) -> UsageError:
    """The one refusal of a name that is no cache policy, wherever it was given (``label``: ``--cache``,
    ``--policies``, ``/cache``, a request's ``policy``): ``--cache 'foo' is not a cache policy; use one of none,
    prefix, …``, listing ``names`` (those that fit the model's attention, :func:`policies_for`; default every
    policy), with :func:`spec_hint` for a ``name:key=value`` given where a bare name is expected (``hint``:
    where the command line's flags and profiles are the way to give parameters)."""
    listed = ", ".join(POLICIES if names is None else names)
    return UsageError(f"{label} {name!r} is not a cache policy; use one of {listed}{spec_hint(name) if hint else ''}")


def make_policy(name: str, strict: bool = True, **params) -> CachePolicy:
    """Build policy ``name`` from its parameters, checked as the command line checks them.

    Raises UsageError for an unknown name (listing the valid ones), a wrongly typed or out-of-range value
    (``tau='x'``, NaN, ``block_refresh='maybe'``) or a parameter the policy does not declare (``kr=3``:
    the message ``--policies`` gives), and a number given as a string (``tau='0.5'``, which the flags never
    pass). ``strict=False`` ignores undeclared parameters instead and reads numbers written as text (a
    profile's YAML ``1e-3``): for callers that hold one set of settings for several policies
    (``runs.settings.Settings``, the server).
    """
    if not isinstance(name, str) or name not in POLICIES:  # a caller's argument: named as the server names it
        raise unknown_policy(name, "policy" if strict else "--cache")
    known = policy_params(name)
    unknown = sorted(k for k in params if k not in known)
    if strict and unknown:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes no parameters"
        raise UsageError(f"policy {name!r} has no parameter {unknown[0]!r}; {takes}")
    kinds = field_types(POLICIES[name])
    typed = {}
    for k, v in params.items():
        if k in known and v is not None:
            # tau='0.5': a number as text, checked as the number first; proportions='1' is a text field's text
            number = text_number(v) if strict and not takes_text(kinds[k]) else None
            try:
                typed[k] = check_value(kinds[k], v if number is None else number)
            except ValueError as e:  # e.g. tau='x' from --policies entropy:tau=x, or --tau nan
                raise UsageError(f"{name} parameter {k}={v!r} {e}") from None
            if number is not None:
                raise UsageError(f"{name} parameter {k}={v!r} must be a number, not a string (e.g. {k}={typed[k]!r})")
    try:
        return POLICIES[name](**typed)
    except UsageError as e:  # a policy's own check words the flag; a parameter given as such is named so
        for k, v in typed.items():
            flag = f"--{k.replace('_', '-')} {v!r} "
            if strict and str(e).startswith(flag):
                raise UsageError(f"{name} parameter {k}={v!r} {str(e)[len(flag):]}") from None
        raise


__all__ = ["CachePolicy", "ForwardPlan", "POLICIES", "make_policy", "policies_for", "policy_params"]
