"""The type of a value as JSON holds it: what ``events.jsonl``, the report CLI and the checkpointed state read."""

from __future__ import annotations

from typing import Union

__all__ = ["JSONValue", "JSONDict"]

JSONValue = Union[None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]]
JSONDict = dict[str, JSONValue]
