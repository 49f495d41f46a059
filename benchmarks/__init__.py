"""Measurements that print tables, one ``python -m benchmarks.<area>.<name>`` script each (its docstring gives
the command and what it measures); not part of the installed package. Shared helpers: :mod:`.common`."""
