"""The run's desk (raylora.desk) is one class made of three plain ones: a method or field
of one part with the name of another's would silently replace it in the actor."""

import inspect

from raylora.data.badrecords import Tally
from raylora.progress import Board
from raylora.stop import Requests


def _names(cls) -> set[str]:
    fields = set(vars(cls()))  # what __init__ sets
    methods = {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("__")}
    return fields | methods


def test_the_desks_parts_share_no_name():
    parts = [_names(Tally), _names(Board), _names(Requests)]
    assert all(parts)
    assert sum(map(len, parts)) == len(set().union(*parts))
    assert {"add", "summary", "push", "since", "request", "requested", "park"} <= set().union(*parts)
