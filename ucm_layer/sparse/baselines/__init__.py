"""Baseline block scorers measured next to GSA: Quest, mean key, sign-hash (HATA), oracle."""
