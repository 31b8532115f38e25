"""The type of a value that goes into an event's ``details`` as it is: JSON (a finding, a replay's evidence)."""

from __future__ import annotations

from typing import Union

__all__ = ["JSONValue", "JSONObject"]

JSONValue = Union[None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]]
JSONObject = dict[str, JSONValue]  # a finding: named values, each JSON
