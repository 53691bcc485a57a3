"""Provably stable cuts, per tokenizer family. Entry point: :class:`finder.CutFinder`."""

from toktier_backend.pipeline.cuts.finder import CutFinder, detect_family

__all__ = ["CutFinder", "detect_family"]
