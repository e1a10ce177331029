"""Formulas (sizing, traffic) and measurements (memory, ledger)."""
