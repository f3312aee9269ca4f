"""Structured outputs: the formats a request may ask for (JSON Schema, JSON object, regex, choice,
grammar), compiled by llguidance into matchers that say which tokens may come next."""
