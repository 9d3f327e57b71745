"""The diagnosis document's JSON Schema (`diagnosis.schema.json`, shipped with the package): what every
reader of `diagnose --json` and `GET /v1/diagnosis` may rely on. docs/api.md explains the fields."""
from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

SCHEMA_FILE = "diagnosis.schema.json"


@cache
def diagnosis_schema() -> dict[str, Any]:
    """The schema (JSON Schema draft 2020-12), read once from the installed package."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())
