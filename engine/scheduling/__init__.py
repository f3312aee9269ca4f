"""Which requests run in a step and with how many tokens: plain data, no torch."""
