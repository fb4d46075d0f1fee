"""The body of ``PATCH /config``, typed key by key from the settings themselves.

Each runtime setting (``shared.runtime.RUNTIME_KEYS``) is declared in the OpenAPI schema with its own
type and bounds, read off its field in :class:`shared.settings.Settings` (``trainer.learning_rate``:
a number above 0; ``trainer.target_kl``: that or null; ``trainer.guard.enabled``: a boolean), and no
other key is allowed. :func:`check_types` holds a body to exactly that schema (strict: ``"5"`` is not
5, ``true`` not 1; ``5.0`` is the integer 5, as in JSON Schema) and names the first key that does not
match. What the schema cannot say (a value against the other settings, e.g. ``trainer.guard.drop``
above ``trainer.guard.hold_tolerance``) is judged when the revision is applied (409 in the route).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from shared.runtime import RUNTIME_KEYS
from shared.settings import ConfigError, Settings


def _field_type(key: str) -> Any:
    """The annotated type of ``key``'s field (``section.name`` or ``section.sub.name``), bounds included."""
    model: type[BaseModel] = Settings
    *path, name = key.split(".")
    for part in path:
        section = model.model_fields[part].annotation
        assert isinstance(section, type) and issubclass(section, BaseModel), key
        model = section
    info = model.model_fields[name]
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


@functools.cache
def _adapters() -> dict[str, TypeAdapter[Any]]:
    return {key: TypeAdapter(_field_type(key)) for key in RUNTIME_KEYS}


def _integer(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "integer" or any(s.get("type") == "integer" for s in schema.get("anyOf", ()))


@functools.cache
def body_schema() -> dict[str, Any]:
    """JSON Schema of the body: at least one runtime setting, each with its own type; no other key."""
    properties = {}
    for key, adapter in _adapters().items():
        schema = adapter.json_schema()
        schema.pop("title", None)
        properties[key] = schema
    return {"type": "object", "properties": properties, "additionalProperties": False, "minProperties": 1}


def check_types(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as the settings' types (integral floats made ints); ConfigError naming the first key that is
    not a runtime setting or whose value does not match its schema."""
    unknown = sorted(set(values) - set(RUNTIME_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]!r}: not a runtime setting (runtime settings: {', '.join(RUNTIME_KEYS)})")
    out = {}
    for key, value in values.items():
        if isinstance(value, float) and value.is_integer() and _integer(body_schema()["properties"][key]):
            value = int(value)
        try:
            out[key] = _adapters()[key].validate_python(value, strict=True)
        except ValidationError as exc:
            raise ConfigError(f"{key}: {exc.errors()[0]['msg']}") from None
    return out
