"""An image-text model's processor: transformers' own (`AutoProcessor`), or, where its video
half cannot load (transformers' video processors need torchvision, which Conveyor does not
install), the same class over its image processor and tokenizer alone. Conveyor reads images,
not videos, and the processor's image path never touches its video processor."""

from __future__ import annotations

import inspect
from typing import Any


def load_processor(path: str, model_type: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    found = _processor_class(model_type)
    if found is None or is_torchvision_available() or not _takes_videos(found):
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return images_only(found).from_pretrained(path, trust_remote_code=trust_remote_code)


def images_only(processor_class: Any) -> Any:
    """`processor_class` without its video processor (it keeps the class's name, so a folder it
    saves names the real class)."""

    class ImagesOnly(processor_class):  # type: ignore[misc]  # a class made at run time
        video_processor = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("video_processor", None)  # SmolVLM's requires one
            super().__init__(*args, **kwargs)

        @classmethod
        def get_attributes(cls) -> list[str]:
            return [name for name in super().get_attributes() if "video" not in name]

    # transformers reads a processor's parts from its `__init__`'s parameters.
    ImagesOnly.__init__.__signature__ = inspect.signature(processor_class.__init__)  # type: ignore[attr-defined]
    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def _processor_class(model_type: str) -> Any:
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def _takes_videos(processor_class: Any) -> bool:
    return "video_processor" in inspect.signature(processor_class.__init__).parameters
