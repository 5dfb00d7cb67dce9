"""Command-line entry points (``[project.scripts]`` and the ``jobs/``, ``tools/`` wrappers).

Each ``main`` returns the process's exit code; the library below raises.
"""
