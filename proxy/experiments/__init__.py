"""Live experiments at run time: per-arm measurement, the guardrail evaluator, PromQL readings, admin JSON.

The decisions (definitions, assignment, guardrails) are pure and live in proxy/core/experiments.py.
"""
