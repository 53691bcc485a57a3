"""Provably stable cuts, per tokenizer family. Entry point: :class:`finder.CutFinder`."""

from .finder import CutFinder, detect_family

__all__ = ["CutFinder", "detect_family"]
