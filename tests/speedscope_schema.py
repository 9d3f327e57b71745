"""The speedscope file format's required fields and types (https://www.speedscope.app/file-format-schema.json,
from speedscope's src/lib/file-format-spec.ts) for the sampled profiles rankscope writes, as a JSON schema."""

SPEEDSCOPE_SCHEMA = {
    "type": "object", "required": ["$schema", "shared", "profiles"],
    "properties": {
        "$schema": {"const": "https://www.speedscope.app/file-format-schema.json"},
        "shared": {"type": "object", "required": ["frames"], "properties": {"frames": {"type": "array", "items": {
            "type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "file": {"type": "string"}, "line": {"type": "number"}}}}}},
        "profiles": {"type": "array", "items": {
            "type": "object", "required": ["type", "name", "unit", "startValue", "endValue", "samples", "weights"],
            "properties": {"type": {"const": "sampled"}, "name": {"type": "string"},
                           "unit": {"enum": ["none", "nanoseconds", "microseconds", "milliseconds", "seconds",
                                             "bytes"]},
                           "startValue": {"type": "number"}, "endValue": {"type": "number"},
                           "samples": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                           "weights": {"type": "array", "items": {"type": "number"}}}}},
        "name": {"type": "string"}, "activeProfileIndex": {"type": "number"}, "exporter": {"type": "string"}}}
