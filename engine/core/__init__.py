"""The serving core: requests in, outputs out, one step at a time (no torch below this line)."""
