"""Conveyor's benchmarks: `conveyor bench serve` (any OpenAI-compatible server) and
`conveyor bench offline` (continuous vs static batching on one machine)."""
