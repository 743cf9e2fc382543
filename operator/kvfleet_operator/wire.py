"""The base of the typed CRD models: camelCase field names on the wire, snake_case in Python,
unknown fields refused, parsed objects frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# Replica counts are int32 in every workload, HPA and scale subresource: a larger one would
# be admitted here and refused (or wrapped negative) in the children.
INT32_MAX = 2**31 - 1


def to_wire_name(field: str) -> str:
    """snake_case -> camelCase, keeping the unit GiB: memory_gib -> memoryGiB."""
    return to_camel(field).replace("Gib", "GiB")


class Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_wire_name, populate_by_name=True, extra="forbid", frozen=True
    )
