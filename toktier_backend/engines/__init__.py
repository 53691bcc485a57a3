"""Engines behind one protocol; see ``protocol.Engine`` and ``registry``."""
