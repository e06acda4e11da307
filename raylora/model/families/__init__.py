"""Model families: one module per pipeline layout, each defining ``FAMILY`` (a subclass of
``raylora.model.families.base.Family``). The rest of raylora asks the family object what to
do and never compares family names; adding a family is adding a module here (found by
listing this package, no table to edit).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from raylora.model.families.base import Cond, Family, TextInput


@functools.cache
def _modules() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"))


def names() -> tuple[str, ...]:
    """Every family's name (``model.family`` values besides ``auto``)."""
    return tuple(get(n).name for n in _modules())


@functools.cache
def get(name: str) -> type[Family]:
    """The family called ``name``; unknown names list the known ones."""
    if name not in _modules():
        raise ValueError(f"model.family: unknown family {name!r} (known: {', '.join(_modules())})")
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def detect(index: dict, where: str = "model.pretrained") -> type[Family]:
    """The family of a pipeline from its ``model_index.json`` ``_class_name`` (never from
    which folders exist: Flux has a ``text_encoder_2`` as SDXL does)."""
    if not isinstance(index, dict):  # a damaged file: named, not an AttributeError
        raise ValueError(f"{where}: model_index.json is not a JSON object")
    found = index.get("_class_name")
    for n in _modules():
        fam = get(n)
        if found in fam.class_names:
            return fam
    supported = "; ".join(f"{get(n).name}: {', '.join(get(n).class_names)}" for n in _modules())
    raise ValueError(
        f"{where}: model_index.json _class_name {found!r} is not a pipeline raylora trains "
        f"(supported: {supported})"
    )


__all__ = ["Cond", "Family", "TextInput", "detect", "get", "names"]
