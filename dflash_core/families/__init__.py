"""Drafter families as the config and the plans see them, without torch (registry.py)."""
