"""Probe sets, one module per library kind."""
