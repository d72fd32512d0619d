"""Tensor codecs for model updates: quantizers, sparsifiers, low-rank, error feedback, wire."""
