"""Helpers shared by aiockpt's tests and its plugins' tests."""
