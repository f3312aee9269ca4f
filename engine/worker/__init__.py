"""Runs a step on the device: batches the inputs, calls the model, samples the next tokens."""
