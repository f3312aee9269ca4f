"""How much image encoding one step may do.

A request's images are encoded on the first step that computes any of their placeholders, all
at once, and that work is not in the token budget: a SmolVLM image of 17 tiles takes seconds on
a CPU, and every request in the step waits for it. So each step encodes at most
`max_num_encoder_input_tokens` feature rows (vLLM's limit of the same name), and always at least
one request's images; a chunk that would reach images past that stops before them and they are
encoded on a later step. Plain data, no torch.
"""

from __future__ import annotations

from engine.core.request import Request


class EncoderBudget:
    """One step's encoder budget, spent as its chunks are scheduled."""

    def __init__(self, rows: int, chunked: bool = True) -> None:
        self.left = rows
        self.spent = False
        # Without chunked prefill a prompt runs whole: one that would encode past the budget
        # waits instead of being cut.
        self.chunked = chunked

    def cut(self, request: Request, num_tokens: int) -> int:
        """How many of the `num_tokens` the request asks for the step runs: all of them,
        unless they reach images not yet encoded that the budget cannot take (then those
        before the images, which may be none)."""
        images = request.images
        if images is None or images.encoder_scheduled:
            return num_tokens
        start = request.num_computed_tokens
        first, last = images.span(start, start + num_tokens)
        if first == last:  # the chunk stops before the images (or a cached prefix holds them)
            return num_tokens
        cost = len(images.positions)
        if cost <= self.left or not self.spent:
            self.left -= cost
            self.spent = True
            images.encoder_scheduled = True
            return num_tokens
        if not self.chunked:
            return 0
        return int(images.positions[first]) - start
