"""Tensor parallelism: a model's weights split across ranks, one step run by all of them.

Rank 0 is the engine: it schedules, builds each step's inputs and samples. Ranks 1..N-1 are
worker processes (`workers.py`) that receive each step as plain data and run their share of the
same forward pass; the ranks meet in one all-reduce after each attention and MLP block and one
all-gather of the logits (`layers.py`, over the group in `group.py`).
"""
