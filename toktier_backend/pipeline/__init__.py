"""The request path: text store -> diff -> cuts -> engine -> splice."""
