"""Adapters that let serving engines call lumen_core. Each adapter is the only importer of its
engine; nothing else in the package imports one."""
