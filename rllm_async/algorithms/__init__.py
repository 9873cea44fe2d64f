"""Advantage estimators (pure Python) and policy-gradient losses (torch)."""
