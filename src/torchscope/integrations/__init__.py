"""Integrations with other tools (TensorBoard). Import the submodule you need; each imports
its tool lazily."""
