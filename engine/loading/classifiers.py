"""Sequence-classification checkpoints (`LlamaForSequenceClassification`,
`Qwen2ForSequenceClassification`, ...), served by `/classify` under `--runner pooling`.

Such a model is its family's decoder with a score head in place of the LM head: the head maps
the last token's normed hidden state to one logit per label, as transformers' model reads the
last token of a prompt. Conveyor holds it as its family's causal LM whose head is the score
head, so the decoder runs on Conveyor's implementation and the pooling runner's last rows come
out through the head: one logit per label (`ModelRunner.classifies`).
"""

from __future__ import annotations

from typing import Any

CLASSIFIER_SUFFIX = "ForSequenceClassification"


def is_classifier(config: Any) -> bool:
    """Whether a checkpoint's config names a sequence-classification architecture."""
    return any(name.endswith(CLASSIFIER_SUFFIX) for name in config.architectures or ())


def labels(config: Any) -> tuple[str, ...]:
    """The classes' names in logit order (`id2label`; `LABEL_i` where it names none)."""
    names = getattr(config, "id2label", None) or {}
    return tuple(str(names.get(i, f"LABEL_{i}")) for i in range(config.num_labels))


def as_causal_lm(classifier: Any) -> Any:
    """The classifier as its family's causal LM (built on the meta device, then given the
    classifier's decoder) whose LM head is the score head: its "logits" are the labels'."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(classifier.config, dtype=classifier.dtype)
    model.model = classifier.model
    model.lm_head = classifier.score
    return model.eval()
