"""Shared pytest plumbing: which of a module's parametrized cases this run selected.

A module that computes all its cases in one worker group (tests/distributed.py) asks :func:`selected` which of
them the run's ``-m`` / ``-k`` selection kept, and computes only those: ``bash run.sh test -m "not slow"``
(the edit-test loop, README) then pays for the rows it runs, not for the module's whole grid.
"""

from __future__ import annotations

import pytest


def selected(request: pytest.FixtureRequest, argname: str) -> list:
    """The values of the parametrize argument ``argname`` of the selected tests of the requesting module, in
    collection order, without repeats."""
    seen = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if argname in params and params[argname] not in seen:
            seen.append(params[argname])
    return seen


def module_selected(request: pytest.FixtureRequest, name: str) -> bool:
    """Whether the run selected the test function ``name`` of the requesting module (any of its cases)."""
    return any(item.module is request.module and item.originalname == name for item in request.session.items)
