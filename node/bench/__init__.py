"""Benchmarks of the node, one module each: `python -m geotrain.node.bench.<name> --help`.

Each prints its figures (and `--json` for machines); none is imported by the node itself.
"""
