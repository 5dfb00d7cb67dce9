"""Megatron-core actor backend: HF <-> megatron weight conversion and GPTModel construction.

Importing this package does not import megatron-core (an optional dependency: the ``gpu`` and
``test`` extras); the submodules import it where they need it.
"""
