"""Evaluation harnesses (GSM8K-style accuracy + speculative acceptance gates)."""
