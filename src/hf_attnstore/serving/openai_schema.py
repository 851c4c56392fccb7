"""OpenAI's typing of request objects, shared by every route's models: the base they derive from, the check that a
``tool_choice`` asks only for offered tools, and the field a validation error names.

The `openai` client's own types are the reference (``openai/types/chat/completion_create_params.py``,
``openai/types/completion_create_params.py``, ``openai/types/responses/response_create_params.py``):

- **An explicit null is "not given".** OpenAI's schema makes optional fields nullable, and clients and routers
  send ``null`` for what they leave unset (``"stream": null`` on every request): the field's default applies.
  A required field (``model``, ``messages``, ``prompt``, ``input``) stays required.
- **No coercion.** ``"5"`` is not an integer, ``5.0`` is not an integer either, ``true`` is not a number, and
  ``"yes"`` is not a boolean: a 400 naming the field, as OpenAI answers, rather than a guess at what was meant.
  JSON has one number type, so a whole number (``1``) is a valid ``number`` (``temperature``).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from pydantic import BaseModel, ConfigDict, model_validator

# A union member's tag in a validation error's location ("str", "list[int]", "literal['auto','none']",
# "function-after[...]", a model class's name): not a field of the request.
_TYPE_TAG = re.compile(r"[a-z][a-z-]*\[.*\]|str|int|float|bool|none|dict|list", re.DOTALL)


class OpenAIRequest(BaseModel):
    """The base of every request model and of their parts: strict JSON types, unknown fields ignored (clients
    send many optional fields this server has no use for), an explicit ``null`` for an optional field taken as
    the field not given.

    Example:
        >>> class Ask(OpenAIRequest):
        ...     stream: bool = False
        >>> Ask.model_validate({"stream": None}).stream
        False
        >>> Ask.model_validate({"stream": "false"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        pydantic_core._pydantic_core.ValidationError: ...
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        if isinstance(data, dict):
            optional = _optional_fields(cls)
            if any(data.get(name, 0) is None for name in optional):
                data = {key: value for key, value in data.items() if value is not None or key not in optional}
        return data


@functools.cache
def _optional_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in model.model_fields.items() if not field.is_required())


def check_tool_choice(choice, tools: list | None, functions: list[str], named: Callable[[dict], str]):
    """`choice`, a request's ``tool_choice``, if it asks only for tools the request offers, else a ValueError
    saying what is wrong: a choice other than "auto" or "none" without `tools` (those two ask for what the request
    gets anyway), or a named function that is not among `functions` (the names of its function tools).

    Args:
        choice: The ``tool_choice`` as sent: "none", "auto", "required", an object, or None (not given).
        tools: The request's ``tools``.
        functions: The names of its function tools.
        named: The function a ``{"type": "function", ...}`` choice names, in the route's form; raises ValueError
            for a malformed one.

    Example:
        >>> check_tool_choice("auto", None, [], lambda c: c["name"])
        'auto'
        >>> check_tool_choice({"type": "function", "name": "f"}, None, [], lambda c: c["name"])
        Traceback (most recent call last):
        ValueError: a `tool_choice` other than "auto" or "none" needs `tools`: offer the functions it may call
    """
    if choice is None or choice in ("auto", "none"):
        return choice
    if not tools:
        raise ValueError('a `tool_choice` other than "auto" or "none" needs `tools`: offer the functions it may call')
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = named(choice)
        if name not in functions:
            offered = ", ".join(functions) or "none"
            raise ValueError(f"`tool_choice` names the function {name[:64]!r}, which is not among `tools` "
                             f"(offered: {offered[:500]})")
    return choice


def error_field(loc: tuple) -> tuple[str | None, bool]:
    """The field a validation error's location names, as OpenAI's ``param`` (``messages.0.content``): the path
    up to a union member's tag (the tags are pydantic's, not the client's fields), and whether there was one (the
    error is then one of several alternatives of that field)."""
    path = []
    for part in loc:
        if error_tag(part):
            return ".".join(path) or None, True
        path.append(str(part))
    return ".".join(path) or None, False


def error_tag(part) -> bool:
    """Whether `part` of a validation error's location is a union member's tag (pydantic's name of a type)."""
    return isinstance(part, str) and (_TYPE_TAG.fullmatch(part) is not None or part in _model_names())


@functools.cache
def _model_names() -> frozenset[str]:
    """The request models' class names (a union of models tags its errors with them); every module that defines
    one is imported by the time a request is validated."""
    names, todo = set(), [OpenAIRequest]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            names.add(sub.__name__)
            todo.append(sub)
    return frozenset(names)
