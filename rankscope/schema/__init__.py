"""What crosses from agents to analyzers: behavior pattern records (patterns.py), their wire codec (wire.py) and
the findings of the diagnosis document (finding.py). Depended on by both sides, depending on neither."""
